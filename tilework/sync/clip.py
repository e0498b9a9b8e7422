"""Clipping as torch.nn.utils defines it, over gradients wherever they are: sparse ones (which
torch's own functions refuse) as their coalesced rows, and the rows a parameter server's owners
hold (sync/engine.py combines the owners' parts with one scalar all-reduce)."""

from __future__ import annotations

import torch


def coalesced_grads(params) -> list[torch.Tensor]:
    """Each gradient, sparse ones coalesced in place and given as their rows (what clipping
    must see: a row id may appear several times in an uncoalesced gradient)."""
    out = []
    for p in params:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            p.grad = p.grad.coalesce()
            out.append(p.grad._values())
        else:
            out.append(p.grad)
    return out


def total_norm(grads: list[torch.Tensor], norm_type: float, foreach=None,
               device: torch.device | None = None) -> torch.Tensor:
    """The total norm of `grads`, as torch.nn.utils.clip_grad_norm_ computes it. With no
    gradients it is 0 on `device` (torch's own: the CPU), where the caller combines it."""
    if not grads:
        return torch.tensor(0.0, device=device)
    return torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(g.detach(), norm_type) for g in grads]), norm_type)


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
        g.mul_(coef.to(g.dtype))
    return total
