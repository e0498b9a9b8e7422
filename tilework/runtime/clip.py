"""Clipping as torch.nn.utils defines it, over gradients wherever they are: sparse ones (which
torch's own functions refuse) as their coalesced rows, the rows a parameter server's owners hold,
ZeRO's chunks, tensor-parallel shards and pipeline stages.

`clip_norm` makes one process's total norm from a rank's gradients, which fall in kinds: split
over tp or not (the layout's split parameters), and spread otherwise as server rows (over the dp
group), as ZeRO stage 2/3 chunks (over the ranks that shard them: a host's under
zero_scope="host", where every host holds a whole copy), or not at all. What is the same on
every rank of a group is counted once. So, in |g|^p sums (max for the infinity norm): rows
summed over dp, chunks over their shard group, the tp-split kinds then over tp, and the stages
over pp: scalar all-reduces, as Megatron's clip_grad_norm does, each only where that axis
spreads something. Where nothing is spread (plain data parallelism: every rank holds the whole
averaged gradient) the norm is torch's own, to the bit.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist

from ..comm.counted import all_reduce
from .replica import plain


def coalesced_grads(params) -> list[torch.Tensor]:
    """Each gradient, sparse ones coalesced in place and given as their rows (what clipping
    must see: a row id may appear several times in an uncoalesced gradient)."""
    from ..parallel.data.shards import ShardedGradient

    out = []
    for p in params:
        if p.grad is None or isinstance(p.grad, ShardedGradient):   # on the shards: see ZeRO
            continue
        if p.grad.is_sparse:
            p.grad = p.grad.coalesce()
            out.append(p.grad._values())
        else:
            out.append(p.grad)
    return out


def norm_dtype(grads: list[torch.Tensor]) -> torch.dtype:
    """The dtype torch.nn.utils.clip_grad_norm_'s norm has: its gradients' promoted dtype
    (a float64 model's norm is float64), float32 with none."""
    return functools.reduce(torch.promote_types, (g.dtype for g in grads), grads[0].dtype) \
        if grads else torch.float32


def total_norm(grads: list[torch.Tensor], norm_type: float, foreach=None,
               device: torch.device | None = None,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """The total norm of `grads`, as torch.nn.utils.clip_grad_norm_ computes it. With no
    gradients it is 0 on `device` (torch's own: the CPU), where the caller combines it, in
    `dtype` (float32 unless given: the dtype of the gradients the other parts hold)."""
    if not grads:
        return torch.tensor(0.0, device=device, dtype=dtype or torch.float32)
    # Each norm where its gradient is, combined on `device` (offloaded shards' are on the CPU).
    return torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(g.detach(), norm_type).to(device or g.device)
                     for g in grads]), norm_type)


def clip_by_total_norm(grads: list[torch.Tensor], total: torch.Tensor, max_norm: float,
                       norm_type: float, error_if_nonfinite: bool) -> torch.Tensor:
    """Scale `grads` in place as torch.nn.utils.clip_grad_norm_ does, given their total norm."""
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients from "
                           "`parameters` is non-finite, so it cannot be clipped. To disable "
                           "this error and scale the gradients by the non-finite norm anyway, "
                           "set `error_if_nonfinite=False`")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device, g.dtype))
    return total


def head_gradients(engine) -> list[torch.Tensor]:
    """The tables' hot heads' summed gradients (parallel/rows/hot.py): the same on every rank."""
    heads = [t.head for t in engine.tables.values() if t.head is not None]
    return [h.received for h in heads if h.received is not None]


def clip_value_with_servers(engine, clip_value: float) -> None:
    """clip_grad_value_ over a parallelized model's gradients, the servers' and heads' too."""
    for g in [*coalesced_grads(engine.model.parameters()), *engine.server_gradients(),
              *head_gradients(engine)]:
        g.clamp_(-clip_value, clip_value)


# Where a gradient's parts are spread besides tp: over the dp group (server rows), over the
# ranks that shard ZeRO's chunks, or nowhere (replicated, or whole on this rank).
ROWS, CHUNKS, WHOLE = 0, 1, 2
NOWHERE = -1   # counted on another rank of the pipeline


