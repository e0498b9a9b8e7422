"""What each pipeline stage of a mesh plan runs, as recorded ops (estimate/ops.py): the rank's
shape-only copy at tp and cp rank 0 (planner/model_parallel.shape_only_copy, what the memory
estimate transforms too), cut into the plan's stages, each recorded on one microbatch of its
1/cp of the sequence with the plan's recompute. Pure; cached per model, since a search asks
for the same stages under every ZeRO stage and bucket size."""

from __future__ import annotations

import weakref
from collections import Counter

import torch
from torch import nn

from ..config.parallel import ParallelConfig
from .ops import Recording, record

_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def stage_recordings(model: nn.Module, config: ParallelConfig, replica_batch: int,
                     seq: int) -> list[Recording]:
    """One Recording per pipeline stage (one for the whole model without pp): a microbatch's
    forward and backward on the first tp and cp rank (their peers run alike)."""
    m = (config.microbatches or 2 * config.pp) if config.pp > 1 else 1
    key = (config.tp, config.cp, config.pp, m, config.schedule, config.stages_per_rank,
           config.sequence_parallel, repr(config.recompute), repr(config.layout),
           replica_batch, seq)
    seen = _CACHE.setdefault(model, {})
    if key not in seen:
        seen[key] = _record(model, config, replica_batch // m, seq)
    return seen[key]


def model_recording(model: nn.Module, example_inputs: tuple, recompute) -> Recording:
    """One forward and backward of any model on `example_inputs` with `recompute` (a plan's
    (module name, policy) pairs), recorded on a meta copy; cached per model, since a search
    asks for it under every ZeRO stage and placement."""
    from .meta_forward import on_meta

    inputs = tuple(x.to("meta") if torch.is_tensor(x) else x for x in example_inputs)
    key = ("model", tuple(recompute),
           tuple(tuple(x.shape) if torch.is_tensor(x) else repr(x) for x in inputs))
    seen = _CACHE.setdefault(model, {})
    if key not in seen:
        seen[key] = record(on_meta(model), inputs, recompute)
    return seen[key]


def _record(model: nn.Module, config: ParallelConfig, microbatch: int, seq: int):
    from ..planner.model_parallel import shape_only_copy
    from ..plans.analysis import recompute_choices
    from .plan_memory import _cut_sequence

    meta, _ = shape_only_copy(model, config, {"tp": 0, "cp": 0})
    messages = _count_messages(meta)
    ids = torch.zeros(microbatch, seq, dtype=torch.long, device="meta")
    tokens, targets = _cut_sequence((ids, ids), 0, config.cp)[:2]
    recompute = recompute_choices(meta, config.recompute)
    if config.pp == 1:
        return [_with(record(meta, (tokens, targets), recompute), messages)]
    from ..parallel.pipeline import build, split_stages

    schedule = build(config.schedule, config.pp, config.microbatches or 2 * config.pp,
                     config.stages_per_rank)
    stages = split_stages(meta, schedule.stages)
    last = len(stages) - 1
    out = []
    for s, stage in enumerate(stages):
        if config.sequence_parallel:   # boundaries carry sequence slices
            stage.sequence_parts = config.tp
        inside = {id(mod): name for name, mod in stage.named_modules()}
        mine = [(inside[id(meta.get_submodule(n))], policy) for n, policy in recompute
                if id(meta.get_submodule(n)) in inside]
        x = tokens if s == 0 else stage.boundary_like(tokens).requires_grad_()
        out.append(_with(record(stage, (x, targets if s == last else None), mine,
                                grad_of_output=s != last), messages))
    return out


def _with(recording: Recording, messages: Counter) -> Recording:
    """`recording` with the message ends counted while it ran (and the count started over)."""
    recording.messages.update(messages)
    messages.clear()
    return recording


def _count_messages(meta: nn.Module) -> Counter:
    """Count, into the Counter returned, the message ends of every exchange the shape-only tp
    and ring objects in `meta` make: a ring all-reduce over n ranks 4 (n - 1), an all-gather or
    reduce-scatter 2 (n - 1) (as tensor/cost.tp_step_calls charges them), a ring shift 2 (a
    send and a receive)."""
    from ..parallel.context.comm import ShapeOnlyRing
    from ..parallel.tensor.regions import ShapeOnlyTP

    counts: Counter = Counter()
    done: set[int] = set()
    for module in meta.modules():
        for value in vars(module).values():
            if id(value) in done:
                continue
            if isinstance(value, ShapeOnlyTP) and value.size > 1:
                n = value.size
                for name, ends in (("all_reduce", 4 * (n - 1)), ("gather_seq", 2 * (n - 1)),
                                   ("reduce_scatter_seq", 2 * (n - 1))):
                    _counting(value, name, counts, "tp", ends)
                done.add(id(value))
            elif isinstance(value, ShapeOnlyRing) and value.size > 1:
                _counting(value, "shift", counts, "cp", 2)
                done.add(id(value))
    return counts


def _counting(exchange, name: str, counts: Counter, axis: str, ends: int) -> None:
    own = getattr(exchange, name)

    def counted(*args, **kwargs):
        counts[axis] += ends
        return own(*args, **kwargs)

    object.__setattr__(exchange, name, counted)   # ShapeOnlyTP is a frozen dataclass


__all__ = ["model_recording", "stage_recordings"]
