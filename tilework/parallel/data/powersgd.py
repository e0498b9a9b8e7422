"""PowerSGD (Vogels et al., NeurIPS 2019) on the dense buckets: `grad_compress="powersgd"`.

A bucket's gradient matrices (each parameter's first dimension by the rest) that are worth it
(`comm/wire.low_rank_view`) cross as two thin factors instead of themselves: P = M Q is summed
over the ranks and orthogonalised, Q = M^T P is summed, and every rank takes P Q^T / world as
the averaged gradient. Two all-reduces a bucket: the first carries the gradients sent as they
are beside every P, the second every Q; the first of a later bucket is in flight while a
bucket's Qs are computed.

As torch's `powerSGD_hook` (DDP's communication hook, what a user would otherwise pick), so a
job moved from it trains the same model (tests/parallel/data/test_powersgd.py runs both):
- error feedback: what the averaged approximation left out of this rank's gradient (the whole
  bucket's difference) is added to its next gradient;
- warm start: a bucket's Q starts from its last step's, orthogonalised;
- plain all-reduce for the first `start` synchronised backward passes;
- a bucket's first Q drawn from the same seeds in the same order (numpy's RandomState(0), one
  draw per bucket, the factors grouped by shape): the same model where the buckets are DDP's
  (DDP caps its first at 1 MB and rebuilds them after a step; tilework fills `bucket_mb`);
- plain steps divided by the ranks before the sum, as the hook's `_allreduce_fut`.
One difference: a factor column that is all zeros (a matrix no rank's gradient touched) stays
zeros, where torch's Gram-Schmidt divides it by its zero norm and the step goes NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from ...comm.wire import low_rank_values, low_rank_view

SEED = 0   # torch's PowerSGDState(random_seed=0)


def orthogonalize(factors: torch.Tensor) -> None:
    """Orthonormal columns, in place, for a (1, rows, r) factor: Gram-Schmidt up to rank 2
    and QR above it, as torch's hook chooses."""
    r = factors.shape[2]
    if r > 2 and factors.dtype not in (torch.float16, torch.bfloat16):
        torch.linalg.qr(factors, out=(factors, factors.new_empty(1, r, r)))
        return
    for i in range(r):
        col = factors[:, :, i:i + 1]
        norm = torch.norm(col, dim=1, keepdim=True)
        col /= torch.where(norm > 0, norm, torch.ones_like(norm))
        if i + 1 < r:
            rest = factors[:, :, i + 1:]
            rest -= torch.sum(col * rest, dim=1, keepdim=True) * col


@dataclass
class Round:
    """One bucket's compression in flight."""

    index: int
    bucket: torch.Tensor          # this rank's gradients, error added; the average when done
    first: torch.Tensor           # gradients sent as they are, then every P: all-reduced first
    plain: list[torch.Tensor]     # their places in the bucket
    factors: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    #                               (M, P, Q), each (1, rows or cols, ...); M a view of the bucket
    sent: torch.Tensor | None = None   # the bucket as this rank sent it (error added)


