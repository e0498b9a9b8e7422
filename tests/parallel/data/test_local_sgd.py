"""Local SGD / DiLoCo (ParallelConfig(sync="diloco"), parallel/data/outer.py): the dense
parameters averaged every H steps as an outer optimizer's step.

Checked against: one process (H = 1, SGD inside, outer SGD of lr 1 without momentum is
synchronous training); PyTorch's own local SGD (torch.distributed's PeriodicModelAverager:
parameters averaged every H steps, which is the outer SGD of lr 1 without momentum); and
DiLoCo written out by hand in one process with W model copies (Nesterov outer momentum). The
bytes the outer sync sends are the plan's, exactly.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import tilework
from tests.equivalence import LR, _train, job, reference, torch_optimizer, worst
from tilework import ParallelConfig
from tilework.cluster.topology import Topology
from tilework.comm.groups import build_groups
from tilework.comm.wire import ring_allreduce_bytes
from tilework.data import ShardedBatches
from tilework.errors import ConfigError, InputError, PlanError
from tilework.estimate.cost import outer_sync_bytes
from tilework.planner import plan
from tilework.testing import spawn
from tilework.train.workloads import build

BATCH = 8


def local_sgd(rank, world_size, workload, mode, steps, outer, optimizer="sgd"):
    j = job(workload)
    work = build(j)
    opt = torch_optimizer(optimizer, work.model.parameters(), LR[optimizer])
    tilework.parallelize(work.model, opt, mode=mode, log=False, sync="diloco", **outer)
    sampler = ShardedBatches(len(work.train_set), BATCH, rank, world_size)
    losses = _train(work, opt, sampler, steps)
    stats = tilework.stats(work.model)
    state = tilework.state_dict(work.model, opt)
    return (state if rank == 0 else None), losses, stats


def torch_local_sgd(rank, world_size, workload, steps, every):
    """PyTorch's own: plain local training, parameters averaged by PeriodicModelAverager."""
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    work = build(job(workload))
    opt = torch.optim.SGD(work.model.parameters(), lr=LR["sgd"])
    # It averages at its calls warmup, warmup + period, ...: after steps H, 2H, ... here.
    averager = PeriodicModelAverager(period=every, warmup_steps=every - 1)
    sampler = ShardedBatches(len(work.train_set), BATCH, rank, world_size)
    for step in range(steps):
        work.loss(work.model, work.train_set.collate(sampler.indices(step)), step).backward()
        opt.step()
        # Before zero_grad, as its documentation does: it averages parameters with a gradient.
        averager.average_parameters(list(work.model.parameters()))
        opt.zero_grad()
    dist.barrier()
    return {k: v.clone() for k, v in work.model.state_dict().items()} if rank == 0 else None


def diloco_by_hand(workload, world, steps, every, lr, momentum):
    """W copies in one process, each on its rank's slices; every H steps the outer SGD with
    Nesterov momentum on the mean of (anchor - copy); every copy restarts from the anchor."""
    works = [build(job(workload)) for _ in range(world)]
    anchor = copy.deepcopy(works[0].model)
    outer = torch.optim.SGD(anchor.parameters(), lr=lr, momentum=momentum, nesterov=True)
    inner = [torch.optim.SGD(w.model.parameters(), lr=LR["sgd"]) for w in works]
    samplers = [ShardedBatches(len(works[0].train_set), BATCH, r, world) for r in range(world)]
    for step in range(steps):
        for w, opt, sampler in zip(works, inner, samplers):
            w.loss(w.model, w.train_set.collate(sampler.indices(step)), step).backward()
            opt.step()
            opt.zero_grad()
        if (step + 1) % every == 0:
            for a, *copies in zip(anchor.parameters(), *(w.model.parameters() for w in works)):
                a.grad = torch.stack([a.detach() - c.detach() for c in copies]).mean(0)
            outer.step()
            outer.zero_grad()
            for w in works:
                w.model.load_state_dict(anchor.state_dict())
    return works[0].model.state_dict()


SYNCHRONOUS = {"sync_every": 1, "outer_optimizer": "sgd", "outer_lr": 1.0, "outer_momentum": 0.0}


@pytest.mark.parametrize("workload, mode", [("cnn", "allreduce"), ("lm", "hybrid"),
                                            ("lm", "allreduce"), ("recommender", "allreduce")])
