"""Local SGD over hosts and in compressed encodings (ParallelConfig(outer_worker=...,
outer_compress=...), parallel/data/outer.py).

Checked against DiLoCo written out by hand in one process: with a host as the worker its ranks
are one replica on the mean of their gradients, and the compressed sync is the encodings'
round trip with both error feedbacks (1-bit Adam's worker and server errors), written out
here with the codec's own encode and decode. The bytes counted are the cost model's, exactly,
and under host workers all that crosses hosts is the outer sync's."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import tilework
from tests.equivalence import LR, _train, job, worst
from tilework import ParallelConfig
from tilework.cluster.topology import Topology
from tilework.comm.codec import decode, encode, multiple_of
from tilework.comm.groups import build_groups
from tilework.comm.wire import ring_allreduce_bytes
from tilework.data import ShardedBatches
from tilework.estimate.cost import outer_bucket_wire, outer_sync_wire, zero_sync_bytes
from tilework.planner import plan
from tilework.plans.plan import OuterSync, config_of, fragments_of, layerwise_groups, sync_slots
from tilework.testing import spawn
from tilework.train.workloads import build

BATCH, STEPS, EVERY, OUTER_LR, MOMENTUM = 8, 6, 2, 0.7, 0.9


def trained(rank, world_size, hosts, worker, codec, zero):
    work = build(job("cnn"))
    opt = torch.optim.SGD(work.model.parameters(), lr=LR["sgd"])
    groups = build_groups(dist.group.WORLD, Topology.uniform(hosts, world_size // hosts))
    tilework.parallelize(work.model, opt, groups=groups, mode="allreduce", log=False,
                         sync="diloco", sync_every=EVERY, outer_lr=OUTER_LR,
                         outer_momentum=MOMENTUM, outer_worker=worker, outer_compress=codec,
                         zero=zero, zero_scope="host" if zero else "world")
    sampler = ShardedBatches(len(work.train_set), BATCH, rank, world_size)
    losses = _train(work, opt, sampler, STEPS)
    state = {k: v.detach().clone() for k, v in work.model.state_dict().items()}
    return state, losses, tilework.stats(work.model)


def averaged_by_hand(pseudo: list[torch.Tensor], per_worker: int, codec: str,
                     errors: dict, owner_errors: dict) -> torch.Tensor:
    """The runtime's average of the workers' flat pseudo-gradients, written out: each worker's
    rank l carries slice l; compressed, parts are encoded (plus what the last encoding lost),
    averaged by their owner (plus what its last average lost), encoded again."""
    workers, numel = len(pseudo), pseudo[0].numel()
    unit = per_worker * (1 if codec == "none" else workers * multiple_of(codec))
    padded = -(-numel // unit) * unit
    flats = [torch.nn.functional.pad(p, (0, padded - numel)).view(per_worker, -1)
             for p in pseudo]
    slices = []
    for lane in range(per_worker):
        if codec == "none":
            slices.append(sum(f[lane] for f in flats) / workers)
            continue
        sent = []
        for w, f in enumerate(flats):
            v = f[lane] + errors.get((w, lane), 0)
            enc = encode(v.view(workers, -1), codec)
            errors[(w, lane)] = v - decode(enc, codec, v.numel() // workers).view(-1)
            sent.append(enc)
        parts = []
        for owner in range(workers):
            k = flats[0].shape[1] // workers
            avg = sum(decode(s[owner:owner + 1], codec, k) for s in sent).view(-1) / workers
            avg = avg + owner_errors.get((owner, lane), 0)
            reply = encode(avg.view(1, -1), codec)
            owner_errors[(owner, lane)] = avg - decode(reply, codec, k).view(-1)
            parts.append(decode(reply, codec, k).view(-1))
        slices.append(torch.cat(parts))
    return torch.cat(slices)[:numel]


def diloco_by_hand(world, hosts, worker, codec):
    """One model copy per worker, on the mean of its ranks' gradients; every EVERY steps the
    Nesterov outer step on the average above; every copy restarts from the anchor."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # as each rank computes (tilework.testing): conv kernels' sums
    try:                       # differ by thread count, and int4 turns that into a level
        return _diloco_by_hand(world, hosts, worker, codec)
    finally:
        torch.set_num_threads(threads)


