"""Process groups from a topology: intra-host and inter-host collectives reach the right ranks."""

import pytest
import torch
import torch.distributed as dist

from tilework.cluster.topology import Topology
from tilework.comm import build_groups
from tilework.testing import spawn


def _sums(rank, world_size, sizes):
    groups = build_groups(dist.group.WORLD, Topology.from_sizes(sizes))
    out = {}
    for name in ("intra", "inter"):
        g = getattr(groups, name)
        t = torch.tensor([float(rank)])
        if g is not None:
            dist.all_reduce(t, group=g)
        out[name] = t.item()
    return groups.host, groups.local_rank, out


@pytest.mark.parametrize("sizes", [[2, 2], [4], [1, 1], [2, 1]])
def test_groups_follow_topology(sizes):
    topo = Topology.from_sizes(sizes)
    results = spawn(_sums, topo.world_size, args=(sizes,))
    for rank, (host, local, sums) in enumerate(results):
        assert host == topo.host_of(rank) and local == topo.local_rank(rank)
        assert sums["intra"] == sum(topo.hosts[host])
        peers = next(g for g in topo.inter_host_groups() if rank in g)
        assert sums["inter"] == (sum(peers) if len(topo.hosts) > 1 else rank)


def _discover(rank, world_size):
    return build_groups().topology


def test_topology_discovered_from_hostnames():
    # All ranks on this machine: one host.
    assert spawn(_discover, 2) == [Topology.from_sizes([2])] * 2
