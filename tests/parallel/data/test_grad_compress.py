"""Compressed dense buckets (ParallelConfig(grad_compress="bf16" | "fp16")) against PyTorch's
own: DDP with its fp16_compress_hook, and with the function its bf16_compress_hook runs. Both
cast each bucket, divide it by the ranks, sum it in that width and cast it back, so on two
ranks (a sum of two is the same in any order) the parameters agree bit for bit. The bytes
counted are half of float32's, as the cost model says."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import tilework
from tests.equivalence import LR, job
from tilework import ParallelConfig
from tilework.cluster.topology import Topology
from tilework.data import ShardedBatches
from tilework.errors import ConfigError
from tilework.estimate.cost import dense_sync_bytes
from tilework.planner import plan
from tilework.testing import spawn
from tilework.train.workloads import build

BATCH, STEPS = 8, 4
# torch's bf16_compress_hook refuses to run without CUDA and NCCL 2.10 (it checks, then calls
# the shared _compress_hook); on gloo the shared function itself is PyTorch's code to match.
def bf16_hook(process_group, bucket):
    return default_hooks._compress_hook(torch.bfloat16, process_group, bucket)


HOOKS = {"bf16": bf16_hook, "fp16": default_hooks.fp16_compress_hook}


def trained(rank, world_size, system, codec):
    work = build(job("cnn"))
    opt = torch.optim.SGD(work.model.parameters(), lr=LR["sgd"])
    model = work.model
    if system == "ddp":
        model = DDP(work.model)
        model.register_comm_hook(None, HOOKS[codec])
    else:
        tilework.parallelize(model, opt, mode="allreduce", log=False, grad_compress=codec)
    sampler = ShardedBatches(len(work.train_set), BATCH, rank, world_size)
    losses = []
    for step in range(STEPS):
        loss = work.loss(model, work.train_set.collate(sampler.indices(step)), step)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    dist.barrier()
    stats = tilework.stats(model) if system != "ddp" else None
    return {k: v.detach().clone() for k, v in work.model.state_dict().items()}, losses, stats


@pytest.mark.parametrize("codec", ["bf16", "fp16"])
def test_compressed_buckets_are_ddps_compress_hook_bit_for_bit(codec):
    ours = spawn(trained, 2, args=("tilework", codec), timeout=180)
    theirs = spawn(trained, 2, args=("ddp", codec), timeout=180)
    for k, v in theirs[0][0].items():
        assert torch.equal(ours[0][0][k], v), k
    assert ours[0][1] == theirs[0][1]
    # Half of float32's bytes, as the cost model counts them; nothing rides the bucket.
    model = build(job("cnn")).model
    nbytes = [p.numel() * p.element_size() for p in model.parameters()]
    assert ours[0][2]["total"]["allreduce"]["sent"] == STEPS * dense_sync_bytes(
        nbytes, 25 * 2**20, 2, grad_compress=codec)
    assert dense_sync_bytes(nbytes, 25 * 2**20, 2, grad_compress=codec) * 2 == \
        dense_sync_bytes(nbytes, 25 * 2**20, 2)
    made = plan(model, ParallelConfig(mode="allreduce", grad_compress=codec),
                topology=Topology.from_sizes([2]))
    assert made.grad_compress == codec
    assert all(f"in {codec} on the wire" in p.reason for p in made.of("allreduce"))


def test_what_compressed_buckets_refuse_in_one_line():
    with pytest.raises(ConfigError, match="grad_compress: expected 'none', 'bf16', 'fp16', "
                                          "'powersgd', 'topk' or 'auto'"):
        ParallelConfig(grad_compress="int8")
    for bad in ({"zero": 2}, {"sync": "diloco"}, {"tp": 2}):
        with pytest.raises(ConfigError, match="grad_compress: expected 'none' with sync="):
            ParallelConfig(grad_compress="bf16", **bad)
