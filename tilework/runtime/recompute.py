"""Activation recompute: each module the plan names (`Plan.recompute`) runs its forward under
`torch.utils.checkpoint` (non-reentrant), so backward rebuilds what the forward did not keep.

- "full": only the module's inputs are kept; everything inside runs again in backward.
- "selective": torch's selective activation checkpointing with `selective_policy`: the outputs
  of the compute-heavy ops (`SAVED_OPS`: the matmul family, attention, convolution) are kept,
  the cheap ops (elementwise, norms, softmax, dropout) run again.

RNG state is saved and restored around the recompute (checkpoint's `preserve_rng_state`,
left on), so dropout draws the same mask twice. The forward is set as an instance attribute,
recorded in `Changes`: `tilework.unparallelize` puts the module's own back.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

from ..parallel.rows.lookups import real_values
from .changes import Changes


def _packets(*names: str) -> frozenset:
    # Some exist only in some torch builds (the cuDNN attention, _scaled_mm).
    return frozenset(getattr(torch.ops.aten, n) for n in names if hasattr(torch.ops.aten, n))


# What "selective" keeps: ops whose FLOPs grow with the layer's width times its tokens (or the
# tokens squared), where recomputing costs as much as the forward itself.
SAVED_OPS = _packets("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "convolution",
                     "_scaled_dot_product_flash_attention",
                     "_scaled_dot_product_flash_attention_for_cpu",
                     "_scaled_dot_product_efficient_attention",
                     "_scaled_dot_product_cudnn_attention")


def selective_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """Keep the matmul-family outputs, recompute everything else.

    Why this split: a block's memory is dominated by the outputs of its cheap ops (GELU's and
    dropout's inputs, norm outputs, attention probabilities: several tensors per matmul, each
    as large as a matmul's output or, for attention scores, quadratic in the sequence), while
    its time is dominated by the matmuls. Megatron-LM's selective recompute (Korthikanti et
    al., 2022) keeps the large GEMMs' outputs and recomputes the attention core's softmax,
    dropout and scores, which are memory-heavy and FLOP-light; torchtitan's op-level selective
    AC keeps the mm and fused-attention outputs the same way. With a fused attention kernel the
    scores never exist, so keeping its output is that trade at op level.
    """
    if func.overloadpacket in SAVED_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(selective_policy)


class Recomputed:
    """A module's forward run under checkpoint with its policy's contexts; pickled (torch.save
    of the model), it is the forward it wraps, so the saved model is a plain one."""

    def __init__(self, forward, policy: str):
        self.forward, self.policy = forward, policy

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():   # evaluation: nothing is saved, nothing to recompute
            return self.forward(*args, **kwargs)
        # A server table's stand-in gets its rows here, outside the checkpoint: pulled inside,
        # the pull's work would be recorded as the block's and be missing from the recompute.
        args, kwargs = real_values(args), real_values(kwargs)
        contexts = _selective_contexts if self.policy == "selective" else noop_context_fn
        # The keywords bound first: a module's own `debug=` or `context_fn=` stays its own.
        return checkpoint(functools.partial(self.forward, **kwargs), *args, use_reentrant=False,
                          context_fn=contexts)

    def __reduce__(self):
        return self.forward.__reduce__()


def apply_recompute(model: nn.Module, recompute, changes: Changes) -> None:
    """Wrap the forward of each (module name, policy) in `recompute`; each undoable."""
    for name, policy in recompute:
        module = model.get_submodule(name)
        changes.set_attribute(module, "forward", Recomputed(module.forward, policy),
                              f"{name}: forward under activation recompute ({policy})")
