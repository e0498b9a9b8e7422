"""Every change `parallelize` makes to the user's model and optimizer, in one list, each with
its undo: what `tilework.unparallelize` walks back, and what `Engine.changes` shows a reader
who wants to know what was done to their objects."""

from __future__ import annotations

from typing import Any, Callable

_MISSING = object()


class Changes:
    def __init__(self):
        self._done: list[tuple[str, Callable[[], None]]] = []

    def record(self, what: str, undo: Callable[[], None]) -> None:
        self._done.append((what, undo))

    def hook(self, what: str, handle) -> None:
        """A hook registered on the user's object: undone by removing it."""
        self.record(what, handle.remove)

    def set_attribute(self, obj: Any, name: str, value: Any, what: str) -> None:
        """Set `obj.name` (an instance attribute), undone by restoring what was there."""
        before = obj.__dict__.get(name, _MISSING)
        setattr(obj, name, value)

        def undo():
            if before is _MISSING:
                obj.__dict__.pop(name, None)
            else:
                setattr(obj, name, before)

        self.record(what, undo)

    def extend_zero_grad(self, obj: Any, first, what: str) -> None:
        """`obj.zero_grad` (a model's or an optimizer's) calls `first()` before its own: the
        gradients tilework keeps where the user's zero_grad cannot reach them go too."""
        own = obj.zero_grad

        def zero_grad(set_to_none: bool = True):
            first()
            own(set_to_none=set_to_none)

        self.set_attribute(obj, "zero_grad", zero_grad, what)

    def listing(self) -> list[str]:
        return [what for what, _ in self._done]

    def undo(self) -> None:
        """Newest first, so each undo finds the state its change left."""
        while self._done:
            _, undo = self._done.pop()
            undo()


def replace_module(changes: Changes, model, param_name: str, replacement, original) -> None:
    """A table's module gives way to its server stand-in; the original keeps its Parameter
    (for the optimizer on undo) but not its rows, which the shards now hold."""
    path = param_name.rsplit(".", 1)[0]
    parent_path, _, child = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(parent, child, replacement)
    weight = original.weight
    shape = weight.shape
    weight.data = weight.data.new_empty(0)

    def undo():
        weight.data = weight.data.new_empty(shape)   # filled by unparallelize's load
        setattr(parent, child, original)

    changes.record(f"{path}: replaced by a ShardedEmbedding (rows on the servers)", undo)


def release_values(changes: Changes, params: list, what: str) -> None:
    """Parameters no module of this rank computes with any more (a tp-split module's whole
    weight, another pipeline rank's blocks) keep their objects, for the optimizer's and the
    module's undo, but not their values: an empty tensor each, so a rank holds what its plan
    says (the memory estimate's figure), not the whole model beside its part. Undone with
    uninitialised values of the old shape, which unparallelize's load fills."""
    shapes = [(p, p.shape) for p in params]
    for p in params:
        p.released_shape = p.shape   # what a shape-only forward gives it (generic.py's probe)
        p.data = p.data.new_empty(0)

    def undo():
        for p, shape in shapes:
            p.data = p.data.new_empty(shape)
            del p.released_shape

    changes.record(what, undo)


def leave_optimizer(changes: Changes, optimizer, named: dict) -> None:
    """The optimizer no longer owns what the servers update (nor keeps its state alive)."""
    gone = {id(p) for p in named.values()}
    before = [list(group["params"]) for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) not in gone]

    def undo():
        for group, params in zip(optimizer.param_groups, before):
            group["params"] = params

    changes.record(f"optimizer: {', '.join(sorted(named))} left its param groups", undo)
    for p in list(optimizer.state):
        if id(p) in gone:
            del optimizer.state[p]
