"""What one rank holds on a dp x pp x cp x tp mesh (`estimate_memory` with tp, pp or cp > 1):
pure, on the meta device, without a process group.

The model is transformed on a meta copy as `parallelize` transforms it on the rank
(runtime/apply.py), with stand-ins for the collectives that only make tensors of the right shapes:
the layout applied for this rank's tp coordinate (`tensor.regions.ShapeOnlyTP`), ring attention for
its cp coordinate (`context.comm.ShapeOnlyRing`), the blocks cut into the schedule's stages and this
rank's kept (parallel/pipeline/model.local_part). Then:

- parameters, gradients, optimizer state, buckets, the step's temporaries: estimate/memory.py's
  rules on that part (its parameters are the layout's local shapes, only this rank's stages'),
  planned over the rank's dp group (dp x cp under context parallelism) as parallelize plans
  it, ZeRO included.
- activations: measured by the meta forward of the transformed model, so tensor parallelism's
  split regions, sequence parallelism's slices (and the all-gathered inputs the column-parallel
  layers save), the vocabulary-parallel loss's saved exponentials, and ring attention's saved
  q, k, v, output and log-normalisers on the rank's 1/cp of the sequence are what the layers
  really save, not a formula. Under pp each of the rank's stages runs forward on one microbatch
  (batch / microbatches sequences), and the schedule is walked action by action (`_walk`): a
  microbatch-stage's activations live from its F to its B (`schedule.in_flight` of them at
  most), the receive buffers posted one action ahead, and what the runtime keeps in its send
  queue until the step ends (each sent output, each sent input gradient).
- temporaries: estimate/memory.py's rule on the largest saved tensor of the transformed forward.

Under pp the gradients exist from the rank's first backward on while later microbatches'
activations are still held: `MemoryEstimate.pipelined` is what the walk holds then (plus the
backward's temporaries), counted beside the gradients in the peak.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from ..parallel.context.comm import ShapeOnlyRing
from ..parallel.tensor.regions import ShapeOnlyTP
from .memory import MemoryEstimate, estimate_per_rank
from .meta_forward import ForwardFacts, meta_forward, on_meta


def estimate_mesh_memory(model: nn.Module, config, example_inputs: tuple, world_size: int,
                         rank: int = 0, optimizer="adam", cluster=None) -> MemoryEstimate:
    """Bytes rank `rank` of `world_size` holds training `model` under `config` (tp, pp, cp, and
    dp = what they leave), `example_inputs` being one data-parallel replica's batch: whole
    sequences, as the script passes them to `parallelize`'s model (every tp, pp and cp rank of
    a replica gets the same). `cluster` gives the ranks' hosts (default: one host)."""
    from ..cluster.mesh import parallel_mesh

    if not 0 <= rank < world_size:
        raise ValueError(f"rank: expected 0..{world_size - 1}, got {rank}")
    per_host = _ranks_per_host(cluster)
    mesh = parallel_mesh(world_size, per_host, tp=config.tp, pp=config.pp, cp=config.cp)
    at = mesh.coords(rank)
    meta = _transformed(model, config, at)
    part, stages, schedule = meta, None, None
    if config.pp > 1:
        part, stages, schedule = _pipeline_part(meta, config, at["pp"])
    axes = ("dp", "cp") if config.cp > 1 else ("dp",)
    dp_ranks = next(g for g in mesh.groups(axes) if rank in g)
    dp_plan = _dp_plan(meta, part, config, cluster, dp_ranks)
    inputs = _cut_sequence(example_inputs, at["cp"], config.cp)
    if stages is None:
        facts = meta_forward(meta, inputs, dp_plan.recompute)
        return dataclasses.replace(estimate_per_rank(
            part, dp_plan, inputs, optimizer, [dp_ranks.index(rank)], facts)[0], rank=rank)
    return _pipelined(part, stages, schedule, at["pp"], dp_plan, inputs, optimizer,
                      dp_ranks.index(rank), rank)


def estimate_every_rank(model: nn.Module, config, example_inputs: tuple, world_size: int,
                        optimizer="adam", cluster=None) -> list[MemoryEstimate]:
    """`estimate_mesh_memory` of every rank, computed once per (pp, cp, tp) coordinate: a
    rank's figures depend on nothing else (dp replicas mirror each other)."""
    from ..cluster.mesh import parallel_mesh

    mesh = parallel_mesh(world_size, _ranks_per_host(cluster), tp=config.tp, pp=config.pp,
                         cp=config.cp)
    seen: dict[tuple, MemoryEstimate] = {}
    out = []
    for rank in range(world_size):
        at = mesh.coords(rank)
        key = (at["pp"], at["cp"], at["tp"])
        if key not in seen:
            seen[key] = estimate_mesh_memory(model, config, example_inputs, world_size, rank,
                                             optimizer, cluster)
        out.append(dataclasses.replace(seen[key], rank=rank))
    return out


def _transformed(model: nn.Module, config, at: dict[str, int]) -> nn.Module:
    """A meta copy of `model` as parallelize leaves it on the rank at `at` (pp aside)."""
    from ..comm.counted import Stats

    meta = on_meta(model)
    if config.tp > 1:   # tp first, then cp: parallelize's order (runtime/apply.py)
        from ..parallel.tensor import apply_layout, layout_for

        tp = ShapeOnlyTP(None, at["tp"], config.tp, config.sequence_parallel)
        apply_layout(meta, config.layout or layout_for(model), tp)
    if config.cp > 1:
        from ..parallel.context import apply_context_parallel

        apply_context_parallel(meta, None, Stats())
        ring = ShapeOnlyRing(at["cp"], config.cp)
        for m in meta.modules():
            if hasattr(m, "ring"):
                m.ring = ring
    return meta