class PowerSGD:
    """The compression state of one engine's buckets: each bucket's error and warm Q, the
    synchronised backward passes so far, the seeds."""

    def __init__(self, rank: int, start: int, buckets: list[list[tuple[int, ...]]]):
        self.rank, self.start = rank, start
        # Each bucket's values and its Qs' (what a loaded state must fit).
        self.sizes = {k: (sum(math.prod(s) for s in shapes), low_rank_values(shapes, rank)[1])
                      for k, shapes in enumerate(buckets)}
        self.reset()

    @property
    def compressing(self) -> bool:
        return self.steps >= self.start

    def launch(self, index: int, buffer: torch.Tensor, params) -> Round:
        """The bucket `buffer` (this rank's gradients of `params`, in order) with its error
        added: returns the round whose `first` is to be summed over the ranks."""
        error = self.errors.get(index)
        if error is None:
            self.errors[index] = torch.zeros_like(buffer)
        else:
            if error.device != buffer.device:   # loaded from a checkpoint, on the CPU
                self.errors[index] = error = error.to(buffer)
            buffer.add_(error)
        if index in self.qs and self.qs[index].device != buffer.device:
            self.qs[index] = self.qs[index].to(buffer)
        plain, by_shape, offset = [], {}, 0
        for _, p in params:
            view = buffer[offset:offset + p.numel()]
            offset += p.numel()
            low = low_rank_view(tuple(p.shape), self.rank)
            if low is None:
                plain.append(view)
            else:
                by_shape.setdefault(low, []).append(view.view(1, low[0], low[1]))
        matrices = [(m, r) for (_, _, r), ms in by_shape.items() for m in ms]
        sent_plain = sum(v.numel() for v in plain)
        first = buffer.new_empty(sent_plain + sum(m.shape[1] * r for m, r in matrices))
        if plain:
            torch.cat(plain, out=first[:sent_plain])
        fresh = index not in self.qs
        if fresh:
            self.qs[index] = buffer.new_empty(sum(m.shape[2] * r for m, r in matrices))
        round_ = Round(index, buffer, first, plain, sent=buffer.clone())
        p_at, q_at, qs = sent_plain, 0, self.qs[index]
        for m, r in matrices:
            rows, cols = m.shape[1], m.shape[2]
            p = first[p_at:p_at + rows * r].view(1, rows, r)
            q = qs[q_at:q_at + cols * r].view(1, cols, r)
            p_at, q_at = p_at + rows * r, q_at + cols * r
            round_.factors.append((m, p, q))
        if fresh:   # one draw per bucket, the same on every rank; on the CPU, as the hook
            #         draws (the same values whatever the device)
            generator = torch.Generator().manual_seed(int(self.rng.randint(1_000_000_000)))
            for _, _, q in round_.factors:
                q.copy_(torch.randn(q.shape, generator=generator, dtype=q.dtype, device="cpu"))
        for m, p, q in round_.factors:
            orthogonalize(q)
            torch.bmm(m, q, out=p)
        return round_

    def second(self, round_: Round, world: int) -> torch.Tensor | None:
        """After `first` was summed: the plain gradients averaged into the bucket, the Ps
        orthogonalised, the Qs computed; returns them to be summed (None: nothing compressed)."""
        sent_plain = sum(v.numel() for v in round_.plain)
        summed = round_.first[:sent_plain].div_(world)
        at = 0
        for view in round_.plain:
            view.copy_(summed[at:at + view.numel()])
            at += view.numel()
        for m, p, q in round_.factors:
            orthogonalize(p)
            torch.bmm(m.transpose(1, 2), p, out=q)
        return self.qs[round_.index] if round_.factors else None

    def finish(self, round_: Round, world: int) -> None:
        """After the Qs were summed: the bucket holds the averaged approximation, and this
        rank's error is what it left out of what this rank sent."""
        self.qs[round_.index].div_(world)
        for m, p, q in round_.factors:
            torch.bmm(p, q.transpose(1, 2), out=m)
        torch.sub(round_.sent, round_.bucket, out=self.errors[round_.index])

    def state_dict(self) -> dict:
        """What every rank holds alike: the steps, the seeds' state (as tensors, which a
        weights-only load reads) and the warm Qs, by bucket."""
        kind, keys, pos, has_gauss, cached = self.rng.get_state()
        return {"steps": self.steps, "rng_keys": torch.from_numpy(keys.astype(np.int64)),
                "rng_pos": int(pos), "rng_gauss": (int(has_gauss), float(cached)),
                "qs": {str(k): v.cpu().clone() for k, v in self.qs.items()}}

    def own_state(self) -> dict:
        """This rank's own: what each bucket's approximation left out of its gradient."""
        return {str(k): v.cpu().clone() for k, v in self.errors.items()}

    def reset(self) -> None:
        """As new: plain steps first, the seeds from the start, no errors, no warm Qs (after a
        load of a checkpoint without this state)."""
        self.steps = 0
        self.rng = np.random.RandomState(SEED)
        self.errors: dict[int, torch.Tensor] = {}
        self.qs: dict[int, torch.Tensor] = {}

    def misfit(self, state: dict, own: dict | None) -> str | None:
        """What of a saved state does not fit these buckets (None: it all does)."""
        for kind, saved, at in (("factors", state["qs"], 1), ("error", own or {}, 0)):
            for index, value in saved.items():
                if int(index) not in self.sizes or value.numel() != self.sizes[int(index)][at]:
                    return f"PowerSGD's {kind} of bucket {index}"
        return None

    def load_state_dict(self, state: dict, own: dict | None) -> None:
        """`state_dict`'s and this rank's `own_state` (None: errors start at zero, at most one
        step's approximation lost, as at another world size); `misfit` checked first."""
        qs = {int(k): v for k, v in state["qs"].items()}
        errors = {int(k): v for k, v in (own or {}).items()}
        self.steps = int(state["steps"])
        has_gauss, cached = state["rng_gauss"]
        self.rng.set_state(("MT19937", state["rng_keys"].numpy().astype(np.uint32),
                            int(state["rng_pos"]), int(has_gauss), float(cached)))
        self.qs = {k: v.clone() for k, v in qs.items()}
        self.errors = {k: v.clone() for k, v in errors.items()}

