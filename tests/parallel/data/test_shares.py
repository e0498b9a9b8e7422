"""Uneven batch shares (ParallelConfig.batch_shares, runtime/shares.py) train as one process on
the global batch: each rank feeds its own count of samples, its gradients weighted by it.

The equivalence harness of tests/equivalence.py (same seeds, global batches of 8, 4 steps,
its tolerances), with rank r taking shares[r] samples of each global batch. The reference is
the same one process; a plain mean over ranks of unequal batches would not match it (checked).
"""

import pytest
import torch
import torch.distributed as dist

import tilework
from tests.equivalence import LR, _train, job, reference, torch_optimizer, worst
from tilework.cluster.topology import Topology
from tilework.comm import build_groups
from tilework.data import ShardedBatches
from tilework.errors import ConfigError
from tilework.testing import spawn
from tilework.train.workloads import build

TOLERANCE = {"sgd": 1e-5, "adam": 1e-4}


def uneven(rank, world_size, workload, optimizer, mode, hosts, shares, zero=0, weighted=True,
           fed=None):
    j = job(workload)
    work = build(j)
    opt = torch_optimizer(optimizer, work.model.parameters(), LR[optimizer])
    groups = build_groups(dist.group.WORLD, Topology.uniform(hosts, world_size // hosts))
    tilework.parallelize(work.model, opt, groups=groups, mode=mode, zero=zero, log=False,
                         batch_shares=list(shares) if weighted else None,
                         check_inputs=weighted)
    sampler = ShardedBatches(len(work.train_set), j.data.batch_size, rank, world_size,
                             shares=fed or shares)
    losses = _train(work, opt, sampler, 4)
    state = tilework.state_dict(work.model, opt)["model"]
    return (state if rank == 0 else None), losses


# Every path a gradient takes, once: dense buckets and server rows (hybrid), everything on
# the servers (ps), over two hosts, ZeRO 1, 2 and 3, and an adaptive optimizer.
@pytest.mark.parametrize("workload, optimizer, mode, world, hosts, shares, zero", [
    ("lm", "sgd", "hybrid", 2, 1, (6, 2), 0),
    ("lm", "sgd", "hybrid", 4, 2, (3, 2, 2, 1), 0),
    ("recommender", "sgd", "ps", 4, 2, (1, 3, 1, 3), 0),
    ("cnn", "sgd", "allreduce", 2, 1, (6, 2), 1),
    ("lm", "sgd", "allreduce", 4, 1, (3, 2, 2, 1), 2),
    ("cnn", "adam", "allreduce", 2, 1, (6, 2), 3),
])
def test_uneven_shares_train_as_one_process(workload, optimizer, mode, world, hosts, shares,
                                           zero):
    ref, ref_losses = reference(workload, optimizer, mode)
    results = spawn(uneven, world, args=(workload, optimizer, mode, hosts, shares, zero),
                    timeout=180)
    state = results[0][0]
    assert state.keys() == ref.keys()
    assert worst(state, ref) <= TOLERANCE[optimizer]
    # Each rank's loss is its own samples' mean: weighted by the shares, the global batch's.
    total = sum(shares)
    losses = [sum(n * r[1][step] for n, r in zip(shares, results)) / total
              for step in range(len(ref_losses))]
    assert losses == pytest.approx(ref_losses, rel=TOLERANCE[optimizer])


def test_without_the_weights_uneven_batches_do_not_match():
    """The weights are what makes it exact: the same uneven slices averaged plainly are off."""
    ref, _ = reference("cnn", "sgd", "allreduce")
    state = spawn(uneven, 2, args=("cnn", "sgd", "allreduce", 1, (7, 1), 0, False),
                  timeout=180)[0][0]
    assert worst(state, ref) > 1e-3


def test_a_rank_feeding_other_than_its_share_is_named():
    with pytest.raises(Exception, match="batch_shares entry is 6") as caught:
        spawn(uneven, 2, args=("cnn", "sgd", "allreduce", 1, (6, 2), 0, True, (4, 4)),
              timeout=180)
    assert "nothing was updated" in str(caught.value)


def test_shares_that_do_not_fit_the_world_or_the_batch_say_which_field():
    with pytest.raises(ConfigError, match="batch_size"):
        ShardedBatches(64, 8, 0, 2, shares=[6, 3])
    with pytest.raises(ConfigError, match="batch_shares"):
        ShardedBatches(64, 8, 0, 2, shares=[8])
    with pytest.raises(ConfigError, match="drop_last"):
        ShardedBatches(64, 8, 0, 2, shares=[6, 2], drop_last=False)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(Exception, match="batch_shares: one per rank"):
        tilework.plan(model, tilework.ParallelConfig(batch_shares=[3, 1, 1]),
                      topology=Topology.from_sizes([2]))


def test_shares_hand_out_the_global_batch_in_rank_order():
    slices = [ShardedBatches(64, 8, r, 2, shares=[6, 2]).indices(3) for r in range(2)]
    assert [len(s) for s in slices] == [6, 2]
    assert list(torch.tensor([*slices[0], *slices[1]])) == \
        list(torch.tensor(ShardedBatches(64, 8).global_indices(3)))
