"""A small GPT-like Transformer: the second dense workload (embedding gradients are dense here)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 1000, dim: int = 64, heads: int = 4, layers: int = 2,
                 seq_len: int = 32):
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(seq_len, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        # Beside the parameters: built under `with torch.device(...)` (meta for planning), it
        # is there too.
        mask = torch.full((seq_len, seq_len), float("-inf"), device=self.head.weight.device)
        self.register_buffer("causal", torch.triu(mask, 1), persistent=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.tokens(tokens) + self.positions(torch.arange(t, device=tokens.device))
        x = self.blocks(x, mask=self.causal[:t, :t], is_causal=True)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