def test_one_step_local_sgd_with_a_plain_outer_step_is_synchronous_training(workload, mode):
    """H = 1: each outer step averages one SGD step's parameters, which is the synchronous
    step; the LM's tables on the servers stay synchronous as always, and tables all-reduced
    (sparse gradients made dense) are replicas averaged on the outer schedule with the rest."""
    ref, ref_losses = reference(workload, "sgd", mode)
    results = spawn(local_sgd, 2, args=(workload, mode, len(ref_losses), SYNCHRONOUS),
                    timeout=180)
    assert worst(results[0][0]["model"], ref) <= 1e-5
    losses = [sum(r[1][s] for r in results) / 2 for s in range(len(ref_losses))]
    assert losses == pytest.approx(ref_losses, rel=1e-5)


def test_local_sgd_equals_pytorchs_periodic_model_averaging():
    steps, every = 8, 4
    ours = spawn(local_sgd, 2, args=("cnn", "allreduce", steps, {
        "sync_every": every, "outer_optimizer": "sgd", "outer_lr": 1.0,
        "outer_momentum": 0.0}), timeout=180)[0][0]["model"]
    theirs = spawn(torch_local_sgd, 2, args=("cnn", steps, every), timeout=180)[0]
    assert worst(ours, theirs) <= 1e-5   # the equivalence suite's SGD tolerance: the outer
    # step computes anchor - mean(anchor - theta_r), torch the mean of theta_r: rounding apart


def test_diloco_with_nesterov_equals_it_written_out_by_hand():
    steps, every, lr, momentum = 6, 2, 0.7, 0.9
    results = spawn(local_sgd, 2, args=("cnn", "allreduce", steps, {
        "sync_every": every, "outer_lr": lr, "outer_momentum": momentum}), timeout=180)
    by_hand = diloco_by_hand("cnn", 2, steps, every, lr, momentum)
    assert worst(results[0][0]["model"], by_hand) <= 1e-5
    # Between syncs the ranks' models differ: their losses do too, which a synchronous run's
    # would not.
    assert results[0][1][1] != results[1][1][1]