def _diloco_by_hand(world, hosts, worker, codec):
    per_host = world // hosts
    workers, per_worker = (hosts, per_host) if worker == "host" else (world, 1)
    works = [build(job("cnn")) for _ in range(workers)]
    anchor = copy.deepcopy(works[0].model)
    outer = torch.optim.SGD(anchor.parameters(), lr=OUTER_LR, momentum=MOMENTUM, nesterov=True)
    inner = [torch.optim.SGD(w.model.parameters(), lr=LR["sgd"]) for w in works]
    samplers = [ShardedBatches(len(works[0].train_set), BATCH, r, world) for r in range(world)]
    errors, owner_errors = {}, {}
    order = list(reversed(list(anchor.parameters())))   # the bucket's order
    for step in range(STEPS):
        for w, (work, opt) in enumerate(zip(works, inner)):
            # The host's ranks' gradients summed and halved as the all-reduce does: the same
            # rounding, which an int4 encoding would otherwise turn into a level apart.
            grads = []
            for r in range(w * per_worker, (w + 1) * per_worker):
                work.loss(work.model, work.train_set.collate(samplers[r].indices(step)),
                          step).backward()
                grads.append([p.grad.clone() for p in work.model.parameters()])
                opt.zero_grad()
            for p, *mine in zip(work.model.parameters(), *grads):
                p.grad = sum(mine[1:], mine[0]) / per_worker
            opt.step()
            opt.zero_grad()
        if (step + 1) % EVERY:
            continue
        pseudo = []
        for work in works:
            mine = list(reversed(list(work.model.parameters())))
            pseudo.append(torch.cat([(a - p).detach().reshape(-1) for a, p in zip(order, mine)]))
        flat = averaged_by_hand(pseudo, per_worker, codec, errors, owner_errors)
        offset = 0
        for a in order:
            a.grad = flat[offset:offset + a.numel()].view_as(a).clone()
            offset += a.numel()
        outer.step()
        outer.zero_grad()
        for work in works:
            work.model.load_state_dict(anchor.state_dict())
    return works[0].model.state_dict()


@pytest.mark.parametrize("world, hosts, worker, codec, zero", [
    (4, 2, "host", "none", 2), (2, 1, "rank", "int8", 0), (4, 2, "host", "int4", 1)])
def test_local_sgd_over_hosts_and_compressed_is_diloco_by_hand_and_sends_the_plans_bytes(
        world, hosts, worker, codec, zero):
    """Host workers here shard with ZeRO inside the host (HSDP inside, DiLoCo across): the
    shards are one optimizer's, so the run is the by-hand one all the same."""
    results = spawn(trained, world, args=(hosts, worker, codec, zero), timeout=240)
    by_hand = diloco_by_hand(world, hosts, worker, codec)
    assert worst(results[0][0], by_hand) <= 1e-5
    per_host = world // hosts
    if worker == "host":   # a host's ranks are one replica
        for r in range(world):
            assert worst(results[r][0], results[r - r % per_host][0]) == 0
    model = build(job("cnn")).model
    nbytes = [p.numel() * p.element_size() for p in model.parameters()]
    workers, per_worker = (hosts, per_host) if worker == "host" else (world, 1)
    wire = outer_sync_wire(nbytes, 25 * 2**20, workers, per_worker, codec)
    syncs = STEPS // EVERY
    for rank, (_, _, stats) in enumerate(results):
        outer = stats["total"]["outer"]
        assert outer["sent"] == wire.sent * syncs, rank
        if worker == "host":
            # Across hosts, only the outer sync; inside, every step's gradient all-reduce, or
            # ZeRO's reduce-scatter and gathers over the host alone.
            assert outer["sent_inter_host"] == wire.across * syncs
            made = plan(model, ParallelConfig(mode="allreduce", zero=zero, zero_scope="host"),
                        topology=Topology.uniform(hosts, per_host))
            inside = sum(zero_sync_bytes(p, per_host, 1)[0] if p.zero
                         else ring_allreduce_bytes(p.nbytes, per_host) for p in made.params)
            got = {m: stats["total"].get(m, {}) for m in ("allreduce", "zero")}
            assert sum(t.get("sent", 0) for t in got.values()) == STEPS * inside
            assert sum(t.get("sent_inter_host", 0) for t in got.values()) == 0
        else:
            assert "allreduce" not in stats["total"]
    if codec == "int4":   # 8 values a 4-byte scale, 2 a byte: about 1/7 of float32
        plain = outer_sync_wire(nbytes, 25 * 2**20, workers, per_worker, "none")
        assert wire.across < plain.across / 6.5


def test_the_plan_prices_a_host_worker_as_the_host_all_reduce_every_step_and_its_sync_share():
    model = build(job("cnn")).model
    topology = Topology.uniform(2, 2)
    made = plan(model, ParallelConfig(mode="allreduce", sync="diloco", sync_every=10,
                                      outer_worker="host", outer_compress="int8"),
                topology=topology)
    for p in made.of("allreduce"):
        wire = outer_bucket_wire(p.numel, 2, 2, "int8")
        assert p.predicted.bytes_sent == pytest.approx(
            wire.sent / 10 + ring_allreduce_bytes(p.nbytes, 2))
        assert "averaged every 10 steps in int8 (local SGD over hosts)" in p.reason
    assert made.outer.worker == "host" and made.outer.compress == "int8"
    assert config_of(made).outer_compress == "int8"   # what a plan.json gives back


