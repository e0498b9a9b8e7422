"""Synthetic datasets of any size: Zipf token streams, images, click logs. Deterministic by seed.

Each dataset maps an index to one sample (a tuple of tensors) and `collate` stacks a list of
indices into a batch, so any of them can be sharded by `ShardedBatches`.
"""

from __future__ import annotations

import functools

import numpy as np
import torch


def zipf_tokens(vocab: int, count: int, alpha: float = 1.1, seed: int = 0) -> np.ndarray:
    """`count` ids in [0, vocab) with P(id) proportional to (id + 1) ** -alpha."""
    if vocab < 1 or count < 0:
        raise ValueError(f"need vocab >= 1 and count >= 0, got vocab={vocab}, count={count}")
    u = np.random.default_rng(seed).random(count)
    cdf = _zipf_cdf(vocab, float(alpha))
    return np.minimum(np.searchsorted(cdf, u, side="right"), vocab - 1).astype(np.int64)


@functools.lru_cache(maxsize=16)
def _zipf_cdf(vocab: int, alpha: float) -> np.ndarray:
    """The CDF, once per table: a benchmark drawing a batch of a 200,000-row table each step
    spent 2.4 ms a step building it again, as much as a sparse step's exchanges."""
    cdf = np.cumsum(np.arange(1, vocab + 1, dtype=np.float64) ** -alpha)
    cdf /= cdf[-1]
    cdf.flags.writeable = False
    return cdf


class TokenSequences:
    """Non-overlapping windows of seq_len + 1 tokens: (inputs, targets) shifted by one."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        if seq_len < 1:
            raise ValueError(f"seq_len must be at least 1, got {seq_len}")
        self.tokens = torch.as_tensor(np.asarray(tokens, dtype=np.int64))
        self.seq_len = seq_len
        self.count = (len(self.tokens) - 1) // seq_len

    def __len__(self) -> int:
        return self.count

    def collate(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.as_tensor(list(indices), dtype=torch.long)
        starts = idx[:, None] * self.seq_len + torch.arange(self.seq_len + 1)
        window = self.tokens[starts]
        return window[:, :-1], window[:, 1:]

    def split(self, holdout: float) -> tuple["TokenSequences", "TokenSequences"]:
        """Train on the first part, evaluate on the last `holdout` fraction of windows."""
        cut = int(self.count * (1 - holdout)) * self.seq_len
        return (TokenSequences(self.tokens[: cut + 1].numpy(), self.seq_len),
                TokenSequences(self.tokens[cut:].numpy(), self.seq_len))


class SyntheticImages:
    """Images whose class is a fixed random linear function of their mean colour, so a small CNN
    learns it in a few dozen steps."""

    def __init__(self, count: int, num_classes: int = 10, size: int = 16, channels: int = 3,
                 seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.images = torch.randn(count, channels, size, size, generator=g)
        teacher = torch.randn(channels, num_classes, generator=g)
        self.labels = (self.images.mean(dim=(2, 3)) @ teacher).argmax(1)

    def __len__(self) -> int:
        return len(self.labels)

    def collate(self, indices):
        idx = torch.as_tensor(list(indices), dtype=torch.long)
        return self.images[idx], self.labels[idx]


class ClickLogs:
    """Click-through samples: dense features, one Zipf id per table, a label from a hidden
    teacher."""

    def __init__(self, count: int, table_sizes: list[int], dense_features: int = 8,
                 alpha: float = 1.1, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.dense = torch.randn(count, dense_features, generator=g)
        self.ids = torch.stack([torch.as_tensor(zipf_tokens(n, count, alpha, seed + 1 + t))
                                for t, n in enumerate(table_sizes)], dim=1)
        score = self.dense @ torch.randn(dense_features, generator=g)
        for t, n in enumerate(table_sizes):
            score += torch.randn(n, generator=g)[self.ids[:, t]]
        self.labels = (score > 0).to(torch.float32)

    def __len__(self) -> int:
        return len(self.labels)

    def collate(self, indices):
        idx = torch.as_tensor(list(indices), dtype=torch.long)
        return self.dense[idx], self.ids[idx], self.labels[idx]
