"""Dense synchronisation with DistributedDataParallel's semantics: when `backward()` returns,
every dense gradient holds the average over ranks.

Buckets hold parameters in reverse registration order (roughly the order backward produces their
gradients). A post-accumulate-grad hook marks a parameter ready; once every parameter of the next
bucket is ready, its gradients are copied into one flat buffer and an asynchronous all-reduce is
launched, overlapping with the rest of backward. At the end of backward the engine calls
`launch_rest()` (the buckets still waiting, with zeros for parameters that got no gradient on
this rank), pushes the server tables' rows meanwhile, then `wait()`, which waits for all and
writes the averaged gradients back. The last bucket waits for that call when something rides
it: the input checks' words, and the server tables' hot heads (parallel/rows/hot.py), whose sums
need no collective of their own then. Where a server push over the same ranks follows, a small
enough last bucket rides it in turn (`wire.bucket_rides_push`): it goes whole to every peer at the
end of the push's all-to-all and each rank sums the copies in rank order (`land`), one meeting of
all ranks fewer per step. Buckets launch strictly in index order on every rank, so ranks
whose graphs differ still issue the same collectives in the same order.

What is reduced is the whole accumulated `.grad`, as DDP does: repeated backward passes without a
step average each micro-batch's gradient (the sum of averages is the average of sums), and
backward passes with sync off (`no_sync`, `require_backward_grad_sync = False`) leave local sums
that the next synchronised backward averages.
"""

from __future__ import annotations

import torch
from torch import nn

from ...comm.counted import Stats, all_gather_async, all_reduce_async, all_to_all_v
from ...comm.wire import CHECK_WORDS, bucket_rides_push
from ...plans.plan import assign_buckets
from ...runtime.hooks import post_accumulate_grad_hook
from .powersgd import PowerSGD
from .topk import TopK


class _Bucket:
    def __init__(self, index: int, params: list[tuple[str, nn.Parameter]]):
        self.index, self.params = index, params
        self.numel = sum(p.numel() for _, p in params)
        self.ready: set[int] = set()
        self.buffer: torch.Tensor | None = None
        self.work = None
        self.riders: list[tuple[object, int, int]] = []   # (rider, offset, numel) in `buffer`
        self.wire: torch.Tensor | None = None   # the compressed copy on the wire
        self.round = None   # PowerSGD's compression in flight (parallel/data/powersgd.py)
        self.divided = False   # summed already divided by the ranks (PowerSGD's plain steps)


