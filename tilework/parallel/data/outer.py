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

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ...comm.codec import decode, encode, multiple_of
from ...comm.counted import Stats, all_gather_async, all_reduce_async, all_to_all_v
from ...errors import InputError, PlanError
from ...plans.plan import OuterSync, assign_buckets


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


class LocalSGD:
    """The outer loop over `params` ((name, parameter) in registration order) among `workers`."""

    def __init__(self, params: list[tuple[str, nn.Parameter]], workers: Workers,
                 stats: Stats, outer: OuterSync, bucket_bytes: int):
        self.workers, self.stats, self.outer = workers, stats, outer
        self.codec = outer.compress
        self.params = [(n, p) for n, p in params if p.requires_grad]
        order = list(reversed(self.params))
        self.buckets = [_Bucket([order[i] for i in members], workers, self.codec)
                        for members in assign_buckets(
                            [p.numel() * p.element_size() for _, p in order], bucket_bytes)]
        # The parameters at the last sync: what the outer optimizer steps.
        self.anchors = {n: nn.Parameter(p.detach().clone(), requires_grad=False)
                        for n, p in self.params}
        self.optimizer = torch.optim.SGD(list(self.anchors.values()), lr=outer.lr,
                                         momentum=outer.momentum,
                                         nesterov=outer.optimizer == "nesterov"
                                         and outer.momentum > 0)
        self.inner_steps = 0   # since the last sync

    def after_step(self) -> bool:
        """Called after every `optimizer.step()`; syncs on every `every`-th. Returns whether
        it synced."""
        self.inner_steps += 1
        if self.inner_steps < self.outer.every:
            return False
        self.sync()
        return True

    @torch.no_grad()
    def sync(self) -> None:
        """Average the pseudo-gradients, step the outer optimizer, start every rank from it."""
        self.inner_steps = 0
        # Each bucket's exchange runs in stages (a launch, then its wait); every bucket's stage
        # is launched before any bucket waits on that stage.
        running = {i: self._exchange(bucket) for i, bucket in enumerate(self.buckets)}
        averaged: dict[int, torch.Tensor] = {}
        while running:
            for i in list(running):
                try:
                    next(running[i])
                except StopIteration as done:
                    averaged[i] = done.value
                    del running[i]
        for i, bucket in enumerate(self.buckets):
            offset = 0
            for n, p in bucket.params:
                anchor = self.anchors[n]
                # A view of this sync's flat average: nothing else holds it.
                anchor.grad = averaged[i][offset:offset + p.numel()].view_as(p)
                offset += p.numel()
        bad = next((n for n, a in self.anchors.items() if not torch.isfinite(a.grad).all()),
                   None)
        if bad is not None:
            for anchor in self.anchors.values():
                anchor.grad = None
            raise InputError(f"the averaged pseudo-gradient of {bad} is not finite at the outer "
                             "step (a worker's inner steps diverged): nothing was applied")
        self.optimizer.step()
        for n, p in self.params:
            p.copy_(self.anchors[n])
            self.anchors[n].grad = None

    def _pseudo_gradient(self, bucket: _Bucket) -> torch.Tensor:
        flat = torch.cat([(self.anchors[n] - p).reshape(-1) for n, p in bucket.params])
        if self.codec != "none":
            flat = flat.float()
        return torch.nn.functional.pad(flat, (0, bucket.padded - bucket.numel))

    def _exchange(self, bucket: _Bucket):
        """`bucket`'s average across the workers, as a generator that yields after each launch
        (so `sync` can launch every bucket's before waiting) and returns the flat average."""
        w, stats, codec = self.workers, self.stats, self.codec
        flat = self._pseudo_gradient(bucket)
        mine = flat.view(w.size, -1)[w.index]
        successor_remote = w.remote[(w.me + 1) % w.count] if w.count > 1 else False
        if codec == "none":
            work = all_reduce_async(mine, w.across, stats, "outer", successor_remote)
            yield
            if work is not None:
                work.wait()
            averaged = mine / w.count
        else:
            mine = mine + bucket.error
            sent = encode(mine.view(w.count, -1), codec)
            bucket.error = mine - decode(sent, codec, bucket.part).view(-1)
            exchange = all_to_all_v(list(sent.unsqueeze(1)), w.across, stats, "outer",
                                    remote=list(w.remote), recv_lengths=[1] * w.count,
                                    async_op=True)
            yield
            received = torch.cat(exchange.wait())
            average = decode(received, codec, bucket.part).sum(0) / w.count + bucket.owner_error
            reply = encode(average.view(1, -1), codec)
            bucket.owner_error = average - decode(reply, codec, bucket.part).view(-1)
            gather = all_gather_async(reply.view(-1), w.across, stats, "outer", successor_remote)
            yield
            averaged = decode(gather.wait().view(w.count, -1), codec, bucket.part).view(-1)
        if w.within is not None:   # the worker's slices, put back together
            gather = all_gather_async(averaged.contiguous(), w.within, stats, "outer")
            yield
            averaged = gather.wait()
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
        self.load_feedback(None)

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

    def feedback(self) -> list | None:
        """This rank's own error-feedback buffers (each rank's differ), None uncompressed."""
        if self.codec == "none":
            return None
        return [(b.error.clone(), b.owner_error.clone()) for b in self.buckets]

    def load_feedback(self, saved: list | None) -> bool:
        """`feedback()`'s buffers back, or none owed (None). False (nothing loaded) where they
        do not fit this sync's buckets."""
        if self.codec == "none":
            return True
        if saved is not None and [tuple(e.shape for e in pair) for pair in saved] != [
                (b.error.shape, b.owner_error.shape) for b in self.buckets]:
            return False
        for i, b in enumerate(self.buckets):
            b.error, b.owner_error = ((saved[i][0].clone(), saved[i][1].clone()) if saved
                                      else (torch.zeros_like(b.error),
                                            torch.zeros_like(b.owner_error)))
        return True


__all__ = ["LocalSGD", "Workers", "workers_of"]
