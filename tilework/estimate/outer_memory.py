"""What local SGD's outer sync holds in memory (parallel/data/outer.LocalSGD), walked in the order
its runtime allocates and frees, so the memory estimate counts a sync as it runs.

Two figures beside the outer state (the anchors, their momentum, error feedback):

- `in_flight`: what a sync keeps between optimizer steps when its exchange travels beside them
  (Streaming DiLoCo's delay, DreamDDP's layer-wise groups): held through the next steps'
  forward and backward, so it is state-like.
- `transient`: the largest excess over that at a sync itself, inside `optimizer.step()` (the
  user's update done, the gradients still held): every bucket's exchange is launched before
  any is waited on, so each launched bucket holds its wire while the next is encoded, and
  the averages of every bucket are held together when the outer step lands.

The codec's temporaries are measured (tests/estimate/test_outer_memory.py holds them against
MemTracker): bytes per encoded element beyond the input and the output.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..comm.codec import encoded_bytes, multiple_of

# comm/codec.py: encode's one float temporary (and the scales); decode's copy of a strided
# payload's values (rows > 1).
ENCODE_TEMPS = {"bf16": 0.0, "int8": 4.0625, "int4": 4.5625}
DECODE_TEMPS = {"bf16": 0.0, "int8": 1.0625, "int4": 1.0625}


@dataclass(frozen=True)
class OuterMemory:
    in_flight: int
    transient: int


@dataclass(frozen=True)
class _Bucket:
    padded: int        # elements, padded to equal slices (and blocked parts, compressed)
    item: int          # bytes of an element of the flat pseudo-gradient
    params: tuple[int, ...]   # each member's bytes
    cast: int = 0      # members' bytes whose dtype is not the flat's: copied at the landing


def _dense(plan) -> list:
    """What LocalSGD averages: every whole all-reduced parameter (ZeRO 1 and 2 too)."""
    return [p for p in plan.of("allreduce") if p.zero < 3]


def outer_workers(plan) -> tuple[int, int]:
    """(workers, ranks per worker) of the plan's outer sync."""
    outer = plan.outer
    hosts = plan.mesh.size_of("host") if "host" in plan.mesh.names else 1
    workers = hosts if outer.worker == "host" else plan.world_size
    return workers, plan.world_size // workers


