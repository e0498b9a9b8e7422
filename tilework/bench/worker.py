"""One rank of a benchmark: train a workload under one system and time the steps.

    python -m tilework.bench.worker --workload lm100k --system hybrid --steps 5 --out r.json

Run by `tilework.bench.suite` in every rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set).
Systems: ddp (DistributedDataParallel, dense gradients: Horovod's analogue), ddp-sparse (DDP with
sparse embedding gradients, gloo's sparse all-reduce), tilework's allreduce, ps and hybrid,
hybrid-zipf (hybrid planned with the workload's Zipf traffic: the planner chooses each table and
its hot head), hybrid-hot (that plan with each server table's head that a rank touches with
probability >= 0.5 replicated where the planner kept none; parallel/rows/hot.py), hybrid-contiguous
(hybrid with every table's rows in contiguous ranges, the layout before the planner chose hashed
rows: what the row map gains), hybrid-shares (hybrid with each rank's own share of the global
batch, --shares: on hosts of different speeds, suite.py's --speeds), hybrid-ahead (hybrid with
the loop's batches read through
`tilework.prefetch`: the next batch's ids routed during this step), allgather (every sparse table
synchronised as DDP synchronises it, its touched rows all-gathered: parallel/rows/gather.py), and
TorchRec (torchrec,
torchrec-rw: recommender only, optional; see torchrec_peer.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import resource
import statistics
import time

import torch
import torch.distributed as dist

from .torchrec_peer import SYSTEMS as TORCHREC_SYSTEMS

SYSTEMS = ("ddp", "ddp-sparse", "allreduce", "ps", "hybrid", "hybrid-ahead", "hybrid-zipf",
           "hybrid-hot", "hybrid-contiguous", "allgather", "hybrid-shares",
           "hybrid-bf16push", "auto") + TORCHREC_SYSTEMS


def _setup(workload, system: str, world_size: int, shares=None):
    """(model, optimizer, bytes counter or None, extra result fields)."""
    if system in TORCHREC_SYSTEMS:
        from . import torchrec_peer

        return torchrec_peer.setup(workload, system, world_size)
    torch.manual_seed(0)
    model = workload.make(system in ("ddp-sparse", "ps", "allgather", "auto")
                          or system.startswith("hybrid"))
    if system.startswith("ddp"):
        if world_size > 1:
            model = torch.nn.parallel.DistributedDataParallel(model)
        return model, torch.optim.SGD(model.parameters(), lr=0.01), None, {}
    import tilework

    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if system in ("hybrid-zipf", "hybrid-hot"):
        plan, extra = _hot_plan(model, workload, world_size,
                                0.5 if system == "hybrid-hot" else None)
        tilework.parallelize(model, opt, plan=plan, log=False)
        return model, opt, None, extra
    if system == "auto":   # what plan="auto" chooses live, with the workload's id traffic
        from ..cluster.topology import Topology

        rank = dist.get_rank()
        tilework.parallelize(
            model, opt, plan="auto", example_inputs=workload.batch(0, rank, world_size),
            traffic=workload.traffic(Topology.from_sizes([world_size])), log=rank == 0)
        return model, opt, None, {"tables": _tables(model)}
    if system == "allgather":
        from ..plans.analysis import embedding_modules

        tilework.parallelize(model, opt, log=False, overrides={
            name: "allgather" for name in embedding_modules(model)})
        return model, opt, None, {}
    if system == "hybrid-contiguous":
        tilework.parallelize(model, opt, mode="hybrid", row_map="contiguous", log=False)
        return model, opt, None, {}
    if system == "hybrid-bf16push":   # the servers' push in half width (push_compress)
        tilework.parallelize(model, opt, mode="hybrid", push_compress="bf16", log=False)
        return model, opt, None, {}
    if system == "hybrid-shares":
        tilework.parallelize(model, opt, mode="hybrid", log=False,
                             batch_shares=list(shares) if shares else None)
        return model, opt, None, {"batch_shares": list(shares) if shares else None}
    tilework.parallelize(model, opt, mode=system.removesuffix("-ahead"), log=False)
    return model, opt, None, {}


def _tables(model) -> dict[str, str]:
    """Each table's method in the plan `model` runs."""
    from ..runtime.handle import runtime_of

    return {p.name: p.method for p in runtime_of(model).engine.plan.params if p.is_table}


