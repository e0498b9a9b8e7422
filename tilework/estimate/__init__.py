"""Pure estimates of a plan: bytes (an exact replay equal to the counters, and expected costs),
compute, and memory on the meta device. `estimate(plan, cluster)` (plan_cost.py) prices a Plan;
`estimate_memory` is the public entry point of memory: plan_memory.plan_memory reads any Plan
(memory.py holds the per-rank rules, run on the model or on a mesh rank's transformed part).
"""

from __future__ import annotations

from torch import nn

from .memory import MemoryEstimate, estimate_per_rank
from .plan_memory import estimate_mesh_memory, plan_for, plan_memory


def estimate_memory(model: nn.Module, config=None, example_inputs: tuple = (), cluster=None,
                    optimizer="adam", rank: int = 0, world_size: int | None = None
                    ) -> MemoryEstimate:
    """Bytes rank `rank` holds training `model` on `example_inputs` (one rank's batch) under
    the plan `tilework.plan(model, config, cluster)` makes, with `optimizer` (a torch optimizer,
    its class or its name). Pure: runs on the meta device, needs no process group.

    `world_size` ranks (default: the cluster's, else tp x pp x cp, dp = 1); with tp, pp or
    cp > 1 `example_inputs` is one data-parallel replica's batch."""
    tp, pp, cp = (config.tp, config.pp, config.cp) if config is not None else (1, 1, 1)
    if world_size is None:
        world_size = cluster.world_size if cluster is not None else tp * pp * cp
    plan = plan_for(model, config, world_size, cluster)
    return plan_memory(model, plan, example_inputs, optimizer, [rank])[0]


__all__ = ["MemoryEstimate", "estimate_memory", "estimate_mesh_memory", "estimate_per_rank",
           "plan_memory"]
