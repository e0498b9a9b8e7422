"""DLRM-style recommender: embedding tables for categorical features, MLPs for dense ones.

The mixed workload: a few large sparse tables (each sample looks up one row per table) beside
dense MLP weights, joined by pairwise dot-product feature interactions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    def __init__(self, table_sizes: list[int], dense_features: int = 8, embed_dim: int = 16,
                 bottom: int = 32, top: int = 32, sparse: bool = True):
        super().__init__()
        self.tables = nn.ModuleList(nn.Embedding(n, embed_dim, sparse=sparse) for n in table_sizes)
        for t in self.tables:
            nn.init.normal_(t.weight, std=0.1)
        self.bottom = _mlp([dense_features, bottom, embed_dim])
        n = len(table_sizes) + 1
        self.top = _mlp([embed_dim + n * (n - 1) // 2, top, 1])

    def forward(self, dense: torch.Tensor, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """dense: batch x features; ids: batch x tables; labels: batch (0 or 1)."""
        x = self.bottom(dense)
        return self.score(x, [t(ids[:, i]) for i, t in enumerate(self.tables)], labels)

    def score(self, x: torch.Tensor, embedded: list[torch.Tensor],
              labels: torch.Tensor) -> torch.Tensor:
        """The loss from the bottom MLP's output and one looked-up row per table (also used by
        the TorchRec peer in the benchmark, which looks the rows up itself)."""
        feats = torch.stack([x] + embedded, dim=1)
        inter = feats @ feats.transpose(1, 2)
        i, j = torch.triu_indices(feats.shape[1], feats.shape[1], offset=1)
        z = torch.cat([x, inter[:, i, j]], dim=1)
        return F.binary_cross_entropy_with_logits(self.top(z).squeeze(1), labels)
