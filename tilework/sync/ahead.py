"""The next batch's ids routed during this step (`tilework.prefetch`): a pull then meets the
other ranks once (rows), not twice (ids, then rows).

`prefetch(loader, model)` reads the loader one batch ahead and tells the engine which batch is
being trained on and which comes next. A lookup whose ids are (a view of) a tensor of the current
batch is keyed by where they sit in it: the tensor's path in the batch and, for a view, its
geometry (a whole tensor is keyed by its path alone: multi-hot bags change length every batch).
The pull that serves it carries, in its rows exchange, the same view of the next batch: its
unique ids sorted to their owners, in an id block like the one the next pull would have sent
(sync/exchange.py). Each rank keeps what it sent and what arrived as an `Entry`, and the next
step's lookup with the same key is served from it: the owners read its rows at that pull, after
this step's update, so the result is what one process computes.

Whether an entry exists must be the same on every rank, since it decides what the next pull
sends. A rank that has nothing to send for a key (no next batch, a view the next batch cannot
give, an id out of range) says so in the block's counts (-1), every rank reads every sender's
counts, and the entry is kept only where all ranks sent ids. A lookup served from an entry whose
ids differ from what it looks up now (the batch was changed in place after it was read) is an
error, not a silent fallback: the other ranks already rely on the entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from ..errors import PlanError


@dataclass
class Entry:
    """One lookup of the next batch, routed: its unique ids sorted to their owners, and what
    every peer sent this rank as their owner."""

    index: int                           # the batch it was routed for
    ids: torch.Tensor                    # this rank's unique ids (head rows left out)
    order: torch.Tensor                  # how they were sorted by owner
    per_peer: list[int]                  # how many went to each peer
    arrived: list[torch.Tensor]          # the ids each peer asked this rank for


def leaves(batch, path: tuple = ()) -> Iterator[tuple[tuple, torch.Tensor]]:
    """(path, tensor) for every tensor in a batch of nested dicts, lists and tuples."""
    if torch.is_tensor(batch):
        yield path, batch
    elif isinstance(batch, dict):
        for k, v in batch.items():
            yield from leaves(v, (*path, k))
    elif isinstance(batch, (list, tuple)):
        for i, v in enumerate(batch):
            yield from leaves(v, (*path, i))


def _at(batch, path: tuple):
    for step in path:
        batch = batch[step]
    return batch


def _storage(t: torch.Tensor) -> tuple:
    return (t.device, t.untyped_storage().data_ptr())


class Ahead:
    """The engine's view of the loop's batches and the entries routed for the next one."""

    def __init__(self):
        self.index = -1
        self.current = self.next = None
        self._by_storage: dict[tuple, tuple[tuple, torch.Tensor]] = {}
        self.entries: dict[tuple, Entry] = {}

    @property
    def active(self) -> bool:
        return self.current is not None

    def advance(self, current, following) -> None:
        """The loop moves to `current`; `following` (or None at the end) comes after it."""
        self.index += 1
        self.current, self.next = current, following
        self._by_storage = {}
        if current is not None:
            for path, t in leaves(current):
                self._by_storage.setdefault(_storage(t), (path, t))
        self.entries = {k: e for k, e in self.entries.items() if e.index == self.index}

    def key_of(self, ids: torch.Tensor) -> tuple | None:
        """Where `ids` sit in the current batch (path and view geometry), or None."""
        if not self.active or torch.compiler.is_compiling():
            return None
        found = self._by_storage.get(_storage(ids))
        if found is None:
            return None
        path, leaf = found
        if (ids.shape == leaf.shape and ids.stride() == leaf.stride()
                and ids.storage_offset() == leaf.storage_offset()):
            return (path,)   # the whole tensor: the next one's, whatever its shape (bags vary)
        return (path, tuple(leaf.shape), leaf.stride(), tuple(ids.shape), ids.stride(),
                ids.storage_offset() - leaf.storage_offset())

    def next_ids(self, key: tuple | None) -> torch.Tensor | None:
        """The same view of the next batch, or None where it has none like it."""
        if key is None or self.next is None:
            return None
        try:
            leaf = _at(self.next, key[0])
        except (KeyError, IndexError, TypeError):
            return None
        if not torch.is_tensor(leaf):
            return None
        if len(key) == 1:
            return leaf
        _, shape, stride, size, view_stride, offset = key
        if tuple(leaf.shape) != shape or leaf.stride() != stride:
            return None
        return leaf.as_strided(size, view_stride, leaf.storage_offset() + offset)

    def take(self, table: str, key: tuple | None, ids: torch.Tensor) -> Entry | None:
        """The entry routed for this lookup, if any (used once)."""
        if key is None:
            return None
        entry = self.entries.pop((table, key), None)
        if entry is not None and not torch.equal(entry.ids, ids.to(entry.ids.dtype)):
            raise PlanError(f"{table}: the ids looked up differ from those tilework.prefetch "
                            f"read ahead at batch{''.join(f'[{p!r}]' for p in key[0])}: the "
                            "batch was changed in place after the loader gave it; change a "
                            "copy, or leave tilework.prefetch out")
        return entry

    def keep(self, table: str, key: tuple, entry: Entry) -> None:
        self.entries[(table, key)] = entry


def prefetch(loader: Iterable, model) -> Iterator:
    """The loader's batches, one read ahead so that the next batch's ids are routed during
    this step (see the module docstring). Every rank's loader must give the same number of
    batches, as for any data-parallel loop; a batch must not be changed in place once given."""
    engine = getattr(model, "_tilework_engine", None)
    if engine is None:
        raise PlanError("tilework.prefetch(loader, model): the model was not parallelized by "
                        "tilework.parallelize")
    lookups = getattr(engine, "lookups", None)
    ahead = getattr(lookups, "ahead", None)
    if ahead is None:    # no server tables here (a mesh): nothing to route ahead
        yield from loader
        return
    end = object()
    batches = iter(loader)
    current = next(batches, end)
    try:
        while current is not end:
            following = next(batches, end)
            ahead.advance(current, None if following is end else following)
            yield current
            current = following
    finally:
        ahead.advance(None, None)
