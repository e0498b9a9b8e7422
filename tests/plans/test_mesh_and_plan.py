"""Plan v2: a named mesh (pure rank <-> coordinates and groups along an axis) and self-contained
plan entries (dtype, kind, placement, predicted cost) that round-trip through JSON and diff."""

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import tilework
from tilework.cluster.mesh import Mesh
from tilework.cluster.topology import Cluster, Host, Topology
from tilework.plans.plan import Plan


@given(st.lists(st.integers(1, 5), min_size=1, max_size=4))
def test_ranks_and_coordinates_are_inverse_and_groups_partition_the_mesh(sizes):
    mesh = Mesh(tuple((f"a{i}", s) for i, s in enumerate(sizes)))
    assert [mesh.rank_of(mesh.coords(r)) for r in range(mesh.size)] == list(range(mesh.size))
    for axis in mesh.names:
        groups = mesh.groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(mesh.size))
        for g in groups:   # members differ in `axis` only
            others = {tuple(v for k, v in mesh.coords(r).items() if k != axis) for r in g}
            assert len(others) == 1 and len(g) == mesh.size_of(axis)


def test_host_by_local_mesh_matches_the_topologys_hosts():
    topo = Topology.uniform(3, 4)
    mesh = Mesh.from_topology(topo)
    assert mesh.axes == (("host", 3), ("local", 4))
    assert mesh.groups("local") == list(topo.hosts)
    assert mesh.groups("host") == topo.inter_host_groups()
    assert Mesh.from_topology(Topology.from_sizes([2, 3])).axes == (("world", 5),)


@pytest.mark.parametrize("axes, message", [((), "at least one axis"),
                                           ((("dp", 2), ("dp", 2)), "distinct"),
                                           ((("tp", 0),), "size must be"),
                                           ((("not a name", 2),), "identifier")])
def test_bad_meshes_are_refused(axes, message):
    with pytest.raises(ValueError, match=message):
        Mesh(axes)


class Hybrid(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(1000, 8, sparse=True)
        self.head = nn.Linear(8, 2).to(torch.float64)


def _plan(**config):
    cluster = Cluster(hosts=[Host("a", 2), Host("b", 2)])
    from tilework.estimate.cost import TableTraffic

    traffic = {"emb.weight": TableTraffic.zipf(1000, 64, cluster.topology())}
    return tilework.plan(Hybrid(), tilework.ParallelConfig(**config), cluster, traffic=traffic)


def test_entries_carry_dtype_kind_placement_and_predicted_cost():
    plan = _plan()
    assert str(plan.mesh) == "host=2 x local=2"
    emb, weight = plan.by_name()["emb.weight"], plan.by_name()["head.weight"]
    assert (emb.dtype, emb.kind, emb.row_bytes) == ("float32", "sparse", 32)
    assert (weight.dtype, weight.kind, weight.nbytes) == ("float64", "dense", 2 * 8 * 8)
    assert weight.placement == "allreduce (replicated)"
    assert all(p.predicted is not None and p.predicted.bytes_sent > 0 for p in plan.params)


def test_a_plan_round_trips_through_json_and_diffs_by_entry():
    plan = _plan()
    again = Plan.from_dict(json.loads(json.dumps(plan.as_dict())))
    assert again == plan and again.diff(plan) == []
    other = _plan(mode="allreduce")
    lines = plan.diff(other)
    assert "mode: 'hybrid' -> 'allreduce'" in lines
    assert "emb.weight.method: 'ps' -> 'allreduce'" in lines
    assert not any(line.startswith("head.weight.method") for line in lines)


def test_an_lm1b_job_plans_by_cost_at_8000_ranks_without_a_process_group():
    from tilework.train.job import Job
    from tilework.train.planning import job_plan

    cluster = Cluster(hosts=[Host(f"h{i}", 8) for i in range(1000)])
    plan = job_plan(Job.load("docs/examples/lm1b.toml"), cluster)
    assert plan.mesh.axes == (("host", 1000), ("local", 8))
    assert not torch.distributed.is_initialized()
    emb = plan.by_name()["embedding.weight"]
    assert emb.method == "ps" and "rows/step" in emb.reason and emb.predicted.seconds > 0
