"""Server tables served unevenly (ParallelConfig.server_weights: a rank with more memory serves
more rows) train as one process, and every count that reads the layout follows it.

The equivalence harness of tests/equivalence.py (same seeds, global batches of 8, 4 steps,
its tolerances); the layout is the plan's partition -> rank map (ParamPlan.servers).
"""

import itertools

import pytest
import torch.distributed as dist

import tilework
from tests.equivalence import LR, _train, job, reference, torch_optimizer, worst
from tilework import ParallelConfig
from tilework.cluster.topology import Topology
from tilework.comm import build_groups
from tilework.data import ShardedBatches
from tilework.errors import ConfigError
from tilework.estimate.cost import TableTraffic, ps_expected
from tilework.planner import plan
from tilework.planner.shares import server_map
from tilework.plans.plan import Plan
from tilework.plans.rows import TableLayout
from tilework.testing import spawn
from tilework.train.workloads import build

TOLERANCE = {"sgd": 1e-5, "adam": 1e-4}


def served(rank, world_size, workload, optimizer, mode, hosts, weights, shares):
    j = job(workload)
    work = build(j)
    opt = torch_optimizer(optimizer, work.model.parameters(), LR[optimizer])
    groups = build_groups(dist.group.WORLD, Topology.uniform(hosts, world_size // hosts))
    tilework.parallelize(work.model, opt, groups=groups, mode=mode, log=False,
                         server_weights=list(weights),
                         batch_shares=list(shares) if shares else None)
    sampler = ShardedBatches(len(work.train_set), j.data.batch_size, rank, world_size,
                             shares=shares)
    losses = _train(work, opt, sampler, 4)
    runtime_plan = work.model._tilework_engine.plan
    held = {p.name: len(TableLayout(p, world_size).shard_rows(rank))
            for p in runtime_plan.of("ps")}
    state = tilework.state_dict(work.model, opt)["model"]
    return (state if rank == 0 else None), losses, held, runtime_plan.as_dict()


@pytest.mark.parametrize("workload, optimizer, mode, world, hosts, weights, shares", [
    ("lm", "sgd", "hybrid", 2, 1, (2, 1), None),
    ("recommender", "adam", "ps", 4, 2, (4, 4, 2, 1), None),
    # with uneven batch shares too: the host with half the memory takes less of both
    ("lm", "sgd", "hybrid", 2, 1, (2, 1), (6, 2)),
])
def test_uneven_servers_train_as_one_process(workload, optimizer, mode, world, hosts, weights,
                                            shares):
    ref, ref_losses = reference(workload, optimizer, mode)
    results = spawn(served, world, args=(workload, optimizer, mode, hosts, weights, shares),
                    timeout=180)
    state = results[0][0]
    assert state.keys() == ref.keys()
    assert worst(state, ref) <= TOLERANCE[optimizer]
    n = shares or (1,) * world
    losses = [sum(k * r[1][step] for k, r in zip(n, results)) / sum(n)
              for step in range(len(ref_losses))]
    assert losses == pytest.approx(ref_losses, rel=TOLERANCE[optimizer])
    # The rows each rank serves follow its weight, within a partition of the table's.
    tables = Plan.from_dict(results[0][3]).of("ps")
    assert tables and all(p.servers for p in tables)
    for p in tables:
        rows = [r[2][p.name] for r in results]
        assert sum(rows) == p.shape[0]
        grain = -(-p.shape[0] // p.partitions)
        for r, w in enumerate(weights):
            assert abs(rows[r] - p.shape[0] * w / sum(weights)) <= grain, (p.name, rows)


def test_the_map_follows_the_weights_and_even_weights_are_round_robin():
    assert server_map(8, [1, 1]) == (0, 1) * 4
    assert server_map(9, [2, 1]) == (0, 0, 1) * 3
    counts = [server_map(32, [4, 4, 2, 1]).count(r) for r in range(4)]
    assert counts == [12, 12, 6, 2]   # 32 x (4, 4, 2, 1) / 11 = 11.6, 11.6, 5.8, 2.9
    # The most loaded rank relative to its weight is as light as any split makes it.
    for parts, weights in [(32, [4, 4, 2, 1]), (7, [3, 1]), (10, [1, 2, 5]), (5, [1, 1, 1])]:
        mine = [server_map(parts, weights).count(r) for r in range(len(weights))]
        best = min(max(n / w for n, w in zip(split, weights))
                   for split in itertools.product(range(parts + 1), repeat=len(weights))
                   if sum(split) == parts)
        assert max(n / w for n, w in zip(mine, weights)) == best
    with pytest.raises(ConfigError, match="server_weights"):
        server_map(4, [1, 0])


def test_the_plan_carries_the_map_and_refuses_a_wrong_count():
    model = build(job("lm")).model
    made = plan(model, ParallelConfig(mode="ps", server_weights=[3, 1]), topology=Topology
                .from_sizes([2]))
    for p in made.of("ps"):
        assert len(p.servers) == p.partitions == 16
        assert p.servers.count(0) == 12 and "served unevenly" in p.placement
    assert Plan.from_dict(made.as_dict()) == made
    even = plan(model, ParallelConfig(mode="ps", server_weights=[1, 1]),
                topology=Topology.from_sizes([2]))
    assert even == plan(model, ParallelConfig(mode="ps"), topology=Topology.from_sizes([2]))
    with pytest.raises(ConfigError, match="server_weights.*one weight per rank"):
        plan(model, ParallelConfig(mode="ps", server_weights=[3, 1, 1]),
             topology=Topology.from_sizes([2]))
    with pytest.raises(ConfigError, match="server_weights"):
        ParallelConfig(server_weights=[1, -1])


def test_the_busiest_server_is_priced_by_its_rows():
    """Even traffic over an uneven map: the rank serving 3/4 of the rows hears 3/4 of every
    request, so the pull and push cost more than the even layout's (the price of the memory
    saved where memory is short)."""
    model = build(job("lm")).model
    topo = Topology.from_sizes([2])
    even = plan(model, ParallelConfig(mode="ps"), topology=topo).of("ps")[0]
    uneven = plan(model, ParallelConfig(mode="ps", server_weights=[3, 1]),
                  topology=topo).of("ps")[0]
    traffic = TableTraffic.from_density(even.shape[0], 0.05, topo)
    assert traffic.busiest_share(even.partitions, 2, even.row_map) == 0.5
    assert traffic.busiest_share(uneven.partitions, 2, uneven.row_map, uneven.servers) == 0.75
    from tilework.cluster.topology import Links

    assert ps_expected(uneven, traffic, topo, Links(), False).seconds > \
        ps_expected(even, traffic, topo, Links(), False).seconds
