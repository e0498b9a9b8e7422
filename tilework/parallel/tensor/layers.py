"""Tensor-parallel stand-ins for torch's own modules, holding this rank's shard.

Each keeps the parameter names of the module it replaces (`weight`, `bias`, `in_proj_weight`,
`out_proj.weight`, ...), so a model's state-dict keys do not change; `shards.py` says how each
tensor is split and `plans/rows.py` builds these from the full module's values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .loss import ShardedLogits
from .regions import (
    TensorParallel,
    copy_to_region,
    enter_region,
    gather_features,
    leave_region,
    scatter_sequence,
)


def _empty(*shape, like: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=like.dtype, device=like.device))


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A's rows (output features) split: the output stays split."""

    def __init__(self, full: nn.Linear, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.in_features, self.out_features = full.in_features, full.out_features
        self.weight = _empty(full.out_features // tp.size, full.in_features, like=full.weight)
        self.bias = None if full.bias is None else _empty(full.out_features // tp.size,
                                                          like=full.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(enter_region(x, self.tp), self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features} split over tp={self.tp.size}"


class VocabParallelHead(ColumnParallelLinear):
    """The output layer, split over the vocabulary; its logits stay split, and a
    `F.cross_entropy` on them runs the vocabulary-parallel loss (loss.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(x)
        if self.tp.size == 1:
            return logits
        return ShardedLogits.wrap(logits, self.tp, self.tp.rank * self.weight.shape[0])


class GatheredColumnParallelLinear(ColumnParallelLinear):
    """Column-parallel, its output gathered whole: what a model that reads every feature
    (HF's own loss over a vocabulary-split head's logits) needs after it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gather_features(super().forward(x), self.tp)


class RowParallelLinear(nn.Module):
    """y = x A^T + b with A's columns (input features) split: partial outputs summed."""

    def __init__(self, full: nn.Linear, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.in_features, self.out_features = full.in_features, full.out_features
        self.weight = _empty(full.out_features, full.in_features // tp.size, like=full.weight)
        self.bias = None if full.bias is None else _empty(full.out_features, like=full.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = leave_region(F.linear(x, self.weight), self.tp)
        if self.bias is None:
            return y
        # Added after the sum, once; on sequence slices each rank's gradient is a part.
        return y + (copy_to_region(self.bias, self.tp) if self.tp.sequence_parallel
                    else self.bias)

    def extra_repr(self) -> str:
        return f"{self.in_features} split over tp={self.tp.size}, {self.out_features}"


class VocabParallelEmbedding(nn.Module):
    """An embedding table's rows split: each rank looks up the ids it holds, zeros elsewhere,
    and the partial lookups are summed (reduce-scattered along the sequence under sequence
    parallelism)."""

    def __init__(self, full: nn.Embedding, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.num_embeddings, self.embedding_dim = full.num_embeddings, full.embedding_dim
        self.weight = _empty(full.num_embeddings // tp.size, full.embedding_dim, like=full.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.shape[0]
        start = self.tp.rank * rows
        outside = (ids < start) | (ids >= start + rows)
        out = F.embedding((ids - start).masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return leave_region(out, self.tp)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings} split over tp={self.tp.size}, {self.embedding_dim}"


class SequenceParallelLayerNorm(nn.LayerNorm):
    """A LayerNorm on this rank's slice of the sequence: its parameters' gradients, partial
    per rank, are summed over tp (Megatron all-reduces them before the step)."""

    def __init__(self, full: nn.LayerNorm, tp: TensorParallel):
        super().__init__(full.normalized_shape, full.eps, full.elementwise_affine,
                         bias=full.bias is not None, device=full.weight.device
                         if full.weight is not None else None)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = None if self.weight is None else copy_to_region(self.weight, self.tp)
        b = None if self.bias is None else copy_to_region(self.bias, self.tp)
        return F.layer_norm(x, self.normalized_shape, w, b, self.eps)


class SequenceParallelEmbedding(nn.Embedding):
    """A table looked up by position (the same ids on every rank): each rank keeps the rows of
    its slice of the sequence, the ids' last dimension; backward all-gathers the slices."""

    def __init__(self, full: nn.Embedding, tp: TensorParallel):
        super().__init__(full.num_embeddings, full.embedding_dim, device=full.weight.device,
                         dtype=full.weight.dtype)
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return scatter_sequence(super().forward(ids), self.tp, dim=ids.dim() - 1)
