"""Word-level language model: input embedding, LSTM, output (softmax) embedding.

The shape of Parallax's LM1B model at small scale: both embeddings are vocab x dim tables, so at a
large vocabulary almost all parameters are in two tables of which a step touches few rows. With
`num_sampled > 0` training uses a sampled softmax over the batch's targets plus shared negative
candidates, so the output table's gradient is row-sparse too (as in LM1B); evaluation always uses
the full softmax, so perplexities are exact.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class WordLM(nn.Module):
    def __init__(self, vocab: int, embed_dim: int = 64, hidden: int = 128, layers: int = 1,
                 sparse: bool = True, num_sampled: int = 0):
        super().__init__()
        if vocab < 2:
            raise ValueError(f"vocab must be at least 2, got {vocab}")
        self.vocab = vocab
        self.num_sampled = num_sampled
        self.embedding = nn.Embedding(vocab, embed_dim, sparse=sparse)
        self.rnn = nn.LSTM(embed_dim, hidden, layers, batch_first=True)
        # Back to the embedding width before the softmax, as LM1B's projected LSTM does.
        self.project = nn.Linear(hidden, embed_dim) if hidden != embed_dim else nn.Identity()
        # Only the sampled softmax looks rows up; the full softmax reads the whole table (dense).
        sparse_out = sparse and num_sampled > 0
        self.softmax_weight = nn.Embedding(vocab, embed_dim, sparse=sparse_out)
        self.softmax_bias = nn.Embedding(vocab, 1, sparse=sparse_out)
        nn.init.normal_(self.embedding.weight, std=0.1)
        nn.init.normal_(self.softmax_weight.weight, std=1.0 / math.sqrt(embed_dim))
        nn.init.zeros_(self.softmax_bias.weight)

    def hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embedding(tokens))
        out = self.project(out)
        return out.reshape(-1, out.shape[-1])

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor,
                negatives: torch.Tensor | None = None) -> torch.Tensor:
        """Mean cross-entropy of `targets` given `tokens` (both batch x seq).

        `negatives` (sampled ids shared by the whole global batch) switches to the sampled softmax;
        sharing them across ranks keeps a data-parallel step equal to a one-process step.
        """
        h = self.hidden_states(tokens)
        flat = targets.reshape(-1)
        if negatives is None:
            logits = h @ self.softmax_weight.weight.t() + self.softmax_bias.weight.t()
            return F.cross_entropy(logits, flat)
        # Each position scores its own target against the shared negatives (TensorFlow's
        # sampled_softmax_loss with accidental hits removed): the loss of a sample does not depend
        # on which other samples share its batch, so a data-parallel step equals a one-process one.
        ids, inverse = torch.unique(torch.cat([flat, negatives]), return_inverse=True)
        weight, bias = self.softmax_weight(ids), self.softmax_bias(ids).squeeze(1)
        log_q = log_uniform_log_prob(ids, self.vocab)
        t, n = inverse[: flat.numel()], inverse[flat.numel():]
        true_logit = (h * weight[t]).sum(1) + bias[t] - log_q[t]
        sampled = h @ weight[n].t() + bias[n] - log_q[n]
        sampled = sampled.masked_fill(negatives[None, :] == flat[:, None], float("-inf"))
        logits = torch.cat([true_logit[:, None], sampled], dim=1)
        return F.cross_entropy(logits, torch.zeros_like(flat))

    @torch.no_grad()
    def perplexity(self, tokens: torch.Tensor, targets: torch.Tensor, chunk: int = 4096) -> float:
        h = self.hidden_states(tokens)
        flat = targets.reshape(-1)
        total = 0.0
        for i in range(0, h.shape[0], chunk):
            logits = h[i:i + chunk] @ self.softmax_weight.weight.t() + self.softmax_bias.weight.t()
            total += F.cross_entropy(logits, flat[i:i + chunk], reduction="sum").item()
        mean = total / flat.numel()
        return math.exp(mean) if mean < 709.0 else math.inf  # a diverged model: not an error here


def log_uniform_log_prob(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """log P(id) under the log-uniform (Zipf-like) candidate sampler, ids sorted by frequency."""
    ids = ids.to(torch.float64)
    p = (torch.log(ids + 2) - torch.log(ids + 1)) / math.log(vocab + 1)
    return torch.log(p).to(torch.float32)


def sample_negatives(num: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """`num` ids from the log-uniform distribution (TensorFlow's log_uniform_candidate_sampler)."""
    u = torch.rand(num, generator=generator, dtype=torch.float64, device=generator.device)
    ids = torch.floor(torch.exp(u * math.log(vocab + 1))) - 1
    return ids.clamp_(0, vocab - 1).to(torch.long)
