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
- adamw: adam after torch.optim.AdamW's decoupled weight decay, w *= 1 - lr * weight_decay. Lazy
  tables decay a row only on the steps that touch it, as its moments: a row untouched for k steps
  keeps its value where AdamW would have shrunk it by (1 - lr * weight_decay)^k. Rows touched
  every step get AdamW's decay exactly; dense-served rows are exactly torch.optim.AdamW.
  Adam's own weight_decay (L2, added to the gradient before the moments) is not implemented and
  is refused.

Hyper-parameters are read from the user's param group at every step, so LR schedulers that change
`group["lr"]` keep working for the rows on the servers.

Any other optimizer class runs as it is on each owner's rows where its step takes a sparse
gradient (a row-wise optimizer of the user's own, as DLRM's RWSAdagrad): optim/own.py.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch

from ..errors import PlanError, use_allreduce_hint
from .own import OwnRowOptimizer, check_runs_on_rows

Family = Literal["sgd", "adagrad", "adam", "adamw"]

# Exact types: a subclass may change step() in ways the row-wise rule would not follow.
_ADAMS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SparseAdam)


def row_optimizer(optimizer: torch.optim.Optimizer, name: str, param, lazy: bool):
    """A factory of the RowOptimizer that applies `optimizer`'s rule, with the hyperparameters
    of `param`'s group read at each step (a scheduler's changes reach the servers), to a
    shard of `param`'s rows; for a class of the user's own, of an OwnRowOptimizer running it."""
    index = next(i for i, g in enumerate(optimizer.param_groups)
                 if any(q is param for q in g["params"]))
    group = optimizer.param_groups[index]
    if not _known(optimizer):
        check_runs_on_rows(optimizer, group, name, param, lambda why: _unsupported(
            name, f"{type(optimizer).__name__} is not supported on the parameter server: {why}"))
        return lambda shard: OwnRowOptimizer(type(optimizer), optimizer.defaults,
                                             lambda: optimizer.param_groups[index], shard,
                                             tuple(param.shape[1:]), lazy=lazy)
    family = family_of(optimizer, group, name)
    return lambda shard: RowOptimizer(family, lambda: optimizer.param_groups[index], shard,
                                      lazy=lazy)


def _known(optimizer: torch.optim.Optimizer) -> bool:
    """Whether one of the rules here stands for `optimizer` (or refuses its settings)."""
    return type(optimizer) in _ADAMS or isinstance(optimizer, (torch.optim.SGD,
                                                               torch.optim.Adagrad))


def _unsupported(param_name: str, what: str) -> PlanError:
    return PlanError(f"{param_name}: {what} (supported: SGD without momentum, Adagrad, "
                     "Adam/SparseAdam without weight decay, AdamW, and optimizer classes whose "
                     "step takes sparse gradients); to all-reduce it instead: "
                     f"{use_allreduce_hint(param_name)}")


def family_of(optimizer: torch.optim.Optimizer, group: dict, param_name: str) -> Family:
    """Which row-wise rule reproduces `optimizer` for a parameter; refuses what none can, with the
    override that keeps the parameter off the servers."""
    kind = type(optimizer).__name__

    def unsupported(why):
        what = " ".join(filter(None, (kind, why)))
        return _unsupported(param_name, f"{what} is not supported on the parameter server")
    if group.get("maximize", False):
        raise unsupported("with maximize=True")
    if type(optimizer) in _ADAMS:
        return _adam_family(optimizer, group, unsupported)
    if group.get("weight_decay", 0):
        raise unsupported("with weight_decay")
    if isinstance(optimizer, torch.optim.SGD):
        if group.get("momentum", 0):
            raise unsupported("with momentum")
        return "sgd"
    if isinstance(optimizer, torch.optim.Adagrad):
        if group.get("lr_decay", 0) or group.get("initial_accumulator_value", 0):
            raise unsupported("with lr_decay or initial_accumulator_value")
        return "adagrad"
    raise unsupported("")


def _adam_family(optimizer, group: dict, unsupported) -> Family:
    if group.get("amsgrad", False):
        raise unsupported("with amsgrad")
    # Newer torch has Adam(decoupled_weight_decay=True), which is AdamW; older AdamW lacks the key.
    if isinstance(optimizer, torch.optim.AdamW) or group.get("decoupled_weight_decay", False):
        return "adamw"
    if group.get("weight_decay", 0):
        raise unsupported("with weight_decay (L2; use torch.optim.AdamW for decoupled decay)")
    return "adam"


class RowOptimizer:
    def __init__(self, family: Family, group: dict, shard: torch.Tensor, lazy: bool = True):
        self.family, self._group, self.shard, self.lazy = family, group, shard, lazy
        self.step_count = 0
        self.state: dict[str, torch.Tensor] = {}
        if family == "adagrad":
            self.state["sum"] = torch.zeros_like(shard)
        elif family in ("adam", "adamw"):
            self.state["exp_avg"] = torch.zeros_like(shard)
            self.state["exp_avg_sq"] = torch.zeros_like(shard)

    @property
    def group(self) -> dict:
        """The user's param group, looked up at every step: `optimizer.load_state_dict` replaces
        the group dicts, and LR schedulers write into whichever are current."""
        return self._group() if callable(self._group) else self._group

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
            if self.family == "adamw":
                self._decay(rows, lr)
            self._adam(rows, grads, lr)

    def _decay(self, rows, lr):
        """AdamW's decoupled weight decay, before the update: on the rows updated at this step
        (lazy tables: the touched ones only; see the module docstring)."""
        weight_decay = self.group["weight_decay"]
        if weight_decay:
            self.shard[rows] *= 1 - lr * weight_decay

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
            self.state[k].copy_(t.reshape(self.state[k].shape))
