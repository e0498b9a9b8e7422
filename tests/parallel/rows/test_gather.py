"""The "allgather" placement (parallel/rows/gather.py): a table synchronised as DDP synchronises
a sparse gradient. Its training semantics (one process's losses and parameters, accumulation,
clipping, hand-written updates, checkpoints) run with DDP's in tests/runtime/test_ddp_semantics.py
(system "allgather"); here: its counted bytes against the cost model, and the planner's choice."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tilework
from tilework.cluster.topology import Link, Links, Topology
from tilework.errors import PlanError
from tilework.estimate.cost import TableTraffic, ps_expected, ring_allreduce, sparse_allgather
from tilework.parallel.rows.gather import allgather_bytes
from tilework.planner.tables import search
from tilework.plans.analysis import ParamInfo
from tilework.plans.plan import ParamPlan
from tilework.testing import spawn

ROWS, DIM, STEPS = 100, 8, 3


class Recommender(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(ROWS, DIM, sparse=True)
        self.out = nn.Linear(DIM, 1)

    def forward(self, ids):
        return self.out(self.emb(ids).mean(1)).pow(2).mean()


def batch(step: int, part: int = 0, parts: int = 1) -> torch.Tensor:
    ids = torch.randint(0, ROWS, (8, 5), generator=torch.Generator().manual_seed(step))
    return ids.chunk(parts)[part]


def _train(rank, world_size):
    torch.manual_seed(0)
    model = Recommender()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt = tilework.parallelize(model, opt, overrides={"emb.weight": "allgather"},
                                      log=False)
    sent = []
    for step in range(STEPS):
        model(batch(step, rank, world_size)).backward()
        opt.step()
        opt.zero_grad()
        sent.append(tilework.stats(model)["last_step"]["allgather"]["sent"])
    return sent


def test_counted_bytes_are_the_cost_models_for_the_largest_count_of_touched_rows():
    """Per step each rank sends the counts, then ids and rows padded to the largest count any
    rank touched: `allgather_bytes`, which the cost model prices with the expected count."""
    sent = spawn(_train, 2, timeout=120)
    for step in range(STEPS):
        most = max(batch(step, r, 2).unique().numel() for r in range(2))
        want = allgather_bytes(most, DIM * 4, 2)
        assert sent[0][step] == sent[1][step] == want, (step, sent, want)
    topo = Topology.from_sizes([2])
    traffic = TableTraffic(per_rank=17.0, per_host=30.0, world=30.0)
    assert sparse_allgather(traffic, topo, Links(), DIM * 4).bytes_sent == \
        allgather_bytes(17.0, DIM * 4, 2)


def _costs(ranks: int, per_rank: float, link: Link):
    topo = Topology.from_sizes([ranks])
    links = Links(intra=link, inter=link)
    info = ParamInfo("emb.weight", (100_000, 64), "float32", "sparse")
    traffic = TableTraffic(per_rank, per_rank * ranks, per_rank * ranks)
    chosen = search(info, traffic, topo, links, local_aggregation=True)
    served = min(ps_expected(ParamPlan(info.name, info.shape, "ps", p, "hashed", "",
                                       info.dtype, info.kind), traffic, topo, links,
                             True).seconds for p in (1, 2, ranks))
    return chosen, sparse_allgather(traffic, topo, links, 64 * 4).seconds, served, \
        ring_allreduce(info.nbytes, topo, links).seconds


@pytest.mark.parametrize("ranks, rows", [(2, 50), (2, 5000), (4, 50), (8, 200), (32, 2000)])
@pytest.mark.parametrize("link", [Link(10.0, 200.0), Link(0.1, 5.0)], ids=["latency", "bandwidth"])
def test_the_planner_places_a_sparse_table_where_the_cost_model_prices_it_cheapest(ranks, rows,
                                                                                   link):
    """All-reduce, the servers or the rows all-gathered: the chosen one is the cheapest as
    priced (ties go to all-reduce, then the servers). The servers and the gather both take
    three exchanges; the gather sends each rank's rows to every other rank, so past two ranks
    the servers' bytes are fewer, and at two the two are within a row of each other."""
    chosen, gathered, served, dense = _costs(ranks, rows, link)
    cheapest = min(("allreduce", dense), ("ps", served), ("allgather", gathered),
                   key=lambda kv: kv[1])[0]
    assert chosen.method == cheapest, (chosen.reason, gathered, served, dense)
    if ranks > 2:
        assert gathered > served


