"""Where each row of a parameter-server table lives, and the way a request takes to it: pure
arithmetic shared by the runtime (parallel/rows/sparse.py binds routes to process groups) and the
cost model (estimate/cost.py replays them exactly)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

import torch

from ..cluster.mesh import Mesh
from .plan import ParamPlan, partition_bounds, partition_rows, partitions_of, server_of


class TableLayout:
    """Rows of one table over `world_size` ranks, from a plan's partitions and row map.

    `device`: where the lookup tensors live, the table's own (ids index them there); the cost
    model's replay stays on the CPU default.
    """

    def __init__(self, plan: ParamPlan, world_size: int, device: torch.device | str = "cpu"):
        self.rows = plan.shape[0]
        self.partitions = plan.partitions
        self.row_map = plan.row_map
        self.world_size = world_size
        self.server_map = plan.servers
        if self.server_map and max(self.server_map) >= world_size:
            raise ValueError(f"{plan.name}: its partitions are served by ranks up to "
                             f"{max(self.server_map)}, in a world of {world_size}")
        self.device = torch.device(device)
        self.starts = torch.tensor([b[0] for b in partition_bounds(self.rows, self.partitions)],
                                   device=self.device)
        # Offset of each partition inside its server's local shard (partitions in ascending order).
        offsets, filled = [0] * self.partitions, [0] * world_size
        for p in range(self.partitions):
            r = server_of(p, world_size, self.server_map)
            offsets[p] = filled[r]
            filled[r] += len(partition_rows(self.rows, self.partitions, self.row_map, p))
        self.offsets = torch.tensor(offsets, device=self.device)
        self.shard_sizes = filled
        self.servers = torch.tensor([server_of(p, world_size, self.server_map)
                                     for p in range(self.partitions)], device=self.device)

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
        parts = partitions_of(rank, self.partitions, self.world_size, self.server_map)
        ranges = [partition_rows(self.rows, self.partitions, self.row_map, p) for p in parts]
        rows = [torch.arange(r.start, r.stop, r.step, device=self.device) for r in ranges]
        return torch.cat(rows) if rows else torch.empty(0, dtype=torch.long, device=self.device)


@dataclass(frozen=True)
class Route:
    """One hop of a request: an all-to-all inside each of `groups` (global ranks, in group rank
    order), sending each id to group rank `dest(ids)`. `axis` names the process group the runtime
    uses for it: the world, a host's ranks, or one local index across hosts."""

    axis: Literal["world", "intra", "inter"]
    groups: list[list[int]]
    dest: Callable[[torch.Tensor], torch.Tensor]


def routes(layout: TableLayout, topology, local_aggregation: bool) -> list[Route]:
    """Direct: one hop over the world to the owner. With local aggregation (hosts of equal
    size): first to the rank of this host that shares the owner's local index, which merges
    its host's duplicate ids, then across hosts to the owner: a row crosses hosts at most once
    per host per step."""
    if not (local_aggregation and topology.can_aggregate_locally):
        return [Route("world", [list(range(topology.world_size))], layout.owner_of)]
    mesh = Mesh.from_topology(topology)   # host x local: hosts of equal size
    per_host = mesh.size_of("local")
    # Ranks are numbered host by host, so owner o sits on host o // L at local index o % L.
    return [Route("intra", [list(g) for g in mesh.groups("local")],
                  lambda ids: layout.owner_of(ids) % per_host),
            Route("inter", [list(g) for g in mesh.groups("host")],
                  lambda ids: layout.owner_of(ids) // per_host)]
