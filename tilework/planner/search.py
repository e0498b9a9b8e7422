"""Choose the mesh: every dp x pp x cp x tp that can run the model on a cluster's ranks,
planned (`tilework.plan`) and priced by `estimate(plan)` (its step: estimate/step.py),
fastest first. Pure (a meta-device model will do). Refused candidates keep the reason (a
layout that does not split, more stages than blocks, a batch that does not divide, a peak over
the memory budget), so a user sees why the mesh they expected is absent.
"""

from __future__ import annotations

from torch import nn

from ..cluster.topology import Cluster
from ..config.parallel import ParallelConfig
from ..estimate.step import MeshCandidate, predict  # noqa: F401 - the search's record


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(world_size: int, ranks_per_host: int | None, layers: int) -> list[ParallelConfig]:
    """Every split of the world into pp x cp x tp (dp the rest) with tp inside a host."""
    out = []
    for tp in _divisors(world_size):
        if ranks_per_host and ranks_per_host % tp and tp % ranks_per_host:
            continue
        for pp in _divisors(world_size // tp):
            if pp > layers:
                continue
            for cp in _divisors(world_size // (tp * pp)):
                out.append(ParallelConfig(tp=tp, pp=pp, cp=cp,
                                          microbatches=2 * pp if pp > 1 else None))
    return out


def search_mesh(model: nn.Module, cluster: Cluster, batch: int, seq: int,
                flops_per_s: float, optimizer="adam",
                message_overhead_s: float = 0.0) -> list[MeshCandidate]:
    """Every candidate for a global batch of `batch` sequences, planned (`tilework.plan`) and
    ranked by `estimate(plan)`; runnable ones fastest first, then the refused with why. Where
    the cluster file gives hosts' memory, a candidate whose estimated peak exceeds 80% of it on
    any rank is refused, as paper 4 prunes plans that would not fit."""
    from ..errors import PlanError
    from . import plan as make_plan

    sizes = {h.procs for h in cluster.hosts}
    layers = len(getattr(getattr(model, "blocks", None), "layers", [])) or 1
    found = []
    for c in candidates(cluster.world_size, sizes.pop() if len(sizes) == 1 else None, layers):
        dp = cluster.world_size // (c.tp * c.pp * c.cp)
        if batch % dp:
            found.append(MeshCandidate(c, None, f"a batch of {batch} does not split over "
                                                f"dp = {dp} replicas", {"dp_size": dp}))
            continue
        try:
            plan = make_plan(model, c, cluster)
        except PlanError as e:   # a layout that does not split, more stages than blocks
            found.append(MeshCandidate(c, None, str(e),
                                       {"dp_size": dp}))
            continue
        found.append(_ranked(model, plan, c, cluster, batch // dp, seq, flops_per_s, optimizer,
                             message_overhead_s))
    return sorted(found, key=lambda c: (c.step_s is None, c.step_s or 0.0))


def _ranked(model, plan, config: ParallelConfig, cluster: Cluster, replica_batch: int,
            seq: int, flops_per_s: float, optimizer, message_overhead_s: float) -> MeshCandidate:
    """The candidate as `estimate(plan)` prices it: its step, or why it cannot run; refused
    where a rank's estimated peak exceeds 80% of the memory the cluster file gives it."""
    import torch

    from ..estimate.memory import with_budget
    from ..estimate.plan_cost import estimate

    ids = torch.zeros(replica_batch, seq, dtype=torch.long, device="cpu")   # shapes only
    cost = estimate(plan, cluster, model, (ids, ids), optimizer=optimizer, flops=flops_per_s,
                    replica_batch=replica_batch, seq=seq, message_overhead_s=message_overhead_s)
    if cost.step_s is None:
        return MeshCandidate(config, None, cost.why, cost.parts)
    figures = [with_budget(e, cluster) for e in cost.memory]
    over = next((f for f in figures if f["over_budget"]), None)
    if over is not None:
        return MeshCandidate(config, None, f"rank {over['rank']}'s estimated peak "
                             f"{over['peak'] / 1e9:.2f} GB exceeds its budget of "
                             f"{over['budget'] / 1e9:.2f} GB (80% of memory_gb)",
                             cost.parts | {"peak_bytes": over["peak"]})
    worst = max(f["peak"] for f in figures)
    return MeshCandidate(config, cost.step_s, "", cost.parts | {"peak_bytes": worst})


__all__ = ["MeshCandidate", "candidates", "predict", "search_mesh"]
