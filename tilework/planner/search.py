"""The planner's search over every dimension: pure (a meta-device model will do), in TorchRec's
planner's roles, each small and tested alone:

    enumerate  `configs`: every ParallelConfig the `Space` allows on the cluster (dp x pp x cp
               x tp with tp inside a host; ZeRO stage and scope, and offload under ZeRO-3;
               recompute none, selective or full; microbatches and schedule under pp); each
               table's placement is chosen inside `tilework.plan` by its own
               cost (all-reduce, all-gather or the servers, partitions, hot rows), and
               `with_table_methods` adds every table placed alike by each method
    estimate   `price`: the Plan `tilework.plan` makes for a config, every rank's memory
               (estimate/plan_memory.py) against the budget (80% of each rank's memory, paper
               4's margin), and the step: on a mesh `estimate/step.predict` (stages, pipeline
               simulator, tp/cp/dp exchanges), else the counted FLOPs (estimate/compute.py) at
               the rank's rate plus the data-parallel communication (`comm_seconds`)
    propose    `search`: every candidate priced, fastest first, the refused after with why
    choose     `choose`: the fastest that fits, and the runner-up with why it lost

Refused candidates keep the reason (a layout that does not split, more stages than blocks, a
batch that does not divide, a peak over the budget), so a user sees why the plan they expected
is absent.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch
from torch import nn

from ..cluster.topology import Cluster
from ..config.parallel import AUTO_SYNC_EVERY, ParallelConfig
from ..errors import ConfigError, PlanError
from ..estimate.model_facts import ModelFacts
from ..estimate.ops import OpTimes
from ..estimate.plan_cost import config_pace, paced, pipeline_pace
from ..estimate.step import MeshCandidate, predict  # noqa: F401 - the search's record

Candidate = MeshCandidate


@dataclass(frozen=True)
class Space:
    """What the search may change; everything else is the base config's."""

    axes: tuple[str, ...] = ()          # of "tp", "cp", "pp": the mesh axes it may split
    zero: tuple[int, ...] = (0, 1, 2, 3)
    zero_scopes: tuple[str, ...] = ("world", "host")
    recompute: tuple[str, ...] = ("none", "selective", "full")
    offload: tuple[str, ...] = ("none", "all")   # with ZeRO-3: its shards in host files
    schedules: tuple[str, ...] = ("1f1b",)
    microbatch_factors: tuple[int, ...] = (1, 2, 4)   # microbatches = factor x pp
    # Beside each table's placement by its own cost: every table the user left to the planner
    # placed alike, by each of these methods (`with_table_methods`)
    tables: tuple[str, ...] = ("allgather", "ps", "allreduce")

    @classmethod
    def mesh_only(cls) -> Space:
        """The mesh split alone (tilework plan --search): ZeRO and recompute as configured."""
        return cls(axes=("tp", "cp", "pp"), zero=(), zero_scopes=(), recompute=(), offload=(),
                   microbatch_factors=(2,), tables=())

    @classmethod
    def of(cls, config: ParallelConfig) -> Space:
        """What plan="auto" may choose for `config`: ZeRO, its scope, recompute and the
        tables' placements always; the mesh axes the config gives as "auto" (the user's loop
        stays as written: tp and cp need data sharded by replica, pp a loop calling
        model.step)."""
        return cls(axes=tuple(config.auto_axes or ()))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(world_size: int, ranks_per_host: int | None, layers: int) -> list[ParallelConfig]:
    """Every split of the world into pp x cp x tp (dp the rest) with tp inside a host."""
    return [ParallelConfig(tp=tp, pp=pp, cp=cp, microbatches=2 * pp if pp > 1 else None)
            for tp, pp, cp in _meshes(world_size, ranks_per_host, layers, ("tp", "pp", "cp"))]


