"""Optimizers by name, for the trainer and for one-process reference runs.

PyTorch's dense Adam cannot take sparse gradients, so a model with sparse embedding tables gets
`torch.optim.SparseAdam` (lazy, row-wise moments) for those tables and Adam for the rest: the
same split that tilework's parameter server makes, which is why this is also the reference that
distributed runs are compared against.
"""

from __future__ import annotations

from typing import Iterable, Literal

import torch
from torch import nn

OptimizerName = Literal["sgd", "adagrad", "adam"]


def sparse_parameter_names(model: nn.Module) -> set[str]:
    """Parameters whose gradients PyTorch produces as sparse tensors."""
    names = set()
    for mod_name, mod in model.named_modules():
        if isinstance(mod, (nn.Embedding, nn.EmbeddingBag)) and mod.sparse:
            names.add(f"{mod_name}.weight" if mod_name else "weight")
    return names


def make(name: OptimizerName, params: Iterable[nn.Parameter], lr: float, sparse: bool = False):
    params = list(params)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=lr)
    if name == "adam":
        return torch.optim.SparseAdam(params, lr=lr) if sparse else torch.optim.Adam(params, lr=lr)
    raise ValueError(f"unknown optimizer {name!r}: expected 'sgd', 'adagrad' or 'adam'")


class MultiOptimizer:
    """Several optimizers stepped as one (dense params in one, sparse tables in another)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers

    @property
    def param_groups(self):
        return [g for o in self.optimizers for g in o.param_groups]

    def step(self, closure=None):
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True):
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state):
        for o, s in zip(self.optimizers, state["optimizers"], strict=True):
            o.load_state_dict(s)


def for_model(model: nn.Module, name: OptimizerName, lr: float):
    """One optimizer over all of `model`, splitting off sparse tables where `name` needs it."""
    sparse = sparse_parameter_names(model)
    named = dict(model.named_parameters())
    if name != "adam" or not sparse:
        return make(name, named.values(), lr)
    dense_params = [p for n, p in named.items() if n not in sparse]
    parts = [make(name, [named[n] for n in sorted(sparse)], lr, sparse=True)]
    if dense_params:
        parts.insert(0, make(name, dense_params, lr))
    return MultiOptimizer(parts)
