"""`apply(model, optimizer, plan, config, groups)`: a Plan made real on this rank, in one order
whatever the plan holds (torchtitan's `parallelize_*` shape):

    apply_tp    the plan's layout splits the layers over tp (the optimizer then holds the shards)
    apply_cp    attention as ring attention over cp, each rank its part of the sequence
    apply_pp    the blocks cut into the plan's stages (the optimizer keeps this rank's)
    apply_dp    the data-parallel engine over this rank's dp group, running `plan.part(pp)`:
                all-reduce, ZeRO or the parameter server (the whole world's group, and the plan
                itself, when the plan has no mesh)
    recompute   activation recompute of the plan's blocks

Before any of them, on a mesh, the world starts from rank 0's values (as DDP does) and the
mesh's groups are built. Every change to the user's objects goes through a change record (the
mesh's, `MeshParallel.changes`, then the engine's), so `tilework.unparallelize` walks it back.
Returns what the user's loop holds: the model (under pp, the pipeline, whose `step` runs the
schedule) and the optimizer. docs/architecture.md, "The mesh".
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..cluster.mesh import Mesh
from ..comm import counted
from ..comm.counted import Stats
from ..comm.groups import Groups, data_parallel_groups
from ..config.parallel import ParallelConfig
from ..errors import PlanError
from ..parallel.context.layout import SequenceCut
from ..planner.shares import gradient_weights
from ..plans.plan import Plan
from .changes import Changes, release_values
from .engine import Engine
from .hooks import PicklesAsNoop
from .preflight import check_same_model_everywhere, check_same_plan_everywhere
from .recompute import apply_recompute
from .replica import SameBatchCheck, mark_local
from .split_forward import name_split_failures


@dataclass(eq=False)
class MeshParallel:
    """What a meshed model carries besides its engine: the mesh, its groups, the bytes moved
    along tp / cp / pp (the engine counts dp's), the layout applied and the pipeline."""

    mesh: Mesh
    world: Groups             # the whole world's (the engine's are one dp group's)
    groups: object            # tensor.groups.MeshGroups
    stats: Stats
    plan: object = None       # plan.Plan: the whole run's, this rank's part being plan.part(pp)
    # What was done to the user's model and optimizer before the engine's own changes (the
    # layout's and cp's module swaps, the optimizer's parameters), each with its undo.
    changes: Changes = field(default_factory=Changes)
    tp: object | None = None  # tensor.regions.TensorParallel
    layout: object | None = None  # tensor.layout.LayoutPlan
    pipeline: nn.Module | None = None  # pipeline.model.PipelineModel
    same_batch: object = None  # replica.SameBatchCheck


def apply(model, optimizer, plan: Plan, config: ParallelConfig, groups: Groups, log: bool):
    """Apply `plan` on this rank (`config` says the same sizes, and what the plan does not
    hold: input checks). `groups` are the world's."""
    # Over the world, before anything changes or any group is made: ranks whose models or
    # plans differ would meet in different collectives (or not meet) from here on.
    check_same_model_everywhere(model, groups)
    check_same_plan_everywhere(plan, groups)
    found = None
    if plan.parallel is not None:
        from ..parallel.tensor import build_mesh_groups

        originals = list({id(p): p for p in model.parameters()}.values())
        _start_alike(model, groups)
        found = MeshParallel(plan.mesh, groups, build_mesh_groups(plan.mesh, groups.world,
                                                                  groups.env), Stats(), plan)
    if config.tp > 1:
        apply_tp(model, optimizer, found)
    ring_modules = apply_cp(model, config, found) if config.cp > 1 else []
    target = apply_pp(model, optimizer, config, found) if config.pp > 1 else model
    if found is not None:
        _release_unheld(model, originals, found)
    engine = apply_dp(target, optimizer, config, plan, groups, found)
    apply_recompute(target, engine.plan.recompute, engine.changes)
    if found is not None:
        _check_the_replica(model, target, config, engine, found, bool(ring_modules))
    if log and groups.rank == 0:
        from ..report.tables import print_plan

        if found is not None:
            print(f"tilework mesh: {found.mesh} "
                  f"({', '.join(_axis_line(found.groups, a) for a in found.mesh.names)})")
        print_plan(plan)
    return (found.pipeline if found is not None and found.pipeline is not None else model), \
        optimizer


def _release_unheld(model, originals: list, found: MeshParallel) -> None:
    """The values of parameters this rank no longer computes with: tp-split modules' whole
    weights (kept for undo) and, under pp, other ranks' blocks."""
    current = {id(p) for p in model.parameters()}
    unheld = [p for p in originals if id(p) not in current]
    if found.pipeline is not None:
        unheld += found.pipeline.unheld
    if unheld:
        release_values(found.changes, unheld, f"{len(unheld)} parameters this rank does not "
                       "hold (tp's whole weights, other pipeline ranks' blocks): values released")


def apply_tp(model, optimizer, found: MeshParallel) -> None:
    """The plan's layout: its modules replaced by tensor-parallel ones; the optimizer takes the
    shards; every tp rank draws the same random numbers from here on."""
    from ..parallel.tensor import TensorParallel, apply_layout

    _same_random_numbers_in_tp(found)
    parallel = found.plan.parallel
    found.tp = TensorParallel.from_mesh(found.groups, found.stats, parallel.sequence_parallel)
    before = dict(model.named_parameters(remove_duplicate=False))
    found.layout = apply_layout(model, dict(parallel.layout), found.tp, found.changes)
    _swap_in_optimizer(optimizer, before, dict(model.named_parameters()), found.changes)
    name_split_failures(model, found.layout, found.changes)


def apply_cp(model, config: ParallelConfig, found: MeshParallel) -> list:
    """After tp (attention split by heads runs the ring on its own heads): the modules that
    become ring attention. Unpipelined, the forward runs under RingSDPA too (apply_dp's
    caller hooks it), which also finds SDPA calls and looks position tables up at global
    positions; the stages of a pipeline run outside it."""
    from ..parallel.context import apply_context_parallel

    staged = config.pp > 1
    return apply_context_parallel(
        model, found.groups.group("cp"), found.stats, positions="positions" if staged else None,
        require_modules=staged, changes=found.changes)


def apply_pp(model, optimizer, config: ParallelConfig, found: MeshParallel) -> nn.Module:
    """This rank's stages of the plan's cut; the optimizer keeps their parameters. Returns the
    part."""
    from ..parallel.pipeline import build
    from ..parallel.pipeline.model import PipelineModel

    parallel = found.plan.parallel
    schedule = build(parallel.schedule, config.pp, parallel.microbatches,
                     parallel.stages_per_rank)
    before = dict(model.named_parameters(remove_duplicate=False))
    found.pipeline = PipelineModel(model, schedule, found.groups.group("pp"),
                                   found.groups.coord("pp"), found.stats,
                                   blocks=[range(a, b) for a, b in parallel.stages])
    if config.sequence_parallel and config.tp > 1:
        _carry_sequence_slices(found.pipeline, config.tp)
    _swap_in_optimizer(optimizer, before, dict(found.pipeline.part.named_parameters()),
                       found.changes)
    return found.pipeline.part


def _carry_sequence_slices(pipeline, tp: int) -> None:
    """Under sequence parallelism each tp rank's activation between blocks is its slice of the
    sequence, and so is what crosses a stage boundary (to the same tp rank of the next stage,
    Megatron's way): the reference GPT's boundaries are 1/tp of the sequence."""
    from ..parallel.pipeline.stages import GPTStage

    for stage in pipeline.runner.stages.values():
        if not isinstance(stage, GPTStage):
            raise PlanError("pp > 1 with sequence_parallel: stages of this model do not know "
                            "their boundaries' sequence slices (the reference GPT's do)")
        stage.sequence_parts = tp


def apply_dp(target, optimizer, config: ParallelConfig, plan: Plan, world: Groups,
             found: MeshParallel | None) -> Engine:
    """The data-parallel engine over `target` (the model, or this rank's pipeline part): over
    the world with the whole plan, or on a mesh over this rank's dp group (dp x cp under
    context parallelism: each rank computes its tokens' mean loss, and every rank holds as many
    tokens) with the plan's part for this rank's pipeline coordinate."""
    if found is None:
        return Engine(target, optimizer, world, plan, config.check_inputs)
    dp = data_parallel_groups(found.groups, found.world,
                              ("dp", "cp") if config.cp > 1 else ("dp",))
    # The pipeline's stages never run the part's own forward, where the input checks and the
    # zeroed-without-a-step check look.
    part = plan.part(found.groups.coord("pp"))
    engine = Engine(target, optimizer, dp, part, config.check_inputs and config.pp == 1,
                    weigh_output=found.pipeline is None)
    engine.mesh = found
    if found.pipeline is not None and part.batch_shares is not None:
        # Each replica's pipeline seeds its loss's gradient with its share's weight, so the
        # mean over dp is the global batch's (runtime/shares.py does it at the output
        # elsewhere); the microbatches of one replica are equal, so 1/m stays their weight.
        found.pipeline.runner.loss_weight = gradient_weights(part.batch_shares)[dp.rank]
    if engine.checks is not None and config.tp > 1:
        engine.checks.across = found.groups.group("tp")
    if found.pipeline is not None:
        found.pipeline._tilework_engine = engine    # the runner ends its counted steps
    elif optimizer is not None:
        engine.changes.hook("optimizer: step post-hook (the mesh's counted step ends)",
                            optimizer.register_step_post_hook(
                                lambda *_: found.stats.end_step()))
    else:   # a hand-written update: the step ends with the synchronised backward
        engine.step_ended.append(found.stats.end_step)
    return engine


def _check_the_replica(model, target, config: ParallelConfig, engine: Engine,
                       found: MeshParallel, modules_ring: bool) -> None:
    """What a mesh adds around the user's forward once the engine is in place: cp's cut of the
    sequence (and SDPA calls as ring attention), norms of a part's gradients refused, and a
    replica's ranks checked to be given one batch."""
    groups = found.groups
    if config.cp > 1 and found.pipeline is not None:
        found.pipeline.cut = SequenceCut(groups.coord("cp"), config.cp)
    elif config.cp > 1:
        engine.changes.hook("model: forward pre-hook (this rank's part of the sequence)",
                            model.register_forward_pre_hook(
                                PicklesAsNoop(SequenceCut(groups.coord("cp"), config.cp)),
                                with_kwargs=True, prepend=True))
        _ring_sdpa(model, engine, found, modules_ring)
    if config.tp > 1 or config.pp > 1:
        for name, p in target.named_parameters():
            engine.changes.hook(f"{name}: post-accumulate-grad hook (norms of a part refused)",
                                p.register_post_accumulate_grad_hook(PicklesAsNoop(mark_local)))
    found.same_batch = SameBatchCheck(found)
    if found.pipeline is None:   # before the cut: a replica's ranks get whole sequences
        engine.changes.hook("model: forward pre-hook (a replica's ranks got one batch)",
                            model.register_forward_pre_hook(
                                PicklesAsNoop(lambda module, args, kwargs: found.same_batch(
                                    [*args, *kwargs.values()])),
                                with_kwargs=True, prepend=True))


def _same_random_numbers_in_tp(found: MeshParallel) -> None:
    """Every tp rank of a group continues tp rank 0's random stream: dropout on activations
    the group holds alike (after a row-parallel sum, on the residual stream) must drop the same
    elements, or the replicated parameters drift apart silently (a script seeding each rank
    differently, as nanoGPT does with 1337 + rank, would). Megatron-LM draws its split regions'
    dropout from a second, per-rank stream; here they share the one stream (the masks of two
    ranks' heads are alike; each is still a valid dropout)."""
    group = found.groups.group("tp")
    device = found.world.device
    states = [("cpu", torch.get_rng_state())]
    if device.type == "cuda":
        states.append(("cuda", torch.cuda.get_rng_state(device)))
    for kind, state in states:
        # Over the tp group's backend (NCCL reduces CUDA tensors only); counted as set-up.
        moved = state.to(device)
        counted.broadcast(moved, 0, group, found.stats, "setup")
        if kind == "cpu":
            torch.set_rng_state(moved.cpu())
        else:
            torch.cuda.set_rng_state(moved.cpu(), device)
    found.stats.discard_step()


def _ring_sdpa(model: nn.Module, engine, found: MeshParallel, modules_ring: bool) -> None:
    """The model's forward, after the cut, under context.sdpa.RingSDPA: its
    F.scaled_dot_product_attention calls run as ring attention over cp."""
    from ..parallel.context import Ring, RingForward

    ring_forward = RingForward(model, Ring(found.groups.group("cp"), found.stats), modules_ring)
    engine.changes.hook("model: forward pre-hook (SDPA calls as ring attention)",
                        model.register_forward_pre_hook(PicklesAsNoop(ring_forward.before),
                                                        with_kwargs=True))
    engine.changes.hook("model: forward hook (SDPA calls as ring attention: the mode ends)",
                        model.register_forward_hook(PicklesAsNoop(ring_forward.after),
                                                    with_kwargs=True, always_call=True))
    for name, _ in engine.plan.recompute:
        for child_name, child in model.get_submodule(name).named_modules():
            if child_name:   # the block's own forward runs under checkpoint, not __call__
                what = f"{name}.{child_name}: forward hooks (SDPA as ring attention in recompute)"
                engine.changes.hook(what, child.register_forward_pre_hook(
                    PicklesAsNoop(ring_forward.inside_before), with_kwargs=True))
                engine.changes.hook(what, child.register_forward_hook(
                    PicklesAsNoop(ring_forward.inside_after), with_kwargs=True, always_call=True))


def _axis_line(groups, axis: str) -> str:
    return f"{axis} groups {groups.mesh.groups(axis)}"


@torch.no_grad()
def _start_alike(model: nn.Module, world: Groups) -> None:
    """Rank 0's values everywhere before the layout cuts them: every tp rank must take its
    shard of the same tensor (DDP broadcasts too; the engine does again over dp)."""
    if world.world is None:
        return
    stats = Stats()
    for t in [*model.parameters(), *model.buffers()]:
        counted.broadcast(t.data, 0, world.world, stats, "setup")


def _swap_in_optimizer(optimizer, before: dict, after: dict, changes: Changes) -> None:
    """The optimizer's parameters replaced by what took their names (tensor-parallel shards),
    and dropped where nothing did (another pipeline stage's)."""
    if optimizer is None:
        return
    if optimizer.state:
        raise PlanError("parallelize with tp or pp > 1 before the optimizer's first step: its "
                        "state would have to be split too")
    # Every name a tied parameter has: the last stage knows the embedding as head.weight.
    kept = [list(group["params"]) for group in optimizer.param_groups]

    def undo():
        for group, params in zip(optimizer.param_groups, kept):
            group["params"] = params

    changes.record("optimizer: parameters replaced by this rank's shards and stages", undo)
    names_of: dict[int, list[str]] = {}
    for n, p in before.items():
        names_of.setdefault(id(p), []).append(n)
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            names = names_of.get(id(p))
            if names is None:
                params.append(p)       # not the model's: left as the user made it
            elif any(n in after for n in names):
                params.append(after[next(n for n in names if n in after)])
        group["params"] = params
