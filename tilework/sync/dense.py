"""Dense synchronisation with DistributedDataParallel's semantics: when `backward()` returns,
every dense gradient holds the average over ranks.

Buckets hold parameters in reverse registration order (roughly the order backward produces their
gradients). A post-accumulate-grad hook marks a parameter ready; once every parameter of the next
bucket is ready, its gradients are copied into one flat buffer and an asynchronous all-reduce is
launched, overlapping with the rest of backward. At the end of backward the engine calls
`launch_rest()` (the buckets still waiting, with zeros for parameters that got no gradient on
this rank), pushes the server tables' rows meanwhile, then `wait()`, which waits for all and
writes the averaged gradients back. The last bucket waits for that call when something rides
it: the input checks' words, and the server tables' hot heads (sync/hot.py), whose sums need no
collective of their own then. Buckets launch strictly in index order on every rank, so ranks
whose graphs differ still issue the same collectives in the same order.

What is reduced is the whole accumulated `.grad`, as DDP does: repeated backward passes without a
step average each micro-batch's gradient (the sum of averages is the average of sums), and
backward passes with sync off (`no_sync`, `require_backward_grad_sync = False`) leave local sums
that the next synchronised backward averages.
"""

from __future__ import annotations

import torch
from torch import nn

from ..comm.counted import Stats, all_reduce_async
from ..wire import CHECK_WORDS
from ..plan import assign_buckets
from .hooks import PicklesAsNoop


class _Bucket:
    def __init__(self, params: list[tuple[str, nn.Parameter]]):
        self.params = params
        self.numel = sum(p.numel() for _, p in params)
        self.ready: set[int] = set()
        self.buffer: torch.Tensor | None = None
        self.work = None
        self.riders: list[tuple[object, int, int]] = []   # (rider, offset, numel) in `buffer`