class DenseSync:
    def __init__(self, params: list[tuple[str, nn.Parameter]], group, world_size: int,
                 stats: Stats, bucket_bytes: int, successor_remote: bool = False,
                 checks=None, on_grad=None, rider_dtype: torch.dtype | None = None,
                 push_dtype: torch.dtype | None = None, wire_dtype: torch.dtype | None = None,
                 powersgd=None, topk: float | None = None):
        self.group, self.world_size, self.stats = group, world_size, stats
        # Compressed buckets (`grad_compress`): cast, divided, summed and cast back as DDP's
        # bf16/fp16 compress hooks do, as PowerSGD's factors (`powersgd`: its rank and start)
        # or as each rank's largest values (`topk`: their share).
        # Nothing rides them: the checks' words and the heads' sums must add up exactly, and a
        # push carries its own width.
        self.wire_dtype = wire_dtype
        compressed = wire_dtype is not None or powersgd is not None or topk is not None
        self.checks = checks  # sees each bucket's local gradients before they leave
        self.successor_remote = successor_remote
        order = list(reversed(params))
        self.buckets = [_Bucket(k, [order[i] for i in members]) for k, members in
                        enumerate(assign_buckets([p.numel() * p.element_size() for _, p in order],
                                       bucket_bytes))]
        self.powersgd = None if powersgd is None else PowerSGD(
            *powersgd, [[tuple(p.shape) for _, p in b.params] for b in self.buckets])
        self.topk = None if topk is None else TopK(topk, [b.numel for b in self.buckets])
        # What a checkpoint keeps of the compression (each rank's error feedback), or None.
        self.compressor = self.powersgd or self.topk
        self.where = {id(p): (b, i) for b, bucket in enumerate(self.buckets)
                      for i, (_, p) in enumerate(bucket.params)}
        self.next_bucket = 0
        # The input checks' words ride the last bucket instead of an exchange of their own (a
        # round trip per step that cost small models 10-20% of their step): the last bucket
        # then launches from the end-of-backward callback, once every gradient was checked;
        # it holds the first-registered parameters, whose gradients come last anyway. Only in
        # float32/float64, where the words' sums stay exact.
        last_dtype = self.buckets[-1].params[0][1].dtype if self.buckets else None
        self.carry = (checks is not None and world_size > 1 and not compressed
                      and last_dtype in (torch.float32, torch.float64))
        # Hot heads' sums (`rider_dtype`: theirs, None without heads) ride it as well: one
        # meeting of all ranks fewer per step. Same dtype only (a sum of flags and rows).
        self.rideable = (world_size > 1 and rider_dtype is not None and not compressed
                         and last_dtype == rider_dtype)
        # And the last bucket itself may ride the server push (`push_dtype`: the dtype of a push
        # over this group, None without one), whole to every peer: wire.bucket_rides_push.
        self.push_ride = (world_size > 1 and push_dtype is not None and not compressed
                          and last_dtype == push_dtype)
        self.riding: _Bucket | None = None
        self.hold_last = self.carry or self.rideable or self.push_ride
        self.active = False  # a synchronised backward has produced gradients not yet averaged
        self.on_grad = on_grad  # the engine's "this backward touched us" (queues its callback)
        self.handles = [p.register_post_accumulate_grad_hook(
                            post_accumulate_grad_hook(self._on_grad)) for _, p in params]

    def _on_grad(self, p: nn.Parameter) -> None:
        sync = self.on_grad() if self.on_grad is not None else True
        if not sync or self.world_size == 1:
            return
        self.active = True
        b, i = self.where[id(p)]
        self.buckets[b].ready.add(i)
        limit = len(self.buckets) - (1 if self.hold_last else 0)
        while (self.next_bucket < limit
               and (len(self.buckets[self.next_bucket].ready)
                    == len(self.buckets[self.next_bucket].params))):
            self._launch(self.buckets[self.next_bucket])
            self.next_bucket += 1

    def _launch(self, bucket: _Bucket, carry: bool = False, riders=(), push: bool = False) -> None:
        """Start `bucket`'s all-reduce; `riders`' `outgoing()` ride after its gradients; with
        `carry`, the input checks' words ride at its end, taken after its gradients were
        checked (taken before, a NaN in the last bucket alone left this rank's words clean and
        its checks dirty: its peers read the words, it exchanged them again, and the step
        hung). With `push`, a bucket small enough is filled and left for the push to carry."""
        if len(bucket.params) == 1 and not carry and not riders and not push \
                and self.compressor is None and self.wire_dtype is None:
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
        if push and bucket_rides_push(bucket.buffer.numel() * bucket.buffer.element_size(),
                                      self.world_size):
            self.riding = bucket
            return
        if self.topk is not None:
            bucket.work = all_gather_async(self.topk.launch(bucket.index, bucket.buffer),
                                           self.group, self.stats, "allreduce",
                                           self.successor_remote)
            return
        if self.powersgd is not None and self.powersgd.compressing:
            bucket.round = self.powersgd.launch(bucket.index, bucket.buffer, bucket.params)
            bucket.work = all_reduce_async(bucket.round.first, self.group, self.stats,
                                           "allreduce", self.successor_remote)
            return
        if self.powersgd is not None:   # its plain steps: divided first, as torch's hook does
            bucket.buffer.div_(self.world_size)
            bucket.work = all_reduce_async(bucket.buffer, self.group, self.stats, "allreduce",
                                           self.successor_remote)
            bucket.divided = True
            return
        if self.wire_dtype is not None:
            bucket.wire = bucket.buffer.to(self.wire_dtype).div_(self.world_size)
            bucket.work = all_reduce_async(bucket.wire, self.group, self.stats, "allreduce",
                                           self.successor_remote)
            return
        bucket.work = all_reduce_async(bucket.buffer, self.group, self.stats, "allreduce",
                                       self.successor_remote)

    def launch_rest(self, riders=(), push: bool = False) -> bool:
        """Launch the buckets not yet launched (the last one carrying the input checks' words);
        `wait` finishes them, and other work can go on between the two. `riders` (hot heads:
        `outgoing()`, then `landed(sum)` from `wait`) ride the last bucket where they can;
        returns whether they do (the same on every rank: it depends on the plan alone).
        `push`: a server push follows, which may carry the last bucket (`riding_buffer`)."""
        if not self.active:
            return False
        ride = bool(riders) and self.rideable
        while self.next_bucket < len(self.buckets):
            last = self.next_bucket == len(self.buckets) - 1
            self._launch(self.buckets[self.next_bucket], carry=self.carry and last,
                         riders=riders if ride and last else (),
                         push=push and self.push_ride and last)
            self.next_bucket += 1
        return ride

    def riding_buffer(self) -> torch.Tensor | None:
        """The filled last bucket the push is to carry to every peer, or None."""
        return None if self.riding is None else self.riding.buffer

    def land(self, parts: list[torch.Tensor]) -> None:
        """Every rank's copy of the riding bucket, in rank order (this rank's own among them):
        summed in that order, so every rank holds the same bits, as an all-reduce leaves."""
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        self.riding.buffer.copy_(total)
        self.riding = None

    def wait(self) -> None:
        if not self.active:
            return
        self.active = False
        if self.riding is not None:   # no push carried it (the same on every rank): alone then
            self.riding.work = all_reduce_async(self.riding.buffer, self.group, self.stats,
                                                "allreduce", self.successor_remote)
            self.riding = None
        for bucket in self.buckets:   # PowerSGD's Qs, each launched as its Ps arrive
            if bucket.round is not None:
                bucket.work.wait()
                qs = self.powersgd.second(bucket.round, self.world_size)
                bucket.work = None if qs is None else all_reduce_async(
                    qs, self.group, self.stats, "allreduce", self.successor_remote)
        for k, bucket in enumerate(self.buckets):
            gathered = bucket.work.wait() if bucket.work is not None else None
            if self.carry and k == len(self.buckets) - 1:
                self.checks.settle(bucket.buffer[-CHECK_WORDS:].double())
            for rider, offset, numel in bucket.riders:
                rider.landed(bucket.buffer[offset:offset + numel].clone())
            bucket.riders.clear()
            if bucket.wire is not None:   # already divided, in its width
                bucket.buffer.copy_(bucket.wire)
                bucket.wire = None
            elif bucket.round is not None:   # the averaged approximation, in place
                self.powersgd.finish(bucket.round, self.world_size)
                bucket.round = None
            elif self.topk is not None:   # every rank's largest values, averaged
                self.topk.land(gathered, bucket.buffer, self.world_size)
            elif bucket.divided:
                bucket.divided = False
            else:
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
        if self.powersgd is not None:
            self.powersgd.steps += 1


