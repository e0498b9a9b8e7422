"""`tilework.clip_grad_norm_` on a mesh: one process's total norm, from gradients spread over
tensor-parallel shards, pipeline stages, ZeRO chunks and server rows.

A rank's gradients fall in four kinds, by whether they are split over tp (the layout's split
parameters) and over the data-parallel group (ZeRO stage 2/3 chunks, server rows: each rank
holds its part). Everything else is the same on every rank of its group (dp, or a replicated
parameter on every tp rank) and must be counted once. So, in |g|^p sums (max for the
infinity norm): the dp-split kinds are summed over the dp group, the tp-split ones then over
tp, and the stages over pp: three scalar all-reduces, as Megatron's clip_grad_norm does.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .comm.counted import all_reduce
from .mesh_checks import plain
from .sync.clip import clip_by_total_norm, coalesced_grads, head_gradients


def _named_gradients(engine) -> list[tuple[torch.Tensor, bool, bool]]:
    """(gradient, split over tp, split over dp) for every gradient this rank holds."""
    specs = engine.mesh.layout.specs() if engine.mesh.layout is not None else {}
    out = []
    for name, p in engine.model.named_parameters():
        for g in coalesced_grads([p]):
            out.append((plain(g), name in specs, False))
    if engine._unsynced:
        engine._sync_servers()
    for name, part in [*engine.tables.items(), *engine.served.items()]:
        g = part.received_grads()
        if g is not None:
            out.append((g, name in specs, True))
    for s in engine.zero.shards:
        if s.stage >= 2 and s.shard.grad is not None:
            out.append((s.shard.grad, s.name in specs, True))
    out += [(g, False, False) for g in head_gradients(engine)]
    return out


def clip_norm_on_mesh(engine, max_norm: float, norm_type: float, error_if_nonfinite: bool,
                      foreach) -> torch.Tensor:
    mesh, stats = engine.mesh, engine.stats
    inf = math.isinf(norm_type)
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    grads = _named_gradients(engine)
    # [tp-split, whole] x [dp-split, dp-replicated], in float64 on the backend's device
    parts = torch.zeros(2, 2, dtype=torch.float64, device=engine.groups.device)
    for g, tp_split, dp_split in grads:
        norm = torch.linalg.vector_norm(g.detach(), norm_type).double().to(parts.device)
        value = norm if inf else norm ** norm_type
        cell = parts[0 if tp_split else 1, 0 if dp_split else 1]
        cell.copy_(torch.maximum(cell, value) if inf else cell + value)

    def combine(a, b):
        return torch.maximum(a, b) if inf else a + b

    dp_split = parts[:, 0].clone()
    all_reduce(dp_split, engine.groups.world, stats, "clip", op=op)
    split = combine(dp_split[0], parts[0, 1]).reshape(1)
    if mesh.tp is not None:
        all_reduce(split, mesh.tp.group, stats, "clip", op=op)
    stage = combine(combine(split[0], dp_split[1]), parts[1, 1]).reshape(1)
    all_reduce(stage, mesh.groups.group("pp"), stats, "clip", op=op)
    total = stage[0] if inf else stage[0] ** (1.0 / norm_type)
    tensors = [g for g, _, _ in grads]
    total = total.to(tensors[0].device if tensors else torch.device("cpu"), torch.float32)
    return clip_by_total_norm(tensors, total, max_norm, norm_type, error_if_nonfinite)
