"""Bytes one rank sends per step on a dp x pp x tp mesh, per axis: pure, from the model (a
meta-device one will do), the config and the batch; the figures `tilework.stats` counts under
"tp", "pipeline" and "allreduce" (tests hold them equal).

    tp         the layout's regions (parallel/tensor/cost.py) for the modules of this rank's stages,
               on the tokens of its dp share of the batch
    pipeline   the schedule's boundary sends (parallel/pipeline/simulate.p2p_bytes), one
               microbatch's activation each
    cp         ring attention's K/V blocks, forward and backward (parallel/context/cost.py)
    allreduce  the dense buckets over dp (dp x cp under context parallelism; cost.dense_sync_bytes)
               of this rank's shards of this rank's stages, the input check's words riding the
               last bucket (not under pp, whose stages never run the model's own forward where the
               check looks)
"""

from __future__ import annotations

from math import prod

from torch import nn

from ..cluster.mesh import parallel_mesh
from ..comm.wire import CHECK_WORDS, ring_allreduce_bytes
from ..config.parallel import ParallelConfig
from ..plans.plan import bucket_bytes
from .cost import dense_sync_bytes
from .model_facts import ModelFacts


def mesh_step_bytes(model: nn.Module, config: ParallelConfig, world_size: int, rank: int,
                    batch: int, seq: int, itemsize: int = 4,
                    facts: ModelFacts | None = None,
                    rank_speeds: tuple[float, ...] | list[float] | None = None,
                    cut: tuple[tuple[int, int], ...] | None = None) -> dict[str, int]:
    """`batch` sequences of `seq` tokens per dp replica; dense all-reduced parameters only
    (ZeRO and server placements are costed by estimate/cost.py as in data parallelism).
    `facts`: the search's, for the model's stage cuts and layouts; `rank_speeds`: each pp
    rank's speed (mesh.pp_speeds), by which the plan cuts the stages where the config gives no
    stage_weights (planner/model_parallel.py); `cut`: a plan's cut (each stage's block range),
    taken as it is."""
    from ..parallel.pipeline import build, p2p_bytes
    from ..parallel.tensor.cost import placement_bytes

    facts = ModelFacts.of(model, facts)
    mesh = parallel_mesh(world_size, None, tp=config.tp, pp=config.pp, cp=config.cp)
    at = mesh.coords(rank)
    out = {"tp": 0, "pipeline": 0, "allreduce": 0}
    held_stages = None
    if config.pp > 1:
        m = config.microbatches or 2 * config.pp
        schedule = build(config.schedule, config.pp, m, config.stages_per_rank)
        held_stages = (schedule.stages, tuple(schedule.stages_of(at["pp"])),
                       cut_weights(config, schedule, rank_speeds), cut)
        # A boundary carries this rank's part of the sequence: cp's, and tp's slice under
        # sequence parallelism.
        sliced = config.tp if config.sequence_parallel else 1
        out["pipeline"] = p2p_bytes(schedule, batch // m * (seq // config.cp // sliced)
                                    * model.head.in_features * itemsize)[at["pp"]]
    local_modules, shapes, attention = facts.once(("rank's part", held_stages),
                                                  lambda: _part(facts, held_stages))
    if config.tp > 1:
        layout = facts.layout(config.layout, config.tp, config.sequence_parallel)
        # On this rank's part of the sequence (cp cuts it before any layer).
        # Per microbatch under pp: what a step moves per token adds up over them, what it
        # moves per parameter (sequence parallelism's norm and position gradients) repeats.
        m = (config.microbatches or 2 * config.pp) if config.pp > 1 else 1
        out["tp"] = m * sum(placement_bytes(p, batch // m, seq // config.cp, config.tp,
                                             config.sequence_parallel, itemsize)
                            for p in layout.placements if p.module in local_modules)
        held = facts.once(("local shapes", layout), layout.local_shapes)
        shapes = {n: held[n] for n in shapes}
    if config.cp > 1:
        from ..parallel.context import cp_attention_bytes

        # The rank's stages' attentions, each ringing its own heads (tp splits them).
        out["cp"] = cp_attention_bytes(batch, attention[0].num_heads // config.tp, seq,
                                       attention[0].head_dim, config.cp, len(attention),
                                       itemsize)
    dp = mesh.size_of("dp") * config.cp   # a dp x cp group averages the gradients
    carried = CHECK_WORDS * itemsize if config.check_inputs and config.pp == 1 else 0
    out["allreduce"] = dense_sync_bytes([prod(s) * itemsize for s in shapes.values()],
                                        bucket_bytes(config.bucket_mb), dp, carried)
    if carried and config.tp > 1:   # the input checks' verdict crosses the tp group (checks.py)
        out["check"] = ring_allreduce_bytes(2 * 8, config.tp)
    return {k: v for k, v in out.items() if v}


def _part(facts: ModelFacts, held_stages: tuple | None) -> tuple:
    """Of the part of the model a rank holds (all of it, or the stages `held_stages` names:
    of how many, which, cut by what weights or as what block ranges): its modules' names, its
    parameters' shapes, its attentions."""
    from ..parallel.pipeline.model import local_part, stage_modules

    part = facts.model
    if held_stages is not None:
        count, which, weights, blocks = held_stages
        stages = facts.stages(count, weights) if blocks is None else facts.cut(count, blocks)
        part = local_part(facts.model, [mod for s in which for mod in stage_modules(stages[s])])
    names = facts.names()
    return (frozenset(names[id(mod)] for mod in part.modules() if id(mod) in names),
            {n: tuple(p.shape) for n, p in part.named_parameters()},
            [m for m in part.modules() if isinstance(m, nn.MultiheadAttention)])


def cut_weights(config: ParallelConfig, schedule,
                rank_speeds: tuple[float, ...] | list[float] | None) -> tuple[float, ...] | None:
    """Each stage's weight in the cut a plan makes (planner/model_parallel.py): from the
    config's stage_weights, else from the pp ranks' speeds, else None (by cost alone)."""
    return schedule.per_stage(config.stage_weights or rank_speeds)