def _syncs(plan) -> list[list[_Bucket]]:
    """Each sync's buckets (a fragment's, a layer-wise group's), cut as LocalSGD cuts them."""
    from ..plans.plan import dtype_bytes, outer_buckets

    outer, dense = plan.outer, _dense(plan)
    workers, per_worker = outer_workers(plan)
    unit = per_worker * (1 if outer.compress == "none" else workers * multiple_of(outer.compress))
    out = []
    for sync in outer_buckets([p.nbytes for p in dense], outer, plan.bucket_bytes):
        buckets = []
        for b in sync:
            members = [dense[i] for i in b]
            numel = sum(p.numel for p in members)
            dtypes = {p.dtype for p in members}
            # As LocalSGD._pseudo_gradient allocates it: float32 where encoded, else the
            # members' promoted dtype (bf16 with fp16 is float32).
            flat = "float32" if outer.compress != "none" else str(functools.reduce(
                torch.promote_types, [getattr(torch, d) for d in sorted(dtypes)])).split(".")[-1]
            buckets.append(_Bucket(-(-numel // unit) * unit, dtype_bytes(flat),
                                   tuple(p.nbytes for p in members),
                                   sum(p.nbytes for p in members if p.dtype != flat)))
        out.append(buckets)
    return out


def _walk(buckets: list[_Bucket], codec: str, workers: int, per_worker: int,
          step_copy: int, crosses: bool) -> tuple[int, list[int]]:
    """(peak, held after each stage) of one sync's exchange: a stage is what one advance of
    every bucket's generator runs (LocalSGD._exchange, between its yields), the last entry
    what is held once all have finished, until the landing. `step_copy`: what the outer
    optimizer's step allocates at the landing; `crosses`: the exchange outlives its step."""
    held = peak = 0
    crossings = []
    enc, dec = ENCODE_TEMPS.get(codec, 0.0), DECODE_TEMPS.get(codec, 0.0)

    def at(extra: float) -> None:
        nonlocal peak
        peak = max(peak, int(held + extra))

    slices = [b.padded // per_worker for b in buckets]
    if crosses and codec != "none":   # what the error feedback owed at the launch, kept for a
        held += sum(4 * (s + s // workers) for s in slices)   # checkpoint taken in flight
    # Launch: the pseudo-gradient (and the slice this rank carries, cloned out of it).
    for b, s in zip(buckets, slices):
        at(b.padded * b.item + (s * b.item if per_worker > 1 else 0))
        if codec == "none":
            held += s * b.item                       # all-reduced in place
            continue
        wire = workers * encoded_bytes(s // workers, codec)
        at(4 * s + enc * s + wire)                   # the slice with its error, encoded
        at(4 * s + wire + dec * s + 4 * s)           # decoded again for the error feedback
        at(3 * wire)                                 # sent, the all-to-all's copy, received
        held += 2 * wire
    crossings.append(held)
    if codec != "none":
        # Each owner averages its part and sends the average to all: received, decoded.
        for s in slices:
            wire, part = workers * encoded_bytes(s // workers, codec), s // workers
            reply = encoded_bytes(part, codec)
            at(wire)
            at(-wire + 4 * s + dec * s)
            held += -2 * wire + 4 * part
            at(enc * part + reply + dec * part + 4 * part)
            held += -4 * part + wire + reply
        crossings.append(held)
        for s in slices:   # every part's average, decoded: this rank's slice
            wire = workers * encoded_bytes(s // workers, codec)
            at(4 * s + dec * s)
            held += 4 * s - wire - encoded_bytes(s // workers, codec)
    back = 4 if codec != "none" else None
    if per_worker > 1:   # the worker's slices put back together, launched in the same stage
        for b, s in zip(buckets, slices):
            item = back or b.item
            at(b.padded * item)
            held += b.padded * item
        crossings.append(held)
        for b, s in zip(buckets, slices):   # waited on: the slice sent is let go
            held -= s * (back or b.item)
    crossings.append(held)   # finished: every average held until the landing
    # The landing: every bucket's average (its gradient for the anchors, in the parameter's
    # dtype), and the outer optimizer's step.
    at(sum(b.cast for b in buckets) + step_copy)
    return peak, crossings


def outer_sync_memory(plan, device: str = "cpu") -> OuterMemory:
    """`OuterMemory` of `plan`'s outer sync on a rank stepping on `device` (a device type)."""
    outer = plan.outer
    if outer is None or not _dense(plan):
        return OuterMemory(0, 0)
    workers, per_worker = outer_workers(plan)
    nesterov = outer.optimizer == "nesterov" and outer.momentum > 0
    peaks, flights = [], []
    for buckets in _syncs(plan):
        members = [n for b in buckets for n in b.params]
        # torch's SGD: Nesterov's `grad.add(buf)` is a copy, one tensor at a time on CPU
        # (single-tensor), every tensor's at once where foreach is the default.
        step_copy = 0 if not nesterov else sum(members) if device != "cpu" else max(members)
        # A delay of tau steps carries the exchange across tau step ends; a layer-wise group
        # across one. After k step ends it has advanced k stages, or finished and holds its
        # averages.
        ends = 1 if outer.schedule == "layerwise" else outer.delay
        peak, crossings = _walk(buckets, outer.compress, workers, per_worker, step_copy,
                                ends > 0)
        peaks.append(peak)
        held = crossings + [crossings[-1]] * max(0, ends - len(crossings))
        flights.append(max(held[:ends], default=0))
    in_flight = max(flights)
    return OuterMemory(in_flight, max(0, max(peaks) - in_flight))


def outer_state_bytes(plan) -> int:
    """What local SGD keeps on every rank beside the model (parallel/data/outer.LocalSGD): the
    last sync's parameters (the outer optimizer's), their momentum where it has one, each
    rank's error feedback of its slice and its part (compressed: float32), under the
    layer-wise schedule the largest group's parameters as they were at its launch, and an
    exchange in flight between steps (`outer_sync_memory`)."""
    from ..plans.plan import outer_groups

    outer = plan.outer
    dense = _dense(plan)
    if outer is None or not dense:
        return 0
    nbytes = [p.nbytes for p in dense]
    out = sum(nbytes) * (2 if outer.momentum > 0 else 1)
    if outer.compress != "none":   # each bucket's, padded as it is cut
        workers, per_worker = outer_workers(plan)
        slices = [b.padded // per_worker for sync in _syncs(plan) for b in sync]
        out += sum(4 * (s + s // workers) for s in slices)
    if outer.schedule == "layerwise":
        out += max(sum(nbytes[i] for i in g) for g in outer_groups(nbytes, outer))
    return out + outer_sync_memory(plan).in_flight


__all__ = ["OuterMemory", "outer_state_bytes", "outer_sync_memory", "outer_workers"]
