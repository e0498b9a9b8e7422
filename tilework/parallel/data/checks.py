"""Checks on what each rank feeds the model, agreed by every rank before any update is applied.

A rank that feeds bad input must not quietly poison the others: a NaN gradient all-reduced is a
NaN on every rank, and batches of different sizes make the averaged gradient weigh samples
unequally (it no longer equals one process's). Per rank, during the step:

- ids are range-checked before a lookup (the parameter server's pull, or nn.Embedding),
  and fail at once, naming the table and the rank;
- a scalar model output (the loss) and every gradient are checked for NaN/inf as they appear,
  before their all-reduce leaves;
- the leading dimension of every tensor the model is called with is recorded.

At the optimizer step every rank knows whether any rank had a non-finite value and whether all
ranks' batch dimensions agree. Normally that rides the step's last all-reduce bucket
(parallel/data/dense.py): `wire.CHECK_WORDS` numbers, a flag and 8 small digests of the batch
dimensions with their squares, summed over ranks (n * sum(d^2) == sum(d)^2 exactly when every rank's
d is the same; digests stay under sqrt(2^24 / n), so float32 sums are exact). Where nothing was
carried (no dense float bucket, or forwards since the last synchronised backward) the ranks exchange
16 bytes instead (`wire.input_check_bytes`). If anything is off, every rank learns the same thing
from the same numbers and raises the same `InputError` together: nobody is left waiting in a
collective, and no parameter moves. Only then is the detail gathered, to name ranks and tensors.

On a tensor-parallel mesh each dp group agrees on its own, and then the verdict crosses the tp
group (a 16-byte all-reduce per step, counted as "check"): one shard's NaN gradient is seen
only by its own dp group, and the other groups must drop the step with it.
"""

from __future__ import annotations

import hashlib
import math
from fractions import Fraction

import torch
import torch.distributed as dist

from ...comm.counted import Stats, all_gather, all_reduce
from ...comm.wire import CHECK_WORDS
from ...errors import IdOutOfRange, InputError
from ...runtime.hooks import PicklesAsNoop

DIGESTS = (CHECK_WORDS - 1) // 2


def check_ids(table: str, ids: torch.Tensor, rows: int, rank: int) -> None:
    flat = ids.reshape(-1)
    if flat.numel() and (flat.min() < 0 or flat.max() >= rows):
        bad = flat[(flat < 0) | (flat >= rows)][0].item()
        raise IdOutOfRange(f"rank {rank}: {table}: id {bad} is out of range for a table of "
                           f"{rows} rows", ranks=(rank,))


def _batch_dims(args, kwargs) -> tuple:
    tensors = [*args, *kwargs.values()]
    return tuple(t.shape[0] if t.dim() else None for t in tensors if torch.is_tensor(t))


