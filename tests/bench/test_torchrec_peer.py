"""The TorchRec peer of `tilework bench` trains the same model as one plain PyTorch process.

Optional: skipped unless torchrec and fbgemm-gpu import (`pip install 'tilework[bench]'` and
torchrec with --no-deps, see README). Two gloo ranks, small batches: the mean of the two ranks'
losses (each over its half of the batch) must equal the one-process loss on the whole batch, step
by step, for the planner's sharding (tiny tables: data-parallel; the bench's tables: table-wise)
and for row-wise. SGD at lr 0.5 (the bench uses 0.01) so
that the tables' updates move the loss well beyond the tolerance: 1e-6 (some float32 ulps, for
sums in another order; measured here: bit-identical), while frozen tables move it by ~8e-5.
"""

import pytest
import torch

from tilework.bench.torchrec_peer import missing, refuse
from tilework.bench.workloads import _recommender
from tilework.testing import spawn

WHY = missing()
pytestmark = pytest.mark.skipif(WHY is not None, reason=WHY or "")
STEPS, BATCH, LR = 6, 8, 0.5
TINY, BENCH = (20, 10, 5), (200_000, 50_000, 1_000)


def _peer(rank, world_size, system, tables):
    import torch.distributed as dist

    from tilework.bench.torchrec_peer import setup

    workload = _recommender(BATCH, tables)
    model, opt, counter, info = setup(workload, system, world_size, lr=LR)
    losses = []
    for step in range(STEPS):
        loss = model(*workload.batch(step, rank, world_size))
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world_size)
    return losses, counter.take(), info


def _reference(tables, train_tables: bool = True) -> list[float]:
    workload = _recommender(BATCH, tables)
    torch.manual_seed(0)
    model = workload.make(False)
    params = [p for n, p in model.named_parameters() if train_tables or not n.startswith("tables")]
    opt = torch.optim.SGD(params, lr=LR)
    losses = []
    for step in range(STEPS):
        loss = model(*workload.batch(step, 0, 1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("system, tables, sharding", [
    ("torchrec", TINY, "data_parallel"), ("torchrec", BENCH, "table_wise"),
    ("torchrec-rw", TINY, "row_wise")])
def test_two_ranks_train_the_one_process_model(system, tables, sharding):
    (losses, sent, info), _ = spawn(_peer, 2, args=(system, tables), timeout=120)
    assert losses == pytest.approx(_reference(tables), abs=1e-6)
    # The check has power: with the tables frozen the losses drift out of it within these steps.
    frozen = _reference(tables, train_tables=False)
    assert max(abs(a - b) for a, b in zip(frozen, losses)) > 1e-5
    assert all(f":{sharding}@" in part for part in info["sharding"].split("; ")), info
    assert sent > 0 and "SGD" in info["embedding_optimizer"]


def test_other_workloads_are_refused_in_one_line():
    assert refuse("recommender") is None
    assert "recommender workload only" in refuse("cnn")
