"""A server table split by row: its hot head replicated and all-reduced, its tail on the servers
(parallel/rows/hot.py). Trains as one process does; checkpoints, clipping and unparallelize see one
table; the planner splits a Zipf table where the head's all-reduce costs less than serving it."""

import dataclasses

import pytest
import torch
from torch import nn

import tilework
from tilework import optim
from tilework.cluster.topology import Links, Topology
from tilework.estimate.cost import TableTraffic, ps_split
from tilework.planner import make_plan
from tilework.plans.analysis import analyze
from tilework.testing import spawn

ROWS, HOT, BATCH, STEPS = 60, 6, 8, 4
LR = {"sgd": 0.1, "adagrad": 0.05, "adam": 0.01}


class Model(nn.Module):
    def __init__(self, dense_dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.words = nn.Embedding(ROWS, 4, sparse=True)
        self.bag = nn.EmbeddingBag(ROWS, 3, mode="sum", sparse=True)
        self.out = nn.Linear(7, 1, dtype=dense_dtype)

    def forward(self, ids):
        x = torch.cat([self.words(ids).mean(1), self.bag(ids)], 1)
        return self.out(x.to(self.out.weight.dtype)).squeeze(1).float()


def batch(step, rank=0, world_size=1):
    g = torch.Generator().manual_seed(step)
    # frequency-sorted: the low ids on every rank, the high ones rarely
    ids = (torch.rand(BATCH, 5, generator=g) ** 3 * ROWS).long()
    y = torch.randn(BATCH, generator=g)
    return ids.chunk(world_size)[rank], y.chunk(world_size)[rank]


def hot_plan(model, world_size, hot=HOT):
    plan = make_plan(analyze(model), world_size, "hybrid")
    params = tuple(dataclasses.replace(p, hot_rows=hot) if p.method == "ps" else p
                   for p in plan.params)
    return dataclasses.replace(plan, params=params)


def _train(model, opt, rank, world_size, clip=False):
    losses = []
    for step in range(STEPS):
        ids, y = batch(step, rank, world_size)
        loss = nn.functional.mse_loss(model(ids), y)
        loss.backward()
        if clip:
            tilework.clip_grad_norm_(model, 0.05)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def torch_optimizer(name, model):
    kind = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "adam": torch.optim.Adam}
    return kind[name](model.parameters(), lr=LR[name])


def _parallel(rank, world_size, name, hot, clip, dense_dtype=torch.float32):
    model = Model(dense_dtype)
    opt = torch_optimizer(name, model)
    tilework.parallelize(model, opt, plan=hot_plan(model, world_size, hot), log=False)
    losses = _train(model, opt, rank, world_size, clip)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    sent = tilework.stats(model)["last_step"]
    return losses, state, sent


def _reference(name, clip, dense_dtype=torch.float32):
    model = Model(dense_dtype)
    opt = optim.for_model(model, name, LR[name])
    losses = _train(model, opt, 0, 1, clip)
    return losses, model.state_dict()


@pytest.mark.parametrize("name, clip", [("sgd", False), ("adagrad", False), ("adam", False),
                                        ("sgd", True)])
