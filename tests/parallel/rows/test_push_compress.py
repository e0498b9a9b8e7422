"""The servers' push in half width (ParallelConfig(push_compress="bf16")): each rank's gradient
rows cast to bf16 for the wire, cast back at their owner and summed there in float32. Two real
ranks against the same rounding written out in one process, the bytes against the cost model's,
and the plan's entries and config."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import tilework
from tests.parallel.rows.test_lookups import TABLES, Recommender, batch
from tilework import ParallelConfig
from tilework.cluster.topology import Topology
from tilework.errors import ConfigError
from tilework.estimate.cost import ps_step_bytes
from tilework.planner import plan
from tilework.plans.plan import config_of
from tilework.testing import spawn

STEPS, LR = 4, 0.1


def _train(rank, world_size, push_compress, full_width=()):
    """`full_width`: tables whose entries are set back to push as they are (two widths in one
    pull, as push_compress="auto" may plan them)."""
    model = Recommender()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    made = plan(model, ParallelConfig(mode="hybrid", push_compress=push_compress),
                topology=Topology.from_sizes([world_size]))
    made = dataclasses.replace(made, params=tuple(
        dataclasses.replace(p, push_dtype="") if p.name in full_width else p
        for p in made.params))
    tilework.parallelize(model, opt, plan=made, log=False)
    sent = []
    for step in range(STEPS):
        ids, y = batch(step, rank, world_size)
        nn.functional.mse_loss(model(ids), y).backward()
        opt.step()
        opt.zero_grad()
        sent.append(tilework.stats(model)["last_step"]["ps"]["sent"])
    meetings = tilework.stats(model)["last_step"]["allreduce"]["calls"]
    state = tilework.state_dict(model, opt)["model"]   # whole on rank 0 (None elsewhere)
    state = {k: v.clone() for k, v in state.items() if v is not None}
    return state, sent, model._tilework_engine.plan, meetings


def _written_out(world: int = 2, rounded=lambda name: name.startswith("tables")) -> dict:
    """One process: each rank's half batch's gradient rows (summed per id, as its pull merged
    them) rounded to bf16, the ranks' rounded rows summed and averaged; the dense head's
    gradient averaged as it is."""
    model = Recommender()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        grads = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
        for rank in range(world):
            model.zero_grad()
            ids, y = batch(step, rank, world)
            nn.functional.mse_loss(model(ids), y).backward()
            for name, p in model.named_parameters():
                g = p.grad.coalesce().to_dense() if p.grad.is_sparse else p.grad
                grads[name] += g.to(torch.bfloat16).float() if rounded(name) else g
        for name, p in model.named_parameters():
            p.grad = grads[name] / world
        opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_a_half_width_push_trains_as_its_rounding_written_out_and_halves_the_rows():
    ours = spawn(_train, 2, args=("bf16",), timeout=120)
    want = _written_out()
    for k, v in want.items():
        assert torch.equal(ours[0][0][k], v), k
    made = ours[0][2]
    assert {p.push_dtype for p in made.of("ps")} == {"bfloat16"}
    blocks = {}
    for step in range(STEPS):
        ids = [batch(step, r, 2)[0] for r in range(2)]
        want_bytes = ps_step_bytes(made.of("ps"), [[i[:, t] for i in ids] for t in range(TABLES)],
                                   Topology.uniform(1, 2), made.local_aggregation, blocks)
        assert [ours[r][1][step] for r in range(2)] == want_bytes, step
    # The dense head's small bucket still rides the push, its bits viewed in bf16: no meeting
    # of its own, as at full width.
    assert ours[0][3] == 0
    plain = spawn(_train, 2, args=("none",), timeout=120)
    assert plain[0][3] == 0
    assert sum(ours[0][1]) < sum(plain[0][1])   # the pushed rows at half their bytes
    assert not all(torch.equal(plain[0][0][k], v) for k, v in ours[0][0].items())


def test_the_plan_carries_the_push_width_and_refuses_it_where_it_means_nothing():
    made = plan(Recommender(), ParallelConfig(mode="hybrid", push_compress="bf16"),
                topology=Topology.from_sizes([2]))
    tables = made.of("ps")
    assert tables and all(p.push_dtype == "bfloat16" and p.push_row_bytes == 4 * 2
                          and p.row_bytes == 4 * 4 for p in tables)
    assert config_of(made).push_compress == "bf16"
    assert all(not p.push_dtype for p in made.of("allreduce"))
    with pytest.raises(ConfigError,
                       match="push_compress: expected 'none', 'bf16' or 'auto'"):
        ParallelConfig(push_compress="int8")
    with pytest.raises(ValueError, match="push_dtype is a server table's push width"):
        type(tables[0])(**{**{f: getattr(tables[0], f) for f in
                              tables[0].__dataclass_fields__}, "method": "allreduce"})


def _two_pulls(rank, world_size, push_compress, how):
    """test_early_push's model (output tables pushed while backward runs) with accumulation
    (a table looked up twice: its ids ride with the rows) or plain steps."""
    from tests.parallel.rows import test_early_push as early

    model = early.TwoPulls()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tilework.parallelize(model, opt, mode="hybrid", log=False, push_compress=push_compress)
    engine, flying, losses = model._tilework_engine, [], []
    model.mid.weight.register_post_accumulate_grad_hook(
        lambda _: flying.append(len(engine.early.flying)))
    for step in range(early.STEPS):
        if how == "accumulate":
            first, second = early.micro_batches(step, rank, world_size)
            with model.no_sync():
                (nn.functional.mse_loss(model(*first[:2]), first[2]) / 2).backward()
            loss = nn.functional.mse_loss(model(*second[:2]), second[2]) / 2
        else:
            ids, targets, y = early.batch(step, rank, world_size)
            loss = nn.functional.mse_loss(model(ids, targets), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, flying, tilework.stats(model)["total"]["ps"]["sent"]


@pytest.mark.parametrize("how", ["plain", "accumulate"])
def test_the_early_push_and_rows_carrying_their_ids_go_in_half_width_too(how):
    """Early pushes (retraced rows, beside backward) and accumulated lookups (ids ride in the
    rows, viewed as bf16) both cross in bf16, and train as the full-width push to its rounding."""
    half = spawn(_two_pulls, 2, args=("bf16", how), timeout=120)
    full = spawn(_two_pulls, 2, args=("none", how), timeout=120)
    assert half[0][0] == pytest.approx(full[0][0], rel=1e-3)
    assert half[0][0][0] == full[0][0][0] and half[0][0][-1] != full[0][0][-1]   # rounded
    assert half[0][2] < full[0][2]
    if how == "plain":
        assert any(half[0][1])   # pushes were in flight while backward ran


def test_push_compress_auto_halves_a_tables_push_on_a_slow_link_and_not_on_a_fast_one():
    """Each table whose traffic is modelled weighs its push in bf16 against as it is: taken
    only where its predicted exchange is at least PUSH_COMPRESS_GAIN shorter."""
    from tilework.cluster.topology import Link, Links
    from tilework.estimate.cost import TableTraffic
    from tilework.models.lm import WordLM
    from tilework.planner.tables import make_plan
    from tilework.plans.analysis import analyze

    topo = Topology.uniform(4, 1)
    infos = analyze(WordLM(100_000, 64, 16, 1, sparse=True))
    traffic = {"embedding.weight": TableTraffic.zipf(100_000, 640, topo)}

    def table(link):
        return make_plan(infos, 4, topology=topo, links=Links(inter=link), traffic=traffic,
                         push_dtype="auto").by_name()["embedding.weight"]

    fast, slow = table(Link(100.0, 500.0)), table(Link(0.1, 50.0))   # latency-, bytes-bound
    assert fast.method == slow.method == "ps"
    assert fast.push_dtype == "" and "push in bf16" not in fast.reason
    assert slow.push_dtype == "bfloat16" and "its push in bf16" in slow.reason, slow.reason
    from tilework.cluster.topology import Cluster, Host

    cluster = Cluster([Host(f"h{i}", 1) for i in range(4)], links=Links(inter=Link(0.1, 50.0)))
    made = plan(WordLM(100_000, 64, 16, 1, sparse=True),
                ParallelConfig(mode="hybrid", push_compress="auto"), cluster, traffic=traffic)
    assert made.by_name()["embedding.weight"].push_dtype == "bfloat16"
    assert config_of(made).push_compress == "auto"   # as planned, whatever each table took
    one = plan(WordLM(1000, 16, 16, 1, sparse=True), ParallelConfig(push_compress="bf16"))
    assert not any(p.push_dtype for p in one.params)   # one rank: nothing crosses


def test_tables_of_two_widths_pulled_together_push_each_in_its_own():
    """Under "auto" one pull's tables may differ in push width: each crosses in its own (two
    exchanges), bit for bit the rounding of those tables only, bytes the cost model's."""
    ours = spawn(_train, 2, args=("bf16", ("tables.1.weight",)), timeout=120)
    want = _written_out(rounded=lambda name: name in ("tables.0.weight", "tables.2.weight"))
    for k, v in want.items():
        assert torch.equal(ours[0][0][k], v), k
    made, blocks = ours[0][2], {}
    assert made.by_name()["tables.1.weight"].push_dtype == ""
    for step in range(STEPS):
        ids = [batch(step, r, 2)[0] for r in range(2)]
        want_bytes = ps_step_bytes(made.of("ps"), [[i[:, t] for i in ids] for t in range(TABLES)],
                                   Topology.uniform(1, 2), made.local_aggregation, blocks)
        assert [ours[r][1][step] for r in range(2)] == want_bytes, step
