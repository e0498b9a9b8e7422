"""Models not written for tilework, tiny, as a user would bring them.

- `NanoGPT`: karpathy/nanoGPT's model.py shape, module names included (transformer.wte / wpe /
  h[i].attn.c_attn (fused q, k, v) / c_proj / mlp.c_fc / c_proj / ln_f, an lm_head tied to wte,
  `F.scaled_dot_product_attention(is_causal=True)`, forward(idx, targets) -> (logits, loss)).
  nanoGPT is not on PyPI, so the file is rewritten here the way its README has users copy it.
- `hf_llama(tied=...)`: Hugging Face transformers' `LlamaForCausalLM` on a tiny config (tied as
  Llama 3.2 1B ships, or not), from the pinned `models` extra; None where it is not installed.

`lm_batch` is tests/tiny_gpt.gpt_batch: step `step`'s global batch, or one rank's contiguous
slice of it.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from .tiny_gpt import gpt_batch as lm_batch  # noqa: F401 - the batches the tests share


class LayerNorm(nn.Module):
    """nanoGPT's: a LayerNorm whose bias is optional."""

    def __init__(self, ndim: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, bias: bool):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)   # q, k, v in one matmul
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, n_embd: int, bias: bool):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, bias: bool):
        super().__init__()
        self.ln_1 = LayerNorm(n_embd, bias)
        self.attn = CausalSelfAttention(n_embd, n_head, bias)
        self.ln_2 = LayerNorm(n_embd, bias)
        self.mlp = MLP(n_embd, bias)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16, bias=False):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList([Block(n_embd, n_head, bias) for _ in range(n_layer)]),
            ln_f=LayerNorm(n_embd, bias),
        ))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight   # weight tying, as nanoGPT does
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        t = idx.size(1)
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1),
                               ignore_index=-1)
        return logits, loss


class FusedAttention(nn.Module):
    """Attention with q, k, v in one projection, written as torchtitan's and Phi-3's are: the
    output is cut into three equal parts and heads are found from the head size (-1), so a
    split of the projection by its parts gives each rank whole heads. Its checkpoints name
    q, k and v apart (a state-dict hook cuts `wqkv.weight`, a load pre-hook packs it again),
    as models whose fused layout is a training detail do."""

    def __init__(self, dim: int, head_dim: int, named_apart: bool = True):
        super().__init__()
        self.head_dim = head_dim
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        if named_apart:
            self._register_state_dict_hook(FusedAttention._cut)
            self._register_load_state_dict_pre_hook(FusedAttention._pack)

    @staticmethod
    def _cut(module, state, prefix, _):
        q, k, v = state.pop(prefix + "wqkv.weight").chunk(3, 0)
        state.update({prefix + "wq.weight": q, prefix + "wk.weight": k, prefix + "wv.weight": v})

    @staticmethod
    def _pack(state, prefix, *_):
        if prefix + "wq.weight" in state:
            state[prefix + "wqkv.weight"] = torch.cat(
                [state.pop(prefix + f"w{x}.weight") for x in "qkv"])

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.wqkv(x).chunk(3, dim=-1)
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FusedBlock(nn.Module):
    def __init__(self, dim: int, head_dim: int, named_apart: bool):
        super().__init__()
        self.norm, self.attn = nn.LayerNorm(dim), FusedAttention(dim, head_dim, named_apart)

    def forward(self, x):
        return x + self.attn(self.norm(x))


class FusedLM(nn.Module):
    """A small LM of fused-attention blocks (untied head), forward(idx, targets) -> loss. With
    `dict_blocks` each block is a ModuleDict the forward indexes (`layer["attn"](...)`), never
    called itself; else a module called with the hidden states."""

    def __init__(self, vocab_size=64, dim=16, head_dim=4, layers=2, named_apart=True,
                 dict_blocks=True):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(
            nn.ModuleDict(dict(norm=nn.LayerNorm(dim),
                               attn=FusedAttention(dim, head_dim, named_apart)))
            if dict_blocks else FusedBlock(dim, head_dim, named_apart) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, idx, targets):
        x = self.tok(idx)
        for layer in self.layers:
            x = x + layer["attn"](layer["norm"](x)) if isinstance(layer, nn.ModuleDict) \
                else layer(x)
        logits = self.out(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.reshape(-1))


class RotaryBlock(nn.Module):
    """Attention with rotary positions from a table it is handed (rows 0..T-1 of it)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x, rotary):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, -1) for t in self.qkv(self.norm(x)).chunk(3, -1))
        rows = rotary[0:T]   # (T, head_dim / 2) complex: the positions of this call's tokens

        def turn(t):
            pairs = torch.view_as_complex(t.float().reshape(*t.shape[:-1], -1, 2))
            return torch.view_as_real(pairs * rows[:, None, :]).flatten(3).type_as(t)

        q, k, v = (t.transpose(1, 2) for t in (turn(q), turn(k), v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(y.transpose(1, 2).reshape(B, T, C))


class BufferLM(nn.Module):
    """An LM written as torchtitan writes its llama3, without the package: blocks in a
    ModuleDict the forward iterates, a rotary table held as a buffer (not saved) and sliced
    `[0:T]` by each block, and logits returned for a loss the training loop takes."""

    def __init__(self, vocab_size=64, dim=16, heads=2, layers=2, seq=8):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleDict({str(i): RotaryBlock(dim, heads) for i in range(layers)})
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)
        half = dim // heads // 2
        angles = torch.outer(torch.arange(seq).float(),
                             1.0 / 10000 ** (torch.arange(half).float() / half))
        self.register_buffer("rotary", torch.polar(torch.ones_like(angles), angles),
                             persistent=False)

    def forward(self, tokens):
        h = self.tok(tokens)
        for layer in self.layers.values():
            h = layer(h, self.rotary)
        return self.output(self.norm(h))


def have_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def hf_llama(tied: bool, vocab_size: int = 64, layers: int = 2):
    """A tiny `LlamaForCausalLM` (eager attention: deterministic on the CPU)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=16, tie_word_embeddings=tied,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def have_torchtitan() -> bool:
    try:
        import torchtitan.models.llama3.model.model  # noqa: F401
    except ImportError:
        return False
    return True


def titan_llama(vocab_size: int = 64, layers: int = 2, seq: int = 8):
    """torchtitan's llama3 `Transformer` on a tiny config (GQA: 4 heads, 2 key/value heads),
    initialised as torchtitan's trainer does. Its forward returns logits; its blocks are a
    ModuleDict it iterates; its rotary table is a buffer it slices `[0:seqlen]`."""
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import Transformer

    args = TransformerModelArgs(dim=16, n_layers=layers, n_heads=4, n_kv_heads=2,
                                vocab_size=vocab_size, max_seq_len=seq, rope_theta=10000)
    model = Transformer(args)
    model.init_weights()
    return model
