"""The sparse path beside its peers, interleaved in one run on loopback: where the time goes.

    torchrun --nproc-per-node 2 bench/sparse_step.py recommender [--rounds 5] [--steps 30]
    torchrun --nproc-per-node 2 bench/sparse_step.py lm100k --systems ddp-sparse hybrid --profile
    torchrun --nproc-per-node 2 bench/sparse_step.py recommender --base hybrid-ahead \
        --systems hybrid-ahead hybrid ddp-sparse torchrec
    python bench/sparse_step.py recommender --hosts 2 --rate parallax ...   # root: emulated hosts

Each round builds every system afresh (same model, seed, data and SGD as `tilework bench`) and
times `steps` steps after 5 warm-up ones; a step's time is its slowest rank's, a round's the
median step. Rounds interleave the systems so that drifts in the machine's speed hit all alike;
the base system's (--base, hybrid unless named) step time over each system's is the median of
the per-round ratios (paired). Also prints, for tilework's systems, how many times per step the
ranks meet (counted collectives by method) and, with --profile, rank 0's cProfile of one round
of the base system (the top functions by own time).
TorchRec systems run where torchrec is installed (see README), else they are left out.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import signal
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import torch
import torch.distributed as dist

from tilework.bench.worker import TORCHREC_SYSTEMS, _setup, batches
from tilework.bench.workloads import WORKLOADS
from tilework.comm import exit_worker

WARMUP = 5


def round_median(workload, system, steps, rank, world_size, profile=None) -> tuple[float, dict]:
    model, opt, _, _ = _setup(workload, system, world_size)
    times = []
    for step, inputs in enumerate(batches(workload, system, model, rank, world_size,
                                          WARMUP + steps)):
        dist.barrier()
        if profile is not None and step == WARMUP:
            profile.enable()
        start = time.perf_counter()
        model(*inputs).backward()
        opt.step()
        opt.zero_grad()
        if step >= WARMUP:
            times.append(time.perf_counter() - start)
    if profile is not None:
        profile.disable()
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    calls = {}
    if system in ("hybrid", "hybrid-ahead", "ps", "allreduce", "allgather", "auto"):
        import tilework

        calls = {m: t["calls"] for m, t in tilework.stats(model)["last_step"].items()}
    return statistics.median(slowest.tolist()), calls


def on_emulated_hosts(hosts: int, rate: str, rank_logs: str | None = None) -> int:
    """This script again, one rank on each of `hosts` emulated hosts; rank 0's output shown,
    the others' written to `rank_logs`/rank-R.log where given (a crash's own lines kept)."""
    from tilework.bench.netns import LinkShape, emulated_cluster
    from tilework.bench.netns import available as emulation
    from tilework.bench.suite import PARALLAX_FLOP_PER_BYTE, _free_port
    from tilework.cluster.calibrate import matmul_flops
    from tilework.cluster.worker_env import WorkerEnv

    ok, why = emulation(LinkShape(rate_mbit=100))
    if not ok:
        return f"no emulated hosts here: {why}"
    mbit = matmul_flops() / PARALLAX_FLOP_PER_BYTE * 8 / 1e6 if rate == "parallax" else float(rate)
    print(f"{hosts} emulated hosts, one rank each, links at {mbit:,.0f} Mbit/s ({rate})",
          flush=True)
    port, argv = _free_port(), [sys.executable, *sys.argv]
    logs = Path(rank_logs) if rank_logs else None
    if logs is not None:
        logs.mkdir(parents=True, exist_ok=True)
    with emulated_cluster(hosts, LinkShape(rate_mbit=mbit)) as cluster, ExitStack() as files:
        procs = []
        for r in range(hosts):   # all on this machine: local ranks 0 to n - 1, as the suite does
            env = WorkerEnv(launched=True, rank=r, world_size=hosts, local_rank=r,
                            local_world_size=hosts, master_addr="127.0.0.1", master_port=port)
            out = None if r == 0 else subprocess.DEVNULL
            if r and logs is not None:
                out = files.enter_context(open(logs / f"rank-{r}.log", "w"))
            procs.append(subprocess.Popen(
                cluster.command(r, argv), stdout=out,
                stderr=None if out in (None, subprocess.DEVNULL) else subprocess.STDOUT,
                env={**os.environ, "OMP_NUM_THREADS": "1", **env.to_environ(),
                     **cluster.gloo_env(r, port)}))
        codes = [proc.wait() for proc in procs]
    for r, code in enumerate(codes):
        if code:   # rank 1's output is not shown: say at least how it ended
            how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            print(f"rank {r} ended with {how}", file=sys.stderr)
    return max(abs(code) for code in codes)


def available(systems: list[str]) -> list[str]:
    try:
        import torchrec  # noqa: F401  (only whether it imports)
    except ImportError:
        return [s for s in systems if s not in TORCHREC_SYSTEMS]
    return systems


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("workload", choices=sorted(WORKLOADS))
    p.add_argument("--systems", nargs="+", default=["ddp-sparse", "hybrid", "torchrec"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--base", default="hybrid", help="the system the others are compared with "
                   "(hybrid-ahead: hybrid reading its batches through tilework.prefetch)")
    p.add_argument("--hosts", type=int, help="run on this many emulated hosts, one rank each "
                   "(root: network namespaces, as `tilework bench`), not on loopback")
    p.add_argument("--rate", default="parallax", help="their links' Mbit/s, or 'parallax' "
                   "(this machine's FLOP/s over Parallax's FLOP per byte, as `tilework bench`)")
    p.add_argument("--rank-logs", help="with --hosts: write ranks 1.. 's stdout and stderr to "
                   "DIR/rank-R.log (rank 0's stays on the terminal)")
    a = p.parse_args()
    if a.hosts and "RANK" not in os.environ:
        sys.exit(on_emulated_hosts(a.hosts, a.rate, a.rank_logs))
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    workload = WORKLOADS[a.workload]
    systems = [s for s in available(a.systems)
               if s not in TORCHREC_SYSTEMS or a.workload == "recommender"]
    rounds: dict[str, list[float]] = {s: [] for s in systems}
    calls: dict = {}
    for r in range(a.rounds):
        for system in systems:
            profile = cProfile.Profile() if a.profile and system == a.base and r == 0 \
                and rank == 0 else None
            median, got = round_median(workload, system, a.steps, rank, world_size, profile)
            rounds[system].append(median)
            if got:
                calls[system] = got
            if profile is not None:
                text = io.StringIO()
                pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(15)
                print(text.getvalue())
    if rank == 0:
        report(a.workload, rounds, calls, a.base)
    exit_worker(0)  # not a normal exit: see tilework.comm.exit_worker


def report(workload: str, rounds: dict[str, list[float]], calls: dict, base_system: str) -> None:
    base = rounds.get(base_system)
    for system, values in rounds.items():
        line = (f"{workload:>11} {system:>12}: " + " ".join(f"{v * 1e3:6.2f}" for v in values)
                + f"  median {statistics.median(values) * 1e3:6.2f} ms/step")
        if base and system != base_system:
            paired = statistics.median(b / v for v, b in zip(values, base))
            line += f"  {base_system}'s step is {paired:.2f}x this one's"
        print(line)
    for system, counted in calls.items():
        print(f"{system} meets the other ranks per step: {counted} (collectives by method)")


if __name__ == "__main__":
    main()
