"""Collectives that count what they move. Every byte the engine sends goes through here.

Counted per method ("allreduce", "ps", "setup", ...) as bytes sent and received by this rank:
all-to-all counts exactly the payload that leaves for (or arrives from) other ranks; all-reduce
counts what a ring all-reduce sends, 2(n-1)/n of the buffer, the figure the cost model uses too.
Each function short-circuits on a one-rank group.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .wire import all_gather_bytes, all_to_all_bytes, count_exchange_bytes, ring_allreduce_bytes


@dataclass
class Traffic:
    sent: int = 0
    received: int = 0
    sent_inter_host: int = 0   # the part of `sent` that left this host
    calls: int = 0

    def add(self, sent: int, received: int, sent_inter_host: int, call: bool = True) -> None:
        self.sent += sent
        self.received += received
        self.sent_inter_host += sent_inter_host
        self.calls += call


@dataclass
class Stats:
    """Bytes by method: in total, and for the current step (reset by `end_step`)."""

    total: dict[str, Traffic] = field(default_factory=lambda: defaultdict(Traffic))
    step: dict[str, Traffic] = field(default_factory=lambda: defaultdict(Traffic))
    last_step: dict[str, Traffic] = field(default_factory=dict)
    steps: int = 0

    def record(self, method: str, sent: int, received: int, sent_inter_host: int = 0,
               call: bool = True) -> None:
        """`call`: a collective of its own (False: bytes riding another method's call)."""
        self.total[method].add(sent, received, sent_inter_host, call)
        self.step[method].add(sent, received, sent_inter_host, call)

    def discard_step(self) -> None:
        """Keep what was counted so far in the totals only (set-up is not a training step)."""
        self.step = defaultdict(Traffic)

    def end_step(self) -> None:
        self.last_step = dict(self.step)
        self.step = defaultdict(Traffic)
        self.steps += 1

    def as_dict(self) -> dict:
        def plain(d):
            return {k: vars(v).copy() for k, v in sorted(d.items())}

        return {"steps": self.steps, "total": plain(self.total), "last_step": plain(self.last_step)}


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def all_reduce_async(tensor: torch.Tensor, group, stats: Stats, method: str,
                     successor_remote: bool = False):
    """Sum `tensor` in place over `group`; returns a Work handle (None on one rank).

    `successor_remote`: this rank's next rank in the ring is on another host, so what it sends
    crosses hosts.
    """
    n = group_size(group)
    if n == 1:
        return None
    wire = ring_allreduce_bytes(tensor.numel() * tensor.element_size(), n)
    stats.record(method, wire, wire, wire if successor_remote else 0)
    return dist.all_reduce(tensor, group=group, async_op=True)


def all_reduce(tensor: torch.Tensor, group, stats: Stats, method: str,
               op=dist.ReduceOp.SUM) -> None:
    """Reduce `tensor` in place over `group` (blocking), counted as a ring all-reduce."""
    n = group_size(group)
    if n == 1:
        return
    wire = ring_allreduce_bytes(tensor.numel() * tensor.element_size(), n)
    stats.record(method, wire, wire)
    dist.all_reduce(tensor, op=op, group=group)


def all_gather(tensor: torch.Tensor, group, stats: Stats, method: str,
               successor_remote: bool = False) -> list[torch.Tensor]:
    """Every group rank's `tensor` (same shape everywhere), in rank order. Counted as gloo's ring
    sends it: this rank's tensor and n-2 forwarded ones, n-1 in all."""
    n = group_size(group)
    if n == 1:
        return [tensor]
    wire = all_gather_bytes(tensor.numel() * tensor.element_size(), n)
    stats.record(method, wire, wire, wire if successor_remote else 0)
    parts = [torch.empty_like(tensor) for _ in range(n)]
    dist.all_gather(parts, tensor, group=group)
    return parts


class _Pending:
    """An asynchronous collective and what turns its raw result into the answer."""

    def __init__(self, work, finish):
        self.work, self.finish = work, finish

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        return self.finish()


# Newer torch names the flat collectives *_single and deprecates (FutureWarning on every call)
# the *_tensor names, which are all that torch 2.6-2.11 have.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def reduce_scatter_async(flat: torch.Tensor, group, stats: Stats, method: str,
                         remote: list[bool] | None = None) -> _Pending:
    """Sum over `group` of `flat`, n equal chunks in rank order; `.wait()` returns this rank's
    chunk of the sum. On gloo an all-to-all and a local sum (gloo's own reduce-scatter took
    1.7x an all-reduce's time here); on NCCL its reduce-scatter. `remote[j]`: group rank j is
    on another host."""
    n = group_size(group)
    if n == 1:
        return _Pending(None, lambda: flat)
    nbytes = flat.numel() * flat.element_size()
    part = nbytes // n
    wire = all_to_all_bytes(nbytes, n)
    stats.record(method, wire, wire, part * sum(remote or []))
    if dist.get_backend(group) == "nccl":
        out = flat.new_empty(flat.numel() // n)
        return _Pending(_reduce_scatter_flat(out, flat, group=group, async_op=True),
                        lambda: out)
    recv = torch.empty_like(flat)
    work = dist.all_to_all_single(recv, flat, group=group, async_op=True)
    return _Pending(work, lambda: recv.view(n, -1).sum(0))


def all_gather_async(part: torch.Tensor, group, stats: Stats, method: str,
                     successor_remote: bool = False) -> _Pending:
    """Every group rank's flat `part` (same size everywhere) concatenated in rank order;
    `.wait()` returns it. Counted as gloo's ring sends it (wire.all_gather_bytes)."""
    n = group_size(group)
    if n == 1:
        return _Pending(None, lambda: part)
    wire = all_gather_bytes(part.numel() * part.element_size(), n)
    stats.record(method, wire, wire, wire if successor_remote else 0)
    out = part.new_empty(n * part.numel())
    return _Pending(_all_gather_flat(out, part, group=group, async_op=True),
                    lambda: out)


def gather(tensor: torch.Tensor, dst: int, group, stats: Stats, method: str):
    """Every group rank's `tensor` (same shape everywhere) on group rank `dst`, in rank order
    (None elsewhere): each other rank sends its tensor once."""
    n = group_size(group)
    if n == 1:
        return [tensor]
    nbytes = tensor.numel() * tensor.element_size()
    me = dist.get_rank(group)
    stats.record(method, 0 if me == dst else nbytes, nbytes * (n - 1) if me == dst else 0)
    parts = [torch.empty_like(tensor) for _ in range(n)] if me == dst else None
    dist.gather(tensor, parts, dst=dist.get_global_rank(group, dst), group=group)
    return parts


def broadcast(tensor: torch.Tensor, src: int, group, stats: Stats, method: str) -> None:
    """Group rank `src`'s `tensor` on every group rank."""
    n = group_size(group)
    if n == 1:
        return
    nbytes = tensor.numel() * tensor.element_size()
    me = dist.get_rank(group)
    stats.record(method, nbytes * (n - 1) if me == src else 0, 0 if me == src else nbytes)
    dist.broadcast(tensor, src=dist.get_global_rank(group, src), group=group)


def all_to_all_v(chunks: list[torch.Tensor], group, stats: Stats, method: str,
                 remote: list[bool] | None = None,
                 recv_lengths: list[int] | None = None,
                 tail: tuple[str, int] | None = None, async_op: bool = False):
    """Send chunks[j] to group rank j; return what each group rank sent here, in rank order.

    Chunks may differ in length (first dimension) but share the trailing shape and dtype. Unless
    the caller knows what will arrive (`recv_lengths`, e.g. the answers to its own requests),
    the lengths go first in a small all-to-all of int64 counts (counted too: real traffic).
    `remote[j]` says group rank j is on another host, for the inter-host byte count.
    `tail`: (method, k): the last k elements of every chunk, sent and received, are another
    method's bytes (a dense bucket riding the push, parallel/data/dense.py), counted as that
    method's. `async_op` (with `recv_lengths`): launch and return at once; `.wait()` gives the list.
    """
    n = group_size(group)
    if n == 1:
        return _Pending(None, lambda: [chunks[0]]) if async_op else [chunks[0]]
    me = dist.get_rank(group)
    trailing = chunks[0].shape[1:]
    row = math.prod(trailing)
    device = chunks[0].device
    remote = remote or [False] * n
    if recv_lengths is None:
        send_counts = torch.tensor([c.shape[0] for c in chunks], dtype=torch.int64, device=device)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=group)
        count_bytes = count_exchange_bytes(n)
        stats.record(method, count_bytes, count_bytes, count_exchange_bytes(2) * sum(remote))
        recv_lengths = recv_counts.tolist()
    send = torch.cat([c.reshape(-1) for c in chunks])
    recv_sizes = [int(c) * row for c in recv_lengths]
    recv = torch.empty(sum(recv_sizes), dtype=send.dtype, device=device)
    work = dist.all_to_all_single(recv, send, output_split_sizes=recv_sizes,
                                  input_split_sizes=[c.numel() for c in chunks], group=group,
                                  async_op=async_op)
    item = send.element_size()
    other, k = tail or (method, 0)
    peers, peers_far = item * k * (n - 1), item * k * sum(remote)
    stats.record(method, item * (send.numel() - chunks[me].numel()) - peers,
                 item * (recv.numel() - recv_sizes[me]) - peers,
                 item * sum(c.numel() for c, far in zip(chunks, remote) if far) - peers_far)
    if k:
        stats.record(other, peers, peers, peers_far, call=False)
    pending = _Pending(work, lambda: [part.reshape(-1, *trailing)
                                      for part in torch.split(recv, recv_sizes)])
    return pending if async_op else pending.wait()
