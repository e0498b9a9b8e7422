"""Row-wise optimizers that the parameter-server owners run on the rows they serve.

Given unique local row indices and their summed gradient rows, each updates only those rows:

- sgd:     w -= lr * g                                   (= torch.optim.SGD on a sparse gradient)
- adagrad: s += g^2; w -= lr * g / (sqrt(s) + eps)       (= torch.optim.Adagrad's sparse path)
- adam, lazy (tables): the moments of a row decay only on steps that touch it, and one step
  counter per table drives the bias correction, exactly torch.optim.SparseAdam. Dense Adam decays
  every row's moments every step, so a row untouched for k steps keeps momentum there but not
  here; rows touched every step get the same update either way, up to where eps sits
  (sqrt(v) + eps here, sqrt(v / bias2) + eps in dense Adam).
- adam, dense (a dense parameter served by the PS in mode="ps": every row every step): exactly
  torch.optim.Adam's formula.

Hyper-parameters are read from the user's param group at every step, so LR schedulers that change
`group["lr"]` keep working for the rows on the servers.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch

from ..errors import PlanError

Family = Literal["sgd", "adagrad", "adam"]


def family_of(optimizer: torch.optim.Optimizer, group: dict, param_name: str) -> Family:
    """Which row-wise rule reproduces `optimizer` for a parameter; refuses what none can."""
    kind = type(optimizer).__name__
    def unsupported(why):
        return PlanError(f"{param_name}: {kind} {why} is not supported on the parameter server "
                         "(supported: SGD without momentum, Adagrad, Adam/SparseAdam without "
                         "weight decay)")
    if group.get("weight_decay", 0):
        raise unsupported("with weight_decay")
    if group.get("maximize", False):
        raise unsupported("with maximize=True")
    if isinstance(optimizer, torch.optim.SGD):
        if group.get("momentum", 0):
            raise unsupported("with momentum")
        return "sgd"
    if isinstance(optimizer, torch.optim.Adagrad):
        if group.get("lr_decay", 0) or group.get("initial_accumulator_value", 0):
            raise unsupported("with lr_decay or initial_accumulator_value")
        return "adagrad"
    if type(optimizer) in (torch.optim.Adam, torch.optim.SparseAdam):
        if group.get("amsgrad", False):
            raise unsupported("with amsgrad")
        return "adam"
    raise unsupported("")


class RowOptimizer:
    def __init__(self, family: Family, group: dict, shard: torch.Tensor, lazy: bool = True):
        self.family, self.group, self.shard, self.lazy = family, group, shard, lazy
        self.step_count = 0
        self.state: dict[str, torch.Tensor] = {}
        if family == "adagrad":
            self.state["sum"] = torch.zeros_like(shard)
        elif family == "adam":
            self.state["exp_avg"] = torch.zeros_like(shard)
            self.state["exp_avg_sq"] = torch.zeros_like(shard)

    @torch.no_grad()
    def apply(self, rows: torch.Tensor, grads: torch.Tensor) -> None:
        """Update `shard[rows]` (rows unique) with gradient rows `grads`; counts one step."""
        self.step_count += 1
        if rows.numel() == 0:
            return
        lr = float(self.group["lr"])
        w = self.shard
        if self.family == "sgd":
            w.index_add_(0, rows, grads, alpha=-lr)
        elif self.family == "adagrad":
            s = self.state["sum"]
            s.index_add_(0, rows, grads * grads)
            std = s[rows].sqrt_().add_(self.group["eps"])
            w.index_add_(0, rows, grads / std, alpha=-lr)
        else:
            self._adam(rows, grads, lr)

    def _adam(self, rows, grads, lr):
        beta1, beta2 = self.group["betas"]
        eps, t = self.group["eps"], self.step_count
        m, v = self.state["exp_avg"], self.state["exp_avg_sq"]
        m_old, v_old = m[rows], v[rows]
        m_new = m_old + (grads - m_old) * (1 - beta1)
        if self.lazy:
            v_new = v_old + (grads * grads - v_old) * (1 - beta2)
        else:
            v_new = v_old * beta2 + grads * grads * (1 - beta2)
        m[rows], v[rows] = m_new, v_new
        bias1, bias2 = 1 - beta1 ** t, 1 - beta2 ** t
        if self.lazy:  # SparseAdam's arithmetic
            step_size = lr * math.sqrt(bias2) / bias1
            update = m_new / (v_new.sqrt() + eps) * step_size
        else:          # Adam's arithmetic
            denom = v_new.sqrt() / math.sqrt(bias2) + eps
            update = m_new / denom * (lr / bias1)
        self.shard.index_add_(0, rows, update, alpha=-1.0)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return self.state

    def load(self, step: int, tensors: dict[str, Any]) -> None:
        self.step_count = step
        for k, t in tensors.items():
            self.state[k].copy_(t)
