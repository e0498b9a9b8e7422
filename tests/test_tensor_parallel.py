"""Tensor and sequence parallelism (tilework/tensor/) against one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tilework.mesh import parallel_mesh
from tilework.tensor.groups import build_mesh_groups
from tilework.testing import spawn


def test_parallel_mesh_puts_tp_inside_a_host():
    mesh = parallel_mesh(8, ranks_per_host=4, tp=2, pp=2)
    assert mesh.names == ("dp", "pp", "cp", "tp") and mesh.shape == (2, 2, 1, 2)
    assert mesh.groups("tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert mesh.groups("pp") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert mesh.groups("dp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert all(len({r // 4 for r in g}) == 1 for g in mesh.groups("tp"))
    assert parallel_mesh(8, 4, tp=8).groups("tp") == [tuple(range(8))]   # whole hosts


@pytest.mark.parametrize("kwargs, message", [
    ({"world_size": 6, "tp": 4}, "does not divide the world of 6"),
    ({"world_size": 12, "ranks_per_host": 4, "tp": 3}, "straddle hosts"),
    ({"world_size": 4, "tp": 0}, "tp must be an integer >= 1"),
])
def test_parallel_mesh_refuses(kwargs, message):
    with pytest.raises(ValueError, match=message):
        parallel_mesh(**kwargs)


def _groups_rank(rank, world_size):
    groups = build_mesh_groups(parallel_mesh(world_size, 2, tp=2))
    sums = {}
    for axis in ("tp", "dp"):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=groups.group(axis))
        sums[axis] = t.item()
    return sums, groups.group("pp") is None, groups.ranks("tp")


def test_mesh_groups_are_built_once_per_axis():
    results = spawn(_groups_rank, 4, timeout=60)
    assert [r[0] for r in results] == [{"tp": 1, "dp": 2}, {"tp": 1, "dp": 4},
                                       {"tp": 5, "dp": 2}, {"tp": 5, "dp": 4}]
    assert all(r[1] for r in results)
    assert [r[2] for r in results] == [(0, 1), (0, 1), (2, 3), (2, 3)]
