"""The next batch's ids routed during this step (`tilework.prefetch`): a pull then meets the
other ranks once (rows), not twice (ids, then rows).

`prefetch(loader, model)` reads the loader one batch ahead and tells the engine which batch is
being trained on and which comes next. A lookup whose ids are (a view of) a tensor of the current
batch is keyed by where they sit in it: the tensor's path in the batch and, for a view, its
geometry (a whole tensor is keyed by its path alone: multi-hot bags change length every batch).
The pull that serves it carries, in its rows exchange, the same view of the next batch: its
unique ids sorted to their owners, in an id block like the one the next pull would have sent
(parallel/rows/exchange.py). Each rank keeps what it sent and what arrived as an `Entry`, and the
next step's lookup with the same key is served from it: the owners read its rows at that pull, after
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

from ...errors import PlanError


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


def _strided(t: torch.Tensor) -> bool:
    return t.layout == torch.strided and not t.is_nested


def _extent(t: torch.Tensor) -> int:
    """One past the last storage element `t` reads, from its storage offset."""
    return t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1


class Ahead:
    """The engine's view of the loop's batches and the entries routed for the next one.
    A key leads with the batch index it was made in: a lookup pulled after the loop moved on
    is not the next batch's."""

    def __init__(self):
        self.index = -1
        self.current = self.next = None
        self.reading = False               # a prefetch generator is running
        self._by_identity: dict[int, tuple] = {}
        self._by_storage: dict[tuple, tuple[tuple, torch.Tensor]] = {}
        self.entries: dict[tuple, Entry] = {}

    @property
    def active(self) -> bool:
        return self.current is not None

    def advance(self, current, following) -> None:
        """The loop moves to `current`; `following` (or None at the end) comes after it."""
        self.index += 1
        self.current, self.next = current, following
        self._by_identity, self._by_storage = {}, {}
        for path, t in leaves(current) if current is not None else ():
            if not _strided(t):   # sparse or nested: no storage to find ids in
                continue
            self._by_identity.setdefault(id(t), path)
            if t.numel():   # every empty tensor may share one null storage
                self._by_storage.setdefault(_storage(t), (path, t))
        self.entries = {k: e for k, e in self.entries.items() if e.index == self.index}

    def key_of(self, ids: torch.Tensor) -> tuple | None:
        """Where `ids` sit in the current batch (path and view geometry), or None."""
        if not self.active or torch.compiler.is_compiling() or torch.jit.is_tracing() \
                or not _strided(ids):
            return None
        if id(ids) in self._by_identity:
            # the whole tensor: the next one's, whatever its shape (bags vary in length)
            return (self.index, self._by_identity[id(ids)])
        found = self._by_storage.get(_storage(ids)) if ids.numel() else None
        if found is None:
            return None
        path, leaf = found
        if ids.storage_offset() < leaf.storage_offset() or _extent(ids) > _extent(leaf):
            return None   # on the leaf's storage but outside it
        if (ids.shape == leaf.shape and ids.stride() == leaf.stride()
                and ids.storage_offset() == leaf.storage_offset()):
            return (self.index, path)   # a view of all of it: whole, as above
        return (self.index, path, tuple(leaf.shape), leaf.stride(), tuple(ids.shape),
                ids.stride(), ids.storage_offset() - leaf.storage_offset())

    def next_ids(self, key: tuple | None) -> torch.Tensor | None:
        """The same view of the next batch, or None where it has none like it."""
        if key is None or self.next is None or key[0] != self.index:
            return None
        try:
            leaf = _at(self.next, key[1])
        except (KeyError, IndexError, TypeError):
            return None
        if not torch.is_tensor(leaf) or not _strided(leaf):
            return None
        if len(key) == 2:
            return leaf
        _, _, shape, stride, size, view_stride, offset = key
        if tuple(leaf.shape) != shape or leaf.stride() != stride:
            return None
        return leaf.as_strided(size, view_stride, leaf.storage_offset() + offset)

    def take(self, table: str, key: tuple | None, ids: torch.Tensor) -> Entry | None:
        """The entry routed for this lookup, if any (used once). Every rank has the same
        entries, so a lookup that misses its table's entry would leave its rank alone in
        another exchange: refused here, on the rank that sees it."""
        if key is None or key[0] != self.index:
            return None
        where = "batch" + "".join(f"[{p!r}]" for p in key[1])
        entry = self.entries.pop((table, key[1:]), None)
        if entry is None:
            if any(name == table for name, _ in self.entries):
                raise PlanError(f"{table}: looked up with ids at {where}, not where "
                                "tilework.prefetch routed them ahead from the batch before "
                                "(a view here, a copy there?); index the batch the same way "
                                "every step, or leave tilework.prefetch out")
            return None
        if not torch.equal(entry.ids, ids.to(entry.ids.dtype)):
            raise PlanError(f"{table}: the ids looked up differ from those tilework.prefetch "
                            f"read ahead at {where}: the batch was changed in place after the "
                            "loader gave it; change a copy, or leave tilework.prefetch out")
        return entry

    def keep(self, table: str, key: tuple, entry: Entry) -> None:
        self.entries[(table, key[1:])] = entry


def prefetch(loader: Iterable, model) -> Iterator:
    """The loader's batches, one read ahead so that the next batch's ids are routed during
    this step (see the module docstring). Every rank's loader must give the same number of
    batches, as for any data-parallel loop; a batch must not be changed in place once given."""
    engine = getattr(model, "_tilework_engine", None)
    if engine is None:
        raise PlanError("tilework.prefetch(loader, model): the model was not parallelized by "
                        "tilework.parallelize")
    ahead = getattr(getattr(engine, "lookups", None), "ahead", None)
    if ahead is None:    # no server tables here (a mesh): nothing to route ahead
        return iter(loader)
    if ahead.reading:
        raise PlanError("tilework.prefetch: this model's batches are already read through "
                        "another tilework.prefetch (an evaluation loop inside the training "
                        "loop?); read the inner loader directly")
    return _read_ahead(iter(loader), ahead)


def _read_ahead(batches: Iterator, ahead: Ahead) -> Iterator:
    end = object()
    ahead.reading = True
    try:
        current = next(batches, end)
        while current is not end:
            following = next(batches, end)
            ahead.advance(current, None if following is end else following)
            yield current
            current = following
    finally:
        ahead.advance(None, None)
        ahead.reading = False
