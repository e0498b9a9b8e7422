"""plan="auto" in a live job: the planner's search (planner/search.py, pure) fed with what this
world is. The ranks' hosts come from the discovered topology, the links from the cluster file
(or the defaults), each rank's memory from the cluster file or else from the device (a GPU's
memory; on a CPU host its RAM over the ranks sharing it), and the compute rate from a matmul
measured here. Every rank must choose the same plan: the rate and the memory are the smallest
any rank measured (one all-reduce), so the pure search gives one answer everywhere.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist
from torch import nn

from ..cluster.topology import Cluster, Host, Links
from ..comm.counted import Stats, all_reduce
from ..comm.groups import Groups
from ..config.parallel import ParallelConfig
from ..errors import PlanError


def choose_live(model: nn.Module, optimizer, config: ParallelConfig, groups: Groups,
                cluster: Cluster | None, example_inputs: tuple | None, traffic: dict | None,
                log: bool) -> ParallelConfig:
    """The config plan="auto" chooses for this world (the same on every rank)."""
    from ..planner.search import Space, auto

    if example_inputs is None:
        raise PlanError("plan='auto' prices each candidate's memory and compute on a batch: "
                        "pass example_inputs=(one rank's batch, as the model takes it) to "
                        "parallelize")
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    live = _live_cluster(groups, cluster)
    flops, memory = _agreed(groups, _measured_flops(groups.device), _device_memory(groups))
    space = Space.of(config)
    if optimizer is None:   # a hand-written update: no optimizer to shard, no server to step
        config = dataclasses.replace(config, zero=0, mode="allreduce")
        space = dataclasses.replace(space, zero=())
    found = auto(model, config, live, example_inputs, flops,
                 optimizer if optimizer is not None else "sgd", traffic, memory, space)
    if log and groups.rank == 0:
        print(f"tilework plan='auto' ({len(found.candidates)} candidates, compute "
              f"{flops / 1e9:,.1f} GFLOP/s per rank): {found.why()}")
    return found.chosen.config


def _live_cluster(groups: Groups, cluster: Cluster | None) -> Cluster:
    """The world's hosts as discovered, with the cluster file's links and memory where given."""
    given = {h.name: h for h in cluster.hosts} if cluster is not None else {}
    named = list(given.values())
    hosts = []
    for i, ranks in enumerate(groups.topology.hosts):
        memory = named[i].memory_gb if i < len(named) else None
        hosts.append(Host(name=f"host{i}", procs=len(ranks), memory_gb=memory))
    return Cluster(hosts=hosts, links=cluster.links if cluster is not None else Links())


def _measured_flops(device: torch.device) -> float:
    from ..cluster.calibrate import matmul_flops

    if device.type == "cuda":
        a = torch.randn(2048, 2048, device=device)
        torch.cuda.synchronize(device)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            a @ a
        end.record()
        torch.cuda.synchronize(device)
        return 2 * 2048**3 * 10 / (start.elapsed_time(end) / 1e3)
    return matmul_flops()


def _device_memory(groups: Groups) -> float:
    """Bytes this rank may use: its GPU's, or its host's RAM over the ranks sharing it."""
    if groups.device.type == "cuda":
        return float(torch.cuda.get_device_properties(groups.device).total_memory)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    sharing = next(len(h) for h in groups.topology.hosts if groups.rank in h)
    return ram / sharing


def _agreed(groups: Groups, flops: float, memory: float) -> tuple[float, float]:
    """The smallest rate and memory any rank has (a 2-element MIN all-reduce)."""
    if groups.world is None:
        return flops, memory
    both = torch.tensor([flops, memory], dtype=torch.float64, device=groups.device)
    all_reduce(both, groups.world, Stats(), "setup", op=dist.ReduceOp.MIN)
    return float(both[0]), float(both[1])
