"""Top-k with error feedback on the dense buckets (ParallelConfig(grad_compress="topk")): two
real ranks against the same algorithm written out in one process (torch has no top-k hook to
run beside it), against plain all-reduce where every value is sent, and the bytes counted
against the cost model's."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tilework
from tilework import ParallelConfig
from tilework.cluster.topology import Topology
from tilework.comm.wire import topk_count, topk_index_bytes
from tilework.errors import ConfigError
from tilework.estimate.cost import dense_sync_bytes
from tilework.planner import plan
from tilework.testing import spawn

STEPS, BATCH, LR = 5, 6, 0.2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(BATCH, 8, generator=g), torch.randint(0, 3, (BATCH,), generator=g)


def trained(rank, world_size, compress, ratio, path=None, stop=None, start=0):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    tilework.parallelize(model, opt, mode="allreduce", log=False, grad_compress=compress,
                         topk_ratio=ratio)
    if start:
        tilework.load(path, model, opt)
    for step in range(start, stop if stop is not None else STEPS):
        x, y = _batch(step, rank)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    if stop is not None:
        tilework.save(path, model, opt)
    dist.barrier()
    return ({k: v.detach().clone() for k, v in model.state_dict().items()},
            tilework.stats(model)["total"]["allreduce"]["sent"])


def written_out(ratio: float, world: int = 2) -> dict:
    """Top-k with error feedback by hand: each rank's bucket (the parameters in reverse
    order, flat) plus its error, its k largest sent, the sent values summed in rank order and
    averaged."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    params = list(reversed(list(model.parameters())))
    errors = [torch.zeros(sum(p.numel() for p in params)) for _ in range(world)]
    for step in range(STEPS):
        total = torch.zeros_like(errors[0])
        for rank in range(world):
            model.zero_grad()
            x, y = _batch(step, rank)
            nn.functional.cross_entropy(model(x), y).backward()
            flat = torch.cat([p.grad.reshape(-1) for p in params]) + errors[rank]
            k = topk_count(flat.numel(), ratio)
            at = torch.topk(flat.abs(), k, sorted=False).indices
            total.index_add_(0, at, flat[at])
            flat[at] = 0
            errors[rank] = flat
        total /= world
        offset = 0
        for p in params:
            p.grad = total[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_topk_buckets_train_as_the_algorithm_written_out():
    ours = spawn(trained, 2, args=("topk", 0.1), timeout=120)
    theirs = written_out(0.1)
    for r in range(2):
        for k, v in theirs.items():
            torch.testing.assert_close(ours[r][0][k], v, rtol=1e-6, atol=1e-7, msg=k)
    # One all-gather a step of k int32 positions and k float32 values a rank.
    nbytes = [p.numel() * 4 for p in _model().parameters()]
    k = topk_count(sum(nbytes) // 4, 0.1)
    assert ours[0][1] == STEPS * dense_sync_bytes(nbytes, 25 * 2**20, 2, grad_compress="topk",
                                                  topk_ratio=0.1) == STEPS * k * 8


def test_topk_sending_every_value_is_plain_all_reduce_bit_for_bit():
    every = spawn(trained, 2, args=("topk", 1.0), timeout=120)
    plain = spawn(trained, 2, args=("none", 0.01), timeout=120)
    for k, v in plain[0][0].items():
        assert torch.equal(every[0][0][k], v), k


def test_a_topk_run_resumes_bit_for_bit(tmp_path):
    """Each rank's error (what it has not sent yet) is in the checkpoint."""
    whole = spawn(trained, 2, args=("topk", 0.1), timeout=120)
    path = str(tmp_path / "c.pt")
    spawn(trained, 2, args=("topk", 0.1, path, 3), timeout=120)
    again = spawn(trained, 2, args=("topk", 0.1, path, None, 3), timeout=120)
    for r in range(2):
        for k, v in whole[r][0].items():
            assert torch.equal(again[r][0][k], v), k


def test_a_plan_prices_topk_as_an_all_gather_and_refuses_bad_ratios():
    made = plan(_model(), ParallelConfig(mode="allreduce", grad_compress="topk", topk_ratio=0.05),
                topology=Topology.from_sizes([4]))
    assert (made.grad_compress, made.topk_ratio) == ("topk", 0.05)
    weight = made.by_name()["2.weight"]   # 48 values: 3 of them, 8 bytes each, to 3 peers
    assert weight.predicted.bytes_sent == 3 * 3 * 8
    assert "largest 5.00% of values" in weight.reason
    # Positions go as int32, as int64 in a bucket past int32's range (a lone huge table).
    assert (topk_index_bytes(2**31 - 1), topk_index_bytes(2**31)) == (4, 8)
    assert dense_sync_bytes([2**31 * 4], 2**40, 2, grad_compress="topk", topk_ratio=1e-6) == \
        topk_count(2**31, 1e-6) * (8 + 4)
    for bad in (0, 1.5, True, "0.1"):
        with pytest.raises(ConfigError, match="topk_ratio: expected a share above 0"):
            ParallelConfig(grad_compress="topk", topk_ratio=bad)