def test_the_outer_sync_sends_the_plans_bytes_once_every_h_steps():
    steps, every = 8, 4
    results = spawn(local_sgd, 2, args=("cnn", "allreduce", steps, {"sync_every": every}),
                    timeout=180)
    stats = results[0][2]
    model = build(job("cnn")).model
    made = plan(model, ParallelConfig(mode="allreduce", sync="diloco", sync_every=every),
                topology=Topology.from_sizes([2]))
    dense = [p for p in made.params if p.method == "allreduce"]
    per_sync = outer_sync_bytes([p.nbytes for p in dense], made.bucket_bytes, 2)
    assert stats["total"]["outer"]["sent"] == per_sync * (steps // every)
    assert stats["total"]["outer"]["calls"] == steps // every   # one bucket: under 25 MB
    assert "allreduce" not in stats["total"]   # no gradient all-reduce at all
    # The plan prices each entry at its share of the sync: its ring all-reduce over H steps.
    assert sum(p.predicted.bytes_sent for p in dense) * every == pytest.approx(
        sum(ring_allreduce_bytes(p.nbytes, 2) for p in dense))
    assert made.outer.every == every and "averaged every 4 steps" in dense[0].reason


def test_what_local_sgd_refuses_in_one_line():
    with pytest.raises(ConfigError, match="zero: expected zero 1 or 2 with zero_scope='host' "
                                          "and outer_worker='host' under sync='diloco'"):
        ParallelConfig(sync="diloco", zero=2)
    with pytest.raises(ConfigError, match="zero: expected zero 1 or 2"):
        ParallelConfig(sync="diloco", zero=3, zero_scope="host", outer_worker="host")
    ParallelConfig(sync="diloco", zero=1, zero_scope="host", outer_worker="host")   # HSDP+DiLoCo
    with pytest.raises(ConfigError, match="sync_every: expected a whole number"):
        ParallelConfig(sync="diloco", sync_every=0)
    with pytest.raises(ConfigError, match="outer_momentum"):
        ParallelConfig(sync="diloco", outer_momentum=1.0)
    with pytest.raises(ConfigError, match="sync: expected 'every_step', 'diloco' or 'auto'"):
        ParallelConfig(sync="sometimes")
    with pytest.raises(ConfigError, match="outer_worker: expected 'rank' or 'host'"):
        ParallelConfig(sync="diloco", outer_worker="machine")
    with pytest.raises(ConfigError, match="outer_compress: expected 'none', 'bf16'"):
        ParallelConfig(sync="diloco", outer_compress="fp8")
    # sync="auto" checks them against the period its local-SGD candidates will run at (40)
    with pytest.raises(ConfigError, match="outer_fragments: expected a whole number from 1 to "
                                          "sync_every \\(40\\), got 50"):
        ParallelConfig(plan="auto", sync="auto", outer_fragments=50)
    with pytest.raises(ConfigError, match="outer_schedule: expected 'layerwise' with"):
        ParallelConfig(plan="auto", sync="auto", outer_schedule="layerwise", outer_fragments=2)
    ParallelConfig(plan="auto", sync="auto", outer_fragments=4, outer_delay=3)
    ParallelConfig(sync="every_step", outer_fragments=4)   # not checked where nothing syncs late
    with pytest.raises(ConfigError, match="outer_schedule: expected 'streaming' or 'layerwise'"):
        ParallelConfig(sync="diloco", outer_schedule="dream")
    with pytest.raises(ConfigError, match="outer_schedule: expected 'layerwise' with "
                                          "sync_every >= 2 and outer_fragments, outer_delay"):
        ParallelConfig(sync="diloco", sync_every=8, outer_fragments=2,
                       outer_schedule="layerwise")
    with pytest.raises(PlanError, match="outer_worker: 'host' .* these have \\[2, 1\\] ranks"):
        plan(build(job("cnn")).model, ParallelConfig(sync="diloco", outer_worker="host"),
             topology=Topology.from_sizes([2, 1]))


def _no_optimizer(rank, world_size):
    work = build(job("cnn"))
    try:
        tilework.parallelize(work.model, None, mode="allreduce", sync="diloco", log=False)
    except PlanError as e:
        return str(e)


def test_local_sgd_needs_the_optimizer():
    assert "sync='diloco' takes its outer step after optimizer.step()" in \
        spawn(_no_optimizer, 1, timeout=60)[0]


def resumed(rank, world_size, path, stop, steps, outer, saved_at=4):
    """Adam inside, DiLoCo outside: train to `stop` and save (tilework.save), or, when `stop`
    is None, load what was saved at step `saved_at` and train to `steps`. Returns rank 0's
    final state. Four ranks are two hosts of two."""
    work = build(job("cnn"))
    opt = torch_optimizer("adam", work.model.parameters(), LR["adam"])
    groups = build_groups(dist.group.WORLD, Topology.uniform(world_size // 2, 2)) \
        if world_size == 4 else None
    tilework.parallelize(work.model, opt, mode="allreduce", log=False, sync="diloco",
                         groups=groups, **outer)
    sampler = ShardedBatches(len(work.train_set), BATCH, rank, world_size)
    start = 0
    if stop is None:
        tilework.load(path, work.model, opt)
        start = saved_at
    for step in range(start, stop if stop is not None else steps):
        work.loss(work.model, work.train_set.collate(sampler.indices(step)), step).backward()
        opt.step()
        opt.zero_grad()
    if stop is not None:
        tilework.save(path, work.model, opt)
    state = tilework.state_dict(work.model, opt)
    return state if rank == 0 else None


@pytest.mark.parametrize("world, extra, at", [
    (2, {}, 4),
    (2, {"sync_every": 4}, 3),
    (2, {"outer_compress": "int4", "sync_every": 4, "outer_fragments": 2, "outer_delay": 1}, 4),
    (4, {"outer_worker": "host", "zero": 2, "zero_scope": "host", "outer_compress": "int8"}, 4),
    (2, {"sync_every": 4, "outer_schedule": "layerwise"}, 4),
    # saved with a group's exchange in flight (launched after step 3, landing after step 4)
    (2, {"sync_every": 4, "outer_schedule": "layerwise", "outer_compress": "int8"}, 3)],
    ids=["plain", "mid-period", "int4-streamed", "hosts-zero2-int8", "layerwise",
         "layerwise-in-flight-int8"])
def test_a_resume_at_a_sync_is_exact_with_each_ranks_own_inner_optimizer(tmp_path, world,
                                                                         extra, at):
    """Each rank's Adam moments are its own between syncs; the checkpoint keeps every rank's,
    and the outer loop's anchor and momentum (and, compressed, every rank's error feedback;
    streamed, or saved mid-period, every rank's parameters, which differ then; sharded by ZeRO
    inside each host, every host's moments, put back into the shards): resuming gives bit for
    bit the uninterrupted run's parameters, its outer momentum and every rank's inner state."""
    outer = {"sync_every": 2, "outer_lr": 0.7, "outer_momentum": 0.9, **extra}
    compress = outer.get("outer_compress", "none")
    whole = spawn(resumed, world, args=(str(tmp_path / "unused.pt"), 8, 8, outer),
                  timeout=180)[0]
    spawn(resumed, world, args=(str(tmp_path / "at.pt"), at, 8, outer), timeout=180)
    again = spawn(resumed, world, args=(str(tmp_path / "at.pt"), None, 8, outer, at),
                  timeout=180)[0]
    for k, v in whole["model"].items():
        assert torch.equal(v, again["model"][k]), k
    for name, m in whole["outer"]["momentum"].items():
        assert torch.equal(m, again["outer"]["momentum"][name]), name
    for mine, theirs in zip(whole["outer"]["inner"], again["outer"]["inner"]):
        for name, s in mine.items():
            assert torch.equal(s["exp_avg"], theirs[name]["exp_avg"]), name
    # Between syncs the workers' inner states differ: one copy would not have resumed them.
    first = next(iter(whole["outer"]["inner"][0]))
    assert not torch.equal(whole["outer"]["inner"][0][first]["exp_avg"],
                           whole["outer"]["inner"][-1][first]["exp_avg"])
    if compress != "none":   # what the encodings still owe, each rank its own
        owed = [own["feedback"] for own in whole["outer"]["own"]]
        assert len(owed) == world and not torch.equal(owed[0][0][0], owed[1][0][0])
        assert owed[0][0][0].abs().max() > 0
        for mine, theirs in zip(owed, [own["feedback"] for own in again["outer"]["own"]]):
            assert all(torch.equal(a, b) for pair, other in zip(mine, theirs)
                       for a, b in zip(pair, other))
    if "outer_fragments" in outer or "outer_schedule" in outer:   # ranks' own differ
        mine, theirs = whole["outer"]["own"]
        assert any(not torch.equal(v, theirs["params"][k]) for k, v in mine["params"].items())


def _dense_adam_on_a_sparse_table(rank, world_size):
    work = build(job("lm"))   # its embedding gives sparse gradients
    opt = torch.optim.Adam(work.model.parameters(), lr=LR["adam"])
    tilework.parallelize(work.model, opt, mode="allreduce", log=False, sync="diloco",
                         sync_every=2)
    sampler = ShardedBatches(len(work.train_set), BATCH, rank, world_size)
    return _train(work, opt, sampler, 4)


def test_a_sparse_tables_gradient_is_made_dense_as_the_buckets_make_it():
    """Under every-step sync the buckets hand the optimizer a dense gradient for an
    all-reduced table, so a dense Adam works; with nothing bucketed local SGD does the same
    (it used to hand Adam the sparse one, which it refuses)."""
    losses = spawn(_dense_adam_on_a_sparse_table, 2, timeout=120)
    assert all(torch.isfinite(torch.tensor(r)).all() for r in losses)


def test_a_checkpoint_taken_while_an_exchange_is_in_flight_resumes_it_at_its_landing(tmp_path):
    """With a delay the exchange runs beside inner steps; a checkpoint between its launch and
    its landing does not hold it (nor what its encoding owed since): the resumed run starts it
    again at the landing, from the parameters then, and trains on."""
    outer = {"sync_every": 4, "outer_delay": 2, "outer_compress": "int8", "outer_lr": 0.7,
             "outer_momentum": 0.9}
    whole = spawn(resumed, 2, args=(str(tmp_path / "unused.pt"), 8, 8, outer), timeout=180)[0]
    spawn(resumed, 2, args=(str(tmp_path / "at3.pt"), 3, 8, outer), timeout=180)   # in flight
    again = spawn(resumed, 2, args=(str(tmp_path / "at3.pt"), None, 8, outer, 3),
                  timeout=180)[0]
    # Not the same sync as the uninterrupted run's (its pseudo-gradient is two steps later),
    # so not equal: it landed (momentum), trained on, and stayed finite.
    assert all(torch.isfinite(v).all() for v in again["model"].values())
    assert set(again["outer"]["momentum"]) == set(whole["outer"]["momentum"])
    assert not all(torch.equal(again["model"][k], v) for k, v in whole["model"].items())


def test_after_a_refused_outer_step_the_next_period_syncs_on_time():
    """A non-finite average is refused (InputError naming the rank whose own was not finite,
    nothing applied: it used to fail building that error); a loop that catches it and goes on
    gets the next period's sync at its step, with nothing owed by the refused encodings (one
    rank: the sync is the outer step alone)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tilework.parallelize(model, opt, mode="allreduce", log=False, sync="diloco", sync_every=2,
                         outer_compress="int8")
    landed = []
    outer = model._tilework_engine.outer
    for step in range(6):
        model(torch.randn(3, 4)).sum().backward()
        if step == 1:
            with torch.no_grad():
                model.weight[0, 0] = float("nan")
        try:
            opt.step()
        except InputError as e:
            assert e.ranks == (0,) and "inner steps of rank(s) [0] diverged" in str(e)
            landed.append("refused")
            with torch.no_grad():   # the user's own repair: back to the last sync
                model.weight.copy_(outer.anchors["weight"])
        opt.zero_grad()
        landed.append(outer.inner_steps)
    assert landed == [1, "refused", 0, 1, 0, 1, 0]
    assert all(torch.isfinite(b.error).all() for b in outer.buckets)
    assert torch.isfinite(model.weight).all()


def _one_rank_diverges(rank, world_size):
    work = build(job("cnn"))
    opt = torch.optim.SGD(work.model.parameters(), lr=LR["sgd"])
    tilework.parallelize(work.model, opt, mode="allreduce", log=False, sync="diloco",
                         sync_every=2, outer_compress="int4")
    sampler = ShardedBatches(len(work.train_set), BATCH, rank, world_size)
    for step in range(2):
        work.loss(work.model, work.train_set.collate(sampler.indices(step)), step).backward()
        if rank == 1 and step == 1:
            with torch.no_grad():
                next(work.model.parameters()).fill_(float("inf"))
        try:
            opt.step()
        except InputError as e:
            return e.ranks, str(e)
        opt.zero_grad()


def test_every_rank_refuses_the_outer_step_together_naming_the_rank_that_diverged():
    for ranks, message in spawn(_one_rank_diverges, 2, timeout=120):
        assert ranks == (1,)
        assert "not finite at the outer step (the inner steps of rank(s) [1] diverged)" in message


def _zero_shards_after_layerwise_landings(rank, world_size):
    work = build(job("cnn"))
    opt = torch_optimizer("adam", work.model.parameters(), LR["adam"])
    groups = build_groups(dist.group.WORLD, Topology.uniform(2, 2))
    tilework.parallelize(work.model, opt, mode="allreduce", log=False, sync="diloco",
                         sync_every=4, outer_schedule="layerwise", outer_worker="host", zero=2,
                         zero_scope="host", groups=groups)
    engine = work.model._tilework_engine
    sampler = ShardedBatches(len(work.train_set), BATCH, rank, world_size)
    behind = []
    for step in range(6):
        work.loss(work.model, work.train_set.collate(sampler.indices(step)), step).backward()
        opt.step()
        opt.zero_grad()
        behind.append([s.name for s in engine.zero.shards
                       if not torch.equal(s.shard, s.take(s.param.detach()))])
    return behind


def test_a_layerwise_landing_under_zero_retakes_the_shards_of_its_group():
    """ZeRO inside each host, a layer-wise group landing after each step: the landing writes
    its group's parameters and only their shards are taken again (not every shard, every
    landing); after every step each rank's shards are its parameters' own slices."""
    for behind in spawn(_zero_shards_after_layerwise_landings, 4, timeout=180):
        assert behind == [[]] * 6
