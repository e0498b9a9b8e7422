"""Hooks that pickle as no-ops, so `torch.save(model)` of a parallelized model writes a plain
model: the hooks close over process groups and the engine, which cannot be pickled and mean
nothing in another process."""

from __future__ import annotations

import contextlib
import weakref


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


class _WhileAlive:
    """Calls a bound method while its object lives (then nothing)."""

    def __init__(self, method):
        self.method = weakref.WeakMethod(method)

    def __call__(self, *args, **kwargs):
        method = self.method()
        return None if method is None else method(*args, **kwargs)


def post_accumulate_grad_hook(method) -> PicklesAsNoop:
    """A parameter's post-accumulate-grad hook calling `method` (a bound method of an object
    the model keeps alive: the engine, its buckets), holding its object weakly. torch keeps
    these hooks in the tensor's C++ autograd state, where Python's collector cannot see them:
    a strong bound method closes a cycle (parameter -> hook -> engine -> model -> parameter)
    that is never collected, so every parallelized model a program dropped stayed alive, its
    buffers, hooks and guard thread with it (ten parallelize calls in one process: ten
    threads polling the store, the step 20-30% slower)."""
    return PicklesAsNoop(_WhileAlive(method))
