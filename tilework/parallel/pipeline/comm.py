"""Point-to-point messages between pipeline stages, counted as comm/counted.py counts collectives.

A send is posted and returns (its Work is waited on at the end of the step); so is a receive,
which the runtime posts one action ahead and waits on when the action needs its tensor. Every
message carries a tag naming what it is (kind, stage, microbatch), so a receive matches its
own send whatever order the two ranks post them in: with interleaved stages two neighbours
exchange activations and gradients of several stages in orders their schedules choose
independently. (gloo matches by tag; NCCL ignores tags and matches in posting order, which
this runtime does not arrange: it is for gloo.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...comm.counted import Stats
from ...comm.wire import SEND_RECV

METHOD = "pipeline"


def tag(kind: str, stage: int, microbatch: int, stages: int, microbatches: int) -> int:
    """A message's tag, unique within a step: an activation ("F") or a gradient ("B") leaving
    `stage` for microbatch `microbatch`."""
    return ("FB".index(kind) * stages + stage) * microbatches + microbatch


def send(tensor: torch.Tensor, peer: int, group, message_tag: int, stats: Stats):
    """Post a send of `tensor` to group rank `peer`; returns its Work (the caller keeps the
    tensor alive until it is waited on). Counted as SEND_RECV: the tensor's bytes, once."""
    nbytes = tensor.numel() * tensor.element_size()
    stats.record(METHOD, SEND_RECV.sent(nbytes, 2), 0)
    return dist.isend(tensor.contiguous(), dist.get_global_rank(group, peer), group=group,
                      tag=message_tag)


def recv(buffer: torch.Tensor, peer: int, group, message_tag: int, stats: Stats):
    """Post a receive into `buffer` from group rank `peer`; returns its Work (wait, then read
    the buffer). Posting it before it is needed lets gloo move the bytes while this rank
    computes: the sender's send completes only once the receive is posted."""
    nbytes = buffer.numel() * buffer.element_size()
    stats.record(METHOD, 0, SEND_RECV.sent(nbytes, 2))
    return dist.irecv(buffer, dist.get_global_rank(group, peer), group=group, tag=message_tag)
