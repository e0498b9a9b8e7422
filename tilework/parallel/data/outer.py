"""Local SGD as DiLoCo does it (Douillard et al. 2023): the dense parameters are averaged every
H steps instead of their gradients every step.

Between syncs each rank runs the user's optimizer on its own batches (the inner steps: nothing
crosses the network for these parameters). At every H-th `optimizer.step()` the ranks average
their pseudo-gradients, the parameters at the last sync minus their own now, in buckets; the
outer optimizer (torch's SGD, with Nesterov momentum for DiLoCo) steps the last sync's
parameters with that average as their gradient; every rank copies the result into its model.
With H = 1, SGD inside and an outer SGD of lr 1 without momentum this is synchronous training:
the average of (theta - theta_r) is lr times the average gradient.

The outer all-reduce's bytes are the plan's (`outer_sync_bytes`): the parameters' ring
all-reduce once every H steps. The averaged pseudo-gradient is the same on every rank, so a
non-finite one (a rank that diverged) is seen by all of them at once, and all refuse the outer
step together, naming the parameter.
"""

from __future__ import annotations

import torch
from torch import nn

from ...comm.counted import Stats, all_reduce_async
from ...comm.wire import ring_allreduce_bytes
from ...errors import InputError
from ...plans.plan import OuterSync, assign_buckets


def outer_sync_bytes(nbytes_in_order: list[int], bucket_bytes: int, n: int) -> int:
    """Bytes one rank sends in one outer sync of parameters of these sizes (in registration
    order) on n ranks: each bucket's ring all-reduce, as `LocalSGD.sync` sends them."""
    order = list(reversed(nbytes_in_order))
    return sum(ring_allreduce_bytes(sum(order[i] for i in bucket), n)
               for bucket in assign_buckets(order, bucket_bytes))


class LocalSGD:
    """The outer loop over `params` ((name, parameter) in registration order) on `group`."""

    def __init__(self, params: list[tuple[str, nn.Parameter]], group, world_size: int,
                 stats: Stats, outer: OuterSync, bucket_bytes: int):
        self.group, self.world_size, self.stats, self.outer = group, world_size, stats, outer
        self.params = [(n, p) for n, p in params if p.requires_grad]
        order = list(reversed(self.params))
        self.buckets = [[order[i] for i in members] for members in assign_buckets(
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
        pending = []
        for bucket in self.buckets:
            flat = torch.cat([(self.anchors[n] - p).reshape(-1) for n, p in bucket])
            pending.append((bucket, flat, all_reduce_async(flat, self.group, self.stats,
                                                           "outer")))
        for bucket, flat, work in pending:
            if work is not None:
                work.wait()
                flat /= self.world_size
            offset = 0
            for n, p in bucket:
                anchor = self.anchors[n]
                anchor.grad = flat[offset:offset + p.numel()].view_as(p)   # flat is this sync's
                offset += p.numel()
        bad = next((n for n, a in self.anchors.items() if not torch.isfinite(a.grad).all()),
                   None)
        if bad is not None:
            for anchor in self.anchors.values():
                anchor.grad = None
            raise InputError(f"the averaged pseudo-gradient of {bad} is not finite at the outer "
                             "step (a rank's inner steps diverged): nothing was applied")
        self.optimizer.step()
        for n, p in self.params:
            p.copy_(self.anchors[n])
            self.anchors[n].grad = None

    # -- checkpoints ---------------------------------------------------------------------------
    @torch.no_grad()
    def restart(self) -> None:
        """A fresh outer loop from the model's parameters now (after a load of a checkpoint
        that has no outer state): anchored there, no momentum, no inner steps."""
        for n, p in self.params:
            self.anchors[n].copy_(p)
        self.optimizer.state.clear()
        self.inner_steps = 0

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


__all__ = ["LocalSGD", "outer_sync_bytes"]
