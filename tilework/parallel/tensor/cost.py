"""Bytes one rank sends per training step under a layout, per mesh axis: pure arithmetic from
the plan and the batch shape, the figures `regions.py` and `apply.average_gradients` count
(tests hold them equal). Collectives are costed by `comm/wire.py`, the table the counters read.

Per token and per style, with T = batch x sequence tokens on a rank and w the width its region
moves (without sequence parallelism | with it):

    entering a region (colwise, heads, vocab_head)   all-reduce T*w backward
                                                     | all-gather T/tp*w fwd, reduce-scatter T*w bwd
    leaving a region (rowwise, heads, vocab_embedding) all-reduce T*w forward
                                                     | reduce-scatter T*w fwd, all-gather T/tp*w bwd
    vocab_head's cross-entropy                       all-reduce T (max) and 2T (target, sum exp)
    colwise_gather's output (o features)             all-gather T*o/tp forward
    sequence parallelism only: each 'sequence' norm parameter's and each row-parallel bias's
    gradient all-reduced; a 'sequence' position table all-gathers its rows' gradients, one
    sequence's worth (the table is looked up once per sequence and broadcast over the batch).

It assumes every region's input needs a gradient (true past the embeddings of a language
model; a first colwise layer on raw data skips its backward all-reduce).
"""

from __future__ import annotations

from math import prod

from ...comm.wire import all_gather_bytes, all_to_all_bytes, ring_allreduce_bytes
from .layout import LayoutPlan, Placement, base_style


def _region(tokens: int, width: int, n: int, sp: bool, item: int) -> int:
    """Entering or leaving a region: mirror images, the same collectives."""
    if sp:
        return all_gather_bytes(tokens // n * width * item, n) + \
            all_to_all_bytes(tokens * width * item, n)
    return ring_allreduce_bytes(tokens * width * item, n)


def placement_bytes(p: Placement, batch: int, seq: int, n: int, sp: bool, item: int) -> int:
    tokens = batch * seq
    shapes = {name: shape for name, shape, _ in p.params}
    style = base_style(p.style)
    if style in ("colwise", "colwise_fused"):
        return _region(tokens, p.width, n, sp, item)
    if style == "colwise_gather":
        out = shapes["weight"][0]
        return _region(tokens, p.width, n, sp, item) + all_gather_bytes(tokens * out // n * item, n)
    if p.style == "vocab_head":
        return _region(tokens, p.width, n, sp, item) + ring_allreduce_bytes(tokens * item, n) \
            + ring_allreduce_bytes(2 * tokens * item, n)
    if p.style == "rowwise":
        bias = ring_allreduce_bytes(p.width * item, n) if sp and "bias" in shapes else 0
        return _region(tokens, p.width, n, sp, item) + bias
    if p.style == "heads":
        bias = ring_allreduce_bytes(p.width * item, n) if sp else 0
        return _region(tokens, p.width, n, sp, item) + _region(tokens, p.width, n, sp, item) + bias
    if p.style == "vocab_embedding":
        return _region(tokens, p.width, n, sp, item)
    if p.style == "sequence" and sp:
        if p.kind == "Embedding":
            return all_gather_bytes(seq // n * p.width * item, n)
        return sum(ring_allreduce_bytes(prod(shape) * item, n) for shape in shapes.values())
    return 0


def _placement_calls(p: Placement, sp: bool) -> tuple[int, int]:
    """(all-reduces, all-gathers and reduce-scatters) one step of `p` makes, as placement_bytes
    moves them: a region is one all-reduce, or under sequence parallelism a gather and a
    scatter."""
    region = (0, 2) if sp else (1, 0)
    shapes = {name for name, _, _ in p.params}
    if base_style(p.style) in ("colwise", "colwise_fused", "vocab_embedding"):
        return region
    if p.style == "colwise_gather":
        return region[0], region[1] + 1               # the output's all-gather
    if p.style == "vocab_head":
        return region[0] + 2, region[1]               # the loss's max and sums
    if p.style == "rowwise":
        return region[0] + (1 if sp and "bias" in shapes else 0), region[1]
    if p.style == "heads":
        return 2 * region[0] + (1 if sp else 0), 2 * region[1]
    if p.style == "sequence" and sp:
        return (0, 1) if p.kind == "Embedding" else (len(shapes), 0)
    return 0, 0


def tp_step_calls(plan: LayoutPlan, modules: set[str] | None = None) -> tuple[int, int]:
    """(all-reduces, all-gathers and reduce-scatters) one rank makes over tp in a step, for the
    placements of `modules` (default all): what tilework.stats counts as the "tp" calls, and
    what a per-message cost is charged on (mesh_search)."""
    if plan.tp == 1:
        return 0, 0
    counts = [_placement_calls(p, plan.sequence_parallel) for p in plan.placements
              if modules is None or p.module in modules]
    return sum(c[0] for c in counts), sum(c[1] for c in counts)


def tp_step_bytes(plan: LayoutPlan, batch: int, seq: int, itemsize: int = 4) -> int:
    """What one rank sends over the tp axis in one step, forward and backward, on a batch of
    `batch` sequences of `seq` tokens (its dp share)."""
    if plan.tp == 1:
        return 0
    return sum(placement_bytes(p, batch, seq, plan.tp, plan.sequence_parallel, itemsize)
               for p in plan.placements)


def dp_step_bytes(plan: LayoutPlan, dp: int, itemsize: int = 4) -> int:
    """What one rank sends over the dp axis in one step: its shards' gradients, one flat
    all-reduce (apply.average_gradients)."""
    return ring_allreduce_bytes(sum(prod(s) for s in plan.local_shapes().values()) * itemsize, dp)


def step_bytes(plan: LayoutPlan, batch: int, seq: int, dp: int = 1,
               itemsize: int = 4) -> dict[str, int]:
    return {"tp": tp_step_bytes(plan, batch, seq, itemsize),
            "dp": dp_step_bytes(plan, dp, itemsize)}
