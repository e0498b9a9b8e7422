"""Local SGD / DiLoCo on slow links, in wall-clock time to a loss, beside DDP and DDP with
PyTorch's PowerSGD hook, on emulated hosts.

    sudo .venv/bin/python bench/slow_links.py [--hosts 4] [--mbit 100] [--rtt-ms 50]
        [--workloads gpt lm] [--steps 120] [--every 20 40] [--compress none int4]
        [--streams 4:5] [--layerwise] [--no-powersgd] [--grad-compress bf16] [--eval-every 40]
        [--longer 4]
        [--out docs/slow-links.json] [--png docs/slow-links.png]

Each host is a network namespace with one rank, its link shaped by netem (rate and a one-way
delay of half the round trip; tilework/bench/netns.py). Every system trains the same model from
the same seed on the same global batches (AdamW inside); DDP runs `--steps`, the others go on to
`--longer` times as many, to find when they reach DDP's final loss:
- ddp: DistributedDataParallel, every gradient all-reduced every step;
- ddp-powersgd: DDP with torch's PowerSGD communication hook (rank 2, error feedback, warm
  start, from step 2);
- sync-bf16, sync-fp16: synchronous tilework, the buckets in that width (grad_compress);
- sync-powersgd: synchronous tilework, the buckets as PowerSGD's factors (grad_compress=
  "powersgd", rank 2, from step 2: the hook's settings above);
- sync-topk: synchronous tilework, each rank's `--topk-ratio` largest values of each bucket
  with error feedback (grad_compress="topk");
- diloco-H[-codec][-F<f>d<tau>|-L][-avg]: tilework.parallelize(sync="diloco", sync_every=H,
  outer_fragments=f, outer_delay=tau; -L: outer_schedule="layerwise", DreamDDP's; -avg: plain
  model averaging, outer SGD of lr 1 without momentum, in place of), the outer step
  Nesterov (lr 0.7, momentum 0.9), every parameter in the outer sync (mode="allreduce"), the
  pseudo-gradients in `--compress`'s encodings (outer_compress, with error feedback).
Wall clock excludes evaluation: every `--eval-every` steps (a multiple of every H) the ranks
stop their clocks, the slowest rank's time is the run's so far, rank 0 evaluates the held-out
loss, and the clocks start again. Bytes: each rank's veth transmit counter (what really left
the host, TCP included), summed over ranks.

Prints a table per workload (final loss, its gap to DDP's, bytes and their ratio to DDP's, the
wall-clock time to DDP's final loss and the speed-up) and writes the curves.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

SIZES = {  # small enough for 4 ranks on 2 cores, large enough that the wire matters
    "gpt": {"vocab": 2000, "dim": 128, "heads": 4, "layers": 2, "seq_len": 32},
    "lm": {"vocab": 5000, "embed_dim": 64, "hidden": 128, "seq_len": 32},
}
BATCH, LR = 32, 3e-3
TOPK_RATIO = 0.01   # --topk-ratio


def _job(workload: str, steps: int):
    from tilework.train.job import DataJob, GPTJob, Job, LMJob, TrainJob

    return Job(workload=workload, gpt=GPTJob(**SIZES["gpt"], eval_sequences=128),
               lm=LMJob(**SIZES["lm"], sparse=False, eval_sequences=128),
               data=DataJob(batch_size=BATCH), train=TrainJob(steps=steps, seed=0))


def _tx_bytes() -> int:
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    return int(Path(f"/sys/class/net/{ifname}/statistics/tx_bytes").read_text())


def _diloco(system: str) -> dict:
    """parallelize's local-SGD keywords for a system named
    diloco-H<H>[-<codec>][-F<fragments>d<delay>|-L][-avg]."""
    out = {"sync_every": 0, "outer_compress": "none"}
    for part in system.split("-")[1:]:
        if part.startswith("H"):
            out["sync_every"] = int(part[1:])
        elif part.startswith("F"):
            fragments, delay = part[1:].split("d")
            out |= {"outer_fragments": int(fragments), "outer_delay": int(delay)}
        elif part == "L":
            out["outer_schedule"] = "layerwise"
        elif part == "avg":   # model averaging (local SGD's, DreamDDP's): no outer momentum
            out |= {"outer_optimizer": "sgd", "outer_lr": 1.0, "outer_momentum": 0.0}
        else:
            out["outer_compress"] = part
    return out


def _wrap(system: str, model, opt):
    from torch.nn.parallel import DistributedDataParallel as DDP

    if system.startswith("ddp"):
        if system == "ddp-powersgd":
            # torch's PowerSGD hook on gloo mismatches collectives between buckets (its chained
            # futures launch all-reduces from callback threads: pytorch/pytorch#58467); in one
            # bucket it runs. One bucket also means no overlap with backward.
            dist._DEFAULT_FIRST_BUCKET_BYTES = 2**40
            model = DDP(model, bucket_cap_mb=2**20)
        else:
            model = DDP(model)
        if system == "ddp-powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

            state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                       start_powerSGD_iter=2, use_error_feedback=True,
                                       warm_start=True)
            model.register_comm_hook(state, psgd.powerSGD_hook)
        return model, model.module
    import tilework

    if system.startswith("sync-"):   # synchronous, the buckets in that width or factored
        factors = {"powersgd_rank": 2, "powersgd_start": 2} if system == "sync-powersgd" else \
            {"topk_ratio": TOPK_RATIO} if system == "sync-topk" else {}
        tilework.parallelize(model, opt, mode="allreduce", grad_compress=system[5:], log=False,
                             **factors)
        return model, model
    tilework.parallelize(model, opt, mode="allreduce", sync="diloco",
                         **({"outer_optimizer": "nesterov", "outer_lr": 0.7,
                             "outer_momentum": 0.9} | _diloco(system)), log=False)
    return model, model


def worker(a) -> None:
    from tilework.data import ShardedBatches
    from tilework.train.workloads import build

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    job = _job(a.workload, a.steps)
    work = build(job)
    opt = torch.optim.AdamW(work.model.parameters(), lr=LR)
    model, plain = _wrap(a.system, work.model, opt)
    sampler = ShardedBatches(len(work.train_set), BATCH, rank, n)
    metric = "eval_loss" if a.workload == "gpt" else "ppl"

    def evaluate() -> float:
        plain.eval()
        value = work.evaluate(plain)[metric]
        plain.train()
        return float(value if metric == "eval_loss" else torch.tensor(value).log())

    dist.barrier()
    tx0, wall, curve = _tx_bytes(), 0.0, [(0, 0.0, evaluate() if rank == 0 else None)]
    start = time.perf_counter()
    for step in range(a.steps):
        work.loss(model, work.train_set.collate(sampler.indices(step)), step).backward()
        opt.step()
        opt.zero_grad()
        if (step + 1) % a.eval_every == 0 or step + 1 == a.steps:
            took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)   # the slowest rank's
            wall += took.item()
            curve.append((step + 1, wall, evaluate() if rank == 0 else None))
            dist.barrier()
            start = time.perf_counter()
    sent = torch.tensor([_tx_bytes() - tx0], dtype=torch.float64)
    dist.all_reduce(sent)
    dist.barrier()
    if rank == 0:
        Path(a.out).write_text(json.dumps({
            "system": a.system, "workload": a.workload, "curve": curve,
            "bytes": sent.item(), "tokens_per_step": BATCH * job.gpt.seq_len,
            "params": sum(p.numel() for p in plain.parameters())}))
    # Every rank is past the last collective: leave without tearing the group down (seen here:
    # two of four ranks waiting in destroy_process_group for peers that had exited).
    sys.stdout.flush()
    os._exit(0)


def run_system(cluster, workload: str, system: str, a) -> dict:
    from tilework.bench.suite import _free_port, launch_ranks
    from tilework.cluster.worker_env import WorkerEnv

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        # The others may go on past DDP's steps: how long they take to reach its loss is the
        # measure (their loss at its step count is in their curves too).
        steps = a.steps * (1 if system == "ddp" else 2 if system in ("sync-bf16", "sync-fp16")
                           else a.longer)
        argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--workload",
                workload, "--system", system, "--steps", str(steps), "--eval-every",
                str(a.eval_every), "--topk-ratio", str(a.topk_ratio), "--out", str(out)]
        port, n = _free_port(), a.hosts
        base = {**os.environ, "OMP_NUM_THREADS": "1"}
        # All on this one machine, as tilework bench's emulated hosts are.
        envs = [{**base, **WorkerEnv(launched=True, rank=r, world_size=n, local_rank=r,
                                     local_world_size=n, master_addr="127.0.0.1",
                                     master_port=port).to_environ(),
                 **cluster.gloo_env(r, port)} for r in range(n)]
        launch_ranks([cluster.command(r, argv) for r in range(n)], envs, timeout=a.timeout)
        return json.loads(out.read_text())


def time_to(curve, target: float) -> float | None:
    """Wall-clock seconds at which the loss first reached `target` (linear between evals)."""
    for (s0, t0, l0), (s1, t1, l1) in zip(curve, curve[1:]):
        if l1 <= target:
            return t0 + (t1 - t0) * ((l0 - target) / (l0 - l1) if l0 != l1 else 1.0)
    return None


def summary(results: list[dict], steps: int) -> list[dict]:
    """Per system: the loss at DDP's step count (equal tokens) and its gap to DDP's; wall
    clock and bytes per step over those steps; when (if ever) it reached DDP's final loss."""
    ddp = next(r for r in results if r["system"] == "ddp")
    target, ddp_time = ddp["curve"][-1][2], ddp["curve"][-1][1]
    rows = []
    for r in results:
        at = next(p for p in r["curve"] if p[0] == steps)
        ran = r["curve"][-1][0]
        reached = time_to(r["curve"], target)
        rows.append({"system": r["system"], "loss": at[2], "loss_gap": (at[2] - target) / target,
                     "wall_s": at[1], "steps_run": ran, "bytes_per_step": r["bytes"] / ran,
                     "bytes_vs_ddp": (ddp["bytes"] / ddp["curve"][-1][0]) / (r["bytes"] / ran),
                     "time_to_ddp_loss": reached,
                     "speedup": None if reached is None else ddp_time / reached})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--system")
    ap.add_argument("--workload")
    ap.add_argument("--workloads", nargs="+", default=["gpt", "lm"])
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--mbit", type=float, default=100.0)
    ap.add_argument("--rtt-ms", type=float, default=50.0,
                    help="round trip to emulate (netem; 0 where the kernel lacks netem)")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--every", type=int, nargs="*", default=[20, 40],
                    help="local SGD's periods H to run (none: no local SGD)")
    ap.add_argument("--compress", nargs="+", default=["none"],
                    choices=["none", "bf16", "int8", "int4"],
                    help="the outer sync's encodings to run at every H (outer_compress)")
    ap.add_argument("--streams", nargs="*", default=[], metavar="F:TAU",
                    help="also run each H and encoding streamed: F fragments, each exchange "
                         "beside TAU inner steps (outer_fragments, outer_delay)")
    ap.add_argument("--layerwise", action="store_true",
                    help="also run each H and encoding with DreamDDP's layer-wise schedule "
                         "(outer_schedule='layerwise')")
    ap.add_argument("--average", action="store_true",
                    help="local SGD's outer step as plain model averaging (-avg) in place of "
                         "DiLoCo's Nesterov")
    ap.add_argument("--no-powersgd", action="store_true", help="leave out DDP + PowerSGD")
    ap.add_argument("--grad-compress", nargs="*", default=[],
                    choices=["bf16", "fp16", "powersgd", "topk"],
                    help="also synchronous tilework with its buckets in that width, run to "
                         "twice DDP's steps, or as PowerSGD's factors or top-k, run as long as "
                         "DDP + PowerSGD (grad_compress)")
    ap.add_argument("--topk-ratio", type=float, default=0.01,
                    help="the share of each bucket a rank sends under --grad-compress topk")
    ap.add_argument("--eval-every", type=int, default=40)
    ap.add_argument("--longer", type=int, default=4,
                    help="the systems other than DDP run this many times its steps (to find "
                         "when they reach its loss)")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per system's run")
    ap.add_argument("--out")
    ap.add_argument("--png")
    a = ap.parse_args(argv)
    global TOPK_RATIO
    TOPK_RATIO = a.topk_ratio
    if a.worker:
        worker(a)
        return 0
    if any(a.eval_every % h for h in a.every):
        ap.error("--eval-every must be a multiple of every --every (evaluate at the syncs)")
    from tilework.bench.netns import LinkShape, available, emulated_cluster

    link = LinkShape(rate_mbit=a.mbit, delay_ms=a.rtt_ms / 2)
    ok, why = available(link)
    if not ok:
        sys.exit(f"slow_links: cannot emulate {a.mbit:g} Mbit/s with {a.rtt_ms:g} ms round trip "
                 f"here: {why} (--rtt-ms 0 shapes the rate alone)")
    streams = [""] + [f"-F{f}d{t}" for f, t in (x.split(":") for x in a.streams)] \
        + (["-L"] if a.layerwise else [])
    systems = ["ddp", *([] if a.no_powersgd else ["ddp-powersgd"]),
               *[f"sync-{c}" for c in a.grad_compress],
               *[f"diloco-H{h}" + ("" if c == "none" else f"-{c}") + st
                 + ("-avg" if a.average else "")
                 for h in a.every for c in a.compress for st in streams]]
    report: dict = {"hosts": a.hosts, "mbit": a.mbit, "rtt_ms": a.rtt_ms, "steps": a.steps,
                    "topk_ratio": a.topk_ratio,
                    "batch": BATCH, "lr": LR, "sizes": SIZES, "workloads": {}}
    with emulated_cluster(a.hosts, link) as cluster:
        for w in a.workloads:
            results = []
            for s in systems:
                results.append(run_system(cluster, w, s, a))
                r = results[-1]
                print(f"{w:>4} {s:>22}: loss {r['curve'][-1][2]:.4f} after "
                      f"{r['curve'][-1][1]:7.1f} s, {r['bytes'] / 1e6:9.1f} MB", flush=True)
            report["workloads"][w] = {"results": results, "summary": summary(results, a.steps)}
    print(f"\n{a.hosts} hosts, {a.mbit:g} Mbit/s, {a.rtt_ms:g} ms round trip, {a.steps} steps "
          f"of {BATCH} sequences, AdamW lr {LR}")
    for w, got in report["workloads"].items():
        print(f"\n{w}: | system | loss at {a.steps} steps | vs DDP | wall s | MB/step | "
              "bytes vs DDP | s to DDP's loss | speed-up |\n"
              "|---|---:|---:|---:|---:|---:|---:|---:|")
        for row in got["summary"]:
            reach = row["time_to_ddp_loss"]
            print(f"| {row['system']} | {row['loss']:.4f} | {row['loss_gap']:+.1%} | "
                  f"{row['wall_s']:.1f} | {row['bytes_per_step'] / 1e6:.2f} | "
                  f"{row['bytes_vs_ddp']:.0f}x | "
                  f"{'-' if reach is None else f'{reach:.1f}'} | "
                  f"{_speedup(row['speedup'])} |")
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1))
    if a.png:
        _plot(report, Path(a.png))
    return 0


def _speedup(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}x"


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["workloads"])
    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 3.8), squeeze=False)
    for ax, w in zip(axes[0], names):
        for r in report["workloads"][w]["results"]:
            ts, ls = zip(*[(t, loss) for _, t, loss in r["curve"]])
            ax.plot(ts, ls, marker="o", markersize=3, label=r["system"])
        ax.set_xlabel("wall-clock seconds (evaluation excluded)")
        ax.set_ylabel("held-out loss" if w == "gpt" else "held-out log perplexity")
        ax.set_title(f"{w}: {report['hosts']} hosts, {report['mbit']:g} Mbit/s, "
                     f"{report['rtt_ms']:g} ms RTT", fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