class DenseSync:
    def __init__(self, params: list[tuple[str, nn.Parameter]], group, world_size: int,
                 stats: Stats, bucket_bytes: int, successor_remote: bool = False,
                 checks=None, on_grad=None, rider_dtype: torch.dtype | None = None):
        self.group, self.world_size, self.stats = group, world_size, stats
        self.checks = checks  # sees each bucket's local gradients before they leave
        self.successor_remote = successor_remote
        order = list(reversed(params))
        self.buckets = [_Bucket([order[i] for i in members]) for members in
                        assign_buckets([p.numel() * p.element_size() for _, p in order], bucket_bytes)]
        self.where = {id(p): (b, i) for b, bucket in enumerate(self.buckets)
                      for i, (_, p) in enumerate(bucket.params)}
        self.next_bucket = 0
        # The input checks' words ride the last bucket instead of an exchange of their own (a
        # round trip per step that cost small models 10-20% of their step): the last bucket
        # then launches from the end-of-backward callback, once every gradient was checked;
        # it holds the first-registered parameters, whose gradients come last anyway. Only in
        # float32/float64, where the words' sums stay exact.
        last_dtype = self.buckets[-1].params[0][1].dtype if self.buckets else None
        self.carry = (checks is not None and world_size > 1
                      and last_dtype in (torch.float32, torch.float64))
        # Hot heads' sums (`rider_dtype`: theirs, None without heads) ride it as well: one
        # meeting of all ranks fewer per step. Same dtype only (a sum of flags and rows).
        self.rideable = world_size > 1 and rider_dtype is not None and last_dtype == rider_dtype
        self.hold_last = self.carry or self.rideable
        self.active = False  # a synchronised backward has produced gradients not yet averaged
        self.on_grad = on_grad  # the engine's "this backward touched us" (queues its callback)
        self.handles = [p.register_post_accumulate_grad_hook(PicklesAsNoop(self._on_grad)) for _, p in params]

    def _on_grad(self, p: nn.Parameter) -> None:
        sync = self.on_grad() if self.on_grad is not None else True
        if not sync or self.world_size == 1:
            return
        self.active = True
        b, i = self.where[id(p)]
        self.buckets[b].ready.add(i)
        limit = len(self.buckets) - (1 if self.hold_last else 0)
        while (self.next_bucket < limit
               and len(self.buckets[self.next_bucket].ready) == len(self.buckets[self.next_bucket].params)):
            self._launch(self.buckets[self.next_bucket])
            self.next_bucket += 1

    def _launch(self, bucket: _Bucket, carry: bool = False, riders=()) -> None:
        """Start `bucket`'s all-reduce; `riders`' `outgoing()` ride after its gradients; with
        `carry`, the input checks' words ride at its end, taken after its gradients were
        checked (taken before, a NaN in the last bucket alone left this rank's words clean and
        its checks dirty: its peers read the words, it exchanged them again, and the step
        hung)."""
        if len(bucket.params) == 1 and not carry and not riders:
            # A parameter that fills a bucket alone (a large table) is reduced in place: copying
            # hundreds of MB into a buffer and back cost more than the all-reduce on loopback.
            # Safe since nothing reads `.grad` before backward returns, when the reduce is done.
            p = bucket.params[0][1]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            elif p.grad.is_sparse:
                p.grad = p.grad.to_dense()
            if p.grad.is_contiguous():
                if self.checks is not None:
                    self.checks.on_gradients([(bucket.params[0][0], p.grad)], p.grad)
                bucket.buffer = p.grad
                bucket.work = all_reduce_async(p.grad, self.group, self.stats, "allreduce",
                                               self.successor_remote)
                return
        chunks = []
        for _, p in bucket.params:
            g = p.grad
            if g is None:
                chunks.append(torch.zeros(p.numel(), dtype=p.dtype, device=p.device))
            else:
                chunks.append((g.to_dense() if g.is_sparse else g).reshape(-1))
        size = sum(c.numel() for c in chunks)
        offset = size
        for rider in riders:
            chunks.append(rider.outgoing())
            bucket.riders.append((rider, offset, chunks[-1].numel()))
            offset += chunks[-1].numel()
        bucket.buffer = chunks[0].new_empty(offset + (CHECK_WORDS if carry else 0))
        torch.cat(chunks, out=bucket.buffer[:offset])
        grads = bucket.buffer[:size]
        if self.checks is not None:
            self.checks.on_gradients([(name, p.grad) for name, p in bucket.params], grads)
        if carry:
            bucket.buffer[offset:] = self.checks.words(grads.device)
        bucket.work = all_reduce_async(bucket.buffer, self.group, self.stats, "allreduce",
                                       self.successor_remote)

    def finish_backward(self) -> None:
        """At the end of a synchronised backward: every bucket reduced, gradients averaged in
        place. A no-op when this backward reduced nothing."""
        self.launch_rest()
        self.wait()

    def launch_rest(self, riders=()) -> bool:
        """Launch the buckets not yet launched (the last one carrying the input checks' words);
        `wait` finishes them, and other work can go on between the two. `riders` (hot heads:
        `outgoing()`, then `landed(sum)` from `wait`) ride the last bucket where they can;
        returns whether they do (the same on every rank: it depends on the plan alone)."""
        if not self.active:
            return False
        ride = bool(riders) and self.rideable
        while self.next_bucket < len(self.buckets):
            last = self.next_bucket == len(self.buckets) - 1
            self._launch(self.buckets[self.next_bucket], carry=self.carry and last,
                         riders=riders if ride and last else ())
            self.next_bucket += 1
        return ride

    def wait(self) -> None:
        if not self.active:
            return
        self.active = False
        for k, bucket in enumerate(self.buckets):
            if bucket.work is not None:
                bucket.work.wait()
            if self.carry and k == len(self.buckets) - 1:
                self.checks.settle(bucket.buffer[-CHECK_WORDS:].double())
            for rider, offset, numel in bucket.riders:
                rider.landed(bucket.buffer[offset:offset + numel].clone())
            bucket.riders.clear()
            bucket.buffer[:bucket.numel].div_(self.world_size)
            offset = 0
            for _, p in bucket.params:
                n = p.numel()
                if p.grad is not bucket.buffer:
                    # Views of distinct ranges: a later backward accumulates into each in place.
                    # A gradient of a tensor subclass (a mesh's LocalGradient) stays one.
                    view = bucket.buffer[offset:offset + n].view_as(p)
                    kind = type(p.grad)
                    p.grad = view if kind is torch.Tensor or p.grad is None \
                        else view.as_subclass(kind)
                offset += n
            bucket.ready.clear()
            bucket.buffer = bucket.work = None
        self.next_bucket = 0
