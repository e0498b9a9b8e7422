"""Context parallelism applied to an unmodified model: every nn.MultiheadAttention becomes ring
attention over the cp group, holding the same parameters under the same names (attention
already split by heads over tp runs the ring on its own heads), and the position table looks
up this rank's global positions. Everything else in a Transformer (norms, MLPs,
residuals, the head, the loss) is per token and needs nothing.

    stats = Stats()
    apply_context_parallel(model, groups.group("cp"), stats)        # before the optimizer
    tokens, targets = shard_sequence(tokens, targets, groups.coord("cp"), groups.size("cp"))
    loss = model(tokens, targets); loss.backward()                  # mean over this rank's tokens
    average_gradients(model, groups.group("cp"), stats, "cp")       # tilework.parallel.tensor's
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...comm.counted import Stats
from ...errors import PlanError
from .comm import Ring
from .layout import global_of_local
from .ring import ring_attention, ring_call_causal


def refusal(mha: nn.MultiheadAttention) -> str | None:
    """Why this attention cannot run as ring attention (None: it can)."""
    if not mha.batch_first:
        return "batch_first=False (the sequence must be dim 1)"
    if not mha._qkv_same_embed_dim:
        return "kdim/vdim differ from embed_dim (separate q, k, v projections)"
    if mha.bias_k is not None or mha.add_zero_attn:
        return "add_bias_kv / add_zero_attn (keys that belong to no rank's sequence)"
    return None


class RingSelfAttention(nn.Module):
    """Causal (or unmasked) self-attention over the whole sequence, this rank holding its
    load-balanced share; called as nn.TransformerEncoderLayer calls nn.MultiheadAttention."""

    # torch's fused inference path (TransformerEncoderLayer in eval under no_grad) would attend
    # over the local tokens alone; declaring the projections separate keeps it off.
    _qkv_same_embed_dim = False
    batch_first = True

    def __init__(self, mha: nn.MultiheadAttention, ring: Ring, name: str):
        super().__init__()
        self.ring, self.name = ring, name
        self.embed_dim, self.num_heads, self.head_dim = mha.embed_dim, mha.num_heads, mha.head_dim
        self.dropout = mha.dropout
        # The same Parameter objects, registered in MultiheadAttention's order: state dict
        # keys, values and optimizer order are one process's.
        self.in_proj_weight = mha.in_proj_weight
        self.register_parameter("in_proj_bias", mha.in_proj_bias)
        self.out_proj = mha.out_proj

    def _causal(self, query, key, value, key_padding_mask, need_weights, attn_mask,
                is_causal) -> bool:
        return ring_call_causal(self.name, self.ring, self.dropout if self.training else 0.0,
                                query, key, value, key_padding_mask, need_weights, attn_mask,
                                is_causal)

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True,
                attn_mask=None, average_attn_weights=True, is_causal=False):
        causal = self._causal(query, key, value, key_padding_mask, need_weights, attn_mask,
                              is_causal)
        b, s, _ = query.shape
        qkv = F.linear(query, self.in_proj_weight, self.in_proj_bias)
        q, k, v = (t.view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
                   for t in qkv.chunk(3, dim=-1))
        out = ring_attention(q, k, v, self.ring, causal)
        return self.out_proj(out.transpose(1, 2).reshape(b, s, self.embed_dim)), None

    def extra_repr(self) -> str:
        return f"{self.embed_dim}, heads {self.num_heads}, ring over cp={self.ring.size}"


class ShardedPositions(nn.Module):
    """A position table looked up at this rank's global positions. The model asks for local
    slots (0..t-1 of the tokens it holds, as `positions(torch.arange(t))`); slot i is global
    position layout.global_of_local(i). Same `weight` Parameter, same state dict key."""

    def __init__(self, table: nn.Embedding, ring: Ring):
        super().__init__()
        self.ring = ring
        self.num_embeddings, self.embedding_dim = table.num_embeddings, table.embedding_dim
        self.padding_idx = table.padding_idx
        self.weight = table.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local_len = ids.shape[-1]
        if self.ring.size > 1 and local_len % 2:
            raise PlanError(f"positions: a local sequence of {local_len} tokens is not two "
                             "chunks; shard it with tilework.parallel.context.shard_sequence")
        where = global_of_local(ids, local_len, self.ring.rank, self.ring.size)
        return F.embedding(where, self.weight, self.padding_idx)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, cp rank {self.ring.rank}"


def _replace(model: nn.Module, name: str, new: nn.Module, changes=None) -> None:
    parent_name, _, attr = name.rpartition(".")
    old, parent = model.get_submodule(name), model.get_submodule(parent_name)
    new.train(old.training)
    setattr(parent, attr, new)   # keeps its place among siblings
    if changes is not None:
        changes.record(f"{name}: replaced by {type(new).__name__} (cp)",
                       lambda: setattr(parent, attr, old))


def _position_table(model: nn.Module, positions: str) -> nn.Embedding:
    try:
        table = model.get_submodule(positions)
    except AttributeError:
        raise PlanError(f"no module {positions!r} to hold position embeddings; pass "
                         "positions=None if the model has none (or its own per-token ids)") \
            from None
    if type(table) is not nn.Embedding:
        raise PlanError(f"positions={positions!r} is a {type(table).__name__}, not an "
                         "nn.Embedding")
    if table.max_norm is not None or table.sparse:
        raise PlanError(f"positions={positions!r}: max_norm / sparse=True are not supported")
    return table


@torch.no_grad()
def apply_context_parallel(model: nn.Module, group, stats: Stats,
                           positions: str | None = "positions", method: str = "cp",
                           require_modules: bool = True, changes=None) -> list[str]:
    """Make `model` context parallel over `group` (None: one rank), in place; returns the
    names of the attentions replaced. Refuses by name any nn.MultiheadAttention ring attention
    cannot run. `positions`: the model's position nn.Embedding, looked up with local slots.
    Bytes are counted in `stats` under `method`. Make the optimizer afterwards (same
    Parameters, but new modules). `require_modules=False`: a model without attention modules
    is not refused here (its forward runs under sdpa.RingForward, which refuses one that
    calls no SDPA either). `changes` (sync.changes.Changes): each replacement recorded with
    its undo."""
    from ..tensor.attention import HeadParallelAttention

    ring = Ring(group, stats, method)
    # Attention already split by heads (tensor parallelism, applied first): its heads run
    # the ring in place.
    split = [(name, m) for name, m in model.named_modules()
             if isinstance(m, HeadParallelAttention)]
    for name, m in split:
        m.ring, m.ring_name = ring, name
    found = [(name, m) for name, m in model.named_modules()
             if isinstance(m, nn.MultiheadAttention)]
    if not found and not split and require_modules:
        raise PlanError(f"{type(model).__name__} has no nn.MultiheadAttention to make ring "
                         "attention")
    for name, mha in found:
        why = refusal(mha)
        if why is not None:
            raise PlanError(f"cannot make {name!r} ring attention: {why}")
    table = _position_table(model, positions) if positions is not None else None
    for name, mha in found:
        _replace(model, name, RingSelfAttention(mha, ring, name), changes)
    if table is not None:
        _replace(model, positions, ShardedPositions(table, ring), changes)
    return [name for name, _ in [*split, *found]]
