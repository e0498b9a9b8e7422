"""The ranks of one model replica (its tp, cp and pp peers) must be given the same batch: a
tensor-parallel pair fed different sequences would add up partial results of different inputs
and train on garbage without a word. At the first step every rank digests its tensor inputs
and one all-reduce over the world compares the digests within each replica; a mismatch is
refused on every rank in one line naming the fix. Once: a loader sharding by the world's rank
instead of the dp coordinate is wrong from its first batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .comm import counted
from .errors import PlanError


def _digest(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Two sums per tensor, one weighted by position (a permuted batch differs too)."""
    out = []
    for t in tensors:
        flat = t.detach().reshape(-1).to("cpu", torch.float64)
        weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64)
        out += [float(flat.numel()), flat.sum().item(), (flat * weights).sum().item()]
    return torch.tensor(out, dtype=torch.float64)


class SameBatchCheck:
    def __init__(self, mesh):
        self.mesh, self.done = mesh, False

    def __call__(self, tensors: list[torch.Tensor]) -> None:
        if self.done or self.mesh.world.world is None:
            return
        self.done = True
        mesh, groups = self.mesh.mesh, self.mesh.groups
        mine = _digest([t for t in tensors if torch.is_tensor(t)])
        dp, at = mesh.size_of("dp"), groups.coord("dp")
        # Row r holds replica r's largest digest and its negated smallest (every other rank
        # leaves the row at -inf): after a MAX all-reduce they agree iff the replica's did.
        table = torch.full((dp, 2, len(mine)), float("-inf"), dtype=torch.float64)
        table[at, 0], table[at, 1] = mine, -mine
        counted.all_reduce(table, self.mesh.world.world, self.mesh.stats, "check",
                           op=dist.ReduceOp.MAX)
        bad = [r for r in range(dp) if not torch.equal(table[r, 0], -table[r, 1])]
        if bad:
            raise PlanError(
                f"the ranks of data-parallel replica {bad[0]} were given different batches: "
                "on a tp/pp/cp mesh every rank of a replica takes the same batch (shard the "
                "data by tilework.data_parallel_rank(model), not by the world's rank)")