def batches(workload, system: str, model, rank: int, world_size: int, count: int,
            shares=None):
    """The workload's batches (this rank's share of each under hybrid-shares), read through
    tilework.prefetch for hybrid-ahead."""
    mine = shares if system == "hybrid-shares" else None
    made = (workload.batch(step, rank, world_size, mine) for step in range(count))
    if system != "hybrid-ahead":
        return made
    import tilework

    return tilework.prefetch(made, model)


def _hot_plan(model, workload, world_size: int, probability: float | None):
    """The hybrid plan with the workload's Zipf traffic, and (given `probability`) each server
    table's head that a rank touches with at least that probability replicated where the
    planner kept none."""
    import dataclasses

    from .. import ParallelConfig, planner
    from ..cluster.topology import Topology

    topology = Topology.from_sizes([world_size])
    traffic = workload.traffic(topology)
    plan = planner.plan(model, ParallelConfig(), traffic=traffic, topology=topology)
    chosen = {p.name: p.hot_rows for p in plan.of("ps")}
    params = tuple(dataclasses.replace(p, hot_rows=p.hot_rows or
                                       traffic[p.name].touched_rows(probability))
                   if p.method == "ps" and p.name in traffic and probability else p
                   for p in plan.params)
    plan = dataclasses.replace(plan, params=params)
    return plan, {"planner_hot_rows": chosen, "hot_rows": {p.name: p.hot_rows
                                                           for p in plan.of("ps")}}


def _ddp_bytes(model, world_size: int) -> int:
    """What DDP sent this step: ring all-reduce of dense grads; sparse grads are all-gathered
    (every rank sends its indices and values to the n - 1 others)."""
    from ..comm.wire import all_gather_bytes, ring_allreduce_bytes

    dense = sparse = 0
    for p in model.parameters():
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            g = p.grad.coalesce()
            sparse += g.indices().numel() * 8 + g.values().numel() * g.values().element_size()
        else:
            dense += p.numel() * p.element_size()
    return ring_allreduce_bytes(dense, world_size) + all_gather_bytes(sparse, world_size)


def timed_steps(workload, system: str, model, opt, counter, rank: int, world_size: int,
                steps: int, warmup: int, shares=None) -> tuple[list[float], list[int]]:
    """`steps` steps after `warmup`, each from a barrier to after the optimizer's step: this
    rank's seconds and the bytes it sent in each (the system's own count)."""
    times, sent = [], []
    for step, inputs in enumerate(batches(workload, system, model, rank, world_size,
                                          warmup + steps, shares)):
        dist.barrier()
        start = time.perf_counter()
        model(*inputs).backward()
        if system.startswith("ddp"):
            step_bytes = _ddp_bytes(model, world_size)
        opt.step()
        opt.zero_grad()
        elapsed = time.perf_counter() - start
        if counter is not None:
            step_bytes = counter.take()
        elif not system.startswith("ddp"):
            import tilework

            step_bytes = sum(t["sent"] for t in tilework.stats(model)["last_step"].values())
        if step >= warmup:
            times.append(elapsed)
            sent.append(step_bytes)
    return times, sent


def run(workload_name: str, system: str, steps: int, warmup: int, shares=None) -> dict:
    from .workloads import WORKLOADS

    workload = WORKLOADS[workload_name]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    model, opt, counter, extra = _setup(workload, system, world_size, shares)
    times, sent = timed_steps(workload, system, model, opt, counter, rank, world_size, steps,
                              warmup, shares)
    # The step of the slowest rank is the step.
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    median = statistics.median(t.tolist())
    result = {"workload": workload_name, "system": system, "world_size": world_size,
              "step_s": median, "throughput": workload.units_per_step / median,
              "mean_step_s": statistics.fmean(t.tolist()),
              "unit": workload.unit, "bytes_per_step": statistics.median(sent),
              "peak_rss_bytes": peak.item(), "steps": steps, **extra}
    dist.destroy_process_group()
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workload", required=True)
    p.add_argument("--system", required=True, choices=SYSTEMS)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", required=True)
    p.add_argument("--shares", type=int, nargs="+", help="hybrid-shares: samples per rank")
    a = p.parse_args()
    if a.system in TORCHREC_SYSTEMS:
        from .torchrec_peer import missing, refuse

        why = refuse(a.workload) or missing()
        if why:
            raise SystemExit(f"{a.system}: {why}")
    from ..cluster.worker_env import WorkerEnv

    env = WorkerEnv.from_environ()  # this worker's entry point: the one read
    result = run(a.workload, a.system, a.steps, a.warmup, a.shares)
    if result and env.rank == 0:
        with open(a.out, "w") as f:
            json.dump(result, f)
    from ..comm import exit_worker

    exit_worker(0)


if __name__ == "__main__":
    main()
