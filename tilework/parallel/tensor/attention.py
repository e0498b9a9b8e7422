"""nn.MultiheadAttention split by heads: each tp rank computes its heads' queries, keys and
values (its rows of q, k and v in the packed in-projection, a column-parallel layer) and
attends on them alone; the out-projection is row-parallel, so one sum (or reduce-scatter along
the sequence) per block, as Megatron-LM's attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import PlanError
from .layers import RowParallelLinear
from .regions import TensorParallel, enter_region


def refusal(mha: nn.MultiheadAttention, tp_size: int) -> str | None:
    """Why this attention cannot be split over `tp_size` ranks by heads (None: it can)."""
    if mha.num_heads % tp_size:
        return f"{mha.num_heads} heads do not split over tp={tp_size}"
    if not mha._qkv_same_embed_dim:
        return "kdim/vdim differ from embed_dim (separate q, k, v projections)"
    if mha.in_proj_bias is None:
        return "bias=False"
    if mha.bias_k is not None or mha.add_zero_attn:
        return "add_bias_kv / add_zero_attn"
    if not mha.batch_first:
        return "batch_first=False"
    return None


class HeadParallelAttention(nn.Module):
    """Self-attention over this rank's heads; called as nn.MultiheadAttention is by
    nn.TransformerEncoderLayer (need_weights=False)."""

    # torch's fused inference path (TransformerEncoderLayer in eval under no_grad) reads
    # in_proj_weight as the whole projection; declaring the projections separate keeps it off.
    _qkv_same_embed_dim = False

    def __init__(self, full: nn.MultiheadAttention, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.embed_dim, self.num_heads = full.embed_dim, full.num_heads
        self.local_heads = full.num_heads // tp.size
        self.head_dim = full.head_dim
        self.dropout, self.batch_first = full.dropout, full.batch_first
        w = full.in_proj_weight
        self.in_proj_weight = nn.Parameter(w.new_empty(3 * self.embed_dim // tp.size, w.shape[1]))
        self.in_proj_bias = nn.Parameter(w.new_empty(3 * self.embed_dim // tp.size))
        self.out_proj = RowParallelLinear(full.out_proj, tp)

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True,
                attn_mask=None, average_attn_weights=True, is_causal=False):
        if not (query is key and key is value):
            raise PlanError("HeadParallelAttention: self-attention only (query, key and value "
                             "the same tensor)")
        if need_weights or key_padding_mask is not None:
            raise PlanError("HeadParallelAttention: call with need_weights=False and no "
                             "key_padding_mask (the heads' weights are on different ranks)")
        if is_causal and attn_mask is None:
            raise RuntimeError("need attn_mask if specifying the is_causal hint")
        x = enter_region(query, self.tp)
        b, s, _ = x.shape
        qkv = F.linear(x, self.in_proj_weight, self.in_proj_bias)
        q, k, v = (t.view(b, s, self.local_heads, self.head_dim).transpose(1, 2)
                   for t in qkv.chunk(3, dim=-1))
        ring = getattr(self, "ring", None)   # context parallelism's, on these heads
        if ring is not None:
            from ..context.ring import ring_attention, ring_call_causal

            causal = ring_call_causal(self.ring_name, ring,
                                      self.dropout if self.training else 0.0, query, key,
                                      value, None, False, attn_mask, is_causal)
            out = ring_attention(q, k, v, ring, causal)
        else:
            mask = None if is_causal else _float_mask(attn_mask, q.dtype)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                                 dropout_p=self.dropout if self.training else 0.0)
        out = out.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim)
        return self.out_proj(out), None

    def extra_repr(self) -> str:
        return f"{self.embed_dim}, heads {self.num_heads} split over tp={self.tp.size}"


def _float_mask(mask: torch.Tensor | None, dtype) -> torch.Tensor | None:
    """nn.MultiheadAttention's convention (True: masked out) as an additive mask; SDPA reads a
    boolean mask the other way round."""
    if mask is None:
        return None
    if mask.dim() != 2:
        raise PlanError("HeadParallelAttention: only a 2-D (target, source) attn_mask; a "
                         "per-head mask would have to be split by heads too")
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
            mask, float("-inf"))
    return mask.to(dtype)