def streamed(rank, world_size, every, fragments, delay):
    work = build(job("cnn"))
    opt = torch.optim.SGD(work.model.parameters(), lr=LR["sgd"])
    tilework.parallelize(work.model, opt, mode="allreduce", log=False, sync="diloco",
                         sync_every=every, outer_lr=OUTER_LR, outer_momentum=MOMENTUM,
                         outer_fragments=fragments, outer_delay=delay)
    sampler = ShardedBatches(len(work.train_set), BATCH, rank, world_size)
    _train(work, opt, sampler, 2 * every)
    state = {k: v.detach().clone() for k, v in work.model.state_dict().items()}
    return state, tilework.stats(work.model)


def _copies_by_hand(world, lr=OUTER_LR, momentum=MOMENTUM, nesterov=True):
    """One model copy per rank with its inner SGD and sampler, the anchor with its outer SGD,
    and a function that runs one inner step of every copy."""
    works = [build(job("cnn")) for _ in range(world)]
    anchor = copy.deepcopy(works[0].model)
    outer = torch.optim.SGD(anchor.parameters(), lr=lr, momentum=momentum, nesterov=nesterov)
    inner = [torch.optim.SGD(w.model.parameters(), lr=LR["sgd"]) for w in works]
    samplers = [ShardedBatches(len(works[0].train_set), BATCH, r, world) for r in range(world)]

    def inner_step(step):
        for w, opt, sampler in zip(works, inner, samplers):
            w.loss(w.model, w.train_set.collate(sampler.indices(step)), step).backward()
            opt.step()
            opt.zero_grad()

    return works, anchor, outer, inner_step


def streaming_by_hand(world, every, fragments, delay, mix=0.5):
    """Streaming DiLoCo written out: fragment f's pseudo-gradient taken `delay` steps before
    step (f+1) H / F of each period, its Nesterov outer step landing there, every copy's
    fragment then mix * its own + (1 - mix) * the outer result (the result alone, undelayed)."""
    works, anchor, outer, inner_step = _copies_by_hand(world)
    names = [n for n, _ in anchor.named_parameters()]
    cuts = fragments_of([p.numel() * 4 for p in anchor.parameters()], fragments)
    pending = {}
    for step in range(2 * every):
        inner_step(step)
        into = step % every + 1
        for f, members in enumerate(cuts):
            lands = (f + 1) * every // fragments
            if into == lands - delay:
                pending[f] = {names[i]: torch.stack([
                    dict(anchor.named_parameters())[names[i]].detach()
                    - dict(w.model.named_parameters())[names[i]].detach()
                    for w in works]).mean(0) for i in members}
            if into == lands:
                for n, a in anchor.named_parameters():
                    a.grad = pending[f].get(n)
                outer.step()
                outer.zero_grad()
                for w in works:
                    own = dict(w.model.named_parameters())
                    with torch.no_grad():
                        for n in pending[f]:
                            a = dict(anchor.named_parameters())[n]
                            own[n].copy_(mix * own[n] + (1 - mix) * a if delay else a)
    return works[0].model.state_dict()


@pytest.mark.parametrize("fragments, delay", [(2, 0), (2, 1)])
def test_streaming_fragments_and_an_overlapped_landing_are_streaming_diloco_by_hand(
        fragments, delay):
    every = 4
    results = spawn(streamed, 2, args=(every, fragments, delay), timeout=240)
    assert worst(results[0][0], streaming_by_hand(2, every, fragments, delay)) <= 1e-5
    model = build(job("cnn")).model
    nbytes = [p.numel() * p.element_size() for p in model.parameters()]
    period = outer_sync_wire(nbytes, 25 * 2**20, 2, fragments=fragments)
    assert results[0][1]["total"]["outer"]["sent"] == 2 * period.sent
    # Each sync sends its fragment: about 1/F of the model's.
    assert results[0][1]["total"]["outer"]["calls"] == 2 * fragments


