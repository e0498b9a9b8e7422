"""The plan of a dp x pp x cp x tp run, made before anything is applied: pure.

A meta copy of the model is transformed as the runtime transforms it (runtime order: tp, then
cp, then the pipeline cut), with stand-ins for the collectives that only make tensors of the
right shapes (`tensor.regions.ShapeOnlyTP`, `context.comm.ShapeOnlyRing`); each pipeline
coordinate's part is then planned as data parallelism over its dp group (tables.plan), and the
parts' entries become one Plan: every parameter as one rank holds it, with its tp split and
the pp ranks that hold it. The runtime applies this Plan (runtime/apply.py) and runs `plan.part(pp)`
on each rank's engine, so what `tilework.plan` returns is what runs.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from ..cluster.mesh import Mesh, parallel_mesh, pp_speeds
from ..cluster.topology import Topology
from ..comm.counted import Stats
from ..config.parallel import ParallelConfig
from ..errors import PlanError
from ..estimate.meta_forward import on_meta
from ..plans.analysis import owning_units, recompute_choices
from ..plans.plan import ParallelPlan, ParamPlan, Plan
from . import tables


def plan_mesh(model: nn.Module, config: ParallelConfig, topology: Topology, cluster=None,
              density=None, traffic=None) -> Plan:
    """The one Plan of `model` under `config` (tp, pp or cp > 1) on `topology`'s ranks."""
    if config.cp > 1 and config.sequence_parallel:
        raise PlanError(f"cp={config.cp} with sequence_parallel: both would cut the sequence "
                        "(ring attention's chunks, and slices between tp's layers); choose one")
    mesh = parallel_mesh(topology.world_size, ranks_per_host(topology), tp=config.tp,
                         pp=config.pp, cp=config.cp)
    meta, layout = shape_only_copy(model, config, {"tp": 0, "cp": 0})
    specs = layout.specs() if layout is not None else {}
    parts, cut, schedule = pipeline_parts(meta, config, config.stage_weights
                                          or pp_speeds(mesh, cluster, config.pp))
    axes = ("dp", "cp") if config.cp > 1 else ("dp",)
    merged: dict[str, ParamPlan] = {}
    dp_mesh = None
    part_config = config
    # ZeRO's and the servers' weights: one per replica; a dp group's ranks, dp-major.
    for field in ("zero_weights", "server_weights"):
        weights = getattr(config, field)
        if weights is None:
            continue
        replicas = mesh.size_of("dp")
        if len(weights) != replicas:
            raise PlanError(f"{field}: one per data-parallel replica ({replicas}) on a tp, pp "
                            f"or cp mesh, got {len(weights)}")
        part_config = dataclasses.replace(part_config, **{field: [
            w for w in weights for _ in range(config.cp)]})
    for pp_rank, part in enumerate(parts):
        ranks = dp_group(mesh, axes, pp_rank)
        dp_topology = Topology.from_host_ids([topology.host_of(r) for r in ranks])
        dp_mesh = dp_mesh or Mesh.from_topology(dp_topology)
        part_plan = plan_part(meta, part, part_config, dp_topology, cluster, density, traffic)
        for entry in part_plan.params:
            held = merged.get(entry.name)
            pp_ranks = (*held.pp_ranks, pp_rank) if held else ((pp_rank,) if cut else ())
            merged[entry.name] = dataclasses.replace(
                held or entry, tp_split=_spec_text(specs.get(entry.name)), pp_ranks=pp_ranks)
    parallel = ParallelPlan(
        layout=() if layout is None else tuple((p.module, p.style) for p in layout.placements),
        sequence_parallel=config.sequence_parallel and config.tp > 1,
        stack=cut[0] if cut else "", stages=cut[1] if cut else (),
        schedule=config.schedule if cut else "", microbatches=schedule.microbatches if cut else 0,
        stages_per_rank=schedule.stages // config.pp if cut else 1, dp_mesh=dp_mesh)
    # The plan-wide settings (mode, buckets, offload) are the config's in every part's plan.
    # Batch shares are the replicas' (each part's plan repeats them over its dp group: Plan.part).
    shares = tuple(config.batch_shares) if isinstance(config.batch_shares, list) else None
    return dataclasses.replace(part_plan, params=tuple(merged.values()),
                               world_size=topology.world_size, mesh=mesh,
                               recompute=recompute_choices(meta, config.recompute),
                               parallel=parallel, batch_shares=shares,
                               zero_weights=tuple(config.zero_weights)
                               if config.zero_weights is not None and config.zero else None)


def plan_part(model: nn.Module, part: nn.Module, config: ParallelConfig, topology: Topology,
              cluster=None, density=None, traffic=None) -> Plan:
    """The data-parallel plan of `part` (the model, or a pipeline rank's part) over a dp group
    of `topology`. The repeated blocks are found in the whole model (in a part they are no
    longer a ModuleList); a part recomputes those it holds."""
    if part is model:
        return tables.plan(part, _flat(config), cluster, density, traffic, topology=topology)
    # A part's blocks are no longer a ModuleList: ZeRO-3's units (each block, gathered by its
    # own forward as the stages call it) are the whole model's.
    held = dict(part.named_parameters())
    units = {n: u for n, u in owning_units(model).items() if n in held} \
        if config.zero == 3 else None
    plan = tables.plan(part, _flat(config), cluster, density, traffic, topology=topology,
                       units=units)
    return dataclasses.replace(plan, recompute=tables.recompute_choices_in(model, part,
                                                                             config.recompute))


def _flat(config: ParallelConfig) -> ParallelConfig:
    return dataclasses.replace(config, tp=1, pp=1, cp=1, layout=None, microbatches=None,
                               sequence_parallel=False, stage_weights=None, batch_shares=None)


def _spec_text(spec) -> str:
    return "" if spec is None else str(spec)


def shape_only_copy(model: nn.Module, config: ParallelConfig, at: dict[str, int]):
    """A meta copy of `model` as the runtime leaves it on the rank at coordinates `at` (tp and
    cp), before the pipeline cut; and the layout it applied (None without tp)."""
    meta = on_meta(model)
    layout = None
    if config.tp > 1:   # tp first, then cp: the runtime's order (runtime/apply.py)
        from ..parallel.tensor import apply_layout, layout_for
        from ..parallel.tensor.regions import ShapeOnlyTP

        tp = ShapeOnlyTP(None, at["tp"], config.tp, config.sequence_parallel)
        layout = apply_layout(meta, config.layout or layout_for(model), tp)
    if config.cp > 1:
        from ..parallel.context import apply_context_parallel
        from ..parallel.context.comm import ShapeOnlyRing

        apply_context_parallel(meta, None, Stats(), positions="positions" if config.pp > 1
                               else None, require_modules=config.pp > 1)
        ring = ShapeOnlyRing(at["cp"], config.cp)
        for m in meta.modules():
            if hasattr(m, "ring"):
                m.ring = ring
    return meta, layout


def pipeline_parts(meta: nn.Module, config: ParallelConfig, rank_speeds=None):
    """Each pp rank's part of `meta` (one part, `meta` itself, without pp), the cut as
    (stack, block ranges) or None, and the schedule (None without pp). `rank_speeds`: each pp
    rank's speed (or its config's stage_weights), so a slower rank's stages get fewer
    blocks."""
    if config.pp == 1:
        return [meta], None, None
    from ..parallel.pipeline import build
    from ..parallel.pipeline.model import cut_stages, is_reference_gpt, local_part, stage_modules

    schedule = build(config.schedule, config.pp, config.microbatches or 2 * config.pp,
                     config.stages_per_rank)
    stages = cut_stages(meta, schedule.stages, speeds=schedule.per_stage(rank_speeds))
    parts = [local_part(meta, [m for s in schedule.stages_of(r) for m in stage_modules(stages[s])])
             for r in range(config.pp)]
    stack = "blocks.layers" if is_reference_gpt(meta) else stages[0].stack_name
    cut = tuple((s.index_range.start, s.index_range.stop) for s in stages)
    return parts, (stack, cut), schedule


def dp_group(mesh: Mesh, axes: tuple[str, ...], pp_rank: int) -> tuple[int, ...]:
    """The dp group (dp x cp under context parallelism) of the first rank at `pp_rank`."""
    first = next(r for r in range(mesh.size)
                 if mesh.coords(r)["pp"] == pp_rank and mesh.coords(r)["tp"] == 0
                 and mesh.coords(r)["cp"] == 0)
    return next(g for g in mesh.groups(axes) if first in g)


def ranks_per_host(topology: Topology) -> int | None:
    sizes = {len(h) for h in topology.hosts}
    return sizes.pop() if len(sizes) == 1 else None