def test_allgather_is_for_embedding_tables():
    model = Recommender()
    with pytest.raises(PlanError, match="'allgather' gathers the rows an embedding table's "
                                        "gradient touches; out.weight"):
        tilework.plan(model, tilework.ParallelConfig(overrides={"out.weight": "allgather"}))
    plan = tilework.plan(model, tilework.ParallelConfig(overrides={"emb.weight": "allgather"}))
    assert plan.by_name()["emb.weight"].placement.startswith("allgather")
    model.emb.sparse = False   # a dense-layout gradient: refused, not turned sparse behind it
    with pytest.raises(PlanError, match="'allgather' gathers a sparse gradient's rows, and "
                                        "emb.weight's module makes a dense one"):
        tilework.plan(model, tilework.ParallelConfig(overrides={"emb.weight": "allgather"}))


class TwoTables(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Embedding(ROWS, DIM, sparse=True)
        self.b = nn.Embedding(ROWS, DIM, sparse=True)
        self.out = nn.Linear(DIM, 1)

    def forward(self, ids):
        return self.out((self.a(ids) + self.b(ids)).mean(1)).pow(2).mean()


def _two_tables(rank, world_size, method):
    torch.manual_seed(0)
    model = TwoTables()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    tilework.parallelize(model, opt, overrides={"a.weight": method, "b.weight": method},
                         log=False)
    model(batch(0, rank, world_size)).backward()
    opt.step()
    return tilework.stats(model)["last_step"][method]["calls"]


@pytest.mark.parametrize("method", ["allgather", "ps"])
def test_tables_of_a_method_meet_once_and_are_priced_so(method):
    """Two gathered tables meet in the same three collectives as one does, and the servers'
    tables are pulled and pushed together: counted, the calls of two tables are one table's.
    So the plan's communication charges their meetings once (estimate/cost.shared_meetings):
    the two tables' own prices less one meeting."""
    from tilework.cluster.topology import Cluster, Host
    from tilework.estimate.cost import meeting_seconds
    from tilework.estimate.plan_cost import comm_seconds, entry_costs

    calls = spawn(_two_tables, 2, args=(method,), timeout=120)
    one = spawn(_train_calls, 2, args=(method,), timeout=120)
    assert calls[0] == one[0], (calls, one)
    link = Link(1.0, 500.0)
    cluster = Cluster([Host("a", 2)], links=Links(intra=link, inter=link))
    traffic = {n: TableTraffic(per_rank=10.0, per_host=18.0, world=18.0)
               for n in ("a.weight", "b.weight")}
    plan = tilework.plan(TwoTables(), tilework.ParallelConfig(
        overrides={"a.weight": method, "b.weight": method}), cluster, traffic=traffic)
    own = sum(c.seconds for c in entry_costs(plan, cluster, traffic) if c.name != "out.weight"
              and c.name != "out.bias")
    dense = comm_seconds(plan, cluster, traffic) - own
    # The dense bucket: all-reduced beside the gathered tables; riding the servers' push
    # (its bytes, no meeting of its own: estimate/plan_cost.dense_seconds).
    bucket = (DIM + 1) * 4
    alone = ring_allreduce(bucket, cluster.topology(), cluster.links).seconds \
        if method == "allgather" else bucket / link.bytes_per_s
    assert dense == pytest.approx(
        -meeting_seconds(method, cluster.topology(), cluster.links, True) + alone)


def _train_calls(rank, world_size, method):
    torch.manual_seed(0)
    model = Recommender()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    tilework.parallelize(model, opt, overrides={"emb.weight": method}, log=False)
    model(batch(0, rank, world_size)).backward()
    opt.step()
    return tilework.stats(model)["last_step"][method]["calls"]
