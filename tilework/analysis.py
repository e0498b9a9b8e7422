"""Inspect a model: each parameter's size, and whether its gradient is sparse (touches few rows).

Pure: reads module types and shapes only (works on the meta device). A gradient is sparse when
PyTorch makes it a sparse tensor (`nn.Embedding(sparse=True)`, `nn.EmbeddingBag(sparse=True)`);
a table with a dense-layout gradient is "embedding-like" and its touched-row fraction can be
measured (`measure_density`) and given to the planner.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .plan import Kind, TensorFacts


@dataclass(frozen=True)
class ParamInfo(TensorFacts):
    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: Kind                 # sparse gradient / embedding with dense-layout gradient / dense
    density: float | None = None  # measured touched-row fraction, where known


def embedding_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Parameter name -> the Embedding/EmbeddingBag that owns it."""
    return {f"{m_name}.weight" if m_name else "weight": m for m_name, m in model.named_modules()
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag))}


def analyze(model: nn.Module, density: dict[str, float] | None = None) -> list[ParamInfo]:
    tables = embedding_modules(model)
    density = density or {}
    infos = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        module = tables.get(name)
        kind: Kind = "dense" if module is None else ("sparse" if module.sparse else "embedding")
        infos.append(ParamInfo(name, tuple(p.shape), str(p.dtype).removeprefix("torch."), kind,
                               density.get(name)))
    return infos


def row_density(grad: torch.Tensor) -> float:
    """Fraction of a table's rows that a gradient touches."""
    rows = grad.shape[0]
    if grad.is_sparse:
        return grad.coalesce().indices()[0].unique().numel() / rows
    return (grad.reshape(rows, -1) != 0).any(dim=1).sum().item() / rows


def measure_density(model: nn.Module, loss_fn, batches) -> dict[str, float]:
    """Mean per-step touched-row fraction of every embedding table's gradient on `batches`.

    Runs forward and backward locally, then clears the gradients: no step is taken.
    """
    tables = {name: m.weight for name, m in embedding_modules(model).items()}
    fractions: dict[str, list[float]] = {name: [] for name in tables}
    for batch in batches:
        model.zero_grad(set_to_none=True)
        loss_fn(model, batch).backward()
        for name, w in tables.items():
            fractions[name].append(0.0 if w.grad is None else row_density(w.grad))
    model.zero_grad(set_to_none=True)
    return {name: sum(f) / len(f) for name, f in fractions.items() if f}
