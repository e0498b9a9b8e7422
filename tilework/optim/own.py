"""The user's own optimizer class, run by each owner on the rows it serves.

A row-wise optimizer that tilework does not know (DLRM's RWSAdagrad, say: one accumulator per
row, updating only the rows a sparse gradient touches) is run as it is: every owner builds an
instance of the user's class over a Parameter that holds its rows (sharing the shard's memory)
with the hyperparameters of the parameter's group, and at each step hands it the rows it
received as a sparse gradient (a table) or as a dense one (a dense parameter served by mode="ps",
every row every step: what one process hands it), then calls its `step()`.

This equals one process for an optimizer whose update of a row reads only that row's gradient
and state and per-parameter scalars (step counts, hyperparameters): row-wise optimizers are so
by design. One that reads the whole gradient (a norm over the table, LAMB's trust ratio) would
see only the owner's rows and is not detected. The rows arrive summed and unique (coalesced),
where one process's nn.Embedding gives duplicates; an optimizer that coalesces first, as it
must for a non-linear update, cannot tell.

Only classes whose `step()` takes a sparse gradient are run (probed once, on a scratch
parameter, before anything changes): that is what marks a row-wise optimizer, and the others
(RMSprop, ...) would update every row of the shard where one process updates the table dense.

Its state goes back to the plain optimizer's layout by rows: a tensor whose first dimension is
the shard's row count is per-row and is gathered into the table's rows (and cut by rows on a
load); anything else (a step count, a scalar tensor) is kept as this rank's instance holds it,
the same on every owner since each steps at every step. A state tensor of another shape that
happens to have as many entries along its first dimension as the shard has rows would be taken
for a per-row one.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable

import torch
from torch import nn

from ..errors import PlanError


def per_row(value: Any, rows: int) -> bool:
    """Whether an optimizer state entry holds one entry per row of a `rows`-row tensor."""
    return torch.is_tensor(value) and value.dim() >= 1 and value.shape[0] == rows


def take_rows(full: dict, rows: int, take: Callable[[torch.Tensor], torch.Tensor]) -> dict:
    """Whole-table optimizer state -> a shard's: every per-row tensor cut by `take` (which
    flattens rows), its own trailing shape kept; step counts and scalars as they are."""
    return {k: take(v).reshape(-1, *v.shape[1:]) if per_row(v, rows) else v
            for k, v in full.items()}


def _build(cls, defaults: dict, group: dict, param: nn.Parameter) -> torch.optim.Optimizer:
    """`cls` over one parameter with `group`'s hyperparameters; the constructor's own keyword
    arguments from the user's `defaults`, where it takes them (some classes read them from
    attributes set in __init__ rather than from the group)."""
    accepted = inspect.signature(cls).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in accepted.values())
    kwargs = {k: v for k, v in defaults.items() if takes_any or k in accepted}
    hyper = {k: v for k, v in group.items() if k != "params"}
    return cls([{**hyper, "params": [param]}], **kwargs)


def check_runs_on_rows(optimizer: torch.optim.Optimizer, group: dict, name: str, param,
                       unsupported: Callable[[str], PlanError]) -> None:
    """Refuses `optimizer`'s class unless an instance over a scratch table of two rows as
    wide as `param`'s takes a sparse gradient of one row and then of none (an owner whose rows
    no rank touched still steps). A table's shape: a dense parameter served by mode="ps" is
    handed dense gradients, but the class must be a row-wise one all the same."""
    rest = (math.prod(param.shape[1:]),)
    scratch = nn.Parameter(torch.zeros(2, *rest, dtype=param.dtype, device=param.device))
    try:
        probe = _build(type(optimizer), optimizer.defaults, group, scratch)
        for n in (1, 0):
            scratch.grad = torch.sparse_coo_tensor(
                torch.zeros(1, n, dtype=torch.long, device=param.device),
                torch.ones(n, *rest, dtype=param.dtype, device=param.device), scratch.shape,
                check_invariants=False)
            probe.step()
    except Exception as e:  # the user's code: any failure means it cannot run on the rows
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise unsupported(f"its step refused a sparse gradient of the rows ({first})") from e


class OwnRowOptimizer:
    """The RowOptimizer interface (optim/rowwise.py) over an instance of the user's class."""

    def __init__(self, cls, defaults: dict, group: Callable[[], dict], shard: torch.Tensor,
                 row_shape: tuple[int, ...], lazy: bool):
        self.shard, self.lazy, self._group, self.row_shape = shard, lazy, group, row_shape
        self.param = nn.Parameter(self._as_param())
        self.inner = _build(cls, defaults, group(), self.param)
        self.step_count = 0

    def _as_param(self) -> torch.Tensor:
        return self.shard.view(len(self.shard), *self.row_shape)

    def apply(self, rows: torch.Tensor, grads: torch.Tensor) -> None:
        """Hands the user's optimizer `grads` for shard rows `rows` (unique) and runs its step;
        counts one step, with no rows too."""
        self.step_count += 1
        # A scheduler writes into the user's group; the instance here reads its own.
        self.inner.param_groups[0].update(
            {k: v for k, v in self._group().items() if k != "params"})
        p = self.param
        values = grads.reshape(len(rows), *self.row_shape).to(p.dtype)
        if self.lazy:
            # Rows come unique and in range (the layout's): no invariant checks needed.
            p.grad = torch.sparse_coo_tensor(rows.reshape(1, -1), values, p.shape,
                                             check_invariants=False).coalesce()
        else:
            p.grad = torch.zeros_like(p).index_copy_(0, rows, values)
        self.inner.step()
        p.grad = None
        if p.data_ptr() != self.shard.data_ptr():   # a class that rebinds p.data: rows follow
            with torch.no_grad():
                self.shard.copy_(p.detach().reshape(self.shard.shape))
            p.data = self._as_param()

    def _state(self) -> dict:
        return self.inner.state.get(self.param, {})

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The per-row state (the same tensor objects at every call between steps)."""
        return {k: v for k, v in self._state().items() if per_row(v, len(self.shard))}

    def scalars(self) -> dict[str, Any]:
        """The rest of the state (step counts, scalars), as this rank's instance holds it."""
        return {k: v for k, v in self._state().items() if not per_row(v, len(self.shard))}

    def load(self, step: int, state: dict[str, Any]) -> None:
        """This shard's state (per-row tensors already cut to its rows), through the class's
        own load_state_dict, which casts as it would in one process."""
        self.step_count = step
        group = {k: v for k, v in self.inner.param_groups[0].items() if k != "params"}
        self.inner.load_state_dict({"state": {0: dict(state)} if state else {},
                                    "param_groups": [{**group, "params": [0]}]})
