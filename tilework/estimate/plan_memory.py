"""What each rank holds under a Plan (`plan_memory`; `estimate_memory` plans, then asks it):
pure, on the meta device, without a process group.

A data-parallel plan is memory.py's rules on the model. On a mesh, the plan is read, not made
again: the model is transformed on a meta copy as `parallelize` transforms it on the rank
(planner/model_parallel.shape_only_copy, the one the planner planned on, at this rank's tp and
cp coordinates: the layout with shape-only tp collectives, ring attention with a shape-only
ring), the blocks are cut at the plan's stages under the plan's schedule and this rank's kept
(parallel/pipeline/model.local_part), and the rank runs `plan.part(pp)`. Then:

- parameters, gradients, optimizer state, buckets, the step's temporaries: estimate/memory.py's
  rules on that part (its parameters are the layout's local shapes, only this rank's stages'),
  as the plan places them over the rank's dp group (dp x cp under context parallelism),
  ZeRO included.
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

from ..errors import PlanError
from ..plans.plan import Plan, config_of
from .memory import MemoryEstimate, estimate_per_rank
from .meta_forward import ForwardFacts, meta_forward


def plan_memory(model: nn.Module, plan: Plan, example_inputs: tuple, optimizer="adam",
                ranks=None) -> list[MemoryEstimate]:
    """Bytes each of `ranks` (default: every rank) holds training `model` under `plan` with
    `optimizer` (a torch optimizer, its class or its name). `example_inputs`: one rank's batch
    for a data-parallel plan; on a mesh one dp replica's (whole sequences, as the script passes
    them: every tp, pp and cp rank of a replica gets the same). On a mesh a rank's figures
    depend on its (pp, cp, tp) coordinates only (dp replicas mirror each other): each is
    computed once."""
    ranks = range(plan.world_size) if ranks is None else ranks
    for rank in ranks:
        if not 0 <= rank < plan.world_size:
            raise ValueError(f"rank: expected 0..{plan.world_size - 1}, got {rank}")
    if plan.parallel is None:
        shares = plan.batch_shares
        if shares is None or len(set(shares)) == 1:
            return estimate_per_rank(model, plan, example_inputs, optimizer, ranks)
        # Uneven shares: each rank on its own count of the batch.
        found = {}
        for n in sorted({shares[r] for r in ranks}):
            mine = [r for r in ranks if shares[r] == n]
            for e in estimate_per_rank(model, plan, with_batch(example_inputs, n), optimizer,
                                       mine):
                found[e.rank] = e
        return [found[r] for r in ranks]
    seen: dict[tuple, MemoryEstimate] = {}
    out = []
    shares = plan.rank_shares()
    uneven = shares is not None and len(set(shares)) > 1   # each replica on its own count
    # ZeRO's cut or the servers' rows differ by dp rank: replicas do not mirror each other.
    chunked = any(p.zero_chunks or p.servers for p in plan.params)
    for rank in ranks:
        at = plan.mesh.coords(rank)
        key = (at["pp"], at["cp"], at["tp"], shares[rank] if uneven else None,
               at["dp"] if chunked else None)
        if key not in seen:
            inputs = with_batch(example_inputs, shares[rank]) if uneven else example_inputs
            seen[key] = _on_mesh(model, plan, inputs, optimizer, rank)
        out.append(dataclasses.replace(seen[key], rank=rank))
    return out


def with_batch(example_inputs: tuple, n: int) -> tuple:
    """`example_inputs` (one rank's batch) as a batch of `n`: every tensor whose leading dim is
    the batch's made that long (zeros: the estimates read shapes); others (sampled negatives)
    kept."""
    import torch

    tensors = [x for x in example_inputs if torch.is_tensor(x) and x.dim()]
    if not tensors:
        return tuple(example_inputs)
    b = tensors[0].shape[0]
    return tuple(torch.zeros((n, *x.shape[1:]), dtype=x.dtype, device=x.device)
                 if torch.is_tensor(x) and x.dim() and x.shape[0] == b else x
                 for x in example_inputs)


def share_caps(model: nn.Module, plan: Plan, example_inputs: tuple,
               budgets: list[float | None], most: int, optimizer="adam") -> list[int | None]:
    """The most samples (up to `most`) each rank's memory holds a step under `plan` (a
    data-parallel plan): the largest batch whose estimated peak on that rank is within its
    budget, by bisection (the peak grows with the batch, though not linearly: at a few samples
    the optimizer's step, not the activations, sets it). None: no budget, no cap; 0: not even
    one sample fits."""
    import dataclasses

    even = dataclasses.replace(plan, batch_shares=None)

    def fits(rank: int, n: int, budget: float) -> bool:
        found = estimate_per_rank(model, even, with_batch(example_inputs, n), optimizer, [rank])
        return found[0].peak <= budget

    caps: list[int | None] = []
    for rank, budget in enumerate(budgets):
        if budget is None:
            caps.append(None)
            continue
        low, high = 0, most   # fits(low) holds (0: nothing), the answer is in [low, high]
        while low < high:
            mid = (low + high + 1) // 2
            if fits(rank, mid, budget):
                low = mid
            else:
                high = mid - 1
        caps.append(low)
    return caps


def estimate_mesh_memory(model: nn.Module, config, example_inputs: tuple, world_size: int,
                         rank: int = 0, optimizer="adam", cluster=None) -> MemoryEstimate:
    """`plan_memory` of rank `rank` under the plan `tilework.plan` makes for `config` on
    `world_size` ranks (`cluster` gives their hosts; default: one host)."""
    return plan_memory(model, plan_for(model, config, world_size, cluster), example_inputs,
                       optimizer, [rank])[0]


def estimate_every_rank(model: nn.Module, config, example_inputs: tuple, world_size: int,
                        optimizer="adam", cluster=None) -> list[MemoryEstimate]:
    """`estimate_mesh_memory` of every rank."""
    return plan_memory(model, plan_for(model, config, world_size, cluster), example_inputs,
                       optimizer)


def plan_for(model: nn.Module, config, world_size: int, cluster) -> Plan:
    from ..cluster.topology import Topology
    from ..planner import plan

    topology = cluster.topology() if cluster is not None else Topology.from_sizes([world_size])
    if topology.world_size != world_size:
        raise ValueError(f"world_size: {world_size}, but the cluster has "
                         f"{topology.world_size} ranks")
    return plan(model, config, cluster, topology=topology)


def _on_mesh(model: nn.Module, plan: Plan, example_inputs: tuple, optimizer,
             rank: int) -> MemoryEstimate:
    from ..planner.model_parallel import shape_only_copy

    config, at = config_of(plan), plan.mesh.coords(rank)
    meta, _ = shape_only_copy(model, config, at)
    part, stages, schedule = meta, None, None
    if config.pp > 1:
        part, stages, schedule = _pipeline_part(meta, plan, at["pp"])
    axes = ("dp", "cp") if config.cp > 1 else ("dp",)
    dp_ranks = next(g for g in plan.mesh.groups(axes) if rank in g)
    dp_plan = plan.part(at["pp"])
    inputs = _cut_sequence(example_inputs, at["cp"], config.cp)
    if stages is None:
        facts = meta_forward(meta, inputs, dp_plan.recompute)
        return dataclasses.replace(estimate_per_rank(
            part, dp_plan, inputs, optimizer, [dp_ranks.index(rank)], facts)[0], rank=rank)
    return _pipelined(part, stages, schedule, at["pp"], dp_plan, inputs, optimizer,
                      dp_ranks.index(rank), rank)


def _pipeline_part(meta: nn.Module, plan: Plan, pp_rank: int):
    """This rank's stages of the plan's cut and schedule, and the module tree of them."""
    from ..parallel.pipeline import build, split_stages
    from ..parallel.pipeline.model import is_reference_gpt, local_part, stage_modules

    parallel = plan.parallel
    if not is_reference_gpt(meta):
        raise PlanError(f"pp: the estimate of pipeline stages is built for the reference GPT "
                        f"only, not {type(meta).__name__} yet (training with pp cuts it)")
    pp = plan.mesh.size_of("pp")
    schedule = build(parallel.schedule, pp, parallel.microbatches, parallel.stages_per_rank)
    stages = split_stages(meta, schedule.stages, blocks=[range(a, b) for a, b in parallel.stages])
    if parallel.sequence_parallel:   # boundaries carry sequence slices
        for stage in stages:
            stage.sequence_parts = plan.mesh.size_of("tp")
    mine = {s: stages[s] for s in schedule.stages_of(pp_rank)}
    part = local_part(meta, [mod for s in mine.values() for mod in stage_modules(s)])
    return part, mine, schedule


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
