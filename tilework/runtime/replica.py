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

from ..comm import counted
from ..errors import PlanError


def _digest(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Two sums per tensor, one weighted by position (a permuted batch differs too)."""
    out = []
    for t in tensors:
        flat = t.detach().reshape(-1).to(torch.float64)
        weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
        out += [float(flat.numel()), flat.sum().item(), (flat * weights).sum().item()]
    return torch.tensor(out, dtype=torch.float64, device="cpu")   # host numbers


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
        # On the world's backend device (NCCL reduces CUDA tensors only).
        table = torch.full((dp, 2, len(mine)), float("-inf"), dtype=torch.float64,
                           device=self.mesh.world.device)
        table[at, 0], table[at, 1] = mine.to(table.device), -mine.to(table.device)
        counted.all_reduce(table, self.mesh.world.world, self.mesh.stats, "check",
                           op=dist.ReduceOp.MAX)
        bad = [r for r in range(dp) if not torch.equal(table[r, 0], -table[r, 1])]
        if bad:
            raise PlanError(
                f"the ranks of data-parallel replica {bad[0]} were given different batches: "
                "on a tp/pp/cp mesh every rank of a replica takes the same batch (shard the "
                "data by tilework.data_parallel_rank(model), not by the world's rank)")


_NORMS = {torch.linalg.vector_norm, torch.linalg.norm, torch.norm, torch.Tensor.norm,
          torch._foreach_norm}


class LocalGradient(torch.Tensor):
    """A parameter's `.grad` on a tp or pp mesh (an alias of it, the same storage): this rank
    holds a shard of it, or only its stages' gradients, so a norm of it is not one process's.
    torch's own `clip_grad_norm_(model.parameters(), c)` (nanoGPT's line) would clip by this
    rank's part and train silently differently: every norm is refused, naming the fix;
    everything else (the optimizer, accumulation, reads) goes through as on a plain tensor."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _NORMS:
            raise PlanError("a norm of a gradient on a tp/pp mesh sees only this rank's shards "
                            "and stages: clip with tilework.clip_grad_norm_(model, max_norm), "
                            "which combines them into one process's norm")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def plain(grad: torch.Tensor) -> torch.Tensor:
    return grad.as_subclass(torch.Tensor) if isinstance(grad, LocalGradient) else grad


def mark_local(param: torch.Tensor) -> None:
    """A post-accumulate-grad hook: the gradient as a LocalGradient (ZeRO's stand-ins, which
    refuse every use already, stay)."""
    from ..parallel.data.shards import ShardedGradient

    g = param.grad
    if g is not None and type(g) is torch.Tensor and not isinstance(g, ShardedGradient):
        param.grad = g.as_subclass(LocalGradient)
