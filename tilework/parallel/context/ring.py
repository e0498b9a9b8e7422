"""Ring attention over the cp axis, forward and backward, on the load-balanced layout.

Each rank holds the queries, keys and values of its two chunks (plans/rows.py). Over cp steps the
K/V blocks travel around the ring (step i: the block of rank (r - i) mod cp is here), the next
block's transfer overlapping the current block's compute, and partial outputs merge by the
log-sum-exp rule (online softmax): two partial softmaxes over disjoint keys, with outputs o1, o2
and log-normalisers l1, l2, are together o = o1 e^(l1-l) + o2 e^(l2-l), l = log(e^l1 + e^l2).

Under a causal mask, with r's chunks (r, 2cp-1-r) and the visiting block's (s, 2cp-1-s):
    s == r   the local causal mask (local order is global order)
    s <  r   every query sees the block's early chunk only       (half the keys)
    s >  r   only the late query chunk sees, the whole block      (half the queries)
so every step after the first is the same half-block of work on every rank: that is the balance.

Backward (flash-attention's rule, recomputing probabilities from the saved log-normalisers)
runs the same ring again: K/V travel as in forward, and beside them an accumulator of dK/dV for
the visiting block, to which each rank adds its share before passing it on; after cp hops it
is home. Per rank and layer: forward (cp-1) K/V shifts, backward (cp-1) K/V and cp dK/dV shifts.
"""

from __future__ import annotations

import math

import torch
from torch.autograd import Function

from ...errors import PlanError
from .comm import TAG_DKV, TAG_KV, Ring

ALL = slice(None)


def _block(step: int, rank: int, n: int, local: int, causal: bool):
    """(query rows, key rows, diagonal) of step `step`: which local queries attend to which of
    the visiting block's keys, and whether the causal mask cuts the block."""
    if step == 0:
        return ALL, ALL, causal
    if not causal:
        return ALL, ALL, False
    half = local // 2
    if (rank - step) % n < rank:
        return ALL, slice(0, half), False
    return slice(half, local), ALL, False


def _scores(q, k, scale: float, diagonal: bool) -> torch.Tensor:
    s = q @ k.transpose(-2, -1) * scale
    if diagonal:
        cut = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(cut, float("-inf"))
    return s


def _attend(q, k, v, scale: float, diagonal: bool):
    """A block's softmax attention and its log-normaliser per query."""
    s = _scores(q, k, scale, diagonal)
    lse = s.logsumexp(-1)
    return torch.exp(s - lse.unsqueeze(-1)) @ v, lse