def _kinds(engine) -> list[tuple[torch.Tensor, bool, int]]:
    """(gradient, split over tp, where else it is spread) for every gradient this rank holds."""
    mesh = engine.mesh
    specs = mesh.layout.specs() if mesh is not None and mesh.layout is not None else {}
    pipeline = mesh.pipeline if mesh is not None else None
    elsewhere = pipeline.counted_elsewhere() if pipeline is not None else set()
    out = []
    for name, p in engine.model.named_parameters():
        # A parameter two ranks' stages hold (summed, equal gradients): scaled on both,
        # counted in the norm on the first only.
        for g in coalesced_grads([p]):
            out.append((plain(g), name in specs, WHOLE if id(p) not in elsewhere else NOWHERE))
    # A table's hot head is summed on every rank alike: counted once, as a whole gradient.
    out += [(g, False, WHOLE) for g in head_gradients(engine)]
    if engine._unsynced:
        engine._sync_servers()
    for name, part in [*engine.tables.items(), *engine.served.items()]:
        g = part.received_grads()
        if g is not None:
            out.append((g, name in specs, ROWS))
    for s in engine.zero.shards:
        # A rank may own none of a parameter under chunks by memory (ParamPlan.zero_chunks):
        # an empty gradient has no inf norm, and adds nothing to any other.
        if s.stage >= 2 and s.shard.grad is not None and s.shard.grad.numel():
            out.append((s.shard.grad, s.name in specs, CHUNKS))
    return out


def clip_norm(engine, max_norm: float, norm_type: float, error_if_nonfinite: bool,
              foreach) -> torch.Tensor:
    """clip_grad_norm_ over a parallelized model on any plan (see the module's docstring)."""
    mesh, stats = engine.mesh, engine.stats
    inf = math.isinf(norm_type)
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    kinds = _kinds(engine)
    tensors = [g for g, _, _ in kinds]
    # The norm lives with the gradients; only its combination travels, on the backend's
    # device (gloo's is the CPU, whatever the model's).
    home = tensors[0].device if tensors else engine.groups.device
    dtype = norm_dtype(tensors)   # torch's: all parts' dtype, not only this rank's whole ones
    whole = total_norm([g for g, split, at in kinds if not split and at == WHOLE], norm_type,
                       foreach, device=home, dtype=dtype)
    # Which axes spread something: the same answer on every rank of each group.
    over_rows = bool(engine.tables or engine.served)
    over_chunks = engine.zero.owns_gradients
    over_tp = mesh is not None and mesh.tp is not None
    over_pp = mesh is not None and mesh.pipeline is not None
    if not (over_rows or over_chunks or over_tp or over_pp):
        return clip_by_total_norm(tensors, whole, max_norm, norm_type, error_if_nonfinite)

    def combine(a, b):
        return torch.maximum(a, b) if inf else a + b

    # [tp-split, whole] x [ROWS, CHUNKS, WHOLE] as |g|^p sums (maxima), in float64 on the
    # backend's device
    parts = torch.zeros(2, 3, dtype=torch.float64, device=engine.groups.device)
    for g, split, at in kinds:
        if at == NOWHERE or (not split and at == WHOLE):
            continue
        norm = torch.linalg.vector_norm(g.detach(), norm_type).double().to(parts.device)
        cell = parts[0 if split else 1, at]
        cell.copy_(combine(cell, norm if inf else norm ** norm_type))
    mine = whole.double().to(parts.device)
    parts[1, WHOLE] = mine if inf else mine ** norm_type
    rows, chunks = parts[:, ROWS].clone(), parts[:, CHUNKS].clone()
    if over_rows:
        all_reduce(rows, engine.groups.world, stats, "clip", op=op)
    if over_chunks:
        all_reduce(chunks, engine.zero.shard_group, stats, "clip", op=op)
    beside_tp = [combine(combine(rows[k], chunks[k]), parts[k, WHOLE]) for k in (0, 1)]
    split = beside_tp[0].reshape(1)
    if over_tp:
        all_reduce(split, mesh.tp.group, stats, "clip", op=op)
    stage = combine(split[0], beside_tp[1]).reshape(1)
    if over_pp:
        all_reduce(stage, mesh.groups.group("pp"), stats, "clip", op=op)
    total = stage[0] if inf else stage[0] ** (1.0 / norm_type)
    return clip_by_total_norm(tensors, total.to(home, dtype), max_norm, norm_type,
                              error_if_nonfinite)
