"""Clipping as torch.nn.utils defines it, over gradients wherever they are: sparse ones (which
torch's own functions refuse) as their coalesced rows, and the rows a parameter server's owners
hold (runtime/engine.py combines the owners' parts with one scalar all-reduce)."""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist

from ..comm.counted import all_reduce


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


def _combined(part: torch.Tensor, inf: bool, group, engine, device) -> torch.Tensor:
    """A local norm's p-th power (the max for inf) summed over `group`, in float64."""
    combined = part.reshape(1).to(engine.groups.device, torch.float64)
    all_reduce(combined, group, engine.stats, "clip",
               op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM)
    return combined[0].to(device)


def clip_norm_with_servers(engine, max_norm, norm_type, error_if_nonfinite, foreach):
    """clip_grad_norm_ over a parallelized model: its own gradients, the server rows this
    rank owns (summed over the world) and its ZeRO chunks (summed over the ranks that shard
    them: a host's under zero_scope="host", where every host holds a whole copy)."""
    chunks = engine.zero.gradients()
    mine = {id(c) for c in chunks}
    server = [g for g in engine.server_gradients() if id(g) not in mine]
    # A table's hot head is summed on every rank alike: counted once, as a dense gradient.
    dense = coalesced_grads(engine.model.parameters()) + head_gradients(engine)
    # The norm lives with the gradients; only its combination travels, on the backend's
    # device (gloo's is the CPU, whatever the model's).
    grads = [*dense, *server, *chunks]
    home = grads[0].device if grads else engine.groups.device
    dtype = norm_dtype(grads)   # torch's: all parts' dtype, not only this rank's dense ones
    total = total_norm(dense, norm_type, foreach, device=home, dtype=dtype)
    inf = math.isinf(norm_type)
    spread = []
    if engine.tables or engine.served:
        spread.append((server, engine.groups.world))
    if engine.zero.owns_gradients:
        spread.append((chunks, engine.zero.shard_group))
    for part, group in spread:
        local = total_norm(part, norm_type, foreach, device=home)
        combined = _combined(local if inf else local ** norm_type, inf, group, engine, home)
        if inf:
            total = torch.maximum(total, combined.to(total.dtype))
        else:
            total = (total.double() ** norm_type + combined) ** (1.0 / norm_type)
    total = total.to(dtype)
    return clip_by_total_norm(grads, total, max_norm, norm_type, error_if_nonfinite)
