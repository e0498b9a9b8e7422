"""tilework.prefetch: the next batch's ids are routed with this step's rows
(parallel/rows/ahead.py). A pull then meets the other ranks once instead of twice; the bytes over a
run are those of the same run without it (the same id blocks, each sent one exchange earlier) and
one padded block at the end that says there is no next batch; the model trains as one process does.
Where a rank cannot route a lookup ahead, no rank does."""

import dataclasses

import pytest
import torch
from torch import nn

import tilework
from tests.parallel.rows.test_hot_rows import Model as HotModel
from tests.parallel.rows.test_hot_rows import batch as hot_batch
from tests.parallel.rows.test_hot_rows import hot_plan
from tests.parallel.rows.test_lookups import TABLES, Recommender, _one_process_losses, batch
from tilework.cluster.topology import Topology
from tilework.errors import PlanError
from tilework.estimate.cost import ps_step_bytes
from tilework.testing import RankFailed, spawn

STEPS = 4


def _train(rank, world_size, kind, ahead=True, change_in_place=False):
    model = Recommender()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tilework.parallelize(model, opt, mode="hybrid", log=False)
    loader = [batch(step, rank, world_size, kind) for step in range(STEPS)]
    calls, losses, sent = [], [], []
    for ids, y in tilework.prefetch(loader, model) if ahead else loader:
        if change_in_place and len(losses) == 1:
            ids[0, 0] = (ids[0, 0] + 1) % 40
        loss = nn.functional.mse_loss(model(ids), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        calls.append(tilework.stats(model)["last_step"]["ps"]["calls"])
        losses.append(loss.item())
        sent.append(tilework.stats(model)["last_step"]["ps"]["sent"])
    return calls, losses, sent, model._tilework_engine.plan


@pytest.mark.parametrize("kind, calls", [
    # step 0 sends its own ids (a second exchange: no block is sized yet); from then on a pull
    # is one exchange and the push one; step 2 carries step 3's overflowing ids (one more)
    ("repeat", [4, 2, 3, 2]),
    # step 1 is four times larger: step 0 cannot route a view of another shape, so it holds
    # every table back and step 1 sends its own ids (overflowing); so does step 2, whose
    # shape step 1 cannot give either; step 3's are routed
    ("spike", [4, 4, 3, 2]),
    ("random", None)])
def test_a_prefetched_pull_meets_once_and_the_run_sends_the_same_bytes(kind, calls):
    out = spawn(_train, world_size=2, args=(kind,), timeout=90)
    for step, want in enumerate(_one_process_losses(kind, STEPS)):
        mean = (out[0][1][step] + out[1][1][step]) / 2
        assert abs(mean - want) < 1e-5, step
    assert out[0][0] == out[1][0]
    if calls:
        assert out[0][0] == calls
    else:
        assert out[0][0][0] == 4 and out[0][0][-1] == 2 and set(out[0][0][1:]) <= {2, 3}
    if kind == "spike":   # blocks held back still carry their padding
        return
    plan, id_blocks, total = out[0][3], {}, [0, 0]
    for step in range(STEPS):
        ids = [batch(step, r, 2, kind)[0] for r in range(2)]
        step_bytes = ps_step_bytes(plan.of("ps"), [[i[:, t] for i in ids] for t in range(TABLES)],
                                   Topology.uniform(1, 2), plan.local_aggregation, id_blocks)
        total = [a + b for a, b in zip(total, step_bytes)]
    # ... and the last step's blocks, which say there is no next batch: a header and padding
    last = [8 * (TABLES + 1 + id_blocks[(0, r, 1 - r)]) for r in range(2)]
    assert [sum(out[r][2]) for r in range(2)] == [t + b for t, b in zip(total, last)]


def test_a_batch_changed_in_place_after_it_was_read_ahead_is_refused():
    with pytest.raises(RankFailed, match=r"ids looked up differ from those tilework.prefetch "
                                         r"read ahead at batch\[0\]"):
        spawn(_train, world_size=2, args=("random", True, True), timeout=90)


def _mixed(rank, world_size, ahead):
    """One table looked up with the batch's ids, in a pull of its own, then one with ids
    computed from them (never routed ahead); an evaluation on another batch between steps."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Embedding(40, 4, sparse=True),
                           "b": nn.Embedding(41, 4, sparse=True), "head": nn.Linear(8, 1)})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if world_size > 1:
        tilework.parallelize(model, opt, mode="hybrid", log=False)

    def forward(ids):
        a = model["a"](ids[:, 0]) * 2   # used at once: a pull of its own
        x = torch.cat([a, model["b"]((ids[:, 1] * 7) % 41)], 1)
        return model["head"](x).squeeze(1)

    loader = [batch(step, rank, world_size) for step in range(STEPS)]
    if world_size > 1 and ahead:
        loader = tilework.prefetch(loader, model)
    calls, losses, evaluated = [], [], []
    for ids, y in loader:
        loss = nn.functional.mse_loss(forward(ids), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        with torch.no_grad():
            evaluated.append(forward(batch(10 + len(losses), rank, world_size)[0]).sum().item())
        if world_size > 1:
            calls.append(tilework.stats(model)["last_step"]["ps"]["calls"])
    return calls, losses, evaluated


def test_a_pull_of_computed_ids_and_an_evaluation_between_steps():
    """Table a's pull is routed ahead; b's ids are computed, so its pull sends them as always;
    an evaluation's lookups (not the loop's batch) leave the routed entries to the next
    training step. Meetings: fewer in all (which step pays an overflow depends on how the
    evaluation's and training's ids take turns in a's blocks)."""
    routed = spawn(_mixed, world_size=2, args=(True,), timeout=90)
    plain = spawn(_mixed, world_size=2, args=(False,), timeout=90)
    one = _mixed(0, 1, False)
    for step in range(STEPS):
        assert abs((routed[0][1][step] + routed[1][1][step]) / 2 - one[1][step]) < 1e-5
        assert routed[0][1][step] == plain[0][1][step]
        assert routed[0][2][step] == plain[0][2][step]
    assert routed[0][0] == routed[1][0]
    assert sum(routed[0][0]) < sum(plain[0][0])


def _hot(rank, world_size, ahead):
    model = HotModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if world_size > 1:
        tilework.parallelize(model, opt, plan=hot_plan(model, world_size), log=False)
    loader = [hot_batch(step, rank, world_size) for step in range(STEPS)]
    if world_size > 1 and ahead:
        loader = tilework.prefetch(loader, model)
    losses = []
    for ids, y in loader:
        loss = nn.functional.mse_loss(model(ids), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def test_hot_heads_and_two_tables_reading_one_batch_tensor():
    """Two tables (an Embedding and an EmbeddingBag) look up the same batch tensor, their head
    rows replicated: each table routes its own tail ahead."""
    routed = spawn(_hot, world_size=2, args=(True,), timeout=90)
    losses, state = _hot(0, 1, False)
    for step in range(STEPS):
        assert abs((routed[0][0][step] + routed[1][0][step]) / 2 - losses[step]) < 1e-5
    for name, value in state.items():
        torch.testing.assert_close(routed[0][1][name], value, rtol=1e-5, atol=1e-6)


def test_prefetch_needs_a_parallelized_model():
    with pytest.raises(PlanError, match="not parallelized by tilework.parallelize"):
        next(iter(tilework.prefetch([1, 2], nn.Linear(1, 1))))


def test_prefetch_reads_one_batch_ahead_and_yields_every_batch():
    read = []

    def loader():
        for i in range(3):
            read.append(i)
            yield i

    class Engine:
        lookups = dataclasses.make_dataclass("L", ["ahead"])(
            tilework.parallel.rows.ahead.Ahead())

    model = nn.Linear(1, 1)
    model._tilework_engine = Engine()
    seen = []
    for b in tilework.prefetch(loader(), model):
        seen.append((b, list(read), Engine.lookups.ahead.next))
    assert seen == [(0, [0, 1], 1), (1, [0, 1, 2], 2), (2, [0, 1, 2], None)]
    assert not Engine.lookups.ahead.active


def _bags(step, rank, world_size):
    """Multi-hot bags of varying length, as DLRM feeds them: (indices, offsets, targets); the
    indices tensor changes length every batch."""
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(1, 4, (BATCH_BAGS,), generator=g)
    ids = torch.randint(0, 30, (int(lengths.sum()),), generator=g)
    y = torch.randn(BATCH_BAGS, generator=g)
    per = BATCH_BAGS // world_size
    mine = slice(rank * per, (rank + 1) * per)
    start = int(lengths[:rank * per].sum())
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths[mine].cumsum(0)[:-1]])
    return ids[start:start + int(lengths[mine].sum())], offsets, y[mine]


