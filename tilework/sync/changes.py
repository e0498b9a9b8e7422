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

    def listing(self) -> list[str]:
        return [what for what, _ in self._done]

    def undo(self) -> None:
        """Newest first, so each undo finds the state its change left."""
        while self._done:
            _, undo = self._done.pop()
            undo()
