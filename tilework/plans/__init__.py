"""Plain data: the Plan (every parameter's placement on every mesh axis, the layout, stages,
schedule), a server table's rows and routes, and the model analysis the planner reads.

    from tilework.plans import Plan, ParamPlan, ParallelPlan
"""

from .plan import Cost, ParallelPlan, ParamPlan, Plan

__all__ = ["Cost", "ParallelPlan", "ParamPlan", "Plan"]
