"""Server-table lookups are batched: a step's lookups in every table meet the other ranks in
one pull exchange (2 all-to-alls per hop: ids in blocks sized from earlier steps, then rows; one
more on a step whose ids outgrow a block) and one push (1), however many tables there are; and
the stand-in a lookup returns behaves as the output it stands for."""

import pytest
import torch
from torch import nn

import tilework
from tilework.cluster.topology import Topology
from tilework.estimate.cost import ps_step_bytes
from tilework.testing import spawn

TABLES, BATCH = 3, 8


class Recommender(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.tables = nn.ModuleList(nn.Embedding(40 + i, 4, sparse=True) for i in range(TABLES))
        self.head = nn.Linear(4 * TABLES, 1)

    def forward(self, ids):
        looked_up = [t(ids[:, i]) for i, t in enumerate(self.tables)]
        return self.head(torch.cat(looked_up, 1)).squeeze(1)


def batch(step, rank=0, world_size=1, kind="random"):
    """"random": fresh ids every step. "repeat": the same few ids on steps 0-2 (every id block
    sized on step 0 holds them), then on step 3 eight distinct ids per table (they overflow).
    "one-rank": the same, but on step 3 only rank 1's ids outgrow its blocks: rank 0's fit, and
    it must still meet for the overflow, which it learns from rank 1's flag. "spike": on step 1
    only, a batch four times larger with distinct ids (as an evaluation's might be), then the
    few ids again."""
    g = torch.Generator().manual_seed(step if kind == "random" else 0)
    ids = torch.randint(0, 40, (BATCH, TABLES), generator=g)
    if kind != "random":
        ids = ids % 3
    if kind == "spike" and step == 1:
        ids = torch.arange(4 * BATCH)[:, None] + torch.arange(TABLES)
        return ids.chunk(world_size)[rank], torch.randn(4 * BATCH, generator=g).chunk(
            world_size)[rank]
    if kind in ("repeat", "one-rank") and step == 3:
        spread = torch.arange(BATCH)[:, None] * 5 + torch.arange(TABLES)
        rows = slice(None) if kind == "repeat" else slice(BATCH // 2, None)  # "one-rank": rank 1's
        ids[rows] = spread[rows]
    y = torch.randn(BATCH, generator=g)
    return ids.chunk(world_size)[rank], y.chunk(world_size)[rank]


def _train(rank, world_size, compiled=False, kind="random", steps=3):
    """Hybrid steps (under torch.compile where asked): ps collectives and loss per step."""
    model = Recommender()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tilework.parallelize(model, opt, mode="hybrid", log=False)
    # aot_eager: dynamo and AOT autograd, no C++ compiler needed
    run = torch.compile(model, backend="aot_eager") if compiled else model
    calls, losses, sent = [], [], []
    for step in range(steps):
        ids, y = batch(step, rank, world_size, kind)
        loss = nn.functional.mse_loss(run(ids), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        calls.append(tilework.stats(model)["last_step"]["ps"]["calls"])
        losses.append(loss.item())
        sent.append(tilework.stats(model)["last_step"]["ps"]["sent"])
    return calls, losses, sent, model._tilework_engine.plan


def _one_process_losses(kind, steps):
    model = Recommender()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        ids, y = batch(step, kind=kind)
        loss = nn.functional.mse_loss(model(ids), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("kind, calls", [("repeat", [4, 3, 3, 4]), ("one-rank", [4, 3, 3, 4]),
                                         ("spike", [4, 4, 3, 3]), ("random", None)])
def test_a_step_meets_the_other_ranks_three_times_for_all_tables(kind, calls):
    """Pull: the id blocks (step 0, sized nothing yet: everything overflows into a second
    exchange; then only when the ids outgrow the blocks) and the rows; push: rows retracing
    the pull (no ids, no lengths). The same model as one process either way."""
    out = spawn(_train, world_size=2, args=(False, kind, 4), timeout=90)
    for step, want in enumerate(_one_process_losses(kind, 4)):
        mean = (out[0][1][step] + out[1][1][step]) / 2   # equal halves: the mean of the means
        assert abs(mean - want) < 1e-5, step
    assert out[0][0] == out[1][0]
    if calls:
        assert out[0][0] == calls
    else:
        assert out[0][0][0] == 4 and set(out[0][0]) <= {3, 4}
    # the bytes, blocks' padding and overflow included, are the cost model's replay
    plan, id_blocks = out[0][3], {}
    for step in range(4):
        ids = [batch(step, r, 2, kind)[0] for r in range(2)]
        want = ps_step_bytes(plan.of("ps"), [[i[:, t] for i in ids] for t in range(TABLES)],
                             Topology.uniform(1, 2), plan.local_aggregation, id_blocks)
        assert [out[r][2][step] for r in range(2)] == want, step
    if kind == "spike":   # the blocks shrank back after the spike: less padding on step 3
        assert all(out[r][2][3] < out[r][2][2] for r in range(2))


def _stand_in(rank, world_size):
    model = Recommender()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    tilework.parallelize(model, opt, mode="hybrid", log=False)
    ids = torch.tensor([[1, 2, 3], [1, 5, 7]])
    table = model.tables[0]
    out = table(ids[:, 0])
    facts = (tuple(out.shape), out.dtype, out.dim(), len(out), isinstance(out, torch.Tensor))
    pulled_before_use = tilework.stats(model)["total"].get("ps", {}).get("calls", 0)
    with torch.no_grad():
        before = table(ids[:, 0])          # waits, like `out`
    loss = model(ids).sum()
    loss.backward()
    opt.step()                              # applies rows: waiting lookups pull first
    after = table(ids[:, 0]).detach()
    return (facts, pulled_before_use, out.requires_grad, (out * 1).tolist(), before.tolist(),
            after.tolist())


def test_the_stand_in_answers_metadata_and_reads_the_rows_of_its_own_time():
    model = Recommender()
    ids = torch.tensor([1, 1])
    expected_before = model.tables[0](ids).tolist()
    for facts, pulled, requires_grad, value, before, after in spawn(_stand_in, world_size=2,
                                                                     timeout=90):
        assert facts == ((2, 4), torch.float32, 2, 2, True)
        assert pulled == 0                 # metadata needed no rows
        assert requires_grad and value == expected_before
        assert before == expected_before   # looked up before the step, used after it
        assert after != expected_before    # the step moved row 1


def test_a_compiled_model_pulls_at_once_and_trains_as_the_eager_one():
    eager = spawn(_train, world_size=2, timeout=90)
    compiled = spawn(_train, world_size=2, args=(True,), timeout=180)
    for rank in range(2):
        assert compiled[rank][1] == eager[rank][1], rank


def _retained(rank, world_size):
    model = Recommender()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tilework.parallelize(model, opt, mode="hybrid", log=False)
    out = model.tables[0](torch.tensor([1, 2, 2]))
    out.retain_grad()
    (out * torch.arange(3.0)[:, None]).sum().backward()
    return out.grad.tolist()


def test_a_retained_gradient_reaches_the_stand_in():
    for grad in spawn(_retained, world_size=2, timeout=90):
        assert grad == [[0.0] * 4, [1.0] * 4, [2.0] * 4]


def _modes(rank, world_size):
    model = Recommender()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tilework.parallelize(model, opt, mode="hybrid", log=False)
    table, ids = model.tables[0], torch.tensor([1, 2, 2])
    with torch.inference_mode():
        evaluated = table(ids).sum().item()           # looked up and used in inference mode
    out = table(ids)                                   # a training lookup ...
    with torch.inference_mode():
        peeked = out.sum().item()                      # ... first used in inference mode
    out.sum().backward()                               # still trains
    return evaluated, peeked, out.requires_grad, tilework.stats(model)["total"]["ps"]["calls"] > 0


def test_a_lookup_keeps_the_modes_of_its_call_whatever_the_pulls():
    for evaluated, peeked, requires_grad, pushed in spawn(_modes, world_size=2, timeout=90):
        assert evaluated == pytest.approx(peeked) and requires_grad and pushed
