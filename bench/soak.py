"""Run multi-rank work again and again under load, with core dumps on, and say how each run ended.

A native crash is a bug until its cause is found (DEVELOPERS.md): this runs a target many
times while other processes keep every core busy, keeps each run's output and any core file,
and prints a backtrace of every thread of each core (gdb), so a rare abort can be read.

    python bench/soak.py --runs 200                       # tests/parallel/rows/test_early_push.py,
                                                          # 2 busy loops
    python bench/soak.py --runs 50 \
        --target "tests/parallel/rows/test_early_push.py tests/parallel/rows/test_prefetch.py"
    python bench/soak.py --runs 20 --target hosts          # bench/sparse_step.py on 2 emulated
                                                           # hosts (root, network namespaces)
    python bench/soak.py --runs 100 --target hosts --systems hybrid-ahead hybrid   # ours alone
    python bench/soak.py --runs 40 --target hosts --hosts 4 --systems auto --malloc-check
                                        # plan="auto" on 4 hosts, glibc's heap checks on, every
                                        # rank's output kept in a bad run's log

Outcomes: passed, failed (the target's own failure: an assertion, a refusal), crashed (a
process ended by a signal, or glibc / the C++ runtime reported a corruption or a terminate),
timeout. Everything lands in --out (default runs/soak): run-NNN.log, cores under run-NNN/,
backtraces in run-NNN.bt, and summary.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing as mp
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Two-rank runs of the paths that talk most: the servers' pull and the push leaving early
# (an asynchronous all-to-all on its own group beside the dense buckets), with clipping and
# accumulation. About 10 s a run on an idle 2-core machine.
DEFAULT_TARGET = "tests/parallel/rows/test_early_push.py"
CRASH_MARKS = re.compile(r"Segmentation fault|core dumped|SIGABRT|SIGSEGV|SIGBUS|signal 6|"
                         r"signal 11|terminate called|tcache|double free|corrupted|"
                         r"free\(\): invalid|malloc\(\)|stack smashing")


def _busy(stop) -> None:
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x = (x * 31 + 7) % 1_000_003


def _command(target: str, systems: list[str] | None = None, hosts: int = 2,
             where: Path | None = None) -> list[str]:
    if target == "hosts":
        # Where the intermittent abort was seen (docs/benchmarks-analysis.md): every system
        # side by side on emulated hosts, TorchRec's too where it is installed; `systems` to
        # tell a crash in tilework's from one in a peer's.
        if systems is None:
            systems = ["hybrid-ahead", "hybrid", "ddp-sparse"]
            if importlib.util.find_spec("torchrec") is not None:
                systems.append("torchrec")
        logs = ["--rank-logs", str(where)] if where is not None else []
        return [sys.executable, str(ROOT / "bench" / "sparse_step.py"), "recommender",
                "--hosts", str(hosts), "--rounds", "2", "--steps", "10", *logs,
                "--systems", *systems]
    # Test paths made absolute: the run's cwd is its own directory, where cores land.
    return [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
            *(str(ROOT / a) if not a.startswith("-") else a for a in target.split())]


def _cores_on() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def _backtraces(cores: list[Path]) -> str:
    if not cores or shutil.which("gdb") is None:
        return ""
    out = []
    for core in cores:
        r = subprocess.run(["gdb", "-batch", "-ex", "thread apply all bt 30", sys.executable,
                            str(core)], capture_output=True, text=True, timeout=300)
        out.append(f"== {core}\n{r.stdout}{r.stderr}")
    return "\n".join(out)


def classify(rc: int | None, output: str) -> str:
    if rc is None:
        return "timeout"
    if rc < 0 or CRASH_MARKS.search(output):
        return "crashed"
    return "passed" if rc == 0 else "failed"


# glibc >= 2.34 checks the heap only with its debug library preloaded: MALLOC_CHECK_=3 aborts
# at the first bad free or overrun it sees (not where a later malloc trips over the damage), and
# MALLOC_PERTURB_ fills freed memory so a use after free reads garbage at once.
MALLOC_CHECKS = {"LD_PRELOAD": "libc_malloc_debug.so.0", "MALLOC_CHECK_": "3",
                 "MALLOC_PERTURB_": "165", "PYTHONFAULTHANDLER": "1"}


def run_once(i: int, target: str, out: Path, timeout: float,
             systems: list[str] | None = None, hosts: int = 2,
             malloc_check: bool = False) -> dict:
    where = out / f"run-{i:03d}"
    where.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT), **(MALLOC_CHECKS if malloc_check else {}))
    start = time.perf_counter()
    # cwd: the run's directory, where a core_pattern of "core" puts every rank's core file.
    try:
        r = subprocess.run(_command(target, systems, hosts, where), cwd=where,
                           capture_output=True, text=True, timeout=timeout, env=env,
                           preexec_fn=_cores_on)
        rc, output = r.returncode, r.stdout + r.stderr
    except subprocess.TimeoutExpired as e:
        rc = None
        output = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(
            errors="replace")
    for log in sorted(where.glob("rank-*.log")):   # the other ranks' own lines (--target hosts)
        output += f"\n== {log.name}\n{log.read_text(errors='replace')}"
    seconds = time.perf_counter() - start
    (out / f"run-{i:03d}.log").write_text(output)
    cores = sorted(p for p in where.glob("core*") if p.is_file())
    if not cores and classify(rc, output) == "passed":
        for log in where.glob("rank-*.log"):   # in run-NNN.log already; keep only a bad run's
            log.unlink()
    outcome = classify(rc, output) if not cores else "crashed"
    if cores:
        (out / f"run-{i:03d}.bt").write_text(_backtraces(cores))
    if not any(where.iterdir()):
        where.rmdir()
    return {"run": i, "outcome": outcome, "rc": rc, "seconds": round(seconds, 1),
            "cores": [str(c) for c in cores]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--target", default=DEFAULT_TARGET,
                        help="pytest arguments, or 'hosts' (bench/sparse_step.py --hosts 2)")
    parser.add_argument("--load", type=int, default=2, help="busy loops beside the runs")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run")
    parser.add_argument("--out", default=str(ROOT / "runs" / "soak"))
    parser.add_argument("--systems", nargs="+", help="--target hosts: the systems each run "
                        "compares (default: tilework's two, DDP's, TorchRec's where installed)")
    parser.add_argument("--hosts", type=int, default=2, help="--target hosts: how many")
    parser.add_argument("--malloc-check", action="store_true", help="glibc's heap checks on "
                        "(its debug malloc preloaded, MALLOC_CHECK_=3, freed memory perturbed)")
    args = parser.parse_args()
    if args.runs < 1 or args.load < 0:
        parser.error("--runs must be >= 1 and --load >= 0")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pattern = Path("/proc/sys/kernel/core_pattern")
    core_pattern = pattern.read_text().strip() if pattern.exists() else "?"
    stop = mp.Event()
    burners = [mp.Process(target=_busy, args=(stop,), daemon=True) for _ in range(args.load)]
    for b in burners:
        b.start()
    results: list[dict] = []
    counts: dict[str, int] = {}
    try:
        for i in range(args.runs):
            results.append(run_once(i, args.target, out, args.timeout, args.systems,
                                    args.hosts, args.malloc_check))
            counts = {k: sum(r["outcome"] == k for r in results)
                      for k in ("passed", "failed", "crashed", "timeout")}
            print(f"run {i + 1}/{args.runs}: {results[-1]['outcome']} "
                  f"({results[-1]['seconds']} s)  so far {counts}", flush=True)
    finally:
        stop.set()
        for b in burners:
            b.join(timeout=5)
    summary = {"target": args.target, "hosts": args.hosts, "systems": args.systems,
               "malloc_check": args.malloc_check, "runs": len(results), "load": args.load,
               "core_pattern": core_pattern, "counts": counts, "results": results}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: summary[k] for k in ("target", "runs", "load", "counts")}))
    bad = [r for r in results if r["outcome"] != "passed"]
    for r in bad:
        log = out / f"run-{r['run']:03d}.log"
        print(f"run {r['run']}: {r['outcome']} (rc {r['rc']}): {log}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
