"""Where each row of a parameter-server table lives: pure arithmetic shared by runtime and tests."""

from __future__ import annotations

import torch

from .plan import ParamPlan, partition_bounds, partition_rows, partitions_of, server_of


class TableLayout:
    """Rows of one table over `world_size` ranks, from a plan's partitions and row map."""

    def __init__(self, plan: ParamPlan, world_size: int):
        self.rows = plan.shape[0]
        self.partitions = plan.partitions
        self.row_map = plan.row_map
        self.world_size = world_size
        self.starts = torch.tensor([b[0] for b in partition_bounds(self.rows, self.partitions)])
        # Offset of each partition inside its server's local shard (partitions in ascending order).
        offsets, filled = [0] * self.partitions, [0] * world_size
        for p in range(self.partitions):
            r = server_of(p, world_size)
            offsets[p] = filled[r]
            filled[r] += len(partition_rows(self.rows, self.partitions, self.row_map, p))
        self.offsets = torch.tensor(offsets)
        self.shard_sizes = filled
        self.servers = torch.tensor([server_of(p, world_size) for p in range(self.partitions)])

    def partition_of(self, ids: torch.Tensor) -> torch.Tensor:
        if self.row_map == "hashed":
            return ids % self.partitions
        return torch.searchsorted(self.starts, ids, right=True) - 1

    def owner_of(self, ids: torch.Tensor) -> torch.Tensor:
        return self.servers[self.partition_of(ids)]

    def local_index(self, ids: torch.Tensor) -> torch.Tensor:
        """Index of each row inside its owner's shard."""
        part = self.partition_of(ids)
        within = ids // self.partitions if self.row_map == "hashed" else ids - self.starts[part]
        return self.offsets[part] + within

    def shard_rows(self, rank: int) -> torch.Tensor:
        """The global rows rank `rank` serves, in the order of its local shard."""
        parts = partitions_of(rank, self.partitions, self.world_size)
        ranges = [partition_rows(self.rows, self.partitions, self.row_map, p) for p in parts]
        rows = [torch.arange(r.start, r.stop, r.step) for r in ranges]
        return torch.cat(rows) if rows else torch.empty(0, dtype=torch.long)
