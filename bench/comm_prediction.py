"""Per-step communication on 2 and 4 emulated hosts: the cost model's prediction beside the
measurement, for every sparse workload under hybrid and DDP with sparse gradients.

    flock /tmp/tilework-bench.lock .venv/bin/python bench/comm_prediction.py [--rate 50]
        [--hosts 2 4] [--steps 4] [--out docs/comm-prediction.md]

(as root: network namespaces.) For each host count, one rank per host, every host's link shaped
with tbf at --rate Mbit/s (tilework.bench.netns): first the links are fitted on that network
(all_reduce, all_to_all and all_gather timed at --link-sizes, alpha-beta by
calibrate.fit_alpha_beta), then every workload x system sets up on unshaped links (the
initial broadcasts), waits while they are shaped, and runs --warmup + --steps steps and, in
the same processes right after, the same steps' compute alone (the plain model, every rank at
once); measured communication = step - compute, median over steps (slowest rank's each).
Predicted: the cost model on the plan the system ran, with the rows the batches touched and
the fitted links (tilework/bench/comm_prediction.py says exactly which functions). Prints the
table and the hybrid-over-DDP-sparse lead at each host count; --out writes it as markdown
(a "## Notes" section already at the end of that file is kept), --json the raw results.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from tilework.bench import comm_prediction as cp
from tilework.bench.netns import LinkShape, available, emulated_cluster
from tilework.bench.suite import launch_ranks
from tilework.bench.torchrec_peer import SYSTEMS as TORCHREC_SYSTEMS
from tilework.bench.torchrec_peer import WORKLOADS as TORCHREC_WORKLOADS
from tilework.cluster.worker_env import WorkerEnv
from tilework.plans.analysis import analyze

ROOT = Path(__file__).resolve().parent.parent
KB = 1 << 10


def launch(cluster, argv: list[str], port: int, timeout: float) -> None:
    n = len(cluster.hosts)
    base = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    envs = [{**base, **WorkerEnv(launched=True, rank=r, world_size=n, local_rank=0,
                                 local_world_size=1, group_rank=r,
                                 master_port=port).to_environ(),
             **cluster.gloo_env(r, port)} for r in range(n)]
    launch_ranks([cluster.command(r, argv) for r in range(n)], envs, timeout)


SETUP_RATE_MBIT = 10_000.0   # during a workload's set-up: in effect unshaped


def launch_gated(cluster, argv: list[str], port: int, timeout: float, rate_mbit: float,
                 gate: Path) -> None:
    """Run a worker whose set-up goes at SETUP_RATE_MBIT and whose steps at `rate_mbit`: the
    links are shaped when the ranks wait at `gate` (comm_prediction.wait_at_gate), so that
    lm800k's initial broadcasts of its 800k-row tables (595 MB left host 0 in 3 minutes at
    25 Mbit/s) do not take the run's time."""
    gate.mkdir()
    cluster.set_rate(SETUP_RATE_MBIT)
    done = threading.Event()

    def shape_when_ready():
        while not done.is_set():
            if (gate / "ready").exists():
                cluster.set_rate(rate_mbit)
                (gate / "go").touch()
                return
            time.sleep(0.05)

    shaper = threading.Thread(target=shape_when_ready, daemon=True)
    shaper.start()
    try:
        launch(cluster, [*argv, "--gate", str(gate)], port, timeout)
    finally:
        done.set()
        shaper.join()
        cluster.set_rate(rate_mbit)
    if not (gate / "go").exists():
        raise RuntimeError(f"{' '.join(argv)}: the ranks never reached the gate {gate}")


def fit_links(cluster, sizes: list[int], repeats: int, port: int, tmp: Path) -> dict:
    out = tmp / "links.json"
    launch(cluster, [sys.executable, "-m", "tilework.bench.comm_prediction", "links", "--sizes",
                     ",".join(map(str, sizes)), "--repeats", str(repeats), "--out", str(out)],
           port, 300)
    got = json.loads(out.read_text())
    n = got["world_size"]
    return {"points": got["points"],
            "links": {name: cp.fitted_link(pts, name, n) for name, pts in got["points"].items()}}


def model_facts(workload) -> tuple[int, dict[str, int]]:
    """(dense gradient bytes, {table: row bytes}) of a workload's sparse model."""
    with torch.device("meta"):
        model = workload.make(True)
    infos = analyze(model)
    return (sum(i.nbytes for i in infos if not i.is_table),
            {i.name: i.row_bytes for i in infos if i.is_table})


def traffic_of(workload_name: str, workload, n: int, steps: range) -> dict:
    with torch.device("meta"):
        rows = {i.name: i.shape[0] for i in analyze(workload.make(True)) if i.is_table}
    return cp.measured_traffic([[cp.table_ids(workload_name, workload.batch(s, r, n))
                                 for r in range(n)] for s in steps], rows=rows)