def _meshes(world: int, ranks_per_host: int | None, layers: int, axes: tuple[str, ...],
            fixed: ParallelConfig | None = None):
    """(tp, pp, cp) splits of `world`: every divisor on the `axes` searched (tp inside a host,
    pp at most one stage per block), the `fixed` config's size on the others."""
    def sizes(axis: str, left: int) -> list[int]:
        if axis in axes:
            return _divisors(left)
        size = getattr(fixed, axis) if fixed is not None else 1
        return [size] if left % size == 0 else []

    for tp in sizes("tp", world):
        if "tp" in axes and ranks_per_host and ranks_per_host % tp and tp % ranks_per_host:
            continue
        for pp in sizes("pp", world // tp):
            if "pp" in axes and pp > layers:
                continue
            for cp in sizes("cp", world // (tp * pp)):
                yield tp, pp, cp


# Local SGD needs more steps than synchronous training to reach a loss: measured about twice
# as many at H = 40 from a cold start (docs/slow-links.md: 1.8x the GPT's, 2.0x the word LM's
# steps to DDP's final loss). sync="auto" takes it only where its predicted step is shorter by
# more than that.
LOCAL_SGD_STEPS = 2.0
# grad_compress="auto" takes bf16 buckets only where they shorten the predicted step by this
# much: their casts are not priced, and their rounding is a cost of its own.
COMPRESS_GAIN = 0.10
# PowerSGD (rank 2, from step 2) needed 1.5x (word LM) and 2.0-2.1x (GPT) DDP's steps to reach
# DDP's final loss, as torch's hook did, and top-k of 1% 1.7x and 2.1x (docs/slow-links.md, 4
# ranks). grad_compress="auto" weighs their steps by these.
POWERSGD_STEPS = 2.0
TOPK_STEPS = 2.0


def with_compression(found: list[ParallelConfig], base: ParallelConfig) -> list[ParallelConfig]:
    """grad_compress="auto": every candidate as it is, and, where compressed buckets can run
    (plain data parallelism, every step), also with bf16 buckets, PowerSGD's factors and
    top-k (at `base`'s powersgd_rank, powersgd_start and topk_ratio)."""
    if base.grad_compress != "auto":
        return found
    out = []
    for c in found:
        out.append(c)
        if c.sync == "every_step" and not c.zero and c.tp * c.pp * c.cp == 1:
            for kind in ("bf16", "powersgd", "topk"):
                out += _allowed(lambda c=c, kind=kind: dataclasses.replace(
                    c, grad_compress=kind))
    return out


def with_sync(found: list[ParallelConfig], base: ParallelConfig) -> list[ParallelConfig]:
    """sync="auto": every candidate synchronous, and, where local SGD can run (plain data
    parallelism, no ZeRO, even shares), also with local SGD as `base`'s outer_* say, and with
    its layer-wise schedule (DreamDDP's: the same bytes in H - 1 syncs, each beside an inner
    step, which the estimate credits) where the user left the schedule as it comes."""
    if base.sync != "auto":
        return found
    every = base.sync_every if base.sync_every > 1 else AUTO_SYNC_EVERY
    schedules = ["streaming", "layerwise"] if base.outer_schedule == "streaming" \
        and base.outer_fragments == 1 and base.outer_delay == 0 else [base.outer_schedule]
    out = []
    for c in found:
        out.append(dataclasses.replace(c, sync="every_step", sync_every=1))
        if not c.zero and c.tp * c.pp * c.cp == 1 and c.batch_shares is None:
            for schedule in schedules:
                out += _allowed(lambda c=c, schedule=schedule: dataclasses.replace(
                    c, sync="diloco", sync_every=every, grad_compress="none",
                    outer_schedule=schedule))
    return out


def configs(base: ParallelConfig, space: Space, cluster: Cluster,
            layers: int) -> list[ParallelConfig]:
    """Enumerate: every config the space allows on `cluster` (`layers`: the model's blocks, the
    most pipeline stages)."""
    per_host, hosts = cluster.procs_per_host, len(cluster.hosts)
    out = []
    for tp, pp, cp in _meshes(cluster.world_size, per_host, layers, space.axes, base):
        # ZeRO shards over the ranks that average gradients (dp x cp): over one rank it shards
        # nothing and only adds its gathers' copies (measured: a pp2 step at dp1 with ZeRO-3
        # 30% slower than without), so it is not a candidate there.
        alone = cluster.world_size // (tp * pp) == 1
        # Nor where every parameter goes to the servers: ZeRO would have nothing to shard (a
        # mesh candidate runs hybrid, below, whose dense parameters it does shard).
        served = base.mode == "ps" and tp * pp * cp == 1 \
            and "allreduce" not in (base.overrides or {}).values()
        for zero in (space.zero or (base.zero,)) if not (alone or served) or not space.zero \
                else (0,):
            scopes = (space.zero_scopes or (base.zero_scope,)) if zero and hosts > 1 \
                else ("world",)
            offloads = (space.offload or (base.offload,)) if zero == 3 else \
                (base.offload if zero else "none",)
            for scope, offload in itertools.product(scopes, offloads):
                for recompute in space.recompute or (base.recompute,):
                    for schedule, microbatches in _pipelines(base, space, pp):
                        out += _allowed(lambda: dataclasses.replace(
                            base, plan="config", auto_axes=None, tp=tp, pp=pp, cp=cp,
                            sync="every_step" if base.sync == "auto" else base.sync,
                            grad_compress="none" if base.grad_compress == "auto"
                            else base.grad_compress,
                            batch_shares=None if base.batch_shares == "auto"
                            else base.batch_shares,
                            # Weights are per rank, or on a mesh per replica: kept where
                            # the candidate's mesh is the base's.
                            server_weights=base.server_weights
                            if (tp, pp, cp) == (base.tp, base.pp, base.cp) else None,
                            stage_weights=base.stage_weights if pp == base.pp else None,
                            zero_weights=base.zero_weights
                            if (tp, pp, cp) == (base.tp, base.pp, base.cp) and zero
                            and scope == "world" else None,
                            zero=zero, zero_scope=scope, offload=offload, recompute=recompute,
                            schedule=schedule, microbatches=microbatches,
                            mode="hybrid" if pp * tp * cp > 1 and base.mode == "ps"
                            else base.mode))
    return out


def with_table_methods(found: list[ParallelConfig], model: nn.Module, base: ParallelConfig,
                       space: Space, world_size: int, optimizer="adam") -> list[ParallelConfig]:
    """Each plain data-parallel candidate as it is (each table placed by its own cost:
    `tilework.plan`) and with every table the user did not place taking each method of
    `space.tables` alike ("allgather": the tables with sparse gradients). Tables of one method
    share their meetings (`cost.shared_meetings`), which a choice table by table cannot see;
    and where two placements are priced close, `tilework plan --trial` can then settle it (the
    recommender's servers and all-gather, priced within 0.3 ms of each other, measured 8-33%
    apart). A variant whose plan is the by-cost one's is dropped when priced
    (`priced_steps`); "ps" is offered only where the servers can run `optimizer` (given as
    the live one) on every table."""
    from ..parallel.pipeline.model import is_reference_gpt
    from ..plans.analysis import analyze

    # The reference GPT's step model prices every parameter all-reduced: it would price each
    # placement alike (estimate/plan_cost.estimate).
    if not space.tables or world_size < 2 or base.mode != "hybrid" \
            or is_reference_gpt(model):
        return found
    placed = base.overrides or {}
    tables = [i for i in analyze(model) if i.is_table and not i.tied and i.name not in placed]
    if not tables:
        return found
    # Each method's tables, the same for every candidate: worked out once.
    placements = []
    for method in space.tables:
        chosen = {i.name: method for i in tables if method != "allgather" or i.kind == "sparse"}
        if chosen and (method != "ps" or _servers_step(optimizer, model, chosen)):
            placements.append(chosen)
    out = []
    for c in found:
        out.append(c)
        if c.model_parallel:
            continue
        for chosen in placements:
            out += _allowed(lambda c=c, chosen=chosen: dataclasses.replace(
                c, overrides={**(c.overrides or {}), **chosen}))
    return out


def _servers_step(optimizer, model: nn.Module, names) -> bool:
    """Whether the servers can apply `optimizer`'s rule to each of `names` (a live optimizer's
    settings, such as SGD's momentum, may refuse them; a family's name is taken as able)."""
    from ..optim.rowwise import row_optimizer

    if not isinstance(optimizer, torch.optim.Optimizer):
        return True
    params = dict(model.named_parameters())
    try:
        for name in names:
            row_optimizer(optimizer, name, params[name], lazy=False)
    except (PlanError, KeyError, StopIteration):
        return False
    return True


def with_stage_weights(found: list[ParallelConfig], cluster: Cluster) -> list[ParallelConfig]:
    """Each pipeline candidate also with its stages cut by memory (stage_weights: each pp
    rank's, the least at its coordinate) where the hosts hold different amounts: a rank with
    less takes fewer blocks. The cut by speed (the default) stays a candidate; the search
    weighs the two by step, and memory refuses what does not fit."""
    from ..cluster.mesh import parallel_mesh, pp_memory

    per_host = cluster.procs_per_host
    out = []
    for c in found:
        out.append(c)
        if c.pp == 1 or c.stage_weights is not None:
            continue
        try:
            mesh = parallel_mesh(cluster.world_size, per_host, c.tp, c.pp, c.cp)
        except (ValueError, PlanError):   # a split the pricing refuses with its reason
            continue
        memory = pp_memory(mesh, cluster, c.pp)
        if memory is not None:
            out.append(dataclasses.replace(c, stage_weights=memory))
    return out


def with_zero_weights(found: list[ParallelConfig], cluster: Cluster) -> list[ParallelConfig]:
    """Each ZeRO candidate (sharded over the world, or on a mesh over its dp group) also with
    its chunks cut by memory (zero_weights: each rank's `memory_gb`, on a mesh each replica's
    least) where the hosts hold different amounts: a
    rank with less keeps less of the shards, their state and gradients (Cephalo's state share
    apart from the compute share). The even cut stays a candidate: it sends less (every chunk
    crosses padded to the largest), which the search weighs; memory refuses what does not
    fit."""
    if any(h.memory_gb is None for h in cluster.hosts) \
            or len({h.memory_gb for h in cluster.hosts}) < 2:
        return found
    from ..cluster.mesh import least_by, parallel_mesh

    memory = cluster.memories()
    out = []
    for c in found:
        out.append(c)
        if not c.zero or c.zero_scope != "world" or c.zero_weights is not None:
            continue
        weights = memory
        if c.model_parallel:   # one per replica: the least memory among its ranks
            try:
                mesh = parallel_mesh(cluster.world_size, cluster.procs_per_host, c.tp, c.pp,
                                     c.cp)
            except (ValueError, PlanError):
                continue
            weights = least_by(mesh, "dp", memory)
            if len(set(weights)) < 2:
                continue
        out += _allowed(lambda c=c, weights=weights: dataclasses.replace(
            c, zero_weights=weights))
    return out


def _allowed(make) -> list[ParallelConfig]:
    """[the config `make` builds], or [] where the user's other settings refuse it (their
    `grad_compress` with a ZeRO stage, their local SGD with tp): not a candidate then."""
    try:
        return [make()]
    except ConfigError:
        return []


def with_shares(found: list[ParallelConfig], cluster: Cluster,
                example_inputs: tuple) -> list[ParallelConfig]:
    """On a cluster whose hosts differ in speed (and the config's batch_shares "auto": the
    loop hands each rank its count), each data-parallel candidate also with every
    rank's batch share by speed (planner/shares.py; the global batch: one rank's batch, the
    example's, times the world), which the estimate prices by the slowest rank's pace; and
    each tp, cp or pp candidate with every replica's share by its slowest rank's speed (the
    same global batch: a replica takes tp x cp x pp ranks' worth; under pp in whole
    microbatches)."""
    if not cluster.heterogeneous or not example_inputs or not torch.is_tensor(example_inputs[0]) \
            or example_inputs[0].dim() == 0:
        return found
    from ..cluster.mesh import least_by, parallel_mesh
    from .shares import batch_shares

    speeds, batch = cluster.speeds(), example_inputs[0].shape[0]
    per_host = cluster.procs_per_host
    extra = []
    for c in found:
        if c.batch_shares is not None:
            continue
        if not c.model_parallel:
            extra.append(dataclasses.replace(c, batch_shares=list(
                batch_shares(batch * cluster.world_size, speeds))))
            continue
        try:
            mesh = parallel_mesh(cluster.world_size, per_host, c.tp, c.pp, c.cp)
        except (ValueError, PlanError):   # a split the pricing refuses with its reason
            continue
        replicas = mesh.size_of("dp")
        slowest = least_by(mesh, "dp", speeds)
        # The global batch as the even split's; under pp in whole microbatches (each
        # replica's pipeline cuts its share into equal ones).
        unit = (c.microbatches or 2 * c.pp) if c.pp > 1 else 1
        total = batch * cluster.world_size
        if replicas > 1 and len(set(slowest)) > 1 and total % unit == 0:
            extra += _allowed(lambda c=c, slowest=slowest, unit=unit, total=total:
                              dataclasses.replace(c, batch_shares=[
                                  unit * n for n in batch_shares(total // unit, slowest)]))
    return found + extra


def _pipelines(base: ParallelConfig, space: Space, pp: int):
    if pp == 1:
        return [(base.schedule, None)]
    return [(s, f * pp) for s in space.schedules or (base.schedule,)
            for f in space.microbatch_factors]


def price(model: nn.Module, config: ParallelConfig, cluster: Cluster, example_inputs: tuple,
          flops_per_s: float, optimizer="adam", traffic: dict | None = None,
          budget_bytes: float | None = None, message_overhead_s: float = 0.0,
          replica: bool = False) -> Candidate:
    """Estimate: one config's plan, priced by `estimate(plan)`: its step, and every rank's
    memory against its budget. `example_inputs`: one rank's batch under plain data
    parallelism (a replica of tp x pp x cp ranks takes as many of them), or with `replica`
    one replica's batch."""
    found = price_step(model, config, cluster, example_inputs, flops_per_s, traffic,
                       message_overhead_s, replica, optimizer=optimizer)
    return price_memory(model, found, cluster, example_inputs, optimizer, budget_bytes,
                        replica, traffic)


def price_step(model: nn.Module, config: ParallelConfig, cluster: Cluster,
               example_inputs: tuple, flops_per_s: float, traffic: dict | None = None,
               message_overhead_s: float = 0.0, replica: bool = False,
               cache: dict | None = None, optimizer="adam") -> Candidate:
    """The predicted step, memory not yet estimated. A data-parallel candidate is planned and
    priced by `estimate(plan)`; a mesh candidate by the step model `estimate(plan)` prices a
    mesh plan with (estimate/step.predict, on the config the plan would say it runs under),
    its plan made when its memory is priced: the step does not read the placements, and most
    candidates never get that far. `cache`: the search's, shared by candidates whose step
    cannot differ (ZeRO's scope and offload, but under measured op times its scope copies
    differently: estimate/runtime_ops.py)."""
    from ..estimate.plan_cost import estimate
    from . import plan as make_plan

    dp = cluster.world_size // (config.tp * config.pp * config.cp)
    inputs = _replica_inputs(example_inputs, config, replica)
    batch = inputs[0].shape[0] if inputs and torch.is_tensor(inputs[0]) else 0
    if config.pp > 1 and batch % config.microbatches:
        return Candidate(config, None, f"each replica's {batch} sequences do not split into "
                                       f"{config.microbatches} microbatches", {"dp_size": dp})
    shares = config.batch_shares if isinstance(config.batch_shares, list) else None
    if shares is not None and config.model_parallel and len(shares) != dp:
        return Candidate(config, None, f"batch_shares: {len(shares)} counts for {dp} "
                                       "data-parallel replicas", {"dp_size": dp})
    if config.model_parallel:
        cache = {} if cache is None else cache
        # ZeRO's stages exchange differently (estimate/step.dp_seconds) and, under measured op
        # times, copy differently (estimate/runtime_ops.py); their scope changes neither there.
        measured_ops = isinstance(flops_per_s, OpTimes)
        key = repr(dataclasses.replace(config, offload="none") if measured_ops else
                   dataclasses.replace(config, zero_scope="world", offload="none"))
        if key not in cache:
            facts = cache.setdefault(("model facts", id(model)), ModelFacts(model))
            cache[key] = predict(model, config, cluster, batch, inputs[0].shape[1], flops_per_s,
                                 message_overhead_s=message_overhead_s, optimizer=optimizer,
                                 facts=facts)
        found = cache[key]
        if found.step_s is None:
            return Candidate(config, None, found.why, {"dp_size": dp})
        step, parts = found.step_s, dict(found.parts)
        # As estimate(plan) paces it: the slowest rank's share and speed (under pp, the
        # slowest replica's: the step model already times each stage at its speed).
        step, parts = paced(step, parts, config_pace(config, cluster) if config.pp == 1
                            else pipeline_pace(config, cluster))
        return Candidate(config, step, "", parts | {"dp_size": dp})
    try:
        plan = make_plan(model, config, cluster, traffic=traffic)
        cost = estimate(plan, cluster, model, inputs, traffic=traffic, flops=flops_per_s,
                        message_overhead_s=message_overhead_s, with_memory=False,
                        optimizer=optimizer, cache=cache)
    except (PlanError, ValueError) as e:   # a layout that does not split, more stages than blocks
        return Candidate(config, None, str(e), {"dp_size": dp})
    if cost.step_s is None:
        return Candidate(config, None, cost.why or "its step cannot be priced", {"dp_size": dp})
    return Candidate(config, cost.step_s, "", cost.parts | {"dp_size": dp, "plan": plan})


def price_memory(model: nn.Module, found: Candidate, cluster: Cluster, example_inputs: tuple,
                 optimizer="adam", budget_bytes: float | None = None,
                 replica: bool = False, traffic: dict | None = None) -> Candidate:
    """A priced candidate's plan (if not made yet) and memory on every rank, refused where the
    plan cannot be made or a peak is over its budget."""
    from ..estimate.memory import rank_budgets
    from ..estimate.plan_memory import plan_memory
    from . import plan as make_plan

    if found.step_s is None:
        return found
    config = found.config
    inputs = _replica_inputs(example_inputs, config, replica)
    try:
        plan = found.parts.get("plan") or make_plan(model, config, cluster, traffic=traffic)
        memory = plan_memory(model, plan, inputs, optimizer)
    except (PlanError, ValueError) as e:   # a layout that does not split; stages the memory
        # estimate cannot cut yet
        return Candidate(config, None, str(e), {"dp_size": found.parts["dp_size"]})
    budget = rank_budgets(cluster, budget_bytes)
    over = next((e for e in memory if budget[e.rank] is not None and e.peak > budget[e.rank]),
                None)
    if over is not None:
        return Candidate(config, None, f"rank {over.rank}'s estimated peak "
                         f"{over.peak / 1e9:.3f} GB exceeds its budget of "
                         f"{budget[over.rank] / 1e9:.3f} GB (80% of its memory)",
                         {"dp_size": found.parts["dp_size"], "peak_bytes": over.peak,
                          "predicted_step_s": found.step_s})
    return dataclasses.replace(found, parts=found.parts | {
        "peak_bytes": max(e.peak for e in memory), "plan": plan})


def _replica_inputs(inputs: tuple, config: ParallelConfig, replica: bool) -> tuple:
    """One replica's batch: as given with `replica`, else the tp x pp x cp ranks' batches of a
    replica along dim 0 (shapes only: on meta)."""
    ways = config.tp * config.pp * config.cp
    if replica or ways == 1:
        return tuple(inputs)
    return tuple(x.new_empty((ways * x.shape[0], *x.shape[1:]), device="meta")
                 .requires_grad_(x.requires_grad) if torch.is_tensor(x) and x.dim() else x
                 for x in inputs)


def search(model: nn.Module, cluster: Cluster, example_inputs: tuple, flops_per_s: float,
           optimizer="adam", base: ParallelConfig | None = None, space: Space | None = None,
           traffic: dict | None = None, budget_bytes: float | None = None,
           message_overhead_s: float = 0.0, every: bool = False) -> list[Candidate]:
    """Propose: every candidate of `space` around `base`, its step priced, fastest first
    (ties: the simpler: fewer ranks per replica, lower ZeRO stage, no recompute), then the
    refused with why. Memory is estimated in that order until two candidates fit (the choice
    and its runner-up; `every`: for all): a slower plan's memory cannot change the choice.
    Those not examined have no "peak_bytes" in their parts."""
    priced = priced_steps(model, cluster, example_inputs, flops_per_s, base, space, traffic,
                          message_overhead_s, optimizer)
    out, fits = [], 0
    for c in priced:
        if c.step_s is not None and (every or fits < 2):
            c = price_memory(model, c, cluster, example_inputs, optimizer, budget_bytes,
                             traffic=traffic)
            fits += c.step_s is not None
        out.append(c)
    return sorted(out, key=_order)


def priced_steps(model: nn.Module, cluster: Cluster, example_inputs: tuple, flops_per_s,
                 base: ParallelConfig | None = None, space: Space | None = None,
                 traffic: dict | None = None, message_overhead_s: float = 0.0,
                 optimizer="adam") -> list[Candidate]:
    """Enumerate and estimate: every candidate of `space` around `base` with its step priced
    (no memory yet), fastest first."""
    base = base or ParallelConfig()
    space = space or Space()
    cache: dict = {}
    enumerated = configs(base, space, cluster, _layers(model))
    if base.batch_shares == "auto":   # the loop reads its count: shares may be chosen
        enumerated = with_shares(enumerated, cluster, example_inputs)
    enumerated = with_zero_weights(with_stage_weights(
        with_compression(with_sync(enumerated, base), base), cluster), cluster)
    enumerated = with_table_methods(enumerated, model, base, space, cluster.world_size,
                                    optimizer)
    priced = [price_step(model, c, cluster, example_inputs, flops_per_s, traffic,
                         message_overhead_s, cache=cache, optimizer=optimizer)
              for c in enumerated]
    for c in priced:   # the variants' one method, which `label` names (the user's aside)
        placed = {k: v for k, v in (c.config.overrides or {}).items()
                  if k not in (base.overrides or {})}
        if placed and len(set(placed.values())) == 1:
            c.parts["tables"] = next(iter(placed.values()))
    return sorted(_distinct_placements(priced, base), key=_order)


def _distinct_placements(priced: list[Candidate], base: ParallelConfig) -> list[Candidate]:
    """Drop a table-method variant (`with_table_methods`) whose plan places every parameter
    as its by-cost sibling's does: the same plan, listed once."""
    seen, out = set(), []
    for c in priced:   # the by-cost candidate comes before its variants
        plan = c.parts.get("plan")
        if plan is None:
            out.append(c)
            continue
        key = (repr(dataclasses.replace(c.config, overrides=base.overrides)),
               tuple((p.name, p.method, p.partitions) for p in plan.params))
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def _order(c: Candidate) -> tuple:
    return (c.step_s is None, (c.step_s or 0.0) * _steps_to_a_loss(c), _complexity(c))


def _steps_to_a_loss(c: Candidate) -> float:
    """Steps to a given loss relative to synchronous training, which the search weighs each
    candidate's step by: local SGD's, PowerSGD's and top-k's are more (`LOCAL_SGD_STEPS`,
    `POWERSGD_STEPS`, `TOPK_STEPS`); bf16 buckets must win by `COMPRESS_GAIN`."""
    if c.config.sync == "diloco":
        return LOCAL_SGD_STEPS
    return {"none": 1.0, "powersgd": POWERSGD_STEPS, "topk": TOPK_STEPS}.get(
        c.config.grad_compress, 1.0 / (1.0 - COMPRESS_GAIN))


def _complexity(c: Candidate) -> tuple:
    cfg = c.config
    return (cfg.tp * cfg.pp * cfg.cp, cfg.sync != "every_step", cfg.grad_compress != "none",
            cfg.batch_shares is not None,
            cfg.zero,
            cfg.offload != "none",
            cfg.zero_scope != "world", ("none", "selective", "full").index(cfg.recompute),
            cfg.microbatches or 0, cfg.stage_weights is not None, cfg.zero_weights is not None,
            len(cfg.overrides or {}))   # a tie goes to the tables placed each by its own cost


def _layers(model: nn.Module) -> int:
    from ..plans.analysis import recompute_units

    return max(1, len(recompute_units(model)))


@dataclass(frozen=True)
class Choice:
    chosen: Candidate
    runner_up: Candidate | None
    candidates: tuple[Candidate, ...]

    def why(self) -> str:
        """The chosen plan, and why the runner-up lost: the predicted step and peak of both."""
        c = self.chosen
        line = f"chose {label(c)}: predicted step {_ms(c.step_s)}, peak {_mb(c)}"
        if self.runner_up is None:
            return line + " (the only candidate that fits)"
        r = self.runner_up
        lost = "the same predicted step: the simpler plan wins" if r.step_s == c.step_s \
            else f"{(r.step_s / c.step_s - 1) * 100:.2g}% slower"
        return f"{line}; runner-up {label(r)}: {_ms(r.step_s)}, peak {_mb(r)} ({lost})"


def choose(found: list[Candidate]) -> Choice:
    """Choose: the fastest candidate that fits. Raises PlanError naming why each was refused
    when none fits."""
    runnable = [c for c in found if c.step_s is not None and "peak_bytes" in c.parts]
    if not runnable:
        reasons = "; ".join(f"{label(c)}: {c.why}" for c in found[:6])
        raise PlanError(f"plan='auto': no candidate fits ({reasons})")
    return Choice(runnable[0], runnable[1] if len(runnable) > 1 else None, tuple(found))


def trial_candidates(found: list[Candidate], k: int) -> list[Candidate]:
    """The `k` candidates `tilework plan --trial` runs: the fastest that fits of each family
    (mesh split, table placement, sync and compression, batch shares), in predicted order,
    then the next fastest of any. Where the model errs most is between families (on CPU ranks
    the servers and the all-gather were priced 1% apart and measured 8-33% apart:
    docs/planner.md), more than between a plan and its own recompute or ZeRO variant."""
    runnable = [c for c in found if c.step_s is not None and "peak_bytes" in c.parts]
    firsts, rest, seen = [], [], set()
    for c in runnable:
        key = _family(c.config)
        (rest if key in seen else firsts).append(c)
        seen.add(key)
    return (firsts + rest)[:k]


def _family(cfg: ParallelConfig) -> tuple:
    return (cfg.tp, cfg.pp, cfg.cp, cfg.mode, tuple(sorted((cfg.overrides or {}).items())),
            cfg.sync, cfg.grad_compress, cfg.batch_shares is not None,
            cfg.stage_weights is not None)


def auto(model: nn.Module, config: ParallelConfig, cluster: Cluster, example_inputs: tuple,
         flops_per_s: float, optimizer="adam", traffic: dict | None = None,
         budget_bytes: float | None = None, space: Space | None = None,
         message_overhead_s: float = 0.0) -> Choice:
    """plan="auto": the search over what `config` leaves to the planner (`Space.of`, unless
    `space` says otherwise), the rest of `config` kept, and the choice."""
    return choose(search(model, cluster, example_inputs, flops_per_s, optimizer, config,
                         space or Space.of(config), traffic, budget_bytes, message_overhead_s))


def options_of(config: ParallelConfig) -> dict:
    """`parallelize`'s keywords for what the search varies in a candidate's config (what
    differs from the defaults): how a benchmark runs a candidate as the search priced it."""
    out = {k: getattr(config, k) for k in ("tp", "pp", "cp") if getattr(config, k) > 1}
    if config.pp > 1:
        out |= {"microbatches": config.microbatches, "schedule": config.schedule}
    if config.stage_weights is not None:
        out["stage_weights"] = list(config.stage_weights)
    if config.zero:
        out["zero"] = config.zero
        if config.zero_scope != "world":
            out["zero_scope"] = config.zero_scope
        if config.zero_weights is not None:
            out["zero_weights"] = list(config.zero_weights)
    if config.offload != "none":
        out["offload"] = config.offload
    if config.recompute != "none":
        out["recompute"] = config.recompute
    if config.batch_shares is not None:
        out["batch_shares"] = list(config.batch_shares)
    if config.overrides:
        out["overrides"] = dict(config.overrides)
    if config.grad_compress != "none":
        out["grad_compress"] = config.grad_compress
    if config.grad_compress == "powersgd":
        out |= {"powersgd_rank": config.powersgd_rank, "powersgd_start": config.powersgd_start}
    if config.grad_compress == "topk":
        out["topk_ratio"] = config.topk_ratio
    if config.sync == "diloco":
        out |= {k: getattr(config, k) for k in (
            "sync", "sync_every", "outer_optimizer", "outer_lr", "outer_momentum",
            "outer_worker", "outer_compress", "outer_fragments", "outer_delay", "outer_mix",
            "outer_schedule")}
    return out


def label(c: Candidate) -> str:
    cfg = c.config
    out = f"dp{c.parts.get('dp_size', '?')}"
    for axis in ("pp", "cp", "tp"):
        if getattr(cfg, axis) > 1:
            out += f" x {axis}{getattr(cfg, axis)}"
    if cfg.zero:
        out += f", zero={cfg.zero}" + (f" ({cfg.zero_scope})" if cfg.zero_scope != "world"
                                       else "")
        if cfg.zero_weights is not None:
            out += f", chunks by memory {'/'.join(f'{w:g}' for w in cfg.zero_weights)}"
    if cfg.offload != "none":
        out += f", offload={cfg.offload}"
    if cfg.recompute != "none":
        out += f", recompute={cfg.recompute}"
    if cfg.pp > 1:
        out += f", {cfg.microbatches} microbatches {cfg.schedule}"
    if cfg.stage_weights is not None:
        out += f", stages by memory {'/'.join(f'{w:g}' for w in cfg.stage_weights)}"
    if cfg.batch_shares is not None:
        out += f", shares {'/'.join(map(str, cfg.batch_shares))}"
    if cfg.grad_compress in ("bf16", "fp16"):
        out += f", {cfg.grad_compress} buckets"
    elif cfg.grad_compress == "powersgd":
        out += f", PowerSGD rank {cfg.powersgd_rank} (weighed at x{POWERSGD_STEPS:g} steps " \
            "to a loss)"
    elif cfg.grad_compress == "topk":
        out += f", top-{cfg.topk_ratio:.2%} (weighed at x{TOPK_STEPS:g} steps to a loss)"
    if "tables" in c.parts:   # with_table_methods' variant
        out += ", tables " + {"allgather": "all-gathered", "ps": "on the servers",
                              "allreduce": "all-reduced"}[c.parts["tables"]]
    if cfg.sync == "diloco":
        out += f", local SGD every {cfg.sync_every} steps" + (
            f" in {cfg.outer_compress}" if cfg.outer_compress != "none" else "") + (
            ", layer-wise" if cfg.outer_schedule == "layerwise" else "") + (
            " (weighed at x{:g} steps to a loss)".format(LOCAL_SGD_STEPS))
    return out


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.3f} ms"


def _mb(c: Candidate) -> str:
    peak = c.parts.get("peak_bytes")
    return "-" if peak is None else f"{peak / 1e6:,.1f} MB"


def search_mesh(model: nn.Module, cluster: Cluster, batch: int, seq: int,
                flops_per_s: float, optimizer="adam",
                message_overhead_s: float = 0.0) -> list[Candidate]:
    """`tilework plan --search`: the mesh split alone for a global batch of `batch` sequences
    of `seq` tokens, priced as `search` prices (the reference GPT's step model)."""
    world = cluster.world_size
    found = []
    for c in configs(ParallelConfig(), Space.mesh_only(), cluster, _layers(model)):
        dp = world // (c.tp * c.pp * c.cp)
        if batch % dp:
            found.append(Candidate(c, None, f"a batch of {batch} does not split over "
                                            f"dp = {dp} replicas", {"dp_size": dp}))
            continue
        ids = torch.zeros(batch // dp, seq, dtype=torch.long, device="meta")
        found.append(price(model, c, cluster, (ids, ids), flops_per_s, optimizer,
                           message_overhead_s=message_overhead_s, replica=True))
    return sorted(found, key=_order)


__all__ = ["Candidate", "Choice", "MeshCandidate", "Space", "auto", "candidates", "choose",
           "configs", "label", "predict", "price", "search", "search_mesh", "trial_candidates"]
