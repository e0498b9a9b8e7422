"""The last dense bucket rides the servers' push (parallel/data/dense.py, wire.bucket_rides_push):
where the push is one all-to-all over the world, a small last bucket goes whole to every peer at the
end of it and each rank sums the copies in rank order. No all-reduce of its own is issued (one
meeting of all ranks fewer per step); its bytes are counted as the all-reduce's, (n - 1) times
the bucket, as the cost model says; the model trains as one process does, and every rank holds
the same bits. Where the push takes two hops (local aggregation), the bucket is all-reduced."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tilework
from tests.parallel.rows.test_lookups import TABLES, Recommender, _one_process_losses, batch
from tilework.cluster.topology import Topology
from tilework.comm import build_groups
from tilework.comm.wire import CHECK_WORDS, RIDE_BYTES, bucket_rides_push, ring_allreduce_bytes
from tilework.estimate.cost import dense_sync_bytes, push_over_world
from tilework.testing import spawn

STEPS = 3
DENSE_BYTES = (4 * TABLES + 1) * 4   # the head Linear(12, 1), float32


class Wide(Recommender):
    """A dense bucket over RIDE_BYTES: a parameter the loss ignores (its gradient is zeros)."""

    def __init__(self):
        super().__init__()
        self.extra = nn.Parameter(torch.zeros(RIDE_BYTES // 4))

    def forward(self, ids):
        return super().forward(ids) + 0 * self.extra.sum()


def _train(rank, world_size, hosts, model_class=Recommender):
    model = model_class()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    groups = build_groups(dist.group.WORLD, Topology.uniform(hosts, world_size // hosts))
    tilework.parallelize(model, opt, mode="hybrid", groups=groups, log=False)
    losses = []
    for step in range(STEPS):
        ids, y = batch(step, rank, world_size)
        loss = nn.functional.mse_loss(model(ids), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    last = tilework.stats(model)["last_step"]["allreduce"]
    head = torch.cat([p.detach().reshape(-1) for p in model.head.parameters()])
    return losses, last["calls"], last["sent"], head


@pytest.mark.parametrize("world_size, hosts", [(2, 1), (4, 1), (4, 2)])
def test_the_last_bucket_rides_the_push_where_it_is_one_exchange(world_size, hosts):
    out = spawn(_train, world_size=world_size, args=(hosts,), timeout=90)
    rides = push_over_world(Topology.uniform(hosts, world_size // hosts), True)
    assert rides == (hosts == 1)
    carried = DENSE_BYTES + CHECK_WORDS * 4
    for losses, calls, sent, head in out:
        assert calls == (0 if rides else 1)
        assert sent == dense_sync_bytes([DENSE_BYTES], 25 * 2**20, world_size, CHECK_WORDS * 4,
                                        push=rides)
        assert sent == ((world_size - 1) * carried if rides
                        else ring_allreduce_bytes(carried, world_size))
        assert torch.equal(head, out[0][3])   # the same bits on every rank
    for step, want in enumerate(_one_process_losses("random", STEPS)):
        mean = sum(o[0][step] for o in out) / world_size
        assert abs(mean - want) < 1e-5, step


def test_the_rule_rides_small_buckets_only():
    assert not bucket_rides_push(1000, 1)
    # What the ride sends, (n - 1) x the bucket, at most RIDE_BYTES.
    assert bucket_rides_push(RIDE_BYTES, 2) and not bucket_rides_push(RIDE_BYTES + 4, 2)
    edge = RIDE_BYTES // 3
    assert bucket_rides_push(edge, 4) and not bucket_rides_push(edge + 4, 4)
    assert dense_sync_bytes([edge], 2**20, 4, push=True) == 3 * edge
    assert dense_sync_bytes([edge + 4], 2**20, 4, push=True) == ring_allreduce_bytes(edge + 4, 4)
    assert dense_sync_bytes([edge], 2**20, 4) == ring_allreduce_bytes(edge, 4)


def test_a_large_bucket_keeps_its_all_reduce():
    out = spawn(_train, world_size=2, args=(1, Wide), timeout=90)
    carried = DENSE_BYTES + RIDE_BYTES + CHECK_WORDS * 4
    assert not bucket_rides_push(carried, 2)
    for _, calls, sent, head in out:
        assert calls == 1 and sent == ring_allreduce_bytes(carried, 2)
        assert torch.equal(head, out[0][3])


def _two_models(rank, world_size):
    routes = []
    for _ in range(2):
        model = Recommender()
        tilework.parallelize(model, torch.optim.SGD(model.parameters(), lr=0.1), mode="hybrid",
                             log=False)
        routes.append(model._tilework_engine.push_route)
    return routes[0].group is routes[1].group, routes[0].group is not dist.group.WORLD


def test_the_push_has_one_group_of_its_own_per_world():
    """A second model parallelized in the process finds the push's group the first one made
    (a gloo group holds threads and sockets until the world ends)."""
    for same, own in spawn(_two_models, world_size=2, timeout=90):
        assert same and own
