"""Where activations enter and leave a tensor-parallel region: Megatron-LM's f and g operators
and their sequence-parallel pair, as autograd functions over counted collectives.

Without sequence parallelism the activations between regions are whole on every tp rank:
entering costs nothing forward and an all-reduce of the input's gradient backward (f); leaving
all-reduces the partial outputs forward and passes the gradient through (g). With sequence
parallelism they are split along the sequence (dim 1, batch first): entering all-gathers the
sequence forward and reduce-scatters the gradient backward; leaving reduce-scatters forward and
all-gathers backward. Same bytes per step in a ring, activations 1/tp between the regions.
Every collective is recorded in `TensorParallel.stats` under `method` ("tp").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.autograd import Function

from ...comm import counted
from ...comm.counted import Stats
from ...errors import PlanError

SEQ_DIM = 1   # activations are (batch, sequence, features), as batch_first modules have them


@dataclass(frozen=True, eq=False)
class TensorParallel:
    """One rank's place in its tensor-parallel group, and where its bytes are counted."""

    group: object            # a ProcessGroup, or None for one rank
    rank: int = 0
    size: int = 1
    sequence_parallel: bool = False
    stats: Stats = field(default_factory=Stats)
    method: str = "tp"

    @classmethod
    def from_mesh(cls, groups, stats: Stats | None = None, sequence_parallel: bool = False,
                  axis: str = "tp") -> "TensorParallel":
        return cls(groups.group(axis), groups.coord(axis), groups.size(axis), sequence_parallel,
                   stats if stats is not None else Stats(), axis)

    def all_reduce(self, x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """A reduced copy: `x` may be saved by autograd, so it is never changed in place."""
        out = x.contiguous().clone()
        counted.all_reduce(out, self.group, self.stats, self.method, op=op)
        return out

    def gather_seq(self, x: torch.Tensor, dim: int = SEQ_DIM) -> torch.Tensor:
        if self.size == 1:
            return x
        part = x.contiguous()
        flat = counted.all_gather_async(part.view(-1), self.group, self.stats,
                                        self.method).wait()
        # rank-major chunks, each one rank's slice of the sequence
        return torch.cat(flat.view(self.size, *part.shape).unbind(0), dim=dim)

    def reduce_scatter_seq(self, x: torch.Tensor, dim: int = SEQ_DIM) -> torch.Tensor:
        if self.size == 1:
            return x
        length = x.shape[dim]
        if length % self.size:
            raise PlanError(f"sequence parallelism: a sequence of {length} does not split "
                             f"over tp={self.size} ranks")
        chunks = torch.stack(x.chunk(self.size, dim=dim))   # rank-major, so the flat is too
        out = counted.reduce_scatter_async(chunks.view(-1), self.group, self.stats,
                                           self.method).wait()
        return out.view(chunks.shape[1:])

    def slice_seq(self, x: torch.Tensor, dim: int = SEQ_DIM) -> torch.Tensor:
        length = x.shape[dim]
        if length % self.size:
            raise PlanError(f"sequence parallelism: a sequence of {length} does not split "
                             f"over tp={self.size} ranks")
        return x.chunk(self.size, dim=dim)[self.rank]


class _CopyToRegion(Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.all_reduce(grad), None


class _ReduceFromRegion(Function):
    @staticmethod
    def forward(ctx, x, tp):
        return tp.all_reduce(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherSequence(Function):
    @staticmethod
    def forward(ctx, x, tp, dim):
        ctx.tp, ctx.dim = tp, dim
        return tp.gather_seq(x, dim)

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.reduce_scatter_seq(grad, ctx.dim), None, None


class _ReduceScatterSequence(Function):
    @staticmethod
    def forward(ctx, x, tp, dim):
        ctx.tp, ctx.dim = tp, dim
        return tp.reduce_scatter_seq(x, dim)

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.gather_seq(grad, ctx.dim), None, None


class _ScatterSequence(Function):
    @staticmethod
    def forward(ctx, x, tp, dim):
        ctx.tp, ctx.dim = tp, dim
        return tp.slice_seq(x, dim).clone()

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.gather_seq(grad, ctx.dim), None, None


class _GatherFeatures(Function):
    """Megatron's gather from the region: every rank's slice of the last dimension, whole;
    backward keeps this rank's slice of the gradient, which every rank computed alike from
    the same whole output."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return tp.gather_seq(x, dim=x.dim() - 1)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.tp.size, dim=-1)[ctx.tp.rank].contiguous(), None


def gather_features(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The whole last dimension from every rank's slice (forward all-gather, no backward
    communication)."""
    return x if tp.size == 1 else _GatherFeatures.apply(x, tp)


def copy_to_region(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """f: identity forward, gradient all-reduced backward (also for a replicated parameter whose
    uses on each rank see only part of the data: a norm's weight under sequence parallelism)."""
    return x if tp.size == 1 else _CopyToRegion.apply(x, tp)


def reduce_from_region(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """g: partial results summed forward, gradient passed through backward."""
    return x if tp.size == 1 else _ReduceFromRegion.apply(x, tp)


def enter_region(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Before a column-parallel layer: f, or the sequence all-gathered."""
    if tp.size == 1:
        return x
    return _GatherSequence.apply(x, tp, SEQ_DIM) if tp.sequence_parallel \
        else _CopyToRegion.apply(x, tp)


def leave_region(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """After a row-parallel layer: g, or reduce-scattered along the sequence."""
    if tp.size == 1:
        return x
    return _ReduceScatterSequence.apply(x, tp, SEQ_DIM) if tp.sequence_parallel \
        else _ReduceFromRegion.apply(x, tp)


def scatter_sequence(x: torch.Tensor, tp: TensorParallel, dim: int = SEQ_DIM) -> torch.Tensor:
    """This rank's slice of the sequence forward, the slices all-gathered backward."""
    return x if tp.size == 1 else _ScatterSequence.apply(x, tp, dim)


def gather_sequence(x: torch.Tensor, tp: TensorParallel, dim: int = SEQ_DIM) -> torch.Tensor:
    """The whole sequence forward, the gradient reduce-scattered backward."""
    return x if tp.size == 1 else _GatherSequence.apply(x, tp, dim)


@dataclass(frozen=True, eq=False)
class ShapeOnlyTP(TensorParallel):
    """A tp rank whose collectives return new tensors of the results' shapes: the layers'
    arithmetic and what autograd saves are the real rank's, nothing is sent. What the planner
    and the memory estimate transform a meta copy with (no process group)."""

    def all_reduce(self, x: torch.Tensor, op=None) -> torch.Tensor:
        return x.contiguous().clone()   # as the real one: a reduced copy

    def gather_seq(self, x: torch.Tensor, dim: int = SEQ_DIM) -> torch.Tensor:
        if self.size == 1:
            return x
        shape = list(x.shape)
        shape[dim] *= self.size
        return x.new_empty(shape)

    def reduce_scatter_seq(self, x: torch.Tensor, dim: int = SEQ_DIM) -> torch.Tensor:
        if self.size == 1:
            return x
        return x.chunk(self.size, dim=dim)[self.rank].contiguous().clone()
