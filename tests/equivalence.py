"""Shared by the equivalence tests: train W steps data-parallel and as one plain process."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import tilework
from tilework import optim
from tilework.cluster.topology import Topology
from tilework.comm import build_groups
from tilework.data import ShardedBatches
from tilework.train.job import CNNJob, DataJob, Job, LMJob, RecommenderJob, TrainJob
from tilework.train.workloads import build

STEPS = 4


def job(workload: str) -> Job:
    return Job(workload=workload,
               lm=LMJob(corpus="zipf", vocab=400, embed_dim=8, hidden=8, seq_len=6,
                        zipf_tokens=5_000, num_sampled=24, eval_sequences=4),
               cnn=CNNJob(samples=64, image_size=6, width=4, blocks=2),
               recommender=RecommenderJob(samples=256, table_sizes=[300, 40, 7], embed_dim=4,
                                          dense_features=3),
               data=DataJob(batch_size=8),
               train=TrainJob(steps=STEPS))


def torch_optimizer(name: str, params, lr: float):
    return {"sgd": lambda: torch.optim.SGD(params, lr=lr),
            "adagrad": lambda: torch.optim.Adagrad(params, lr=lr),
            "adam": lambda: torch.optim.Adam(params, lr=lr)}[name]()


def _train(work, opt, sampler, steps):
    losses = []
    for step in range(steps):
        loss = work.loss(work.model, work.train_set.collate(sampler.indices(step)), step)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


LR = {"sgd": 0.1, "adagrad": 0.05, "adam": 0.01}


def reference(workload: str, optimizer: str, mode: str, steps: int = STEPS):
    """One process, plain PyTorch. Adam's tables are lazy (SparseAdam) unless all-reduced."""
    work = build(job(workload))
    lazy_tables = mode != "allreduce"
    if optimizer == "adam" and not lazy_tables:
        for m in work.model.modules():
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
                m.sparse = False
    opt = optim.for_model(work.model, optimizer, LR[optimizer])
    sampler = ShardedBatches(len(work.train_set), job(workload).data.batch_size)
    losses = _train(work, opt, sampler, steps)
    return {k: v.detach().clone() for k, v in work.model.state_dict().items()}, losses


def distributed(rank, world_size, workload, optimizer, mode, hosts, local_aggregation,
                steps=STEPS):
    """One rank of the data-parallel run; rank 0 returns the gathered single-device state."""
    j = job(workload)
    work = build(j)
    opt = torch_optimizer(optimizer, work.model.parameters(), LR[optimizer])
    groups = build_groups(dist.group.WORLD, Topology.uniform(hosts, world_size // hosts))
    tilework.parallelize(work.model, opt, groups=groups, mode=mode,
                         local_aggregation=local_aggregation, log=False)
    sampler = ShardedBatches(len(work.train_set), j.data.batch_size, rank, world_size)
    losses = _train(work, opt, sampler, steps)
    state = tilework.state_dict(work.model, opt)["model"]
    return (state if rank == 0 else None), losses, tilework.stats(work.model)


def worst(state, ref) -> float:
    """The largest difference of any tensor of `state` from `ref`'s, relative to that tensor's
    largest magnitude in `ref`."""
    return max((state[k] - v).abs().max().item() / (v.abs().max().item() + 1e-12)
               for k, v in ref.items())
