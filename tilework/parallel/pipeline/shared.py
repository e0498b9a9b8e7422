"""Parameters the stages of several pipeline ranks hold, trained as one.

A tied embedding and head sit on the first and the last stage; a model cut over its stack of
blocks (generic.py) keeps every parameter outside the stack on both. Each rank computes its
part of their gradient, and at a synchronised step the parts are summed over the pipeline
(Megatron-LM's embedding all-reduce), so every copy takes the same update.

Only what a rank added since the last sum travels: a loop that calls `model.step` twice
before `optimizer.step()` (accumulation without no_sync) must not count the first step's
sum twice. Each step's starting gradient is kept until the next sum; the sum adds the ranks'
fresh parts to it. A parameter that no rank computed a gradient for keeps `.grad` None, as one
process leaves a parameter unused; a frozen one is not touched. Tensors of each dtype travel
in one flat all-reduce.

A rank whose stages do not hold a parameter must not compute its gradient: if it does, the
model's forward feeds that parameter to this rank's blocks (a position bias passed to every
block, say), and this rank would use a copy that never updates. That is refused by name.
"""

from __future__ import annotations

import torch
from torch import nn

from ...comm import counted
from ...errors import PlanError
from .schedule import Schedule


class SharedGradients:
    def __init__(self, model: nn.Module, stages, schedule: Schedule, rank: int, group, stats):
        ranks_of: dict[int, set[int]] = {}
        for s, stage in enumerate(stages):
            for p in stage.parameters():
                ranks_of.setdefault(id(p), set()).add(schedule.rank_of(s))
        # (name, parameter, held by this rank, the first rank that holds it), model order
        self.entries = [(name, p, rank in ranks_of[id(p)], min(ranks_of[id(p)]))
                        for name, p in model.named_parameters()
                        if p.requires_grad and len(ranks_of.get(id(p), ())) > 1]
        self.unheld = [(name, p) for name, p in model.named_parameters()
                       if rank not in ranks_of.get(id(p), ())]
        self.rank, self.group, self.stats, self.pp = rank, group, stats, schedule.pp
        self.before: list | None = None   # each gradient as the last sum left it

    def __bool__(self) -> bool:
        return bool(self.entries)

    def first_name(self) -> str:
        return self.entries[0][0]

    def counted_elsewhere(self) -> set[int]:
        """ids of the parameters whose (summed, equal) gradient another rank counts in a
        norm: each is counted once, on the first rank holding it."""
        return {id(p) for _, p, held, first in self.entries if held and first != self.rank}

    def start_step(self) -> None:
        for _, p in self.unheld:
            p.grad = None
        if self.before is None:
            self.before = [p.grad.detach().clone() if held and p.grad is not None else None
                           for _, p, held, _ in self.entries]

    def check_unheld(self) -> None:
        fed = [name for name, p in self.unheld if p.grad is not None]
        if fed:
            raise PlanError(f"pp: {fed[0]} got a gradient on pipeline rank {self.rank}, whose "
                            "stages do not hold it: the model's forward feeds it to this "
                            "rank's blocks, which would use a copy that never updates; keep "
                            "it inside a block (or use pp=1)")

    def sum(self) -> None:
        """The ranks' fresh parts summed into every holder's gradient (a collective over the
        pipeline: every rank calls it at a synchronised step)."""
        if not self.entries or self.pp == 1:
            self.before = None
            return
        before = self.before or [None] * len(self.entries)
        fresh = []
        for (_, p, held, _), start in zip(self.entries, before):
            if not held or p.grad is None:
                fresh.append(torch.zeros_like(p))
            else:
                fresh.append(p.grad.detach() - start if start is not None else p.grad.detach())
        had = torch.tensor([float(held and p.grad is not None) for _, p, held, _ in self.entries],
                           device=fresh[0].device)
        counted.all_reduce(had, self.group, self.stats, "pipeline")
        summed = [None] * len(fresh)
        for dtype in dict.fromkeys(g.dtype for g in fresh):
            where = [i for i, g in enumerate(fresh) if g.dtype == dtype]
            flat = torch.cat([fresh[i].reshape(-1) for i in where])
            counted.all_reduce(flat, self.group, self.stats, "pipeline")
            for i, part in zip(where, flat.split([fresh[i].numel() for i in where])):
                summed[i] = part.view_as(fresh[i])
        for (_, p, held, _), start, total, count in zip(self.entries, before, summed, had):
            if held and count > 0:
                p.grad = total.clone() if start is None else start + total
        self.before = None