def predict(result: dict, workload, traffic: dict, links: dict, n: int) -> cp.Prediction:
    if result["system"].startswith("hybrid"):
        return cp.predict_hybrid(pickle.loads(bytes.fromhex(result["plan"])), traffic, n, links)
    if result["system"] == "ddp-sparse":
        dense, tables = model_facts(workload)
        return cp.predict_ddp_sparse(dense, tables, traffic, n, links)
    if result["system"] == "torchrec":
        with torch.device("meta"):
            model = workload.make(True)
        dense = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                    if not name.startswith("tables."))
        # A table TorchRec keeps data-parallel is all-reduced with the dense layers.
        owners = cp.torchrec_owners(result["sharding"])
        dense += sum(t.weight.numel() * t.weight.element_size()
                     for i, t in enumerate(model.tables) if owners[f"t{i}"][0] == "data_parallel")
        return cp.predict_torchrec(result["sharding"], workload.units_per_step // n,
                                   [t.embedding_dim for t in model.tables], dense, n, links)
    raise ValueError(f"no prediction for {result['system']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=25.0, help="Mbit/s on every host's link")
    p.add_argument("--hosts", type=int, nargs="+", default=[2, 4])
    p.add_argument("--workloads", nargs="+", default=list(cp.SPARSE_WORKLOADS))
    p.add_argument("--systems", nargs="+", default=["hybrid", "ddp-sparse"],
                   help="also hybrid-contiguous, and torchrec (run on the recommender only)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--recommender-batch", type=int, default=4096)
    p.add_argument("--link-sizes", default="32768,131072,524288")
    p.add_argument("--link-repeats", type=int, default=3)
    p.add_argument("--out", type=Path)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    ok, why = available(LinkShape(rate_mbit=a.rate))
    if not ok:
        raise SystemExit(f"emulated hosts are not available here: {why}")
    started = time.time()
    rows, fits, port = [], {}, 29600
    for n in a.hosts:
        with emulated_cluster(n, LinkShape(rate_mbit=a.rate)) as cluster, \
                tempfile.TemporaryDirectory() as tmp:
            port += 1
            fit = fit_links(cluster, [int(s) for s in a.link_sizes.split(",")], a.link_repeats,
                            port, Path(tmp))
            fits[n] = fit
            print(f"{n} hosts at {a.rate:g} Mbit/s, fitted links: " + "; ".join(
                f"{k} {v.bandwidth_gbps * 1e3:.1f} Mbit/s, {v.latency_us:.0f} us/message"
                for k, v in fit["links"].items()), flush=True)
            for w in a.workloads:
                workload = cp.bench_workload(w, a.recommender_batch)
                traffic = traffic_of(w, workload, n, range(a.warmup, a.warmup + a.steps))
                for s in a.systems:
                    if s in TORCHREC_SYSTEMS and w not in TORCHREC_WORKLOADS:
                        continue
                    port += 1
                    out = Path(tmp) / f"{w}-{s}.json"
                    argv = [sys.executable, "-m", "tilework.bench.comm_prediction", "worker",
                            "--workload", w, "--system", s, "--steps", str(a.steps),
                            "--warmup", str(a.warmup), "--out", str(out)]
                    if a.recommender_batch:
                        argv += ["--recommender-batch", str(a.recommender_batch)]
                    launch_gated(cluster, argv, port, 900, a.rate, Path(tmp) / f"gate-{w}-{s}")
                    r = json.loads(out.read_text())
                    pred = predict(r, workload, traffic, fit["links"], n)
                    row = {"hosts": n, "workload": w, "system": s,
                           "step_s": sorted(r["step_s"])[len(r["step_s"]) // 2],
                           "compute_s": sorted(r["compute_s"])[len(r["compute_s"]) // 2],
                           "measured_s": cp.measured_comm(r["step_s"], r["compute_s"]),
                           "predicted_s": pred.seconds, "single_link_s": pred.single_link_s,
                           "predicted_bytes": pred.bytes_sent,
                           # DDP's own figure (bench.worker._ddp_bytes) reads the gradients
                           # after the all-reduce, which hold every rank's rows: not a count.
                           "counted_bytes": None if s.startswith("ddp") else r["counted_bytes"],
                           "terms": pred.terms,
                           "steps_s": r["step_s"], "computes_s": r["compute_s"],
                           "traffic": {k: vars(v) for k, v in traffic.items()}}
                    if s.startswith("hybrid"):
                        plan = pickle.loads(bytes.fromhex(r["plan"]))
                        ids = [[cp.table_ids(w, workload.batch(st, rk, n)) for rk in range(n)]
                               for st in range(a.warmup, a.warmup + a.steps)]
                        row["exact_s"], row["exact_bytes"] = cp.hybrid_exact(plan, ids, n,
                                                                             fit["links"])
                    rows.append(row)
                    print(f"{n} hosts {w:>11} {s:>10}: step {row['step_s'] * 1e3:7.1f} ms, "
                          f"compute {row['compute_s'] * 1e3:6.1f}, comm measured "
                          f"{row['measured_s'] * 1e3:7.1f}, predicted {pred.seconds * 1e3:7.1f} "
                          f"(ratio {row['measured_s'] / pred.seconds:.2f}); MB model "
                          f"{pred.bytes_sent / 1e6:.3f} counted {r['counted_bytes'] / 1e6:.3f}"
                          f"; terms ms: " + ", ".join(f"{k} {v * 1e3:.1f}"
                                                      for k, v in pred.terms.items()),
                          flush=True)
    leads = lead_lines(rows)
    text = markdown(a, rows, fits, leads, time.time() - started)
    print("\n".join(text))
    if a.json:
        a.json.write_text(json.dumps({"rows": rows, "fits": {
            n: {"points": f["points"], "links": {k: vars(v) for k, v in f["links"].items()}}
            for n, f in fits.items()}}, indent=1, default=str))
    if a.out:
        notes = ""
        if a.out.exists():
            old = a.out.read_text()
            if "\n## Notes" in old:
                notes = old[old.index("\n## Notes"):]
        a.out.write_text("\n".join(text) + "\n" + notes)


def lead_lines(rows: list[dict]) -> list[str]:
    by = {(r["hosts"], r["workload"], r["system"]): r for r in rows}
    hosts = sorted({r["hosts"] for r in rows})
    lines = ["| workload | " + " | ".join(f"{h} hosts: predicted | measured" for h in hosts)
             + " | grows from 2 to 4 hosts: predicted / measured |",
             "|---|" + "---:|---:|" * len(hosts) + "---|"]
    for w in dict.fromkeys(r["workload"] for r in rows):
        cells, pred, meas = [], [], []
        for h in hosts:
            d, hy = by.get((h, w, "ddp-sparse")), by.get((h, w, "hybrid"))
            if d is None or hy is None:
                cells.append("- | -")
                continue
            pred.append(cp.lead(d["predicted_s"], hy["predicted_s"]))
            meas.append(cp.lead(d["measured_s"], hy["measured_s"]))
            cells.append(f"{pred[-1]:.2f}x | {meas[-1]:.2f}x")
        grows = "-" if len(pred) < 2 else \
            f"{'yes' if pred[-1] > pred[0] else 'no'} / {'yes' if meas[-1] > meas[0] else 'no'}"
        lines.append(f"| {w} | " + " | ".join(cells) + f" | {grows} |")
    return lines


def markdown(a, rows, fits, leads, elapsed) -> list[str]:
    links = ["| hosts | collective | fitted bandwidth (Mbit/s) | latency per message (us) | "
             "points: KB sent by a rank -> ms |", "|---:|---|---:|---:|---|"]
    for n, f in fits.items():
        for name, link in f["links"].items():
            pts = ", ".join(f"{b / KB:.0f} -> {s * 1e3:.1f}" for b, s in f["points"][name])
            links.append(f"| {n} | {name} | {link.bandwidth_gbps * 1e3:.1f} | "
                         f"{link.latency_us:.0f} | {pts} |")
    return [
        "# Per-step communication: the cost model against emulated hosts",
        "",
        f"Generated by `bench/comm_prediction.py` on "
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC in {elapsed / 60:.1f} minutes.",
        "",
        f"Command: `flock /tmp/tilework-bench.lock .venv/bin/python bench/comm_prediction.py "
        f"--rate {a.rate:g} --hosts {' '.join(map(str, a.hosts))} --systems "
        f"{' '.join(a.systems)} --steps {a.steps} "
        f"--recommender-batch {a.recommender_batch}" + (f" --out {a.out}" if a.out else "") + "`",
        "",
        f"Machine: `nproc` = {os.cpu_count()}, Linux {platform.release()}, Python "
        f"{platform.python_version()}, torch {torch.__version__} (gloo). One rank per emulated "
        f"host, every host's link tbf-shaped at {a.rate:g} Mbit/s each way; {a.warmup} warm-up "
        f"and {a.steps} measured steps; the recommender at a global batch of "
        f"{a.recommender_batch}.",
        "",
        "## Links fitted on the emulated network",
        "",
        *links,
        "",
        "## Predicted vs measured communication per step",
        "",
        *cp.markdown_rows(rows),
        "",
        "## Hybrid's lead over DDP-sparse (DDP-sparse's communication time / hybrid's)",
        "",
        *leads,
    ]


if __name__ == "__main__":
    main()
