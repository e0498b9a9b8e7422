"""Deterministic global batches over any dataset, each split over ranks.

Strong scaling (the default): the global batch size and its contents do not depend on the world
size; rank r takes the r-th contiguous slice, so the ranks' slices concatenated are the global
batch. Weak scaling: every rank keeps `batch_size` samples, and the global batch grows with the
world. The batch is a pure function of the step, so resuming needs nothing but the step number.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from ..errors import ConfigError


class ShardedBatches:
    def __init__(self, num_samples: int, batch_size: int, rank: int = 0, world_size: int = 1,
                 seed: int = 0, scaling: Literal["strong", "weak"] = "strong",
                 shuffle: bool = True, drop_last: bool = True, shares=None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size}")
        if batch_size < 1:
            raise ConfigError("batch_size", f"expected at least 1, got {batch_size}")
        if scaling not in ("strong", "weak"):
            raise ConfigError("scaling", f"expected 'strong' or 'weak', got {scaling!r}")
        self.global_batch = batch_size if scaling == "strong" else batch_size * world_size
        if scaling == "strong" and batch_size % world_size and shares is None:
            raise ConfigError("batch_size",
                              f"strong scaling splits the global batch of {batch_size} "
                              f"over {world_size} ranks: expected a multiple of {world_size}")
        if num_samples < self.global_batch and drop_last:
            raise ConfigError("batch_size", f"global batch {self.global_batch} is larger than the "
                              f"dataset ({num_samples} samples)")
        self.num_samples, self.rank, self.world_size = num_samples, rank, world_size
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.shares = None if shares is None else [int(n) for n in shares]
        if self.shares is not None:
            self._check_shares()

    def _check_shares(self) -> None:
        """Uneven shares (ParallelConfig.batch_shares): rank r takes the r-th slice of
        shares[r] samples, so the global batch is their sum, and only whole batches are
        cut (the gradients are weighted by the shares, a short batch would not match them)."""
        shares = self.shares
        if len(shares) != self.world_size or any(n < 1 for n in shares):
            raise ConfigError("batch_shares", f"a positive count for each of the "
                              f"{self.world_size} ranks, got {shares}")
        if self.global_batch != sum(shares):
            raise ConfigError("batch_size", f"the shares {shares} make a global batch of "
                              f"{sum(shares)}, the batch size gives {self.global_batch}")
        if not self.drop_last:
            raise ConfigError("drop_last", "uneven shares cut whole batches only: their "
                              "gradient weights are the shares'")

    @property
    def batches_per_epoch(self) -> int:
        full, rest = divmod(self.num_samples, self.global_batch)
        return full + (1 if rest and not self.drop_last else 0)

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_samples)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def global_indices(self, step: int) -> np.ndarray:
        epoch, b = divmod(step, self.batches_per_epoch)
        return self._order(epoch)[b * self.global_batch:(b + 1) * self.global_batch]

    def indices(self, step: int) -> np.ndarray:
        """This rank's samples at `step` (a short last batch is split as evenly as possible;
        with shares, its slice of shares[rank])."""
        if self.shares is not None:
            start = sum(self.shares[:self.rank])
            return self.global_indices(step)[start:start + self.shares[self.rank]]
        return np.array_split(self.global_indices(step), self.world_size)[self.rank]
