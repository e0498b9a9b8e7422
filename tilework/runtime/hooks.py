"""Hooks that pickle as no-ops, so `torch.save(model)` of a parallelized model writes a plain
model: the hooks close over process groups and the engine, which cannot be pickled and mean
nothing in another process."""

from __future__ import annotations

import contextlib


def _noop(*args, **kwargs):
    return None


def _make_noop():
    return _noop


def _make_nullcontext():
    return contextlib.nullcontext


class PicklesAsNoop:
    """Calls `fn`; pickled, becomes a function that does nothing."""

    def __init__(self, fn, plain=_make_noop):
        self.fn, self.plain = fn, plain

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def __reduce__(self):
        return (self.plain, ())


def plain_no_sync(fn) -> PicklesAsNoop:
    """`model.no_sync`: pickled, becomes a context manager that does nothing."""
    return PicklesAsNoop(fn, _make_nullcontext)
