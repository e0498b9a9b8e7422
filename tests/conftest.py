"""Fixtures shared by the multi-rank test modules."""

from __future__ import annotations

import pytest

from tilework.testing import spawn


# A module that defines `_suite(rank, world_size)` runs it once per world size on real gloo
# ranks (a world's start costs seconds on 2 cores); each test reads its part of the results.
@pytest.fixture(scope="module")
def two_ranks(request):
    return spawn(request.module._suite, 2, timeout=120)


@pytest.fixture(scope="module")
def four_ranks(request):
    return spawn(request.module._suite, 4, timeout=120)