def test_a_hot_split_trains_as_one_process(name, clip):
    losses, state = _reference(name, clip)
    out = spawn(_parallel, 2, args=(name, HOT, clip), timeout=120)
    mean = [(a + b) / 2 for a, b in zip(out[0][0], out[1][0])]   # halves of the batch
    assert mean == pytest.approx(losses, rel=1e-5, abs=1e-6)
    for _, got_state, _ in out:
        for k, v in state.items():
            torch.testing.assert_close(got_state[k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_the_head_sends_no_ids_and_rides_the_dense_all_reduce():
    plain = spawn(_parallel, 2, args=("sgd", 0, False), timeout=120)
    split = spawn(_parallel, 2, args=("sgd", HOT, False), timeout=120)
    assert plain[0][0] == pytest.approx(split[0][0], rel=1e-6)
    for r in range(2):
        assert split[r][2]["ps"]["sent"] < plain[r][2]["ps"]["sent"]
        assert split[r][2]["allreduce"]["sent"] > plain[r][2]["allreduce"]["sent"]
        # in the last dense bucket: its bytes, no meeting of the ranks of its own
        assert split[r][2]["allreduce"]["calls"] == plain[r][2]["allreduce"]["calls"]


def test_a_head_with_no_bucket_of_its_dtype_is_all_reduced_on_its_own():
    losses, state = _reference("sgd", False, torch.float64)
    plain = spawn(_parallel, 2, args=("sgd", 0, False, torch.float64), timeout=120)
    split = spawn(_parallel, 2, args=("sgd", HOT, False, torch.float64), timeout=120)
    mean = [(a + b) / 2 for a, b in zip(split[0][0], split[1][0])]
    assert mean == pytest.approx(losses, rel=1e-5, abs=1e-6)
    for r in range(2):
        for k, v in state.items():
            torch.testing.assert_close(split[r][1][k], v, rtol=1e-5, atol=1e-6, msg=k)
        # one all-reduce for each table's head (words, bag)
        assert split[r][2]["allreduce"]["calls"] == plain[r][2]["allreduce"]["calls"] + 2


def _checkpoint_and_undo(rank, world_size):
    model = Model()
    opt = torch_optimizer("adam", model)
    tilework.parallelize(model, opt, plan=hot_plan(model, world_size), log=False)
    _train(model, opt, rank, world_size)
    model_state = {k: v.clone() for k, v in model.state_dict().items()}
    opt_state = opt.state_dict()
    # a load sets the head and the tail: zero everything, load back, train on
    with torch.no_grad():
        zeros = {k: torch.zeros_like(v) for k, v in model_state.items()}
    model.load_state_dict(zeros)
    assert all(float(v.abs().sum()) == 0 for v in model.state_dict().values())
    model.load_state_dict(model_state)
    opt.load_state_dict(opt_state)
    after_load = _train(model, opt, rank, world_size)
    tilework.unparallelize(model, opt)
    plain = {k: v.clone() for k, v in model.state_dict().items()}
    return model_state, after_load, plain


def _plain_twice():
    model = Model()
    opt = optim.for_model(model, "adam", LR["adam"])
    first = _train(model, opt, 0, 1)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return first, state, _train(model, opt, 0, 1), model.state_dict()


def test_checkpoints_and_unparallelize_hold_the_head():
    _, state, second, final = _plain_twice()
    after_load_all = []
    for model_state, after_load, plain in spawn(_checkpoint_and_undo, 2, timeout=120):
        for k, v in state.items():
            torch.testing.assert_close(model_state[k], v, rtol=1e-5, atol=1e-6, msg=k)
        after_load_all.append(after_load)
        for k, v in final.items():
            torch.testing.assert_close(plain[k], v, rtol=1e-5, atol=1e-6, msg=k)
    mean = [(a + b) / 2 for a, b in zip(*after_load_all)]
    assert mean == pytest.approx(second, rel=1e-5, abs=1e-6)


# -- the planner ------------------------------------------------------------------------------

class Table(nn.Module):
    def __init__(self, rows):
        super().__init__()
        self.emb = nn.Embedding(rows, 64, sparse=True)


def _plan(rows, lookups, hosts, per_host, alpha=1.0, shared=0.0):
    topo = Topology.uniform(hosts, per_host)
    with torch.device("meta"):
        model = Table(rows)
    traffic = {"emb.weight": TableTraffic.zipf(rows, lookups, topo, alpha, shared=shared)}
    return make_plan(analyze(model), topo.world_size, topology=topo, links=Links(),
                     traffic=traffic).by_name()["emb.weight"]


def test_the_planner_takes_the_cheapest_split():
    topo = Topology.uniform(1, 8)
    entry = _plan(800_000, 4096, 1, 8)
    traffic = TableTraffic.zipf(800_000, 4096, topo)
    chosen = ps_split(entry, traffic, topo, Links(), True)
    assert entry.predicted == chosen
    splits = traffic.splits()
    assert len(splits) >= 3 and all(h > 0 for h, _ in splits)
    for hot, tail in splits:
        # the tail's traffic is the whole table's less the head's
        assert tail.per_rank < traffic.per_rank and tail.world < traffic.world
        split = dataclasses.replace(entry, hot_rows=hot)
        assert ps_split(split, traffic, topo, Links(), True).seconds >= chosen.seconds
    # A row every rank touches costs the ring all-reduce exactly what its pull and push cost
    # (n-1)/n (2 row + 8) bytes either way, so a head pays only for what the alpha-beta model
    # does not see (the owner of a contiguous head's load); the split is costed, not assumed.
    head = dataclasses.replace(entry, hot_rows=splits[0][0])
    assert ps_split(head, traffic, topo, Links(), True).bytes_sent > 0


def test_no_head_where_ranks_share_few_rows():
    # a handful of lookups per rank: no row is touched by nearly every rank
    entry = _plan(800_000, 4, 4, 8)
    assert entry.method == "ps" and entry.hot_rows == 0, entry
    # without a Zipf model there is nothing to split
    topo = Topology.uniform(4, 8)
    with torch.device("meta"):
        model = Table(800_000)
    traffic = {"emb.weight": TableTraffic.from_density(800_000, 0.001, topo)}
    plain = make_plan(analyze(model), 32, topology=topo, traffic=traffic).by_name()["emb.weight"]
    assert plain.hot_rows == 0


def test_the_plan_keeps_hot_rows_through_json_and_diff():
    from tilework.plans.plan import Plan

    plan = hot_plan(Model(), 2)
    assert Plan.from_dict(plan.as_dict()) == plan
    plain = make_plan(analyze(Model()), 2, "hybrid")
    assert "words.weight.hot_rows: 0 -> 6" in plain.diff(plan)
    with pytest.raises(ValueError, match="hot_rows"):
        dataclasses.replace(plan.by_name()["out.weight"], hot_rows=1)
    with pytest.raises(ValueError, match="hot_rows"):
        dataclasses.replace(plan.by_name()["words.weight"], hot_rows=ROWS)
