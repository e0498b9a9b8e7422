"""A pull's tables are pushed while backward still runs once their rows are complete and another
table's are still to come (parallel/rows/push.py's EarlyPush): an LM's softmax tables before its
LSTM's backward, as DDP overlaps their sparse all-reduce. The model trained is one process's,
with clipping and accumulation too, and the bytes are the cost model's replay."""

import pytest
import torch
from torch import nn

import tilework
from tilework.cluster.topology import Topology
from tilework.estimate.cost import ps_step_bytes
from tilework.testing import spawn

BATCH, STEPS = 8, 3


class TwoPulls(nn.Module):
    """The LM's shape: an input table, a dense layer, then output tables looked up with ids the
    model computes (a second pull, of two tables), whose gradients backward reaches first."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Embedding(40, 4, sparse=True)
        self.mid = nn.Linear(4, 4)
        self.out_w = nn.Embedding(50, 4, sparse=True)
        self.out_b = nn.Embedding(50, 1, sparse=True)

    def forward(self, ids, targets):
        h = torch.tanh(self.mid(self.inp(ids)))
        wanted, inverse = torch.unique(targets, return_inverse=True)
        w, b = self.out_w(wanted), self.out_b(wanted)
        return (h * w[inverse]).sum(1) + b[inverse, 0]


def batch(step, rank=0, world_size=1):
    g = torch.Generator().manual_seed(step)
    ids, targets = torch.randint(0, 40, (BATCH,), generator=g), torch.randint(0, 50, (BATCH,),
                                                                             generator=g)
    y = torch.randn(BATCH, generator=g)
    return [t.chunk(world_size)[rank] for t in (ids, targets, y)]


def micro_batches(step, rank, world_size):
    """Each rank's batch in two halves; for one process, the union of the ranks' halves (with
    mean losses halved, the accumulated gradient is then the same)."""
    mine = [t.reshape(2, -1)[rank:rank + 1] if world_size == 2 else t.reshape(2, -1)
            for t in batch(step)]
    half = BATCH // 4
    return [t[:, :half].reshape(-1) for t in mine], [t[:, half:].reshape(-1) for t in mine]


def _train(rank, world_size, how="plain"):
    """Losses, the ps bytes sent per step, and how many pushes were in flight when backward
    reached the dense layer (after the output tables' rows, before the input table's)."""
    model = TwoPulls()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    flying = []
    if world_size > 1:
        tilework.parallelize(model, opt, mode="hybrid", log=False)
        early = model._tilework_engine.early
        model.mid.weight.register_post_accumulate_grad_hook(
            lambda _: flying.append(len(early.flying)))
    losses, sent = [], []
    for step in range(STEPS):
        ids, targets, y = batch(step, rank, world_size)
        if how == "accumulate":   # two micro-batches, the first without sync
            first, second = micro_batches(step, rank, world_size)
            with model.no_sync() if world_size > 1 else torch.enable_grad():
                (nn.functional.mse_loss(model(*first[:2]), first[2]) / 2).backward()
            loss = nn.functional.mse_loss(model(*second[:2]), second[2]) / 2
        else:
            loss = nn.functional.mse_loss(model(ids, targets), y)
        loss.backward()
        if how == "clip":
            tilework.clip_grad_norm_(model, 0.05)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if world_size > 1:
            sent.append(tilework.stats(model)["last_step"]["ps"]["sent"])
    weights = [model.mid.weight.detach().clone()]
    if world_size == 1:
        weights += [model.inp.weight.detach().clone(), model.out_w.weight.detach().clone()]
    else:
        state = tilework.state_dict(model, opt)["model"]
        if rank == 0:
            weights += [state["inp.weight"], state["out_w.weight"]]
    plan = model._tilework_engine.plan if world_size > 1 else None
    return losses, sent, flying, weights, plan


@pytest.mark.parametrize("how", ["plain", "clip", "accumulate"])
def test_the_output_tables_push_while_backward_runs_and_train_as_one_process(how):
    out = spawn(_train, world_size=2, args=(how,), timeout=90)
    one, _, _, weights, _ = _train(0, 1, how)
    for step in range(STEPS):
        # equal halves, per-sample losses: the mean of the ranks' losses is one process's
        assert abs((out[0][0][step] + out[1][0][step]) / 2 - one[step]) < 1e-5, step
    for got, want in zip(out[0][3], weights):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    if how == "accumulate":
        # tables looked up twice since the last push send their ids: at the end of backward
        assert set(out[0][2]) == set(out[1][2]) == {0}
        return
    assert out[0][2] == out[1][2] == [1] * STEPS
    # the bytes: each pull's tables replayed as the cost model sends them, push included
    plan, topology = out[0][4].by_name(), Topology.uniform(1, 2)
    blocks_inp, blocks_out = {}, {}
    for step in range(STEPS):
        per_rank = [batch(step, r, 2) for r in range(2)]
        inp = ps_step_bytes([plan["inp.weight"]], [[b[0] for b in per_rank]], topology, False,
                            blocks_inp)
        wanted = [torch.unique(b[1]) for b in per_rank]
        outs = ps_step_bytes([plan["out_w.weight"], plan["out_b.weight"]], [wanted, wanted],
                             topology, False, blocks_out)
        assert [out[r][1][step] for r in range(2)] == [a + b for a, b in zip(inp, outs)], step
