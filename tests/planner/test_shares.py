"""Uneven data shares (planner/shares.py): pure."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tilework.errors import ConfigError
from tilework.planner.shares import batch_shares, gradient_weights, ideal_time, step_time


def test_equal_speeds_give_numpy_s_even_split():
    for n, w in [(16, 2), (10, 4), (7, 7), (101, 8)]:
        assert batch_shares(n, [1.0] * w) == tuple(len(a) for a in np.array_split(range(n), w))


def test_shares_follow_speed():
    assert batch_shares(20, [4, 1]) == (16, 4)
    assert batch_shares(22, [1, 1, 0.5, 0.25]) == (8, 8, 4, 2)


def test_a_memory_cap_moves_the_rest_to_the_others():
    assert batch_shares(20, [4, 1], caps=[10, None]) == (10, 10)
    assert batch_shares(12, [1, 1, 1], caps=[2, None, None]) == (2, 5, 5)


def test_what_cannot_be_done_is_said_by_field():
    with pytest.raises(ConfigError, match="batch_size"):
        batch_shares(20, [1, 1], caps=[5, 5])
    with pytest.raises(ConfigError, match="speed"):
        batch_shares(20, [1, 0])
    with pytest.raises(ConfigError, match="batch_size"):
        batch_shares(1, [1, 1])


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 40), st.lists(st.sampled_from([0.25, 0.5, 1.0, 2.0, 3.0]), min_size=1,
                                    max_size=4))
def test_no_integer_split_finishes_sooner(batch, speeds):
    if batch < len(speeds):
        return
    best = min(step_time(s, speeds, 1.0)
               for s in itertools.product(range(1, batch + 1), repeat=len(speeds))
               if sum(s) == batch)
    got = batch_shares(batch, speeds)
    assert sum(got) == batch and step_time(got, speeds, 1.0) == pytest.approx(best)
    assert step_time(got, speeds, 1.0) >= ideal_time(batch, speeds, 1.0) - 1e-12


def test_the_weights_make_the_mean_over_ranks_the_global_mean():
    shares = (6, 2)
    weights = gradient_weights(shares)
    local_means = [1.0, 5.0]   # each rank's mean gradient over its own samples
    global_mean = (6 * 1.0 + 2 * 5.0) / 8
    assert np.mean([w * g for w, g in zip(weights, local_means)]) == pytest.approx(global_mean)
    assert gradient_weights((4, 4)) == (1.0, 1.0)
