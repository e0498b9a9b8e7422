"""The messages of context parallelism: one counted shift around the cp ring.

Each rank sends a tensor to the next cp rank and receives the previous one's, asynchronously,
so ring attention can compute on the block it holds while the next arrives. Point-to-point
(isend/irecv, which gloo and NCCL both have), counted in `Stats` under `method` ("cp") as
the bytes sent and received: wire.SEND_RECV's rule, the tensor once each way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...comm import counted
from ...comm.counted import Stats

# Forward and backward both shift K/V; the backward also shifts dK/dV, and both shifts of a
# step are in flight together between the same two ranks: the tag keeps them apart.
TAG_KV, TAG_DKV = 0, 1


class _Shifted:
    """A shift in flight; `.wait()` returns what the previous rank sent."""

    def __init__(self, works, sent: torch.Tensor, received: torch.Tensor):
        # `sent` is held until the send completes: the backend reads it asynchronously.
        self.works, self.sent, self.received = works, sent, received

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        self.sent = None
        return self.received


class Ring:
    """This rank's place on its cp ring and the counted shift to its neighbours."""

    def __init__(self, group, stats: Stats, method: str = "cp"):
        self.group, self.stats, self.method = group, stats, method
        self.size = counted.group_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        if self.size > 1:   # p2p takes global ranks
            self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
            self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def shift(self, tensor: torch.Tensor, tag: int) -> _Shifted:
        """Send `tensor` to the next rank and receive the previous rank's (same shape) into a
        new buffer. One rank: the tensor comes back to itself, nothing moves or is counted."""
        if self.size == 1:
            return _Shifted([], tensor, tensor)
        tensor = tensor.contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        self.stats.record(self.method, nbytes, nbytes)
        received = torch.empty_like(tensor)
        works = [dist.isend(tensor, self.next, group=self.group, tag=tag),
                 dist.irecv(received, self.prev, group=self.group, tag=tag)]
        return _Shifted(works, tensor, received)

    def __repr__(self) -> str:
        return f"Ring(rank {self.rank} of {self.size}, counted as {self.method!r})"


class ShapeOnlyRing(Ring):
    """A cp rank's ring whose shift receives a new tensor of the sent one's shape (the planner's
    and the memory estimate's meta copies: no process group)."""

    def __init__(self, rank: int, size: int):
        self.group, self.stats, self.method = None, Stats(), "cp"
        self.rank, self.size = rank, size

    def shift(self, tensor, tag):
        return _Shifted([], tensor, torch.empty_like(tensor))