BATCH_BAGS = 8


def _bag_model(rank, world_size):
    torch.manual_seed(0)
    model = nn.ModuleDict({"bag": nn.EmbeddingBag(30, 4, mode="sum", sparse=True),
                           "head": nn.Linear(4, 1)})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = [_bags(step, rank, world_size) for step in range(STEPS)]
    if world_size > 1:
        tilework.parallelize(model, opt, mode="hybrid", log=False)
        loader = tilework.prefetch(loader, model)
    losses, calls = [], []
    for ids, offsets, y in loader:
        loss = nn.functional.mse_loss(model["head"](model["bag"](ids, offsets)).squeeze(1), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if world_size > 1:
            calls.append(tilework.stats(model)["last_step"]["ps"]["calls"])
    return losses, calls


def test_bags_whose_indices_change_length_every_batch_are_routed_ahead():
    """A whole batch tensor is keyed by its path alone, so bags of another length each batch
    still go ahead (a view's geometry must match, a whole tensor's need not)."""
    routed = spawn(_bag_model, world_size=2, timeout=90)
    one, _ = _bag_model(0, 1)
    for step in range(STEPS):
        assert abs((routed[0][0][step] + routed[1][0][step]) / 2 - one[step]) < 1e-5
    calls = routed[0][1]
    assert calls == routed[1][1] and calls[-1] == 2 and set(calls[1:]) <= {2, 3}, calls


def _uneven(rank, world_size):
    model = Recommender()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tilework.parallelize(model, opt, mode="hybrid", log=False)
    loader = [batch(step, rank, world_size) for step in range(3 + rank)]   # rank 1: one more
    for ids, y in tilework.prefetch(loader, model):
        nn.functional.mse_loss(model(ids), y).backward()
        opt.step()
        opt.zero_grad()
    torch.distributed.barrier()


def test_loaders_of_different_lengths_stop_with_the_guards_verdict_not_a_crash_or_hang():
    """The last batch's pull still sends its blocks (every table held back), so rank 0's last
    exchange matches rank 1's; rank 1's extra lookup then meets the call guard."""
    with pytest.raises(RankFailed, match="exited with code 2"):
        spawn(_uneven, world_size=2, timeout=60)


def test_keys_find_whole_tensors_by_identity_and_views_by_storage():
    from tilework.parallel.rows.ahead import Ahead

    ahead = Ahead()
    now = {"b": torch.empty(0, dtype=torch.long), "c": torch.empty(0, dtype=torch.long),
           "ids": torch.arange(12).reshape(4, 3), "s": torch.eye(3).to_sparse()}
    after = {"b": torch.tensor([5]), "c": torch.tensor([7, 8]),
             "ids": torch.arange(12, 24).reshape(4, 3), "s": torch.eye(3).to_sparse()}
    ahead.advance(now, after)   # a sparse leaf is passed over, not an error
    # empty tensors may share one null storage: each is found as itself
    assert ahead.key_of(now["c"]) == (0, ("c",))
    assert ahead.key_of(torch.empty(0, dtype=torch.long)) is None
    assert torch.equal(ahead.next_ids(ahead.key_of(now["c"])), after["c"])
    column = ahead.key_of(now["ids"][:, 1])
    assert torch.equal(ahead.next_ids(column), after["ids"][:, 1])
    assert ahead.key_of(now["ids"].view(4, 3)) == (0, ("ids",))   # all of it: whole
    assert ahead.key_of(now["ids"][:, 1] + 0) is None            # computed: not routed
    ahead.advance(after, None)   # a key from the batch before is not this batch's
    assert ahead.next_ids(column) is None and ahead.take("t", column, now["ids"][:, 1]) is None


def test_a_prefetch_inside_another_for_the_same_model_is_refused():
    from tilework.parallel.rows.ahead import Ahead

    class Engine:
        lookups = dataclasses.make_dataclass("L", ["ahead"])(Ahead())

    model = nn.Linear(1, 1)
    model._tilework_engine = Engine()
    for _ in tilework.prefetch([1, 2], model):
        with pytest.raises(PlanError, match="already read through another tilework.prefetch"):
            tilework.prefetch([3], model)
    assert list(tilework.prefetch([3], model)) == [3]   # the outer one has ended
