"""Uneven batch shares on a tp, cp or pp mesh (ParallelConfig(batch_shares=[...], tp=2 | cp=2 |
pp=2)): each data-parallel replica takes its own count of the global batch, every rank of a
replica the same, and the model trains as one process on the global batch (FlashFlex's
per-replica batch; issue 27). Under pp each replica's pipeline cuts its share into its equal
microbatches and seeds its last stage's backward with the replica's weight. The reference GPT
on 4 ranks, SGD, against one process; tolerance as the mesh suite's (the tp sums and dp
all-reduce reorder additions)."""

from __future__ import annotations

import pytest
import torch

import tilework
from tests import tiny_gpt
from tests.runtime.test_mesh_parallelize import GLOBAL_BATCH, SEQ, STEPS, TOL, VOCAB, new_gpt
from tilework import ParallelConfig
from tilework.errors import ConfigError
from tilework.testing import spawn


def _slice(step: int, shares, replica: int):
    tokens, targets = tiny_gpt.gpt_batch(step, VOCAB, SEQ, GLOBAL_BATCH)
    start = sum(shares[:replica])
    return tokens[start:start + shares[replica]], targets[start:start + shares[replica]]


def _reference():
    model = new_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        loss = model(*tiny_gpt.gpt_batch(step, VOCAB, SEQ, GLOBAL_BATCH))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def _train(rank, world_size, options):
    model = new_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = tilework.parallelize(model, opt, log=False, **options)
    replica, replicas = tilework.data_parallel_rank(model)
    shares = tilework.batch_shares(model)
    losses = []
    for step in range(STEPS):
        if options.get("pp", 1) > 1:   # the last stage's ranks return the replica's loss
            loss = model.step(*_slice(step, shares, replica))
        else:
            loss = model(*_slice(step, shares, replica))
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(None if loss is None else loss.item())
    return {"losses": losses, "replica": replica, "replicas": replicas, "shares": shares,
            "state": tilework.state_dict(model, opt)["model"]}


@pytest.mark.parametrize("options", [
    {"tp": 2, "batch_shares": [6, 2]}, {"cp": 2, "batch_shares": [2, 6]},
    {"pp": 2, "microbatches": 2, "batch_shares": [6, 2]},
    {"pp": 2, "microbatches": 2, "schedule": "gpipe", "batch_shares": [2, 6]}],
    ids=["tp2", "cp2", "pp2-1f1b", "pp2-gpipe"])
def test_replicas_of_a_mesh_take_their_shares_and_train_as_one_process(options):
    losses, state = _reference()
    results = spawn(_train, 4, (options,), timeout=300)
    shares = options["batch_shares"]
    for r in results:
        assert r["shares"] == shares and r["replicas"] == 2
        _assert_one_process(state, r["state"])
    # Each replica's mean loss weighted by its share is the global batch's (every rank of a
    # replica computes its replica's, or under cp its own tokens' half; under pp its last
    # stage's ranks).
    for step in range(STEPS):
        told = [r for r in results if r["losses"][step] is not None]
        weighted = sum(r["losses"][step] * shares[r["replica"]] for r in told) \
            / sum(shares[r["replica"]] for r in told)
        assert abs(weighted - losses[step]) <= 1e-5 * abs(losses[step]), step


def test_a_mesh_plan_takes_one_share_per_replica():
    with pytest.raises(ConfigError, match="batch_shares: expected with pp, counts that split "
                                          "into the 4 equal microbatches"):
        ParallelConfig(pp=2, microbatches=4, batch_shares=[6, 2])
    from tilework.cluster.topology import Topology

    with torch.device("meta"):
        model = new_gpt()
    piped = tilework.plan(model, ParallelConfig(pp=2, microbatches=2, batch_shares=[6, 2]),
                          topology=Topology.from_sizes([4]))
    assert piped.rank_shares() == tuple(
        (6, 2)[piped.mesh.coords(r)["dp"]] for r in range(4))
    assert piped.part(0).batch_shares == piped.part(1).batch_shares == (6, 2)
    made = tilework.plan(model, ParallelConfig(tp=2, batch_shares=[6, 2]),
                         topology=Topology.from_sizes([4]))
    assert made.batch_shares == (6, 2) and made.rank_shares() == (6, 6, 2, 2)
    assert made.part(0).batch_shares == (6, 2)
    cp = tilework.plan(model, ParallelConfig(cp=2, batch_shares=[6, 2]),
                       topology=Topology.from_sizes([4]))
    assert cp.part(0).batch_shares == (6, 6, 2, 2)   # the dp x cp group, dp-major
    with pytest.raises(ConfigError, match="batch_shares: expected 'auto' where tp, cp or pp"):
        ParallelConfig(plan="auto", tp="auto", batch_shares=[6, 2])
    from tilework.cluster.topology import Cluster, Host
    from tilework.report.job import shares_section
    from tilework.report.tables import _shares_lines

    hosts = Cluster([Host("a", 2, speed=3.0), Host("b", 2, speed=1.0)])
    section = shares_section(made, hosts)["shares"]
    assert section["batch_shares"] == [6, 6, 2, 2]   # each rank's: its replica's
    assert "rank 3: 2 at speed 1" in _shares_lines({"shares": section})[0]
    with pytest.raises(tilework.errors.PlanError, match="one per data-parallel replica \\(2\\)"):
        tilework.plan(model, ParallelConfig(tp=2, batch_shares=[6, 1, 1]),
                      topology=Topology.from_sizes([4]))


