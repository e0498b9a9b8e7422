"""Top-k sparsification with error feedback on the dense buckets: `grad_compress="topk"`.

Each rank sends, of each bucket, its `topk_ratio` share of values largest in magnitude as
(index, value) pairs, after adding what it left out before (error feedback: Stich et al. 2018,
the residual accumulation of Deep Gradient Compression, Lin et al. 2018). The ranks pick
different positions, so the pairs cannot be summed in place: every rank's are all-gathered and
each rank adds them into a zeroed bucket in rank order (the same bits on every rank), then
divides by the ranks: the average of what was sent, when `backward()` returns. What a rank did
not send stays in its error for its next step, so every value is sent eventually.

The wire: k int32 positions and k values per rank and bucket (`comm/wire.topk_count`), one
all-gather of their bytes; `estimate.cost.dense_sync_bytes` counts it exactly.
"""

from __future__ import annotations

import torch

from ...comm.wire import topk_count


class TopK:
    """Each bucket's error on this rank (what it has not sent yet)."""

    def __init__(self, ratio: float, buckets: list[int]):
        self.ratio = ratio
        self.sizes = dict(enumerate(buckets))   # each bucket's values
        self.errors: dict[int, torch.Tensor] = {}

    def launch(self, index: int, buffer: torch.Tensor) -> torch.Tensor:
        """The bucket `buffer` (this rank's gradients) with its error added: returns the
        bytes to all-gather (positions, then values) and keeps the rest as the error."""
        error = self.errors.get(index)
        if error is not None:
            buffer.add_(error)
        k = topk_count(buffer.numel(), self.ratio)
        _, at = torch.topk(buffer.abs(), k, sorted=False)
        values = buffer[at]
        buffer[at] = 0
        self.errors[index] = buffer.clone()
        return torch.cat([at.to(torch.int32).view(torch.uint8), values.view(torch.uint8)])

    def land(self, gathered: torch.Tensor, buffer: torch.Tensor, world: int) -> None:
        """Every rank's pairs (`gathered`, in rank order) summed into `buffer` and averaged."""
        k = topk_count(buffer.numel(), self.ratio)
        buffer.zero_()
        for part in gathered.view(world, -1):
            at = part[:4 * k].clone().view(torch.int32).long()
            buffer.index_add_(0, at, part[4 * k:].clone().view(buffer.dtype))
        buffer.div_(world)

    def state_dict(self) -> dict:
        return {}

    def own_state(self) -> dict:
        """This rank's own: what it has not sent yet, by bucket."""
        return {str(k): v.clone() for k, v in self.errors.items()}

    def misfit(self, state: dict, own: dict | None) -> str | None:
        for index, value in (own or {}).items():
            if int(index) not in self.sizes or value.numel() != self.sizes[int(index)]:
                return f"top-k's error of bucket {index}"
        return None

    def load_state_dict(self, state: dict, own: dict | None) -> None:
        self.errors = {int(k): v.clone() for k, v in (own or {}).items()}
