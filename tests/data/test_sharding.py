"""Sharding: each sample once per epoch, and global batches independent of the world size."""

import numpy as np
import pytest

from tilework.data import ShardedBatches
from tilework.errors import ConfigError


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("drop_last", [False, True])
def test_every_sample_once_per_epoch(world_size, drop_last):
    n, batch = 103, 8
    shards = [ShardedBatches(n, batch, r, world_size, seed=3, drop_last=drop_last)
              for r in range(world_size)]
    steps = shards[0].batches_per_epoch
    for epoch in range(2):
        seen = np.concatenate([s.indices(epoch * steps + b) for b in range(steps) for s in shards])
        if drop_last:
            assert len(seen) == (n // batch) * batch and len(set(seen)) == len(seen)
        else:
            assert sorted(seen) == list(range(n))
    # Epochs are shuffled differently.
    assert not np.array_equal(shards[0].global_indices(0), shards[0].global_indices(steps))


def test_strong_scaling_global_batches_do_not_depend_on_world_size():
    reference = ShardedBatches(1000, 16, 0, 1, seed=5)
    for world_size in (2, 4):
        for step in range(0, 130, 7):
            parts = [ShardedBatches(1000, 16, r, world_size, seed=5).indices(step)
                     for r in range(world_size)]
            assert all(len(p) == 16 // world_size for p in parts)
            np.testing.assert_array_equal(np.concatenate(parts), reference.indices(step))


def test_weak_scaling_keeps_the_per_rank_batch():
    for world_size in (1, 2, 4):
        s = ShardedBatches(1000, 8, 0, world_size, scaling="weak")
        assert s.global_batch == 8 * world_size and len(s.indices(0)) == 8


def test_strong_scaling_needs_divisible_batch():
    with pytest.raises(ConfigError, match="multiple of 4"):
        ShardedBatches(100, 10, 0, 4)