def layered(rank, world_size, every, optimizer, lr, momentum):
    work = build(job("cnn"))
    opt = torch.optim.SGD(work.model.parameters(), lr=LR["sgd"])
    tilework.parallelize(work.model, opt, mode="allreduce", log=False, sync="diloco",
                         sync_every=every, outer_optimizer=optimizer, outer_lr=lr,
                         outer_momentum=momentum, outer_schedule="layerwise")
    sampler = ShardedBatches(len(work.train_set), BATCH, rank, world_size)
    _train(work, opt, sampler, 2 * every)
    state = {k: v.detach().clone() for k, v in work.model.state_dict().items()}
    return state, tilework.stats(work.model)


def layerwise_by_hand(world, every, optimizer, lr, momentum):
    """DreamDDP's partial synchronisation written out: the parameters in H - 1 groups of about
    equal bytes; group g's pseudo-gradients (anchor - own) taken after inner step g + 1 of each
    period, averaged, the outer step landing after step g + 2, every copy's group then the
    outer result plus what its own step g + 2 changed."""
    works, anchor, outer, inner_step = _copies_by_hand(
        world, lr, momentum, nesterov=optimizer == "nesterov" and momentum > 0)
    names = [n for n, _ in anchor.named_parameters()]
    groups = layerwise_groups([p.numel() * 4 for p in anchor.parameters()], every)
    slots = [(1 + g, 2 + g) for g in range(every - 1)]   # H - 1 groups: one per step
    assert len(groups) == every - 1
    pending, taken = {}, {}
    for step in range(2 * every):
        inner_step(step)
        into = step % every + 1
        for g, members in enumerate(groups):
            launch, lands = slots[g]
            if into == lands:
                for n, a in anchor.named_parameters():
                    a.grad = pending[g].get(n)
                outer.step()
                outer.zero_grad()
                for w, before in zip(works, taken[g]):
                    own = dict(w.model.named_parameters())
                    with torch.no_grad():
                        for n in pending[g]:
                            a = dict(anchor.named_parameters())[n]
                            own[n].copy_(a + (own[n] - before[n]))
            if into == launch:
                anchors = dict(anchor.named_parameters())
                taken[g] = [{names[i]: dict(w.model.named_parameters())[names[i]].detach()
                             .clone() for i in members} for w in works]
                pending[g] = {names[i]: torch.stack([anchors[names[i]].detach() - t[names[i]]
                                                     for t in taken[g]]).mean(0)
                              for i in members}
    return works[0].model.state_dict()


@pytest.mark.parametrize("optimizer, lr, momentum", [("sgd", 1.0, 0.0),
                                                     ("nesterov", OUTER_LR, MOMENTUM)],
                         ids=["dreamddp", "nesterov"])
def test_the_layerwise_schedule_is_dreamddp_by_hand_and_sends_the_plans_bytes(
        optimizer, lr, momentum):
    """outer_schedule="layerwise" at H = 4 on 2 ranks: DreamDDP written out by hand (its plain
    averaging: outer SGD of lr 1 without momentum; and with DiLoCo's Nesterov outer step), and
    the counted bytes are `outer_sync_wire`'s for the schedule, H - 1 syncs a period."""
    every = 4
    results = spawn(layered, 2, args=(every, optimizer, lr, momentum), timeout=240)
    assert worst(results[0][0], layerwise_by_hand(2, every, optimizer, lr, momentum)) <= 1e-5
    model = build(job("cnn")).model
    nbytes = [p.numel() * p.element_size() for p in model.parameters()]
    period = outer_sync_wire(nbytes, 25 * 2**20, 2, every=every, schedule="layerwise")
    assert results[0][1]["total"]["outer"]["sent"] == 2 * period.sent
    assert results[0][1]["total"]["outer"]["calls"] == 2 * (every - 1)
    # One period's bytes are the whole model's, as plain local SGD's (padding aside).
    assert period.sent <= outer_sync_wire(nbytes, 25 * 2**20, 2).sent + 4 * (every - 1) * 4


def test_layerwise_groups_balance_the_bytes_and_slots_end_inside_the_period():
    sizes = [400, 100, 100, 300, 50, 50, 200]
    groups = layerwise_groups(sizes, 4)
    assert sorted(i for g in groups for i in g) == list(range(len(sizes)))
    assert [sum(sizes[i] for i in g) for g in groups] == [400, 400, 400]
    assert all(g == sorted(g) for g in groups)
    assert len(layerwise_groups([8, 8], 40)) == 2   # no more groups than parameters
    for every, count in ((4, 3), (40, 2), (2, 1), (10, 9)):
        slots = sync_slots(OuterSync(every, schedule="layerwise"), count)
        assert all(1 <= a < b <= every for a, b in slots)
        assert len({a for a, _ in slots}) == count   # one launch per step at most
    assert sync_slots(OuterSync(4, schedule="layerwise"), 3) == [(1, 2), (2, 3), (3, 4)]