def _pipeline_part(meta: nn.Module, config, pp_rank: int):
    """This rank's stages of the schedule parallelize builds, and the module tree of them."""
    from ..parallel.pipeline import build, split_stages
    from ..parallel.pipeline.model import local_part, stage_modules

    m = config.microbatches or 2 * config.pp
    schedule = build(config.schedule, config.pp, m, config.stages_per_rank)
    stages = split_stages(meta, schedule.stages)
    if config.sequence_parallel and config.tp > 1:   # boundaries carry sequence slices
        for stage in stages:
            stage.sequence_parts = config.tp
    mine = {s: stages[s] for s in schedule.stages_of(pp_rank)}
    part = local_part(meta, [mod for s in mine.values() for mod in stage_modules(s)])
    return part, mine, schedule


def _dp_plan(model: nn.Module, part: nn.Module, config, cluster, dp_ranks: tuple[int, ...]):
    """The data-parallel plan parallelize makes for the part over the rank's dp group."""
    from ..cluster.topology import Topology
    from ..planner.model_parallel import plan_part

    if cluster is not None:
        hosts = cluster.topology()
        topology = Topology.from_host_ids([hosts.host_of(r) for r in dp_ranks])
    else:
        topology = Topology.from_sizes([len(dp_ranks)])
    return plan_part(model, part, config, topology, cluster)


def _ranks_per_host(cluster) -> int | None:
    if cluster is None:
        return None
    sizes = {h.procs for h in cluster.hosts}
    return sizes.pop() if len(sizes) == 1 else None


def _cut_sequence(inputs: tuple, cp_rank: int, cp: int) -> tuple:
    """The (batch, sequence, ...) inputs cut to the rank's load-balanced part: meshed's own
    cut, as the model sees them."""
    if cp == 1:
        return tuple(inputs)
    from ..parallel.context.layout import SequenceCut

    return SequenceCut(cp_rank, cp)(None, tuple(inputs), {})[0]


def _pipelined(part: nn.Module, stages: dict, schedule, pp_rank: int, dp_plan, inputs: tuple,
               optimizer, dp_index: int, rank: int) -> MemoryEstimate:
    """The estimate of a pipeline rank: each of its stages' forward on one microbatch, the
    schedule walked for what is held when."""
    m = schedule.microbatches
    tokens, targets = (x.to("meta").chunk(m)[0] for x in inputs[:2])
    last = schedule.stages - 1
    facts, boundary = {}, 0
    for s, stage in stages.items():
        x = tokens if s == 0 else stage.boundary_like(tokens).requires_grad_()
        boundary = stage.boundary_like(tokens).untyped_storage().nbytes()
        # The plan names recomputed modules in the part; the stage holds them under its own.
        inside = {id(mod): name for name, mod in stage.named_modules()}
        recompute = [(inside[id(part.get_submodule(n))], policy) for n, policy
                     in dp_plan.recompute if id(part.get_submodule(n)) in inside]
        facts[s] = meta_forward(stage, (x, targets if s == last else None), recompute)
    held, pipelined = _walk(schedule, pp_rank, {s: f.activations for s, f in facts.items()},
                            boundary)
    largest = max(f.largest for f in facts.values())
    merged = ForwardFacts(held, largest, {k: v for f in facts.values()
                                          for k, v in f.lookups.items()},
                          max(f.recomputed for f in facts.values()))
    out = estimate_per_rank(part, dp_plan, inputs, optimizer, [dp_index], merged)[0]
    return dataclasses.replace(out, rank=rank, pipelined=pipelined + out.temporaries)


def _walk(schedule, pp_rank: int, acts: dict[int, int], boundary: int) -> tuple[int, int]:
    """Bytes a pipeline rank holds over its actions, as runtime.py holds them: (the most at
    once, the most once the first backward has made the gradients). A microbatch-stage's
    activations (its input and output included) live from F to B (W when split); each action's
    receive buffer is posted one action ahead (an input becomes the stage's saved input; a
    gradient is freed after its B); a sent output and a sent input gradient stay in the send
    queue until the step ends. The sent gradients are made in backward (MemTracker's "Temp"):
    they count in the second figure only."""
    actions = schedule.ranks[pp_rank]
    last = schedule.stages - 1
    split = {(a.stage, a.microbatch) for a in actions if a.kind == "W"}

    def remote(stage: int) -> bool:
        return schedule.rank_of(stage) != pp_rank

    def receives(a) -> tuple | None:
        if a.kind == "F" and a.stage > 0 and remote(a.stage - 1):
            return ("F", a.stage, a.microbatch)
        if a.kind == "B" and a.stage < last and remote(a.stage + 1):
            return ("B", a.stage, a.microbatch)
        return None

    posted: set = set()
    live = sent_grads = peak = with_grads = 0
    backward = False
    for i, a in enumerate(actions):
        for b in actions[i:i + 2]:   # this action's receive and the next one's
            if receives(b) and receives(b) not in posted:
                posted.add(receives(b))
                live += boundary
        released = a.kind == "W" or (a.kind == "B" and (a.stage, a.microbatch) not in split)
        if a.kind == "F":
            live += acts[a.stage] - (boundary if receives(a) else 0)
        if a.kind == "B":
            backward = True
            live -= boundary if receives(a) else 0
            sent_grads += boundary if a.stage > 0 and remote(a.stage - 1) else 0
        if released:   # the output, if sent, stays queued
            live -= acts[a.stage] - (boundary if a.stage < last and remote(a.stage + 1) else 0)
        peak = max(peak, live)
        with_grads = max(with_grads, live + sent_grads) if backward else with_grads
    return peak, with_grads
