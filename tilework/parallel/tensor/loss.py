"""Cross-entropy over logits split by vocabulary, without gathering them (Megatron-LM).

Numerically stable as the one-process loss: the row maximum is all-reduced (MAX) over tp, then
the target's shifted logit (held by one rank, zero elsewhere) and the sum of exponentials go in
one all-reduce (SUM); loss = log(sum exp) - shifted target logit. Backward needs no
communication: softmax minus one-hot, each rank for its own columns.

An unmodified model calls `F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets)` on
its head's output; `VocabParallelHead` returns a `ShardedLogits`, a tensor subclass whose
`__torch_function__` lets shape queries and views through and routes `F.cross_entropy` here.
Anything else on split logits would silently compute on a part of the vocabulary, so it is
refused with the way out (the "colwise" style gathers nothing either; "replicate" keeps the head
whole).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd import Function

from ...errors import PlanError, UnsupportedCall
from .regions import TensorParallel


class _VocabParallelCrossEntropy(Function):
    @staticmethod
    def forward(ctx, logits, target, tp, start, ignore_index):
        local = logits.shape[-1]
        row_max = tp.all_reduce(logits.detach().max(dim=-1).values, op=dist.ReduceOp.MAX)
        shifted = logits - row_max.unsqueeze(-1)
        mine = (target >= start) & (target < start + local)
        column = (target - start).clamp(0, local - 1)
        picked = shifted.gather(-1, column.unsqueeze(-1)).squeeze(-1) * mine
        exp = shifted.exp()
        summed = tp.all_reduce(torch.stack([picked, exp.sum(-1)]))
        valid = target != ignore_index
        loss = (summed[1].log() - summed[0]) * valid
        ctx.save_for_backward(exp, summed[1], column, mine, valid)
        return loss

    @staticmethod
    def backward(ctx, grad):
        exp, total, column, mine, valid = ctx.saved_tensors
        g = exp / total.unsqueeze(-1)
        g.scatter_add_(-1, column.unsqueeze(-1), -mine.to(g.dtype).unsqueeze(-1))
        return g * (grad * valid).unsqueeze(-1), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp: TensorParallel,
                                 start: int, ignore_index: int = -100,
                                 reduction: str = "mean") -> torch.Tensor:
    """F.cross_entropy(full_logits, target) from this rank's columns [start, start + local)."""
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise PlanError("vocabulary-parallel cross-entropy takes (N, vocab/tp) logits and (N,) "
                         f"targets, got {tuple(logits.shape)} and {tuple(target.shape)}")
    loss = _VocabParallelCrossEntropy.apply(logits, target, tp, start, ignore_index)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        return loss.sum() / (target != ignore_index).sum()
    raise PlanError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


def _cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                   reduction="mean", label_smoothing=0.0):
    if weight is not None or size_average is not None or reduce is not None or label_smoothing:
        raise PlanError("F.cross_entropy on vocabulary-split logits: weight, label_smoothing "
                         "and the deprecated size_average/reduce are not supported")
    return vocab_parallel_cross_entropy(input.as_subclass(torch.Tensor), target, input._tp,
                                        input._start, ignore_index, reduction)


# Views and casts that keep the vocabulary as the last dimension (checked), and what computes
# nothing from the values (shape queries, hooks, display).
_PASS = {torch.Tensor.reshape, torch.Tensor.view, torch.Tensor.flatten, torch.Tensor.contiguous,
         torch.Tensor.float, torch.Tensor.to, torch.Tensor.detach, torch.reshape, torch.flatten}
# Questions about the tensor, not its values (untyped_storage: memory tools such as torch's
# MemTracker ask every module output for its storage).
_QUERIES = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.__len__,
            torch.Tensor.register_hook, torch.Tensor.retain_grad, torch.Tensor.__repr__,
            torch.Tensor.__format__, torch.Tensor.untyped_storage}


class ShardedLogits(torch.Tensor):
    """This rank's columns of the logits; `_start` is the first column's vocabulary id."""

    @staticmethod
    def wrap(t: torch.Tensor, tp: TensorParallel, start: int) -> "ShardedLogits":
        out = t.as_subclass(ShardedLogits)
        out._tp, out._start = tp, start
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        me = args[0]
        with torch._C.DisableTorchFunctionSubclass():
            if func is F.cross_entropy:
                return _cross_entropy(*args, **kwargs)
            if getattr(func, "__name__", "") == "__get__" or func in _QUERIES:
                return func(*args, **kwargs)
            if func in _PASS and isinstance(me, ShardedLogits):
                out = func(*args, **kwargs)
                if out.shape[-1] == me.shape[-1]:
                    return ShardedLogits.wrap(out, me._tp, me._start)
        raise UnsupportedCall(f"{getattr(func, '__name__', func)} on logits "
                        "split over the vocabulary "
                        "(tensor parallel, style 'vocab_head'): only views that keep the "
                        "vocabulary last, and F.cross_entropy, are supported; give the head "
                        "the style 'replicate' to keep it whole")
