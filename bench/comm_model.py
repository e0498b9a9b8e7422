"""Predicted vs measured communication time: does the calibrated alpha-beta model hold?

    flock /tmp/tilework-bench.lock .venv/bin/python bench/comm_model.py

(as root, for the emulated case; `--no-emulated` skips it.) For each case, 2 gloo ranks run
`python -m tilework.cluster.calibrate`, timing all_reduce and all_to_all on the fit sizes
(`--fit-sizes`, 64 KB, 256 KB and 8 MB by default) and the judged sizes (1 MB, 4 MB, 16 MB) in the
same rounds; alpha and beta are fitted on the fit sizes alone. The prediction is
`tilework.estimate.cost.seconds(wire bytes, link, messages)` with the collective's fitted link
(latency per message, the cost model's message counts). The cases:

  (a) loopback: 2 processes on this machine, no shaping;
  (b) 2 emulated hosts (network namespaces), each host's link shaped with tbf at 500 Mbit/s
      (skipped, saying why, where `tilework.bench.netns.available()` says no).

Prints the table and writes it as markdown to docs/comm-model.md with the command and the
machine. A "## Notes" section already at the end of that file is kept. Target: within +-25% at
1 MB and more.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import torch

from tilework.bench.netns import LinkShape, available, emulated_cluster
from tilework.cluster.calibrate import Measurement
from tilework.estimate import cost

ROOT = Path(__file__).resolve().parent.parent
KB, MB = 1 << 10, 1 << 20
COLLECTIVES = ("all_reduce", "all_to_all")
TARGET = 0.25
WORKER_TIMEOUT_S = 110


def _size(n: int) -> str:
    return f"{n // MB} MB" if n >= MB and n % MB == 0 else f"{n // KB} KB"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_argv(fit_sizes, judge_sizes, repeats, out: Path) -> list[str]:
    return [sys.executable, "-m", "tilework.cluster.calibrate",
            "--sizes", ",".join(map(str, fit_sizes)), "--judge", ",".join(map(str, judge_sizes)),
            "--repeats", str(repeats), "--collectives", ",".join(COLLECTIVES), "--out", str(out)]


def _run_workers(commands: list[list[str]], out: Path) -> dict:
    procs = []
    try:
        for argv in commands:
            procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True))
        results = [p.communicate(timeout=WORKER_TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for rank, (p, (_, err)) in enumerate(zip(procs, results)):
        if p.returncode != 0:
            raise RuntimeError(f"rank {rank} exited {p.returncode}:\n{err.strip()[-2000:]}")
    return json.loads(out.read_text())


def _env(rank: int, port: int, extra: dict[str, str]) -> dict[str, str]:
    return {**extra, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def loopback(fit_sizes, judge_sizes, repeats, tmp: Path) -> dict:
    out, port = tmp / "loopback.json", _free_port()
    argv = _worker_argv(fit_sizes, judge_sizes, repeats, out)
    commands = [["env", *(f"{k}={v}" for k, v in
                          _env(r, port, {"MASTER_ADDR": "127.0.0.1"}).items()), *argv]
                for r in range(2)]
    return _run_workers(commands, out)


def emulated(fit_sizes, judge_sizes, repeats, tmp: Path, rate_mbit: float) -> dict:
    out, port = tmp / "emulated.json", 29500   # free: nothing else runs in namespaces just made
    argv = _worker_argv(fit_sizes, judge_sizes, repeats, out)
    with emulated_cluster(2, LinkShape(rate_mbit=rate_mbit)) as c:
        commands = [c.command(r, argv, _env(r, port, c.gloo_env(r, port))) for r in range(2)]
        return _run_workers(commands, out)


def rows(result: dict) -> list[dict]:
    fits = {name: Measurement.from_dict(name, d) for name, d in result["fit"].items()}
    ar_link = fits["all_reduce"].link()
    table = []
    for name in COLLECTIVES:
        m = fits[name]
        for p in result["judge"][name]:
            predicted = cost.seconds(p["wire_bytes"], m.link(), m.messages)
            assert predicted == m.predict(p["buffer_bytes"])
            table.append({
                "collective": name, "buffer_bytes": p["buffer_bytes"],
                "wire_bytes": p["wire_bytes"], "predicted_s": predicted,
                "measured_s": p["seconds"], "ratio": p["seconds"] / predicted,
                "alpha_share": m.alpha_s / predicted,
                "from_all_reduce_link_s": cost.seconds(p["wire_bytes"], ar_link, m.messages),
            })
    return table


def fits_table(result: dict) -> list[str]:
    lines = ["| collective | alpha (us per call) | messages | bandwidth (Gbit/s) "
             "| bandwidth (MB/s) |"
             " fit points: size -> ms |", "|---|---:|---:|---:|---:|---|"]
    for name, d in result["fit"].items():
        pts = ", ".join(f"{_size(p['buffer_bytes'])} -> {p['seconds'] * 1e3:.2f}"
                        for p in d["points"])
        lines.append(f"| {name} | {d['alpha_us']:.0f} | {d['messages']} | "
                     f"{d['bandwidth_gbps']:.3f} | {d['bandwidth_gbps'] * 1e3 / 8:.1f} | {pts} |")
    return lines


def markdown_table(table: list[dict]) -> list[str]:
    lines = ["| collective | size | predicted ms | measured ms | ratio (measured / predicted) |"
             " within 25% | predicted from the all_reduce link, ms |",
             "|---|---:|---:|---:|---:|:---:|---:|"]
    for r in table:
        ok = abs(r["ratio"] - 1) <= TARGET
        lines.append(f"| {r['collective']} | {_size(r['buffer_bytes'])} | "
                     f"{r['predicted_s'] * 1e3:.2f} | {r['measured_s'] * 1e3:.2f} | "
                     f"{r['ratio']:.2f} | {'yes' if ok else 'NO'} | "
                     f"{r['from_all_reduce_link_s'] * 1e3:.2f} |")
    return lines


def verdict(table: list[dict]) -> list[str]:
    misses = [r for r in table if abs(r["ratio"] - 1) > TARGET]
    if not misses:
        worst = max(table, key=lambda r: abs(r["ratio"] - 1))
        return [f"All within +-25% (worst: {worst['collective']} {_size(worst['buffer_bytes'])}, "
                f"{(worst['ratio'] - 1) * 100:+.0f}%)."]
    return [f"Missed: {r['collective']} {_size(r['buffer_bytes'])}: measured "
            f"{(r['ratio'] - 1) * 100:+.0f}% against the prediction (alpha is "
            f"{r['alpha_share']:.0%} of the predicted time)." for r in misses]


def print_table(title: str, table: list[dict]) -> None:
    print(f"\n{title}")
    print(f"{'collective':<11} {'size':>6} {'predicted ms':>13} {'measured ms':>12} {'ratio':>6}")
    for r in table:
        flag = "" if abs(r["ratio"] - 1) <= TARGET else "  <- outside +-25%"
        print(f"{r['collective']:<11} {_size(r['buffer_bytes']):>6} "
              f"{r['predicted_s'] * 1e3:>13.2f} "
              f"{r['measured_s'] * 1e3:>12.2f} {r['ratio']:>6.2f}{flag}")
    for line in verdict(table):
        print(line)


def machine() -> str:
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"`nproc` = {os.cpu_count()}, CPU: {model}, Linux {platform.release()}, "
            f"Python {platform.python_version()}, torch {torch.__version__} (gloo)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fit-sizes", default=f"{64 * KB},{256 * KB},{8 * MB}",
                   help="bytes, comma-separated: what alpha and beta are fitted on")
    p.add_argument("--sizes", default=f"{MB},{4 * MB},{16 * MB}",
                   help="bytes, comma-separated: what is judged")
    p.add_argument("--repeats", type=int, default=11, help="median of this many, after a warm-up")
    p.add_argument("--rate-mbit", type=float, default=500.0, help="emulated hosts' link rate")
    p.add_argument("--no-emulated", action="store_true", help="loopback only")
    p.add_argument("--out", default=str(ROOT / "docs" / "comm-model.md"))
    p.add_argument("--raw", help="also write every case's timings (JSON) here")
    a = p.parse_args(argv)
    fit_sizes = [int(s) for s in a.fit_sizes.split(",")]
    judge_sizes = [int(s) for s in a.sizes.split(",")]
    overlap = sorted(set(fit_sizes) & set(judge_sizes))
    if overlap:
        p.error(f"fit and judged sizes overlap ({overlap}): the fit must not see what it is "
                "judged on")
    args = sys.argv[1:] if argv is None else argv
    command = "flock /tmp/tilework-bench.lock .venv/bin/python bench/comm_model.py" + \
        (" " + shlex.join(args) if args else "")
    fitted_on = ", ".join(_size(s) for s in sorted(fit_sizes))
    print(f"fit on {fitted_on}; judged on {', '.join(_size(s) for s in judge_sizes)}; "
          f"median of {a.repeats}")

    cases: list[tuple[str, dict | None, str]] = []
    with tempfile.TemporaryDirectory(prefix="comm-model-") as tmp:
        result = loopback(fit_sizes, judge_sizes, a.repeats, Path(tmp))
        cases.append(("(a) loopback, 2 ranks, unshaped", result, ""))
        title = f"(b) 2 emulated hosts, 1 rank each, tbf {a.rate_mbit:g} Mbit/s per host link"
        ok, why = (False, "--no-emulated") if a.no_emulated else \
            available(LinkShape(rate_mbit=a.rate_mbit))
        if ok:
            cases.append((title, emulated(fit_sizes, judge_sizes, a.repeats, Path(tmp),
                                          a.rate_mbit), ""))
        else:
            print(f"\n{title}: skipped ({why})")
            cases.append((title, None, why))

    md = ["# Communication model: predicted vs measured", "",
          f"Generated by `bench/comm_model.py` on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC.",
          "", f"Command: `{command}`", "", f"Machine: {machine()}.", "",
          f"alpha and beta are fitted per collective on **{fitted_on}** only (alpha from 40 "
          "calls of the smallest between short computes, beta the least-squares slope of the "
          "points, alpha clamped at 0: `tilework.cluster.calibrate.fit_alpha_beta`). The "
          "judged sizes are "
          "timed in the same rounds (sizes interleaved, so fitted and judged points see the same "
          "load) but never fitted on, and predicted with "
          "`tilework.estimate.cost.seconds(wire bytes, link, "
          "messages)`: wire bytes are what one rank sends (all_reduce 2(n-1)/n of the buffer, "
          "all_to_all (n-1)/n), messages 2(n-1) and n-1, the link's latency alpha per message. "
          f"Times are the slowest rank's, median of {a.repeats} after a warm-up, 2 ranks. The "
          "last column predicts with the all_reduce fit, which is what `tilework calibrate` "
          "writes into a cluster file's link (and so what the planner uses for every method).",
          "", f"Target: measured within +-{TARGET:.0%} of predicted for 1 MB and more."]
    for title, result, why in cases:
        md += ["", f"## {title}", ""]
        if result is None:
            md.append(f"Skipped: {why}.")
            continue
        table = rows(result)
        print_table(title, table)
        md += ["Fits:", "", *fits_table(result), "", "Judged:", "", *markdown_table(table), "",
               *verdict(table)]
    if a.raw:
        Path(a.raw).write_text(json.dumps({title: result for title, result, _ in cases}, indent=1))
    out = Path(a.out)
    notes = ""
    if out.exists():
        old = out.read_text()
        i = old.find("\n## Notes")
        notes = old[i:] if i >= 0 else ""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(md) + "\n" + notes)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
