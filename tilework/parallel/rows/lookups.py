"""Lookups in server tables, batched: a table's forward returns at once a stand-in for its
output (`Deferred`), and the rows of every lookup waiting are pulled in one exchange when any
of them is first used. A model that looks up its tables one after the other and then combines
the results (DLRM's `torch.stack(embedded)`) meets the other ranks once per step, not once per
table.

The stand-in is a torch.Tensor subclass whose `__torch_function__` answers shape, dtype and
device from itself and, for anything else, pulls the batch and hands the real output on: what a
user's code sees is a tensor with the output's value and autograd history. Where code is traced
or compiled (torch.compile, torch.jit, FX) a lookup pulls at once instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx._symbolic_trace as _fx

from .ahead import Ahead

# Answered from the stand-in: the output's metadata is known before its rows arrive.
_METADATA = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.__len__,
             torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
             torch.Tensor.ndim.__get__, torch.Tensor.layout.__get__,
             torch.Tensor.is_sparse.__get__}


@dataclass
class Lookup:
    table: object                        # the PSTable
    ids: torch.Tensor                    # unique ids
    finish: Callable[[torch.Tensor], torch.Tensor]   # rows -> the module's output
    grad_enabled: bool
    inference: bool = False              # made under torch.inference_mode()
    key: tuple | None = None             # where its ids sit in the loop's batch
    #                                      (parallel/rows/ahead.py)
    stand_in: "Deferred | None" = None
    output: torch.Tensor | None = None

    def complete(self, rows: torch.Tensor) -> None:
        """The output from its rows, under the grad and inference modes of the lookup's call
        (the pull may run under others: the first use of a training lookup inside no_grad)."""
        if rows.is_inference() and not self.inference:
            with torch.inference_mode(False):
                rows = rows.clone()   # an inference tensor cannot join autograd
        with torch.inference_mode(self.inference), torch.set_grad_enabled(self.grad_enabled):
            self.output = self.finish(rows)


class Batch:
    """Lookups waiting for their rows; `pull` fetches them (a collective)."""

    def __init__(self, pull: Callable[[list[Lookup]], None], ahead: Ahead | None = None):
        self.waiting: list[Lookup] = []
        self._pull = pull
        self.ahead = Ahead() if ahead is None else ahead   # the loop's batches, if prefetched

    def add(self, lookup: Lookup, like: torch.Tensor) -> torch.Tensor:
        if _tracing():
            return self._pull_now(lookup)
        stand_in = torch.Tensor._make_subclass(Deferred, like, False)
        stand_in._lookup, stand_in._batch = lookup, self
        lookup.stand_in = stand_in
        self.waiting.append(lookup)
        return stand_in

    @torch.compiler.disable
    def _pull_now(self, lookup: Lookup) -> torch.Tensor:
        """Compiled code gets the rows at once, from a graph break: collectives, the call guard
        and the store stay out of the graph."""
        self._pull([lookup])
        return lookup.output

    def flush(self) -> None:
        if self.waiting:
            lookups, self.waiting = self.waiting, []
            self._pull(lookups)


# torch.export and torch.compile are caught by is_compiling; this is FX's symbolic_trace (looked
# up once: the check runs on every lookup).
_fx_tracing = getattr(_fx, "is_fx_symbolic_tracing", None) or _fx.is_fx_tracing


def _tracing() -> bool:
    return (torch.compiler.is_compiling() or torch.jit.is_tracing()
            or torch.jit.is_scripting() or _fx_tracing())


class Deferred(torch.Tensor):
    """A lookup's output before its rows arrive (see the module docstring)."""

    _lookup: Lookup
    _batch: Batch

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        return func(*real_values(args), **real_values(kwargs))

    def __reduce_ex__(self, protocol):
        return self._resolve().__reduce_ex__(protocol)

    def _resolve(self) -> torch.Tensor:
        if self._lookup.output is None:
            self._batch.flush()
        return self._lookup.output


def real_values(value):
    if isinstance(value, Deferred):
        return value._resolve()
    if isinstance(value, tuple) and hasattr(value, "_fields"):   # a named tuple
        return type(value)(*(real_values(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(real_values(v) for v in value)
    if isinstance(value, dict):
        return {k: real_values(v) for k, v in value.items()}
    return value