def _merge(out, lse, part_out, part_lse) -> None:
    """Fold a partial softmax over further keys into (out, lse), in place (the rule above)."""
    new = torch.logaddexp(lse, part_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(part_out * torch.exp(part_lse - new)
                                                      .unsqueeze(-1))
    lse.copy_(new)


def _forward(q, k, v, ring: Ring, causal: bool, scale: float):
    n, local = ring.size, q.shape[-2]
    kv = torch.stack([k, v])   # one message per step
    out = lse = None
    for step in range(n):
        arriving = ring.shift(kv, TAG_KV) if step < n - 1 else None
        rows, cols, diagonal = _block(step, ring.rank, n, local, causal)
        o, l = _attend(q[..., rows, :], kv[0][..., cols, :], kv[1][..., cols, :], scale,
                       diagonal)
        if out is None:
            out, lse = o, l    # step 0 covers every query
        else:
            _merge(out[..., rows, :], lse[..., rows], o, l)
        if arriving is not None:
            kv = arriving.wait()
    return out, lse


def _attend_backward(q, k, v, dout, lse, delta, scale: float, diagonal: bool):
    """dQ, dK, dV of one block, its probabilities recomputed from the final log-normaliser."""
    p = torch.exp(_scores(q, k, scale, diagonal) - lse.unsqueeze(-1))
    dv = p.transpose(-2, -1) @ dout
    ds = p * (dout @ v.transpose(-2, -1) - delta.unsqueeze(-1))
    return ds @ k * scale, ds.transpose(-2, -1) @ q * scale, dv


def _backward(q, k, v, out, lse, dout, ring: Ring, causal: bool, scale: float):
    n, local = ring.size, q.shape[-2]
    delta = (dout * out).sum(-1)   # rowsum(dO * O): the softmax Jacobian's correction term
    dq = torch.zeros_like(q)
    kv = torch.stack([k, v])
    returning = None               # the dK/dV accumulator of the block arriving next
    for step in range(n):
        arriving = ring.shift(kv, TAG_KV) if step < n - 1 else None
        rows, cols, diagonal = _block(step, ring.rank, n, local, causal)
        dq_part, dk_part, dv_part = _attend_backward(
            q[..., rows, :], kv[0][..., cols, :], kv[1][..., cols, :], dout[..., rows, :],
            lse[..., rows], delta[..., rows], scale, diagonal)
        dq[..., rows, :] += dq_part
        acc = torch.zeros_like(kv) if returning is None else returning.wait()
        acc[0][..., cols, :] += dk_part
        acc[1][..., cols, :] += dv_part
        returning = ring.shift(acc, TAG_DKV)   # the last hop takes it to the block's owner
        if arriving is not None:
            kv = arriving.wait()
    dkv = returning.wait()
    return dq, dkv[0], dkv[1]


class _RingAttention(Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, causal: bool, scale: float):
        out, lse = _forward(q, k, v, ring, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.causal, ctx.scale = ring, causal, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(q, k, v, out, lse, dout.contiguous(), ctx.ring, ctx.causal,
                               ctx.scale)
        return dq, dk, dv, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring,
                   causal: bool = True, scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v over the whole sequence, each rank holding its load-balanced
    share (layout.shard along the sequence) of q, k, v: (batch, heads, local seq, head dim).
    `scale` defaults to 1/sqrt(head dim), as SDPA's does.

    Returns this rank's share of the output. Every rank of the ring must call it with the same
    shapes. Causal or full (no mask); the local sequence must be even (two chunks) when the
    ring has more than one rank."""
    if not q.shape == k.shape == v.shape or q.dim() != 4:
        raise PlanError("ring_attention: q, k and v must share one (batch, heads, seq, "
                         f"head_dim) shape, got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if ring.size > 1 and q.shape[-2] % 2:
        raise PlanError(f"ring_attention: a local sequence of {q.shape[-2]} tokens is not two "
                         "equal chunks; shard the sequence with tilework.parallel.context.shard")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return _RingAttention.apply(q, k, v, ring, causal, float(scale))


def _is_causal_mask(mask: torch.Tensor, seq: int) -> bool:
    if mask.shape != (seq, seq):
        return False
    cut = torch.ones(seq, seq, dtype=torch.bool, device=mask.device).triu(1)
    if mask.dtype == torch.bool:
        return torch.equal(mask, cut)
    return torch.equal(mask, torch.zeros_like(mask).masked_fill(cut, float("-inf")))


def ring_call_causal(name: str, ring: Ring, dropout: float, query, key, value,
                     key_padding_mask, need_weights, attn_mask, is_causal) -> bool:
    """Refuse by name what ring attention cannot do with this call; else whether its mask is
    causal. (`dropout`: the attention's dropout probability in this mode.)"""
    where = f"{name} (ring attention over cp={ring.size})"
    if not (query is key and key is value):
        raise PlanError(f"{where}: self-attention only (query, key and value the same tensor)")
    if need_weights:
        raise PlanError(f"{where}: need_weights=True (the weights span every rank's keys); "
                         "call with need_weights=False")
    if key_padding_mask is not None:
        raise PlanError(f"{where}: key_padding_mask is not supported")
    if dropout > 0:
        raise PlanError(f"{where}: attention dropout={dropout} in training (each rank would "
                         "drop its own pattern)")
    if is_causal and attn_mask is None:
        raise RuntimeError("need attn_mask if specifying the is_causal hint")
    if is_causal or attn_mask is None:
        return bool(is_causal)
    if _is_causal_mask(attn_mask, query.shape[1]):
        return True
    raise PlanError(f"{where}: only a causal attn_mask or none; this "
                     f"{tuple(attn_mask.shape)} mask is neither")
