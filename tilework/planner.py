"""Choose each parameter's method and partition count (v1: by the sparsity rule).

Pure: takes `ParamInfo`s and a world size, returns a `Plan`. In "hybrid" mode tables with sparse
gradients (or a measured touched-row fraction under `density_threshold`) go to the parameter
server and everything else to all-reduce; "allreduce" and "ps" send everything one way.
"""

from __future__ import annotations

from typing import Literal

from .analysis import ParamInfo
from .errors import PlanError
from .plan import Method, ParamPlan, Plan, RowMap

Mode = Literal["hybrid", "allreduce", "ps"]


def make_plan(infos: list[ParamInfo], world_size: int, mode: Mode = "hybrid",
              overrides: dict[str, Method] | None = None,
              partitions: int | dict[str, int] | None = None, row_map: RowMap = "contiguous",
              sparse_reduce: Literal["mean", "sum"] = "mean", local_aggregation: bool = True,
              bucket_bytes: int = 25 * 2**20, density_threshold: float = 0.1) -> Plan:
    if mode not in ("hybrid", "allreduce", "ps"):
        raise PlanError(f"mode: expected 'hybrid', 'allreduce' or 'ps', got {mode!r}")
    if sparse_reduce not in ("mean", "sum"):
        raise PlanError(f"sparse_reduce: expected 'mean' or 'sum', got {sparse_reduce!r}")
    overrides = dict(overrides or {})
    known = {i.name for i in infos}
    for name, method in overrides.items():
        if name not in known:
            raise PlanError(f"override for {name!r}: no such trainable parameter "
                            f"(parameters: {', '.join(sorted(known))})")
        if method not in ("allreduce", "ps"):
            raise PlanError(f"override for {name!r}: expected 'allreduce' or 'ps', got {method!r}")
    params = []
    for info in infos:
        method, reason = _rule(info, mode, density_threshold)
        if info.name in overrides:
            method, reason = overrides[info.name], "set by the user"
            if method == "ps" and not info.is_table and mode != "ps":
                raise PlanError(
                    f"{info.name} (shape {tuple(info.shape)}) is not an embedding table: the "
                    "parameter server serves rows looked up by ids. Use mode='ps' to send every "
                    "parameter through the servers.")
        parts = 1
        if method == "ps":
            wanted = partitions.get(info.name) if isinstance(partitions, dict) else partitions
            parts = min(wanted or world_size, info.shape[0])
        params.append(ParamPlan(info.name, info.shape, method, parts, row_map, reason))
    return Plan(tuple(params), world_size, mode, sparse_reduce, local_aggregation, bucket_bytes)


def _rule(info: ParamInfo, mode: Mode, threshold: float) -> tuple[Method, str]:
    if mode == "allreduce":
        return "allreduce", "mode=allreduce"
    if mode == "ps":
        return "ps", "mode=ps"
    if info.kind == "sparse":
        return "ps", "sparse gradient"
    if info.kind == "embedding" and info.density is not None and info.density < threshold:
        return "ps", f"touched-row fraction {info.density:.3f} < {threshold}"
    if info.kind == "embedding":
        known = "unmeasured" if info.density is None else f"touched-row fraction {info.density:.3f}"
        return "allreduce", f"dense-layout gradient ({known})"
    return "allreduce", "dense"
