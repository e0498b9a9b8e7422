"""Uneven batch shares in a live job (Plan.batch_shares; planner/shares.py chooses them): each
data-parallel rank feeds its own number of samples, and its gradient is weighted so that the
usual mean over ranks is the gradient of the global batch's mean loss.

One place does it for every path a gradient takes (dense buckets, ZeRO, the servers' rows,
tables all-gathered): a hook on the model's output multiplies its gradient by the rank's
weight W n_r / N, so everything backward computes from it is weighted before
any of it is synchronised, and every synchronisation stays the mean it already is. A term of
the loss that does not come from the model's output (a penalty on the parameters, the same on
every rank) is left unweighted, which is also what one process on the global batch computes.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map_only

from ..errors import PlanError
from ..planner.shares import gradient_weights
from .hooks import PicklesAsNoop


def weight_output(weight: float):
    """A forward hook giving the output's gradient `weight` times what it would be. An output
    in which no tensor that needs a gradient can be reached (a container pytree does not
    know) is refused: its gradient would go unweighted."""
    def hook(module, args, output):
        if not torch.is_grad_enabled():
            return output
        weighted = []

        def weigh(t):
            # A hook on the output's gradient, not a new tensor: the user's in-place changes
            # to what the model returned (`loss /= steps`) stay allowed.
            if t.requires_grad:
                t.register_hook(lambda grad: grad * weight)
                weighted.append(t)
            return t

        tree_map_only(torch.Tensor, weigh, output)
        if not weighted and any(p.requires_grad for p in module.parameters()):
            raise PlanError(f"batch_shares: the model's output ({type(output).__name__}) holds "
                            "no tensor that needs a gradient where tilework can reach it, so "
                            "its gradient cannot be weighted by this rank's share; return "
                            "tensors (or a tuple, list or dict of them)")
        return output

    return hook


def install(model, shares, rank: int, checks, changes) -> float:
    """Weight this rank's gradients by its share and compare batches as fractions of the
    shares; returns the weight (1.0 where the shares are even: nothing is installed)."""
    if len(set(shares)) == 1:
        return 1.0
    weight = gradient_weights(shares)[rank]
    if checks is not None:
        checks.share = shares[rank]
    changes.hook(f"model: forward hook (gradient weighted by its batch share, x{weight:.4g})",
                 model.register_forward_hook(PicklesAsNoop(weight_output(weight))))
    return weight


__all__ = ["install", "weight_output"]
