"""Top-k sparsification with error feedback on the dense buckets: `grad_compress="topk"`.

Each rank sends, of each bucket, its `topk_ratio` share of values largest in magnitude as
(index, value) pairs, after adding what it left out before (error feedback: Stich et al. 2018,
the residual accumulation of Deep Gradient Compression, Lin et al. 2018). The ranks pick
different positions, so the pairs cannot be summed in place: every rank's are all-gathered and
each rank adds them into a zeroed bucket in rank order (the same bits on every rank), then
divides by the ranks: the average of what was sent, when `backward()` returns. What a rank did
not send stays in its error for its next step, so every value is sent eventually.

The wire: k int32 positions (int64 past int32's range) and k values per rank and bucket
(`comm/wire.topk_count`), one all-gather of their bytes; `estimate.cost.dense_sync_bytes`
counts it exactly.
"""

from __future__ import annotations

import torch

from ...comm.wire import topk_count, topk_index_bytes

_INDEX = {4: torch.int32, 8: torch.int64}


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
            buffer.add_(error.to(buffer))   # loaded from a checkpoint: on the CPU
        k = topk_count(buffer.numel(), self.ratio)
        _, at = torch.topk(buffer.abs(), k, sorted=False)
        values = buffer[at]
        buffer[at] = 0
        self.errors[index] = buffer.clone()
        positions = _INDEX[topk_index_bytes(buffer.numel())]
        return torch.cat([at.to(positions).view(torch.uint8), values.view(torch.uint8)])

    def land(self, gathered: torch.Tensor, buffer: torch.Tensor, world: int) -> None:
        """Every rank's pairs (`gathered`, in rank order) summed into `buffer` and averaged."""
        k, width = topk_count(buffer.numel(), self.ratio), topk_index_bytes(buffer.numel())
        buffer.zero_()
        for part in gathered.view(world, -1):
            at = part[:width * k].clone().view(_INDEX[width]).long()
            buffer.index_add_(0, at, part[width * k:].clone().view(buffer.dtype))
        buffer.div_(world)

    def state_dict(self) -> dict:
        return {}

    def own_state(self) -> dict:
        """This rank's own: what it has not sent yet, by bucket."""
        return {str(k): v.cpu().clone() for k, v in self.errors.items()}

    def reset(self) -> None:
        """Nothing owed (after a load of a checkpoint without this state)."""
        self.errors = {}

    def misfit(self, state: dict, own: dict | None) -> str | None:
        for index, value in (own or {}).items():
            if int(index) not in self.sizes or value.numel() != self.sizes[int(index)]:
                return f"top-k's error of bucket {index}"
        return None

    def load_state_dict(self, state: dict, own: dict | None) -> None:
        self.errors = {int(k): v.clone() for k, v in (own or {}).items()}
