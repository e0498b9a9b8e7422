"""`tilework bench`: tilework beside PyTorch's DDP, same model, data and seed, in the same run.

    tilework bench --quick           # < 2 minutes: the sparse LM and the CNN on 2 emulated hosts
    tilework bench                   # every workload, loopback and emulated hosts at 3 link rates

Emulated hosts are network namespaces joined by a bridge (bench/netns.py), each host's link
shaped with tbf. The rate is chosen by ratio, not habit: the Parallax testbed had about 1,000
FLOP of GPU compute per byte of network (12 TFLOP/s on 100 Gb/s); this machine's per-process
matmul FLOP/s over 1,000 gives the "parallax" rate, reported with 10x and 0.1x of it. Without
root or iproute2 the suite says so and runs on loopback only.

    tilework bench --speeds 1 0.25   # hosts that differ: one rank per host, each in a CPU quota

With --speeds each emulated host's rank runs in a CPU cgroup of that many cores
(bench/cgroup.CpuQuota, a 10 ms period; the step is then the mean, not the median), on
loopback and on links at the parallax rate; hybrid-shares gives each rank the share of the
global batch that `tilework train` gives hosts of those speeds, beside DDP and tilework on the
even split.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from ..cluster.worker_env import WorkerEnv
from .cgroup import CpuQuota
from .netns import LinkShape, available, emulated_cluster
from .worker import SYSTEMS, TORCHREC_SYSTEMS

PARALLAX_FLOP_PER_BYTE = 12e12 / (100e9 / 8)   # TITAN Xp fp32 over 100 Gb/s InfiniBand (~960)
# Steps here take tens of ms: under the kernel's 100 ms period a quarter-core rank would run a
# step or two at full speed and then stop for 75 ms. 10 ms spreads the stops over the steps.
QUOTA_PERIOD_US = 10_000


@dataclass(frozen=True)
class Setting:
    name: str
    hosts: int
    link: LinkShape | None       # None: loopback
    only: tuple[str, ...] = ()   # workloads to run here (empty: all)
    speeds: tuple[float, ...] = ()   # each host's CPU cores (cgroup quotas); (): unlimited


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_ranks(commands: list[list[str]], envs: list[dict], timeout: float,
                 quotas: list | None = None, grace: float = 120.0) -> None:
    """Run every rank's command to its end; `quotas`: each rank's CpuQuota (joined before its
    command runs, so every thread and child of it is held to the quota).

    Watched together, not one after another: a rank that fails stops the others at once and
    is named, and ranks still running `grace` seconds after another finished cleanly are
    stopped too (seen: ranks left waiting in a collective for peers that had exited), rather
    than each waiting out `timeout`."""
    quotas = quotas or [None] * len(commands)
    with tempfile.TemporaryDirectory() as tmp:
        logs = [open(Path(tmp) / f"rank{r}.log", "w+") for r in range(len(commands))]
        procs = [subprocess.Popen(c, env=e, stdout=f, stderr=subprocess.STDOUT,
                                  preexec_fn=q.join if q is not None else None)
                 for c, e, q, f in zip(commands, envs, quotas, logs)]
        problem = None
        try:
            problem = _watch(procs, timeout, grace)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
            outs = []
            for f in logs:
                f.seek(0)
                outs.append(f.read())
                f.close()
    if problem is not None:
        rank, why = problem
        raise RuntimeError(f"benchmark rank {rank} {why}:\n{outs[rank][-2000:]}")


def _watch(procs, timeout: float, grace: float) -> tuple[int, str] | None:
    """(rank, what went wrong) for the first rank that failed or hung, or None when all ended
    cleanly."""
    deadline, first_done = time.monotonic() + timeout, None
    while True:
        codes = [p.poll() for p in procs]
        failed = next((r for r, c in enumerate(codes) if c not in (None, 0)), None)
        if failed is not None:
            return failed, f"failed (exit code {codes[failed]})"
        if all(c == 0 for c in codes):
            return None
        now = time.monotonic()
        if first_done is None and 0 in codes:
            first_done = now
        running = next(r for r, c in enumerate(codes) if c is None)
        if now > deadline:
            return running, f"still running after {timeout:.0f} s"
        if first_done is not None and now - first_done > grace:
            return running, f"still running {grace:.0f} s after another rank finished"
        time.sleep(0.1)


def run_one(workload: str, system: str, setting: Setting, steps: int, warmup: int,
            cluster=None, timeout: float = 300) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        argv = [sys.executable, "-m", "tilework.bench.worker", "--workload", workload,
                "--system", system, "--steps", str(steps), "--warmup", str(warmup),
                "--out", str(out)]
        port, n = _free_port(), setting.hosts
        if system == "hybrid-shares" and setting.speeds:
            argv += ["--shares", *map(str, shares_for(workload, setting.speeds))]
        # Each rank inherits this process's environment (PATH, ...) and is told who it is; all
        # run on this one machine (emulated hosts too), hence local ranks 0 to n - 1.
        base = {**os.environ, "OMP_NUM_THREADS": "1"}
        ranks = [WorkerEnv(launched=True, rank=r, world_size=n, local_rank=r, local_world_size=n,
                           master_addr="127.0.0.1", master_port=port).to_environ()
                 for r in range(n)]
        if cluster is None:
            envs, commands = [{**base, **ranks[r]} for r in range(n)], [argv] * n
        else:
            envs = [{**base, **ranks[r], **cluster.gloo_env(r, port)} for r in range(n)]
            commands = [cluster.command(r, argv) for r in range(n)]
        quotas = [CpuQuota(c, name=f"bench-host{h}", period_us=QUOTA_PERIOD_US)
                  for h, c in enumerate(setting.speeds)]
        try:
            launch_ranks(commands, envs, timeout, quotas or None)
        finally:
            for q in quotas:
                q.remove()
        result = json.loads(out.read_text())
    if setting.speeds:   # a quota stops a rank for whole periods: the median step hides that
        result |= {"step_s": result["mean_step_s"],
                   "throughput": result["throughput"] * result["step_s"] / result["mean_step_s"]}
    return {**result, "setting": setting.name, "hosts": setting.hosts}


def shares_for(workload: str, speeds) -> tuple[int, ...]:
    """hybrid-shares' split of the workload's global batch over hosts of these speeds: what
    `tilework train` gives a cluster file with these `speed`s (planner/shares.batch_shares)."""
    from ..planner.shares import batch_shares
    from .workloads import WORKLOADS

    return batch_shares(WORKLOADS[workload].samples, speeds)


def uneven_settings(speeds: tuple[float, ...], flops: float) -> tuple[list[Setting], str]:
    """Hosts of different speeds (`speeds`: CPU cores each, one rank per host): on loopback,
    and on emulated hosts at the parallax rate where namespaces can be made."""
    try:
        CpuQuota(speeds[0], name="probe").remove()
    except OSError as e:
        raise RuntimeError(f"--speeds needs CPU cgroups (root): {e}") from None
    label = "/".join(f"{c:g}" for c in speeds)
    chosen = [Setting(f"{len(speeds)} hosts of {label} cores, loopback", len(speeds), None,
                      speeds=speeds)]
    ok, why = available(LinkShape(rate_mbit=100))
    if not ok:
        return chosen, f"CPU quotas {label}; no emulated hosts: {why}"
    parallax = flops / PARALLAX_FLOP_PER_BYTE * 8 / 1e6
    chosen.append(Setting(f"{len(speeds)} hosts of {label} cores, {parallax:,.0f} Mbit/s",
                          len(speeds), LinkShape(rate_mbit=parallax), speeds=speeds))
    return chosen, (f"CPU quotas {label} (cgroups); emulated hosts: tbf-shaped veth links at "
                    f"the parallax rate {parallax:,.0f} Mbit/s")


def settings(quick: bool, flops: float) -> tuple[list[Setting], str]:
    ok, why = available(LinkShape(rate_mbit=100))
    parallax = flops / PARALLAX_FLOP_PER_BYTE * 8 / 1e6   # Mbit/s
    chosen = [Setting("1 host", 1, None)]
    if not ok:
        return chosen + [Setting("loopback, 2 ranks", 2, None)], f"no emulated hosts: {why}"
    rates = [("parallax", 1.0, ())] if quick else [
        ("parallax", 1.0, ()), ("10x", 10.0, ()),
        # At a tenth of the rate dense all-reduce of the 800k LM takes a minute a step: skipped.
        ("0.1x", 0.1, ("lm100k", "cnn", "gpt", "recommender"))]
    for label, factor, only in rates:
        chosen.append(Setting(f"2 hosts, {label} ({parallax * factor:,.0f} Mbit/s)", 2,
                              LinkShape(rate_mbit=parallax * factor), only))
    if not quick:
        chosen.insert(1, Setting("loopback, 2 ranks", 2, None))
    return chosen, f"emulated hosts: tbf-shaped veth links; parallax rate {parallax:,.0f} Mbit/s"


def _peer_missing(systems: list[str], workloads: list[str], log) -> str | None:
    """Why the TorchRec peer cannot run here (None: it can, or it was not asked for); says once
    which workloads it skips."""
    if not set(systems) & set(TORCHREC_SYSTEMS):
        return None
    from .torchrec_peer import WORKLOADS as PEER_WORKLOADS
    from .torchrec_peer import missing

    skipped = [w for w in workloads if w not in PEER_WORKLOADS]
    if skipped:
        log(f"torchrec systems run the recommender workload only: skipped for {', '.join(skipped)}")
    why = missing()
    if why:
        log(f"torchrec systems marked missing: {why}")
    return why


def run_suite(workloads: list[str], systems: list[str], quick: bool, steps: int, warmup: int,
              log=print, speeds: tuple[float, ...] = ()) -> dict:
    from ..cluster.calibrate import matmul_flops

    flops = matmul_flops()
    chosen, note = uneven_settings(tuple(speeds), flops) if speeds else settings(quick, flops)
    log(f"per-process matmul: {flops / 1e9:.1f} GFLOP/s; {note}")
    peer_missing = _peer_missing(systems, workloads, log)
    results = []
    for setting in chosen:
        systems_here = systems if setting.hosts > 1 else ["hybrid"]  # one rank: nothing to sync
        cm = (nullcontext() if setting.link is None
              else emulated_cluster(setting.hosts, setting.link))
        with cm as cluster:
            for w in workloads:
                if setting.only and w not in setting.only:
                    continue
                for s in systems_here:
                    if s in TORCHREC_SYSTEMS and (w != "recommender" or peer_missing):
                        if w == "recommender":
                            results.append({"workload": w, "system": s, "setting": setting.name,
                                            "hosts": setting.hosts, "missing": peer_missing})
                            log(f"{setting.name:>34}  {w:>11}  {s:>10}  missing (torchrec)")
                        continue
                    r = run_one(w, s, setting, steps, warmup, cluster)
                    results.append(r)
                    log(f"{setting.name:>34}  {w:>11}  {s:>10}  {r['step_s'] * 1e3:8.1f} ms/step  "
                        f"{r['throughput']:10,.0f} {r['unit']}/s  "
                        f"{r['bytes_per_step'] / 1e6:8.3f} MB"
                        + (f"  ({r['sharding']})" if "sharding" in r else ""))
    return {"flops_per_s": flops, "note": note, "results": results, "quick": quick,
            "steps": steps, "warmup": warmup, "speeds": list(speeds)}


def ratios(results: list[dict]) -> list[dict]:
    """Each result with its throughput relative to DDP and to tilework's hybrid mode in the same
    setting and workload (None where that one did not run; rows marked missing get None)."""
    def by(system):
        return {(r["setting"], r["workload"]): r["throughput"] for r in results
                if r["system"] == system and "throughput" in r}

    base = {"vs_ddp": by("ddp"), "vs_hybrid": by("hybrid")}
    return [{**r, **{k: r["throughput"] / b[(r["setting"], r["workload"])]
                     if "throughput" in r and (r["setting"], r["workload"]) in b else None
                     for k, b in base.items()}} for r in results]


def write_report(suite: dict, markdown: Path, png: Path, command: str) -> None:
    rows = ratios(suite["results"])
    cpu = (next((line.split(":", 1)[1].strip()
                 for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")), "unknown CPU")
           if Path("/proc/cpuinfo").exists() else "?")
    lines = [
        "# Benchmarks: tilework beside DistributedDataParallel",
        "",
        f"Command: `{command}`  ",
        f"Machine: {os.cpu_count()} cores ({cpu}), one thread per rank, gloo, CPU.  ",
        f"Per-process fp32 matmul: {suite['flops_per_s'] / 1e9:.1f} GFLOP/s; {suite['note']}.  ",
        (f"Mean of {suite['steps']} measured steps (CPU quotas: the median would hide the "
         f"periods a rank is stopped) after {suite['warmup']} warm-up steps; "
         if suite.get("speeds") else
         f"Median of {suite['steps']} measured steps after {suite['warmup']} warm-up steps; ") +
        "the step "
        "time of a step is its slowest rank's. Bytes: what one rank sent in a step (tilework: "
        "its counters; DDP: ring all-reduce of dense gradients plus the all-gather of sparse ones; "
        "TorchRec: its all-to-all / reduce-scatter / all-gather calls plus a ring all-reduce of "
        "its DDP-wrapped parameters).",
        "",
        "| setting | workload | system | ms/step | throughput | vs DDP | vs hybrid | MB sent/step "
        "| peak RSS MB |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [_report_row(r) for r in rows]
    sharded = [f"- {r['setting']}, {r['system']}: {r['sharding']}; "
               f"tables: {r['embedding_optimizer']}"
               for r in rows if "sharding" in r]
    if sharded:
        lines += ["", "TorchRec's sharding (table:type@ranks):", ""] + sharded
    markdown.parent.mkdir(parents=True, exist_ok=True)
    markdown.write_text("\n".join(lines) + "\n\n![throughput](" + png.name + ")\n")
    (_plot_settings if suite.get("speeds") else _plot)(rows, png)


def _report_row(r: dict) -> str:
    head = f"| {r['setting']} | {r['workload']} | {r['system']} |"
    if "missing" in r:
        return f"{head} missing: {r['missing']} | | | | | | |"
    ratio = ["-" if r[k] is None else f"{r[k]:.2f}x" for k in ("vs_ddp", "vs_hybrid")]
    return (f"{head} {r['step_s'] * 1e3:.1f} | {r['throughput']:,.0f} {r['unit']}/s | "
            f"{ratio[0]} | {ratio[1]} | {r['bytes_per_step'] / 1e6:.3f} | "
            f"{r['peak_rss_bytes'] / 2**20:.0f} |")


def _plot_settings(rows: list[dict], png: Path) -> None:
    """Hosts that differ: each workload's throughput by system, a group of bars per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "throughput" in r]
    workloads = sorted({r["workload"] for r in rows})
    settings_ = list(dict.fromkeys(r["setting"] for r in rows))
    systems = list(dict.fromkeys(r["system"] for r in rows))
    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 4), squeeze=False)
    width = 0.8 / max(1, len(systems))
    for ax, w in zip(axes[0], workloads):
        for k, system in enumerate(systems):
            ys = [next((r["throughput"] for r in rows if r["workload"] == w
                        and r["system"] == system and r["setting"] == s), 0.0)
                  for s in settings_]
            ax.bar([i + k * width for i in range(len(settings_))], ys, width, label=system)
        ax.set_xticks([i + width * (len(systems) - 1) / 2 for i in range(len(settings_))])
        ax.set_xticklabels(settings_, fontsize=7)
        ax.set_title(w)
        ax.set_ylabel(f"{next(r['unit'] for r in rows if r['workload'] == w)} per second")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def _plot(rows: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "throughput" in r]      # rows marked missing have none
    workloads = sorted({r["workload"] for r in rows})
    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 4), squeeze=False)
    single = {r["workload"]: r["throughput"] for r in rows if r["hosts"] == 1}
    link_settings = [s for s in dict.fromkeys(r["setting"] for r in rows) if "parallax" in s]
    for ax, w in zip(axes[0], workloads):
        for system in SYSTEMS:
            pts = [(r["hosts"], r["throughput"]) for r in rows
                   if r["workload"] == w and r["system"] == system
                   and r["setting"] in link_settings]
            if pts and w in single:
                xs, ys = zip(*([(1, single[w])] + sorted(pts)))
                ax.plot(xs, ys, marker="o", label=system)
        ax.set_title(f"{w} (Parallax-ratio link)")
        ax.set_xlabel("hosts (1 rank each)")
        ax.set_ylabel(f"{next(r['unit'] for r in rows if r['workload'] == w)} per second")
        ax.set_xticks([1, 2])
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