def _trained_evenly(options):
    """The reference GPT parallelized with `options` and trained on even replica slices:
    (model, optimizer, this rank's replica)."""
    model = new_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = tilework.parallelize(model, opt, log=False, **options)
    replica, replicas = tilework.data_parallel_rank(model)
    even = [GLOBAL_BATCH // replicas] * replicas
    for step in range(STEPS):
        if options.get("pp", 1) > 1:
            model.step(*_slice(step, even, replica))
        else:
            model(*_slice(step, even, replica)).backward()
        opt.step()
        opt.zero_grad()
    return model, opt, replica


def _assert_one_process(state, got):
    for k, v in state.items():
        scale = v.abs().max().item() + 1e-12
        assert (got[k] - v).abs().max().item() / scale <= TOL, k


def _train_with_zero_weights(rank, world_size, options):
    model, opt, replica = _trained_evenly(options)
    engine = (model.part if options.get("pp", 1) > 1 else model)._tilework_engine
    return {"replica": replica, "own": sum(s.own for s in engine.zero.shards),
            "elements": sum(s.numel for s in engine.zero.shards),
            "state": tilework.state_dict(model, opt)["model"]}


@pytest.mark.parametrize("options", [
    {"tp": 2, "zero": 2, "zero_weights": [3, 1]},
    {"tp": 2, "zero": 3, "zero_weights": [1, 3]},
    {"pp": 2, "microbatches": 2, "zero": 1, "zero_weights": [3, 1]}],
    ids=["tp2-zero2", "tp2-zero3", "pp2-zero1"])
def test_zero_chunks_by_weight_on_a_mesh_train_as_one_process(options):
    """ZeRO's chunks cut by weight on a tp or pp mesh (`zero_weights`: one per data-parallel
    replica, as a host's memory gives them): each replica's ranks keep their weight's share of
    the shards of what they hold, and the model trains as one process."""
    _, state = _reference()
    results = spawn(_train_with_zero_weights, 4, (options,), timeout=300)
    weights = options["zero_weights"]
    for r in results:
        _assert_one_process(state, r["state"])
        share = weights[r["replica"]] / sum(weights)
        assert r["own"] == pytest.approx(share * r["elements"], rel=0.02, abs=64)


def _train_served_unevenly(rank, world_size, options):
    from tilework.plans.rows import TableLayout

    model, opt, replica = _trained_evenly(options)
    engine = model._tilework_engine
    part = engine.plan
    rows = {p.name: len(TableLayout(p, part.world_size).shard_rows(engine.groups.rank))
            for p in part.of("ps")}
    return {"replica": replica, "rows": rows, "state": tilework.state_dict(model, opt)["model"]}


def test_a_table_served_unevenly_on_a_tp_mesh_trains_as_one_process():
    """The token embedding on the servers of each dp group while tp splits the blocks, served
    3:1 between the replicas (`server_weights`, one per replica on a mesh: a host with less
    memory serves fewer rows): each replica's ranks serve their weight's share of the rows,
    within a partition, and the model trains as one process."""
    from tests.runtime.test_mesh_parallelize import SERVED_TOKENS

    _, state = _reference()
    weights = [3, 1]
    results = spawn(_train_served_unevenly, 4, ({**SERVED_TOKENS, "server_weights": weights},),
                    timeout=300)
    for r in results:
        _assert_one_process(state, r["state"])
        assert r["rows"], "no table on the servers"
        rows = r["rows"]["tokens.weight"]
        assert rows == pytest.approx(VOCAB * weights[r["replica"]] / sum(weights), abs=VOCAB / 8)


def test_replicas_served_unevenly_are_estimated_and_searched_each_as_itself():
    """Replicas that serve different rows do not mirror each other: the memory estimate gives
    each its own shard (it took the first replica's for all), and plan="auto" on the user's
    mesh keeps the weights (it dropped them on any mesh)."""
    from tests.runtime.test_mesh_parallelize import SERVED_TOKENS
    from tilework.cluster.topology import Cluster, Host, Topology
    from tilework.estimate.plan_memory import plan_memory
    from tilework.planner.search import Space, configs

    with torch.device("meta"):
        model = new_gpt()
    config = ParallelConfig(**SERVED_TOKENS, server_weights=[3, 1])
    made = tilework.plan(model, config, topology=Topology.from_sizes([4]))
    tokens = torch.zeros(2, SEQ, dtype=torch.long)
    held = [e.parameters for e in plan_memory(model, made, (tokens, tokens))]
    replica = [made.mesh.coords(r)["dp"] for r in range(4)]
    assert held[replica.index(0)] > held[replica.index(1)]
    assert held == [e.parameters for r in range(4)
                    for e in plan_memory(model, made, (tokens, tokens), ranks=[r])]
    found = configs(ParallelConfig(**SERVED_TOKENS, server_weights=[3, 1], plan="auto"),
                    Space(zero=(), recompute=()), Cluster([Host("a", 4)]), layers=4)
    assert found and all(c.server_weights == [3, 1] for c in found)