class InputChecks:
    def __init__(self, groups, stats: Stats, successor_remote: bool):
        self.groups, self.stats, self.successor_remote = groups, stats, successor_remote
        self.batches: list[tuple] = []     # leading dims of each forward's inputs this step
        self.nonfinite: str | None = None  # the first tensor found with NaN/inf this step
        self.steps = 0
        self.carried: list[float] | None = None  # the summed words of the last synced backward
        self.dirty = False  # something was recorded since those words were taken
        # On a tp mesh: the ranks that hold the other shards of this rank's replica (its tp
        # group). Each dp group agrees on its own; the verdict then crosses this group so that
        # every rank of the world drops the step together (runtime/apply.py sets it).
        self.across = None
        # With uneven batch shares (Plan.batch_shares): this rank's samples a step. Batches are
        # then compared as fractions of each rank's share (a rank accumulating over k
        # microbatches feeds 1/k of it each time, as every other rank does).
        self.share: int | None = None

    def _compared(self, batches: list[tuple]) -> list[tuple]:
        """What the ranks compare: the leading dims, where a rank's own share (over the
        forwards of the step) reads "share", so ranks feeding their own shares agree while
        inputs that do not scale with the batch must still be equal."""
        if self.share is None or not batches:
            return batches
        per = Fraction(self.share, len(batches))
        return [tuple("share" if d == per else d for d in dims) for dims in batches]

    def _misfed(self, batches: list[tuple]) -> str | None:
        """With shares: a forward none of whose inputs has this rank's share of the batch."""
        if self.share is None or not batches:
            return None
        per = Fraction(self.share, len(batches))
        for i, dims in enumerate(batches):
            if not any(d == per for d in dims):
                sizes = ", ".join(str(d) for d in dims if d is not None)
                return (f"its batch_shares entry is {self.share} samples a step ({per} in each of "
                        f"its {len(batches)} forward calls), but forward call {i + 1} had inputs "
                        f"with leading dims {sizes}")
        return None

    def install(self, model, embeddings: dict, changes) -> None:
        """The hooks that feed these checks: the model's inputs and output, and the ids each
        of `embeddings` is asked for."""
        rank = self.groups.rank
        changes.hook("model: forward pre-hook (input checks)", model.register_forward_pre_hook(
            PicklesAsNoop(lambda m, args, kwargs: self.on_forward(args, kwargs)),
            with_kwargs=True))
        changes.hook("model: forward hook (input checks)", model.register_forward_hook(
            PicklesAsNoop(lambda m, args, out: self.on_output(out))))
        for name, module in embeddings.items():
            changes.hook(f"{name}: forward pre-hook (ids in range)",
                         module.register_forward_pre_hook(PicklesAsNoop(
                             lambda m, args, name=name: check_ids(name, args[0],
                                                                  m.num_embeddings, rank))))

    # -- during the step (local) ---------------------------------------------------------------
    def on_forward(self, args, kwargs) -> None:
        if torch.is_grad_enabled():  # evaluation forwards may legitimately differ per rank
            self.batches.append(_batch_dims(args, kwargs))
            self.dirty = True

    def on_output(self, output) -> None:
        # Under no_grad (evaluation) nothing trains on it, and only some ranks may evaluate.
        if (self.nonfinite is None and torch.is_grad_enabled() and torch.is_tensor(output)
                and output.dim() == 0
                and output.is_floating_point() and not torch.isfinite(output)):
            self.nonfinite = f"the loss the model returned ({output.item()})"
            self.dirty = True

    def on_tables(self, tables) -> None:
        """The gradient rows each server table (parallel/rows/sparse.py's PSTable) holds on this
        rank."""
        for table in tables:
            self.on_gradients([(table.name, g) for g in table.gradients()])

    def on_gradients(self, named: list[tuple[str, torch.Tensor]], flat: torch.Tensor | None = None):
        """`named` gradients (or their concatenation `flat`, checked in one pass first)."""
        if self.nonfinite is not None:
            return
        # One pass, no mask: a sum is finite only if every term is (inf - inf is NaN). A finite
        # tensor whose sum overflows falls through to the exact per-tensor check.
        if flat is not None and bool(torch.isfinite(flat.sum())):
            return
        for name, g in named:
            if g is not None and g.is_sparse:
                g = g.coalesce().values()
            if g is not None and not bool(torch.isfinite(g).all()):
                self.nonfinite = f"the gradient of {name}"
                self.dirty = True
                return

    # -- carried by the last all-reduce bucket -------------------------------------------------
    def words(self, device: torch.device) -> torch.Tensor:
        """This rank's CHECK_WORDS numbers for what it recorded so far this step, on `device`
        (the bucket's that carries them)."""
        limit = max(2, math.isqrt((2**24 - 1) // self.groups.world_size))
        raw = hashlib.blake2b(repr(self._compared(self.batches)).encode(),
                              digest_size=4 * DIGESTS).digest()
        digests = [1 + int.from_bytes(raw[4 * k:4 * k + 4], "little") % (limit - 1)
                   for k in range(DIGESTS)]
        words = [float(self.nonfinite is not None or self._misfed(self.batches) is not None)]
        for d in digests:
            words += [float(d), float(d * d)]
        self.dirty = False
        return torch.tensor(words, dtype=torch.float64, device=device)

    def settle(self, summed: torch.Tensor) -> None:
        self.carried = summed.tolist()

    # -- at the step (collective) --------------------------------------------------------------
    def agree(self) -> None:
        """Every rank calls this at the step; raises an InputError on every rank together."""
        self.steps += 1
        step = self.steps  # counted from 1 since parallelize
        batches, nonfinite = self.batches, self.nonfinite
        self.batches, self.nonfinite = [], None
        misfed = self._misfed(batches)
        batches = self._compared(batches)
        carried, dirty = self.carried, self.dirty
        self.carried, self.dirty = None, False
        if self.groups.world_size == 1:
            bad_values, uneven = nonfinite is not None or misfed is not None, False
        elif carried is not None and not dirty:
            n = self.groups.world_size
            bad_values = carried[0] > 0
            uneven = any(n * carried[2 + 2 * k] != carried[1 + 2 * k] ** 2 for k in range(DIGESTS))
        else:
            digest = int.from_bytes(hashlib.blake2b(repr(batches).encode(), digest_size=7).digest(),
                                    "little")
            mine = torch.tensor([int(nonfinite is not None or misfed is not None), digest],
                                dtype=torch.int64,
                                device=self.groups.device)
            everyone = torch.stack(all_gather(mine, self.groups.world, self.stats, "check",
                                              self.successor_remote))
            bad_values = bool(everyone[:, 0].any())
            uneven = bool((everyone[:, 1] != everyone[0, 1]).any())
        if self.across is not None:
            # One shard's inf must drop the step in every replica part, not in its dp group only.
            flags = torch.tensor([int(bad_values), int(uneven)], dtype=torch.int64,
                                 device=self.groups.device)
            all_reduce(flags, self.across, self.stats, "check", op=dist.ReduceOp.MAX)
            bad_values, uneven = bool(flags[0]), bool(flags[1])
        if not (bad_values or uneven):
            return
        error = self._explain(step, nonfinite, batches, bad_values, misfed)
        if self.across is not None:
            error = _shared(error, self.across)
        raise error

    def _explain(self, step: int, nonfinite, batches, bad_values: bool,
                 misfed: str | None = None) -> InputError | None:
        """What this dp group saw go wrong (None: it was another tp shard's group). Rare:
        everyone is here, so the detail can travel as objects."""
        details: list = [(nonfinite, batches, misfed)]
        if self.groups.world_size > 1:
            details = [None] * self.groups.world_size
            dist.all_gather_object(details, (nonfinite, batches, misfed),
                                   group=self.groups.world)
        culprits = tuple(self._global(r) for r, (what, _, _) in enumerate(details) if what)
        if bad_values and culprits:
            first = next(what for what, _, _ in details if what)
            return InputError(f"step {step}: rank {culprits[0]}: {first} has NaN or inf "
                              f"values (ranks at fault: {', '.join(map(str, culprits))}); "
                              "nothing was updated", ranks=culprits)
        misfed_by = tuple(self._global(r) for r, (_, _, m) in enumerate(details) if m)
        if bad_values and misfed_by:
            first = next(m for _, _, m in details if m)
            return InputError(f"step {step}: rank {misfed_by[0]}: {first}; its gradient would "
                              "be weighted by its share, so nothing was updated (ranks at "
                              f"fault: {', '.join(map(str, misfed_by))})", ranks=misfed_by)
        shapes = [b for _, b, _ in details]
        if not bad_values and any(b != shapes[0] for b in shapes):
            return _uneven(step, shapes, self._global)
        return None

    def _global(self, r: int) -> int:
        """Rank `r` of the dp group as the world numbers it (the same without a mesh)."""
        group = self.groups.world
        if group is None:   # a dp group of one rank (a tp mesh at dp = 1): this rank
            return dist.get_rank() if dist.is_initialized() else r
        return dist.get_global_rank(group, r)


def _shared(error: InputError | None, across) -> InputError:
    """The first tp rank's explanation, raised alike on every tp rank: only the dp group that
    saw the fault can name it."""
    mine = None if error is None else (str(error), tuple(error.ranks))
    theirs: list = [None] * dist.get_world_size(across)
    dist.all_gather_object(theirs, mine, group=across)
    message, ranks = next(t for t in theirs if t is not None)
    return InputError(message, ranks=ranks)


def _uneven(step: int, batches: list[list[tuple]], named=lambda r: r) -> InputError:
    """`batches[r]`: rank r's (of the dp group; `named(r)` the world's number for it)."""
    # The ranks at fault are those that differ from the most common batch shape.
    reference = max(batches, key=batches.count)
    ref_rank = batches.index(reference)
    odd = tuple(r for r, b in enumerate(batches) if b != reference)
    r = odd[0]
    theirs = batches[r]
    if len(theirs) != len(reference):
        what = (f"rank {named(r)} called the model {len(theirs)} times since the last step, "
                f"rank {named(ref_rank)} {len(reference)} times")
    else:
        call = next(i for i, (a, b) in enumerate(zip(reference, theirs)) if a != b)
        arg = next((j for j, (x, y) in enumerate(zip(reference[call], theirs[call])) if x != y),
                   min(len(reference[call]), len(theirs[call])))
        size = theirs[call][arg] if arg < len(theirs[call]) else "no"
        want = reference[call][arg] if arg < len(reference[call]) else "no"
        what = (f"model input {arg} has a batch of {size} on rank {named(r)} but {want} on "
                f"rank {named(ref_rank)}"
                + (f" (forward call {call + 1} of the step)" if len(reference) > 1 else ""))
    if any(d == "share" for call in reference for d in call):
        what += " (\"share\": that rank's batch_shares entry)"
    return InputError(f"step {step}: batches differ across ranks: {what}; with a mean over "
                      "ranks they would weigh samples unequally, so nothing was updated "
                      "(parallelize(check_inputs=False) allows it)",
                      ranks=tuple(named(o) for o in odd))
