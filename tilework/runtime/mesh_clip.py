"""`tilework.clip_grad_norm_` on a mesh: one process's total norm, from gradients spread over
tensor-parallel shards, pipeline stages, ZeRO chunks and server rows.

A rank's gradients fall in kinds: split over tp or not (the layout's split parameters), and
spread otherwise as server rows (over the data-parallel group), as ZeRO stage 2/3 chunks (over
the ranks that shard them: a host's under zero_scope="host", where every host holds a whole
copy), or not at all. What is the same on every rank of a group must be counted once. So, in
|g|^p sums (max for the infinity norm): rows summed over dp, chunks over their shard group,
the tp-split kinds then over tp, and the stages over pp: scalar all-reduces, as Megatron's
clip_grad_norm does.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..comm.counted import all_reduce
from .clip import clip_by_total_norm, coalesced_grads, head_gradients, norm_dtype
from .replica import plain

# Where a gradient's parts are spread besides tp: over the dp group (server rows), over the
# ranks that shard ZeRO's chunks (a host's under zero_scope="host"), or nowhere (replicated).
ROWS, CHUNKS, WHOLE = 0, 1, 2
NOWHERE = -1   # counted on another rank of the pipeline


def _named_gradients(engine) -> list[tuple[torch.Tensor, bool, int]]:
    """(gradient, split over tp, where else it is spread) for every gradient this rank holds."""
    specs = engine.mesh.layout.specs() if engine.mesh.layout is not None else {}
    pipeline = engine.mesh.pipeline
    elsewhere = pipeline.counted_elsewhere() if pipeline is not None else set()
    out = []
    for name, p in engine.model.named_parameters():
        # A parameter two ranks' stages hold (summed, equal gradients): scaled on both,
        # counted in the norm on the first only.
        for g in coalesced_grads([p]):
            out.append((plain(g), name in specs, WHOLE if id(p) not in elsewhere else NOWHERE))
    if engine._unsynced:
        engine._sync_servers()
    for name, part in [*engine.tables.items(), *engine.served.items()]:
        g = part.received_grads()
        if g is not None:
            out.append((g, name in specs, ROWS))
    for s in engine.zero.shards:
        if s.stage >= 2 and s.shard.grad is not None:
            out.append((s.shard.grad, s.name in specs, CHUNKS))
    out += [(g, False, WHOLE) for g in head_gradients(engine)]
    return out


def clip_norm_on_mesh(engine, max_norm: float, norm_type: float, error_if_nonfinite: bool,
                      foreach) -> torch.Tensor:
    mesh, stats = engine.mesh, engine.stats
    inf = math.isinf(norm_type)
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    grads = _named_gradients(engine)
    # [tp-split, whole] x [ROWS, CHUNKS, WHOLE], in float64 on the backend's device
    parts = torch.zeros(2, 3, dtype=torch.float64, device=engine.groups.device)
    for g, tp_split, spread in grads:
        if spread == NOWHERE:
            continue
        norm = torch.linalg.vector_norm(g.detach(), norm_type).double().to(parts.device)
        value = norm if inf else norm ** norm_type
        cell = parts[0 if tp_split else 1, spread]
        cell.copy_(torch.maximum(cell, value) if inf else cell + value)

    def combine(a, b):
        return torch.maximum(a, b) if inf else a + b

    rows, chunks = parts[:, ROWS].clone(), parts[:, CHUNKS].clone()
    all_reduce(rows, engine.groups.world, stats, "clip", op=op)
    all_reduce(chunks, engine.zero.shard_group, stats, "clip", op=op)
    beside_tp = [combine(combine(rows[k], chunks[k]), parts[k, WHOLE]) for k in (0, 1)]
    split = beside_tp[0].reshape(1)
    if mesh.tp is not None:
        all_reduce(split, mesh.tp.group, stats, "clip", op=op)
    stage = combine(split[0], beside_tp[1]).reshape(1)
    all_reduce(stage, mesh.groups.group("pp"), stats, "clip", op=op)
    total = stage[0] if inf else stage[0] ** (1.0 / norm_type)
    tensors = [g for g, _, _ in grads]
    total = total.to(tensors[0].device if tensors else torch.device("cpu"), norm_dtype(tensors))
    return clip_by_total_norm(tensors, total, max_norm, norm_type, error_if_nonfinite)
