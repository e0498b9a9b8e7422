"""`apply(model, optimizer, plan, config, groups)`: a Plan made real on this rank, in one order
whatever the plan holds: tp, cp and the pipeline cut (runtime/mesh.py, where the plan has a
mesh), then the data-parallel engine over the rank's dp group (its part of the plan, ZeRO and
the servers included), then activation recompute. Every change goes through a change record,
so `tilework.unparallelize` walks it back. Returns what the user's loop holds: the model (under
pp, the pipeline, whose `step` runs the schedule) and the optimizer.
"""

from __future__ import annotations

from ..comm.groups import Groups
from ..config.parallel import ParallelConfig
from ..plans.plan import Plan
from .engine import Engine
from .recompute import apply_recompute


def apply(model, optimizer, plan: Plan, config: ParallelConfig, groups: Groups, log: bool):
    if plan.parallel is not None:
        from .mesh import parallelize_on_mesh  # tp, cp, pp, then the engine and recompute

        return parallelize_on_mesh(model, optimizer, config, groups, plan, log)
    engine = Engine(model, optimizer, groups, plan, config.check_inputs)
    apply_recompute(model, plan.recompute, engine.changes)
    if log and groups.rank == 0:
        from ..report.tables import print_plan

        print_plan(plan)
    return model, optimizer
