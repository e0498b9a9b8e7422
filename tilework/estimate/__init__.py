"""Pure estimates of a plan: bytes (an exact replay equal to the counters, and expected costs),
compute, and memory on the meta device. `estimate_memory` is the public entry point of memory:
memory.py holds the per-rank rules of a data-parallel plan, mesh_memory.py the mesh's (its
parts planned as data parallelism, its activations from a meta forward of the transformed
model).
"""

from __future__ import annotations

from torch import nn

from .memory import MemoryEstimate, estimate_per_rank
from .mesh_memory import estimate_mesh_memory


def estimate_memory(model: nn.Module, config=None, example_inputs: tuple = (), cluster=None,
                    optimizer="adam", rank: int = 0, world_size: int | None = None
                    ) -> MemoryEstimate:
    """Bytes rank `rank` holds training `model` on `example_inputs` (one rank's batch) under
    the plan `tilework.plan(model, config, cluster)` makes, with `optimizer` (a torch optimizer,
    its class or its name). Pure: runs on the meta device, needs no process group.

    With tp, pp or cp > 1 (mesh_memory.py): rank `rank` of `world_size` ranks (default: the
    cluster's, else tp x pp x cp, dp = 1), `example_inputs` one data-parallel replica's batch."""
    from ..planner import plan as make_plan

    if config is not None and config.model_parallel:
        if world_size is None:
            world_size = cluster.world_size if cluster is not None else \
                config.tp * config.pp * config.cp
        return estimate_mesh_memory(model, config, example_inputs, world_size, rank, optimizer,
                                    cluster)
    plan = make_plan(model, config, cluster)
    if not 0 <= rank < plan.world_size:
        raise ValueError(f"rank: expected 0..{plan.world_size - 1}, got {rank}")
    return estimate_per_rank(model, plan, example_inputs, optimizer, ranks=[rank])[0]


__all__ = ["MemoryEstimate", "estimate_memory", "estimate_mesh_memory", "estimate_per_rank"]
