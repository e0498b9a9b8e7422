"""A parallel plan trains the same model as one process (the reference: plain PyTorch).

Same seeds, same global batches (strong scaling), STEPS steps. Tolerances, relative to each
tensor's largest value: SGD 1e-5 (sums only reorder); Adagrad and Adam 1e-4 (their division by
a running norm amplifies the last-bit differences of reordered sums in rarely touched rows).
Adam's tables are lazy on the parameter server, as torch.optim.SparseAdam is; the reference uses
SparseAdam for them, and dense Adam where the table is all-reduced.
"""

import pytest
import torch

from tests.equivalence import distributed, reference
from tilework.testing import spawn

TOLERANCE = {"sgd": 1e-5, "adagrad": 1e-4, "adam": 1e-4}


def assert_same(state, ref, optimizer):
    assert state.keys() == ref.keys()
    for name, expected in ref.items():
        scale = expected.abs().max().item() + 1e-12
        worst = (state[name] - expected).abs().max().item() / scale
        assert worst <= TOLERANCE[optimizer], f"{name}: relative difference {worst:.2e}"


def check(workload, optimizer, mode, world_size, hosts, local_aggregation=True):
    ref, ref_losses = reference(workload, optimizer, mode)
    results = spawn(distributed, world_size,
                    args=(workload, optimizer, mode, hosts, local_aggregation), timeout=120)
    assert_same(results[0][0], ref, optimizer)
    return results


@pytest.mark.parametrize("workload", ["lm", "cnn", "recommender"])
@pytest.mark.parametrize("mode", ["hybrid", "allreduce", "ps"])
@pytest.mark.parametrize("world_size, hosts", [(2, 1), (4, 2)])
def test_sgd_matches_one_process(workload, mode, world_size, hosts):
    check(workload, "sgd", mode, world_size=world_size, hosts=hosts)


@pytest.mark.parametrize("workload", ["lm", "recommender"])
@pytest.mark.parametrize("optimizer", ["adagrad", "adam"])
def test_two_ranks_adaptive_optimizers(workload, optimizer):
    check(workload, optimizer, "hybrid", world_size=2, hosts=1)


@pytest.mark.parametrize("optimizer", ["adam"])
@pytest.mark.parametrize("mode", ["allreduce", "ps"])
def test_adam_other_modes(optimizer, mode):
    check("lm", optimizer, mode, world_size=2, hosts=1)


@pytest.mark.parametrize("workload", ["lm", "recommender"])
def test_without_local_aggregation(workload):
    check(workload, "sgd", "hybrid", world_size=4, hosts=2, local_aggregation=False)


def test_local_aggregation_cuts_parameter_server_traffic():
    """Same model either way; aggregating inside hosts first moves fewer bytes across them."""
    with_la = spawn(distributed, 4, args=("lm", "sgd", "hybrid", 2, True), timeout=120)
    without = spawn(distributed, 4, args=("lm", "sgd", "hybrid", 2, False), timeout=120)
    for a, b in zip(with_la[0][0].values(), without[0][0].values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert with_la[0][1] == pytest.approx(without[0][1], rel=1e-5)
    crossing = [sum(r[2]["total"]["ps"]["sent_inter_host"] for r in run)
                for run in (with_la, without)]
    assert 0 < crossing[0] < crossing[1], crossing
