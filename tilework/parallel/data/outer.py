"""Local SGD as DiLoCo does it (Douillard et al. 2023): the dense parameters are averaged every
H steps instead of their gradients every step.

A worker is a rank, or a host (`outer_worker="host"`: its ranks all-reduce their gradients every
step over the host's fast link, as DDP, so they hold one replica; only the outer sync crosses
hosts, the usual deployment). Between syncs each worker runs the user's optimizer on its own
batches (the inner steps: nothing crosses hosts for these parameters). At every H-th
`optimizer.step()` the workers average their pseudo-gradients, the parameters at the last sync
minus their own now, in buckets; the outer optimizer (torch's SGD, with Nesterov momentum for
DiLoCo) steps the last sync's parameters with that average as their gradient; every rank copies
the result into its model. With H = 1, SGD inside and an outer SGD of lr 1 without momentum this
is synchronous training: the average of (theta - theta_r) is lr times the average gradient.

The wire. A worker of L ranks splits each bucket into L slices, and rank l carries slice l
across: the cross-host bytes of a host are one copy of the model, spread over its ranks, and an
all-gather inside the host puts the average back together. Uncompressed, a slice is all-reduced
across the workers. Compressed (`outer_compress`: bf16, int8, int4; comm/codec.py), it is cut in
one part per worker: every worker sends each part's owner its encoding (an all-to-all), the
owner decodes, averages, encodes the average and sends it to all (an all-gather), which is a
ring all-reduce at the encoding's width. Both encodings keep error feedback, as 1-bit Adam
does: a worker adds what its last encoding lost to its next pseudo-gradient, and an owner what
its last average lost to its next average. The bytes are the plan's, exactly
(`estimate.cost.outer_sync_bytes`).

The averaged pseudo-gradient is the same on every rank, so a non-finite one (a worker that
diverged; a non-finite value makes its whole block non-finite through any encoding) is seen by
all of them at once, and all refuse the outer step together, naming the parameter.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ...comm.codec import decode, encode, multiple_of
from ...comm.counted import Stats, all_gather, all_gather_async, all_reduce_async, all_to_all_v
from ...errors import InputError, PlanError
from ...plans.plan import OuterSync, outer_buckets, sync_slots


@dataclass(frozen=True)
class Workers:
    """Who averages with whom in the outer sync, seen from one rank."""

    across: object          # the group of this rank's counterparts in every worker (None: one)
    count: int              # workers (DiLoCo's W)
    within: object          # this worker's ranks (None: a worker is one rank)
    size: int               # ranks per worker
    index: int              # this rank's place in its worker: the slice it carries across
    remote: tuple[bool, ...]   # `across` rank j is on another host (for the inter-host count)

    @property
    def me(self) -> int:
        return 0 if self.across is None else dist.get_rank(self.across)


def workers_of(groups, worker: str) -> Workers:
    """The `Workers` of `groups` (comm/groups.Groups) for `outer_worker` "rank" or "host"."""
    topo = groups.topology
    if worker == "rank":
        host = groups.host
        return Workers(groups.world, groups.world_size, None, 1, 0,
                       tuple(topo.host_of(j) != host for j in range(groups.world_size)))
    sizes = {len(h) for h in topo.hosts}
    if len(sizes) > 1:
        raise PlanError(f"outer_worker='host' splits the outer sync evenly over each host's "
                        f"ranks, which needs hosts of one size; these have "
                        f"{[len(h) for h in topo.hosts]} ranks (use outer_worker='rank')")
    across = groups.inter if topo.num_hosts > 1 else None
    return Workers(across, topo.num_hosts, groups.intra if sizes != {1} else None,
                   sizes.pop(), groups.local_rank,
                   tuple(j != groups.host for j in range(topo.num_hosts)))


class _Bucket:
    def __init__(self, params: list[tuple[str, nn.Parameter]], workers: Workers, codec: str):
        self.params = params
        self.numel = sum(p.numel() for _, p in params)
        unit = workers.size * (1 if codec == "none" else workers.count * multiple_of(codec))
        self.padded = -(-self.numel // unit) * unit
        self.slice = self.padded // workers.size          # what this rank carries across
        self.part = self.slice // workers.count           # what it owns, compressed
        # Error feedback (compressed only): what this rank's last encoding of its slice lost,
        # and what its last encoding of its part's average lost. Each rank of a worker carries
        # its own slice, so each keeps its own.
        device = params[0][1].device
        lossy = codec != "none"
        self.error = torch.zeros(self.slice, device=device) if lossy else None
        self.owner_error = torch.zeros(self.part, device=device) if lossy else None
        self.owed = None   # (error, owner_error) as they were when an exchange in flight began


class _Fragment:
    """Parameters synced together (Streaming DiLoCo's fragment; all of them by default): their
    buckets, the inner step of each period at which their exchange starts and the one at which
    the outer step lands (`delay` steps later), and the exchanges in flight."""

    def __init__(self, buckets: list[_Bucket], launch_at: int, apply_at: int):
        self.buckets, self.launch_at, self.apply_at = buckets, launch_at, apply_at
        self.running: dict[int, object] = {}
        self.averaged: dict[int, torch.Tensor] = {}
        self.launched = False   # its exchange started this period, not landed yet
        self.at_launch: dict[str, torch.Tensor] = {}   # layerwise: its parameters then

    @property
    def names(self) -> list[str]:
        return [n for b in self.buckets for n, _ in b.params]

    def advance(self) -> None:
        """One stage of every bucket's exchange: each bucket's is launched before any bucket
        waits on it."""
        for i in list(self.running):
            try:
                next(self.running[i])
            except StopIteration as done:
                self.averaged[i] = done.value
                del self.running[i]


class LocalSGD:
    """The outer loop over `params` ((name, parameter) in registration order) among `workers`.

    Streaming (`outer.fragments` F > 1): the parameters are cut into F fragments of about equal
    bytes in registration order, and fragment f's outer step lands at inner step (f+1) H / F of
    every period of H, so a sync sends 1/F of the model. With `outer.delay` tau > 0 each
    fragment's exchange starts tau steps before its outer step lands and runs beside those
    inner steps; the result is then mixed with what the rank learnt meanwhile:
    theta <- mix * theta + (1 - mix) * outer (Streaming DiLoCo's alpha). Nothing is in flight at
    the end of a period, where checkpoints are taken.

    Layerwise (`outer.schedule`, DreamDDP's partial synchronisation): groups of about equal
    bytes (plans/plan.layerwise_groups), group g's exchange launched after its own inner step
    and landed after the next (plans/plan.sync_slots), so it travels beside that step's
    forward, backward and update; at the landing theta <- outer + (theta - theta_launch): the
    outer step on the parameters as they were at the launch, plus what this rank's step did
    since (DreamDDP averages the parameters before the step and applies the step on top).
    """

    def __init__(self, params: list[tuple[str, nn.Parameter]], workers: Workers,
                 stats: Stats, outer: OuterSync, bucket_bytes: int):
        self.workers, self.stats, self.outer = workers, stats, outer
        self.codec = outer.compress
        self.params = [(n, p) for n, p in params if p.requires_grad]
        self.fragments = []
        cuts = outer_buckets([p.numel() * p.element_size() for _, p in self.params], outer,
                             bucket_bytes)
        for sync, (launch, lands) in zip(cuts, sync_slots(outer, len(cuts))):
            buckets = [_Bucket([self.params[i] for i in b], workers, self.codec) for b in sync]
            self.fragments.append(_Fragment(buckets, launch, lands))
        self.layerwise = outer.schedule == "layerwise"
        self.buckets = [b for f in self.fragments for b in f.buckets]
        self.by_name = dict(self.params)
        # The parameters at the last sync: what the outer optimizer steps.
        self.anchors = {n: nn.Parameter(p.detach().clone(), requires_grad=False)
                        for n, p in self.params}
        self.optimizer = torch.optim.SGD(list(self.anchors.values()), lr=outer.lr,
                                         momentum=outer.momentum,
                                         nesterov=outer.optimizer == "nesterov"
                                         and outer.momentum > 0)
        self.inner_steps = 0   # into the current period of `every`
        # With fragments, a delay or layer-wise groups, ranks' parameters differ even at a
        # period's end.
        self.ranks_differ = len(self.fragments) > 1 or outer.delay > 0 or self.layerwise
        # Called after every landing with the names it wrote (ZeRO's shards follow them).
        self.landed = None

    def after_step(self) -> bool:
        """Called after every `optimizer.step()`: moves the exchanges in flight a stage,
        starts those due, lands those due. Returns whether an outer step landed."""
        self.inner_steps += 1
        landed = False
        try:
            for fragment in self.fragments:
                if fragment.running and fragment.apply_at != self.inner_steps:
                    fragment.advance()
                if fragment.launch_at == self.inner_steps:
                    self._start(fragment)
                if fragment.apply_at == self.inner_steps:
                    self._land(fragment)
                    landed = True
        finally:   # a refused landing still ends the period: the next one starts on time
            if self.inner_steps == self.outer.every:
                self.inner_steps = 0
        return landed

    @torch.no_grad()
    def _start(self, fragment: _Fragment) -> None:
        # What the encodings owed before this exchange: what a checkpoint taken while it is in
        # flight keeps (the exchange itself is not saved; a resume starts it again at landing).
        # Only an exchange that outlives this step can be in flight at a checkpoint.
        crosses = fragment.apply_at != self.inner_steps
        for b in fragment.buckets:
            b.owed = None if b.error is None or not crosses else (b.error.clone(),
                                                                  b.owner_error.clone())
        fragment.launched = True
        if self.layerwise and not fragment.at_launch:   # (restored by a mid-period resume)
            fragment.at_launch = {n: self.by_name[n].detach().clone() for n in fragment.names}
        fragment.running = {i: self._exchange(b, fragment.at_launch)
                            for i, b in enumerate(fragment.buckets)}
        fragment.averaged = {}
        fragment.advance()

    @torch.no_grad()
    def _land(self, fragment: _Fragment) -> None:
        """Wait for the fragment's average, step the outer optimizer on its anchors, start
        every rank from the result (mixed with its own, under a delay)."""
        if not fragment.launched:   # resumed from a checkpoint taken while it was in flight
            self._start(fragment)
        fragment.launched = False
        while fragment.running:
            fragment.advance()
        for i, bucket in enumerate(fragment.buckets):
            offset = 0
            for n, p in bucket.params:
                # A view of this sync's flat average (nothing else holds it), in the anchor's
                # dtype: an encoded average comes back in float32.
                self.anchors[n].grad = fragment.averaged[i][offset:offset + p.numel()].view_as(
                    p).to(p.dtype)
                offset += p.numel()
        fragment.averaged = {}
        for b in fragment.buckets:   # landed: the encodings owe what their buffers say
            b.owed = None
        names = fragment.names
        bad = next((n for n in names if not torch.isfinite(self.anchors[n].grad).all()), None)
        if bad is not None:
            for n in names:
                self.anchors[n].grad = None
            for b in fragment.buckets:   # a refused average owes nothing (and is not finite)
                if b.error is not None:
                    b.error.zero_()
                    b.owner_error.zero_()
            # Nothing was applied: a rank that diverged holds non-finite parameters still.
            at_fault = self._diverged(any(not torch.isfinite(self.anchors[n] - self.by_name[n])
                                          .all() for n in names))
            why = (f"the inner steps of rank(s) {list(at_fault)} diverged" if at_fault
                   else "every rank's own was finite: their sum overflowed")
            raise InputError(f"the averaged pseudo-gradient of {bad} is not finite at the outer "
                             f"step ({why}): nothing was applied", at_fault)
        self.optimizer.step()   # only the fragment's anchors have a gradient
        mix = self.outer.mix if self.outer.delay else 0.0
        for n in names:
            p, anchor = self.by_name[n], self.anchors[n]
            if self.layerwise:   # the outer result plus this rank's step since the launch
                p.sub_(fragment.at_launch.pop(n)).add_(anchor)
            elif mix:
                p.mul_(mix).add_(anchor, alpha=1 - mix)
            else:
                p.copy_(anchor)
            anchor.grad = None
        if self.landed is not None:
            self.landed(names)

    def _diverged(self, mine: bool) -> tuple[int, ...]:
        """The ranks whose own pseudo-gradient was not finite (a collective on the refusal
        path only, where every rank is, since the average is the same everywhere); for host
        workers, the rank that carried each faulty slice across."""
        w = self.workers
        flag = torch.tensor([int(mine)], device=self.buckets[0].params[0][1].device)
        flags = [flag] if w.across is None else all_gather(flag, w.across, self.stats, "outer")
        return tuple(j if w.across is None else dist.get_global_rank(w.across, j)
                     for j, f in enumerate(flags) if f.item())

    def _pseudo_gradient(self, bucket: _Bucket, at: dict) -> torch.Tensor:
        """The anchors minus the parameters now, or as they were at the launch (`at`: the
        layer-wise schedule's), written into one padded flat tensor (float32 where it is
        encoded): no parameter-sized temporaries beside it."""
        dtype = torch.float32 if self.codec != "none" else \
            functools.reduce(torch.promote_types, [p.dtype for _, p in bucket.params])
        flat = torch.empty(bucket.padded, dtype=dtype, device=bucket.params[0][1].device)
        flat[bucket.numel:].zero_()
        offset = 0
        for n, p in bucket.params:
            torch.sub(self.anchors[n], at.get(n, p), out=flat[offset:offset + p.numel()]
                      .view_as(p))
            offset += p.numel()
        return flat

    def _exchange(self, bucket: _Bucket, at: dict):
        """`bucket`'s average across the workers, as a generator that yields after each launch
        (so `sync` can launch every bucket's before waiting) and returns the flat average.

        Every bucket's exchange is in flight at once, so each keeps only what is on the wire
        across its yields (what it sends and receives); the pseudo-gradient and the encodings'
        work are dropped before it yields (estimate/outer_memory.py prices this order)."""
        w, stats, codec = self.workers, self.stats, self.codec
        flat = self._pseudo_gradient(bucket, at)
        mine = flat.view(w.size, -1)[w.index]
        if w.size > 1:   # only this rank's slice crosses hosts: the rest is not kept
            mine = mine.clone()
        del flat
        successor_remote = w.remote[(w.me + 1) % w.count] if w.count > 1 else False
        if codec == "none":
            work = all_reduce_async(mine, w.across, stats, "outer", successor_remote)
            yield
            if work is not None:
                work.wait()
            del work
            averaged = mine.div_(w.count)
        else:
            mine.add_(bucket.error)
            sent = encode(mine.view(w.count, -1), codec)
            torch.sub(mine, decode(sent, codec, bucket.part).view(-1), out=bucket.error)
            del mine
            exchange = all_to_all_v(list(sent.unsqueeze(1)), w.across, stats, "outer",
                                    remote=list(w.remote), recv_lengths=[1] * w.count,
                                    async_op=True)
            del sent
            yield
            received = torch.cat(exchange.wait())
            del exchange
            average = decode(received, codec, bucket.part).sum(0).div_(w.count)
            del received
            average.add_(bucket.owner_error)
            reply = encode(average.view(1, -1), codec)
            torch.sub(average, decode(reply, codec, bucket.part).view(-1),
                      out=bucket.owner_error)
            del average
            gather = all_gather_async(reply.view(-1), w.across, stats, "outer", successor_remote)
            del reply
            yield
            averaged = decode(gather.wait().view(w.count, -1), codec, bucket.part).view(-1)
            del gather
        if w.within is not None:   # the worker's slices, put back together
            gather = all_gather_async(averaged.contiguous(), w.within, stats, "outer")
            del averaged
            yield
            averaged = gather.wait()
            del gather
        return averaged[:bucket.numel]

    # -- checkpoints ---------------------------------------------------------------------------
    @torch.no_grad()
    def restart(self) -> None:
        """A fresh outer loop from the model's parameters now (after a load of a checkpoint
        that has no outer state): anchored there, no momentum, no inner steps, nothing owed
        by error feedback."""
        for n, p in self.params:
            self.anchors[n].copy_(p)
        self.optimizer.state.clear()
        self.inner_steps = 0
        for fragment in self.fragments:
            fragment.running, fragment.averaged, fragment.launched = {}, {}, False
            fragment.at_launch = {}
        self.load_own_state(None)

    def state_dict(self) -> dict:
        """The outer state: the last sync's parameters by name, the outer optimizer's
        momentum, and the inner steps taken since (the same on every rank)."""
        names = list(self.anchors)
        opt = self.optimizer.state_dict()
        return {"anchors": {n: a.detach().clone() for n, a in self.anchors.items()},
                "momentum": {names[i]: s["momentum_buffer"].clone()
                             for i, s in opt["state"].items()
                             if s.get("momentum_buffer") is not None},
                "inner_steps": self.inner_steps}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        names = list(self.anchors)
        for n, a in self.anchors.items():
            a.copy_(state["anchors"][n])
        opt = self.optimizer.state_dict()
        opt["state"] = {i: {"momentum_buffer": state["momentum"][n].clone()}
                        for i, n in enumerate(names) if n in state["momentum"]}
        self.optimizer.load_state_dict(opt)
        self.inner_steps = int(state["inner_steps"])
        # Exchanges that were in flight when it was saved start again at their landing.
        for fragment in self.fragments:
            fragment.running, fragment.averaged, fragment.launched = {}, {}, False
            fragment.at_launch = {}

    def own_state(self) -> dict:
        """What only this rank holds: its error-feedback buffers (compressed), and its
        parameters where ranks differ at a period's end (fragments, a delay)."""
        own = {}
        if self.codec != "none":
            flying = {id(b) for f in self.fragments if f.launched for b in f.buckets}
            # (owed is kept only for an exchange that outlives its step: one that failed in
            # its own step left nothing owed behind the buffers.)
            own["feedback"] = [tuple(t.clone() for t in b.owed)
                               if id(b) in flying and b.owed is not None
                               else (b.error.clone(), b.owner_error.clone())
                               for b in self.buckets]
        if self.ranks_differ or self.inner_steps:   # mid-period: every rank's own, too
            own["params"] = {n: p.detach().clone() for n, p in self.params}
        if self.layerwise:   # a group in flight: its parameters at the launch, to rerun it
            own["in_flight"] = {f: {n: t.clone() for n, t in fragment.at_launch.items()}
                                for f, fragment in enumerate(self.fragments)
                                if fragment.at_launch}
        return own

    @torch.no_grad()
    def load_own_state(self, own: dict | None) -> bool:
        """`own_state()`'s back, or a fresh start of them (None: nothing owed by error feedback,
        the parameters as loaded). False (nothing loaded) where they do not fit this sync."""
        own = own or {}
        saved = own.get("feedback")
        if self.codec != "none":
            if saved is not None and [tuple(e.shape for e in pair) for pair in saved] != [
                    (b.error.shape, b.owner_error.shape) for b in self.buckets]:
                return False
            for i, b in enumerate(self.buckets):
                b.error, b.owner_error = (
                    (saved[i][0].clone(), saved[i][1].clone()) if saved
                    else (torch.zeros_like(b.error), torch.zeros_like(b.owner_error)))
        params = own.get("params")
        if params is not None:
            if set(params) != set(self.by_name):
                return False
            for n, p in self.params:
                p.copy_(params[n])
        for f, taken in own.get("in_flight", {}).items():
            f = int(f)
            if not self.layerwise or f >= len(self.fragments) \
                    or set(taken) != set(self.fragments[f].names):
                return False
            self.fragments[f].at_launch = {n: t.clone() for n, t in taken.items()}
        return True


__all__ = ["LocalSGD", "Workers", "workers_of"]
