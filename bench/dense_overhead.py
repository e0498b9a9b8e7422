"""tilework's dense path beside DistributedDataParallel, interleaved in one run on loopback.

    torchrun --nproc-per-node 2 bench/dense_overhead.py cnn [--rounds 5] [--steps 50]

Each round builds the workload's model afresh under DDP, tilework mode="allreduce" with input
checks (the default) and without, and times `steps` steps (forward, backward, SGD step) after 10
warm-up steps; a step's time is its slowest rank's, a round's the median step. Rounds interleave
the systems so that drifts in the machine's speed hit all three alike. Prints each system's
round medians, their median, and the ratio to DDP. Loopback makes the links nearly free, so what
remains is each system's own per-step overhead (hooks, buffers, checks): the number that issue
10's "dense step time within 5% of DDP" is about. `tilework bench` measures the same systems on
emulated hosts.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import tilework
from tilework.bench.workloads import WORKLOADS
from tilework.comm import exit_worker

SYSTEMS = ("ddp", "tilework", "tilework-nocheck")


def build(workload, system: str):
    torch.manual_seed(0)
    model = workload.make(False)
    opt = None
    if system == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        tilework.parallelize(model, opt, mode="allreduce", log=False,
                             check_inputs=system == "tilework")
    return model, opt


def round_median(workload, system: str, steps: int, rank: int, world_size: int) -> float:
    model, opt = build(workload, system)
    times = []
    for step in range(10 + steps):
        inputs = workload.batch(step, rank, world_size)
        dist.barrier()
        start = time.perf_counter()
        model(*inputs).backward()
        opt.step()
        opt.zero_grad()
        if step >= 10:
            times.append(time.perf_counter() - start)
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return statistics.median(slowest.tolist())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("workload", choices=sorted(WORKLOADS))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=50)
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    workload = WORKLOADS[a.workload]
    rounds: dict[str, list[float]] = {s: [] for s in SYSTEMS}
    for _ in range(a.rounds):
        for system in SYSTEMS:
            rounds[system].append(round_median(workload, system, a.steps, rank, world_size))
    if rank == 0:
        ddp = statistics.median(rounds["ddp"])
        for system, values in rounds.items():
            median = statistics.median(values)
            print(f"{a.workload:>8} {system:>17}: " + " ".join(f"{v * 1e3:6.2f}" for v in values)
                  + f"  median {median * 1e3:6.2f} ms/step  ({median / ddp:.3f}x DDP)")
    exit_worker(0)  # not a normal exit: see tilework.comm.exit_worker


if __name__ == "__main__":
    main()