class PushRide:
    """Where the servers' push goes, and the last dense bucket riding it. A push over the world
    runs on `comm.push_group` (a twin of the world, so it never pairs with a pull); the bucket
    rides at the end of every peer's part of its first all-to-all, and the copies that arrive
    go back to the DenseSync to be summed. `dtype`: what a world push sends (exchange.py's
    `push_route`), None where no push over the world can carry a bucket."""

    def __init__(self, dtype: torch.dtype | None, world, group):
        self.dtype, self.world, self.group = dtype, world, group
        self.dense, self.buffer = None, None

    def start(self, dense) -> "PushRide":
        """Before a push: the bucket `dense` (a DenseSync, or None) holds for it, if any."""
        self.dense = dense
        self.buffer = None if dense is None else dense.riding_buffer()
        return self

    def group_of(self, hop):
        return self.group if hop.group is self.world else hop.group

    def all_to_all(self, parts: list[torch.Tensor], hop, stats, recv_lengths: list[int]):
        buffer, group = self.buffer, self.group_of(hop)
        if buffer is None or hop.group is not self.world \
                or buffer.element_size() % parts[0].element_size():
            return all_to_all_v(parts, group, stats, "ps", hop.remote, recv_lengths=recv_lengths)
        # A push in a narrower width (push_compress) carries the bucket's bits viewed in it: a
        # bit-exact round trip, as the ids ride the rows.
        carried = buffer.view(parts[0].dtype)
        k, self.buffer = carried.numel(), None
        got = all_to_all_v([torch.cat([part, carried]) for part in parts], group, stats, "ps",
                           hop.remote, recv_lengths=[r + k for r in recv_lengths],
                           tail=("allreduce", k))
        self.dense.land([g[-k:].clone().view(buffer.dtype) for g in got])
        return [g[:-k] for g in got]
