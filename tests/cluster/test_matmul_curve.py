"""The matmul efficiency curve (cluster/matmul_curve.py) and the estimates that read it: pure,
except one small measurement."""

from __future__ import annotations

import math

import pytest
import torch

from tilework.cluster.matmul_curve import MatmulCurve, measure, seconds_of
from tilework.estimate.compute import step_flops
from tilework.estimate.step import forward_flops, stage_seconds
from tilework.models.gpt import TinyGPT


def curve_by_smallest(rates: dict[int, float], sizes=(16, 64, 256, 1024)) -> MatmulCurve:
    """A curve whose rate at a grid point is `rates[min(m, k, n)]`: small products are slow."""
    return MatmulCurve(sizes, tuple(tuple(tuple(rates[min(m, k, n)] for n in sizes)
                                          for k in sizes) for m in sizes))


SLOW_SMALL = curve_by_smallest({16: 1e9, 64: 4e9, 256: 1e10, 1024: 2e10})


def test_the_rate_at_a_grid_point_is_the_measured_one_and_between_points_log_linear():
    assert SLOW_SMALL.rate(64, 256, 1024) == pytest.approx(4e9)
    assert SLOW_SMALL.rate(1024, 1024, 1024) == pytest.approx(2e10)
    # Halfway between 64 and 256 in log size, every other size larger: the geometric mean.
    assert SLOW_SMALL.rate(128, 1024, 1024) == pytest.approx(math.sqrt(4e9 * 1e10))


def test_beyond_the_grid_the_rate_is_its_edges():
    assert SLOW_SMALL.rate(8192, 8192, 8192) == pytest.approx(2e10)
    assert SLOW_SMALL.rate(1, 1024, 1024) == pytest.approx(1e9)


def test_a_flat_curve_is_one_rate_and_a_number_still_works():
    flat = MatmulCurve.flat(5e9)
    assert flat.rate(3, 700, 9000) == pytest.approx(5e9)
    assert seconds_of(flat, 10, 20, 30, 2) == pytest.approx(seconds_of(5e9, 10, 20, 30, 2))
    assert float(SLOW_SMALL) == 2e10


def test_the_curve_round_trips_and_refuses_a_bad_grid():
    assert MatmulCurve.from_dict(SLOW_SMALL.as_dict()) == SLOW_SMALL
    with pytest.raises(ValueError, match="increasing"):
        MatmulCurve((16, 16), ((((1.0,) * 2,) * 2,) * 2))
    with pytest.raises(ValueError, match="grid of positive rates"):
        MatmulCurve((16, 64), ((((1.0, 0.0),) * 2,) * 2))


def test_measure_gives_a_positive_grid():
    curve = measure(sizes=(8, 32), min_seconds=0.001)
    assert curve.sizes == (8, 32)
    assert all(v > 0 for plane in curve.flops_per_s for row in plane for v in row)


def _meta_gpt(dim=256, layers=2):
    with torch.device("meta"):
        return TinyGPT(1000, dim, 4, layers, 32)


def test_the_step_priced_by_shape_sums_each_product_at_its_own_rate():
    """The forward's products are recorded as run (their FLOPs are exactly FlopCounterMode's
    count), and under a flat curve the step is the plain rate's; under a curve slow for small
    products it is slower, and by the products' own rates."""
    model, ids = _meta_gpt(), torch.zeros(4, 32, dtype=torch.long)
    flops = step_flops(model, (ids, ids))
    assert sum(2 * m * k * n * c for m, k, n, c in flops.matmuls) == flops.forward
    assert flops.seconds(MatmulCurve.flat(1e10)) == pytest.approx(flops.seconds(1e10))
    by_hand = sum(SLOW_SMALL.seconds(m, k, n, c) + SLOW_SMALL.seconds(m, n, k, c)
                  + SLOW_SMALL.seconds(k, m, n, c) for m, k, n, c in flops.matmuls)
    assert flops.seconds(SLOW_SMALL) == pytest.approx(by_hand)
    assert flops.seconds(SLOW_SMALL) > flops.seconds(2e10)


def test_a_stage_priced_by_shape_loses_efficiency_as_tp_and_microbatches_shrink_it():
    """The mesh step model's stages: the same FLOPs as one rate gives under a flat curve; with
    a curve slow for small products, half the products (tp=2, or half the tokens) take more
    than half the time, which one rate cannot say."""
    blocks = [_meta_gpt().blocks]
    f, b = stage_seconds(blocks, 128, 32, 1, MatmulCurve.flat(1e10))
    assert f == pytest.approx(forward_flops(blocks, 128, 32, 1) / 1e10)
    assert b == pytest.approx(2 * f)
    whole = sum(stage_seconds(blocks, 128, 32, 1, SLOW_SMALL))
    assert sum(stage_seconds(blocks, 128, 32, 2, SLOW_SMALL)) > whole / 2
    assert sum(stage_seconds(blocks, 64, 32, 1, SLOW_SMALL)) > whole / 2
