"""Pipeline schedules measured beside the simulator's prediction, and beside torch's own
schedules on the same stages (issue 14 item 4).

    .venv/bin/python bench/pipeline_schedules.py [--rounds 5] [--pp 2,4] [--out FILE]
        [--pictures DIR] [--no-torch] [--quick] [--quiet-cores 0.3] [--max-wait 60]
    .venv/bin/python bench/pipeline_schedules.py --paper    # Megatron-LM's Table 1, simulated

For pp in {2, 4}: GPipe, 1F1B and interleaved 1F1B (v = 2) run by tilework's PipelineRunner on
pp real gloo ranks (one thread each), the GPT of tilework/bench/pipeline_runs.Shape, 8
microbatches. Measured, per round: the step (barrier to the last rank's return) and the bubble
(1 - the ranks' mean busy time / step, busy from the runner's timeline). Predicted, per round:
pipeline.simulate replaying the same schedule with each stage's forward and backward seconds
timed on its rank in that round (one microbatch, one rank at a time), the send/recv link fitted
in the same world (calibrate.time_points), and the ranks sharing the machine's cores
(`processors`: pp = 4 puts 4 ranks on 2 cores here). The table gives medians over rounds and
of the per-round ratios. torch.distributed.pipelining's ScheduleGPipe, Schedule1F1B and
ScheduleInterleaved1F1B run the same stage modules in the same rounds: their step time beside
ours. The machine may be shared: before each round the benchmark waits (--max-wait seconds at
most) until other processes keep fewer than --quiet-cores cores busy, and reports the cores
they used during each round (/proc/stat less our ranks' own CPU time): their load is not
modelled.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from tilework.bench.pipeline_runs import Shape, link_fit, run_rank  # noqa: E402
from tilework.pipeline.schedule import build  # noqa: E402
from tilework.pipeline.simulate import simulate  # noqa: E402
from tilework.pipeline.timeline import draw  # noqa: E402
from tilework.testing import spawn  # noqa: E402

NAMES = ("gpipe", "1f1b", "interleaved")
V = 2


def _world(rank, world_size, shape, rounds, torch_peer, quiet):
    link = link_fit(rank, world_size, shape.activation_bytes)
    runs = run_rank(rank, world_size, shape, list(NAMES), V, rounds, torch_peer, quiet)
    return {"link": (link.bandwidth_gbps, link.latency_us), "runs": runs}


def one_round(run: dict, stage_times: dict, schedule, link, shape: Shape) -> dict:
    """A round's measured step and bubble (1 - the ranks' mean busy time / step) beside the
    simulator's on that round's stage times, the ranks sharing this machine's cores (paired by
    round: the machine's load drifts between rounds)."""
    fwd = [stage_times[s][0] for s in range(schedule.stages)]
    bwd = [stage_times[s][1] for s in range(schedule.stages)]
    sim = simulate(schedule, fwd, bwd, link, shape.activation_bytes,
                   processors=len(os.sched_getaffinity(0)))
    busy = [sum(e - s for _, s, e in tl) for tl in run["timelines"]]
    return {"measured_s": run["step_s"], "predicted_s": sim.step_s, "sim": sim,
            "measured_bubble": 1 - sum(busy) / len(busy) / run["step_s"],
            "predicted_bubble": sim.bubble, "forward_s": fwd, "backward_s": bwd,
            "timeline": [(r, s, e, a) for r, tl in enumerate(run["timelines"]) for a, s, e in tl]}


def _median(rounds: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rounds)


def measure(shape: Shape, pp: int, rounds: int, torch_peer: bool, pictures: Path | None,
            quiet: tuple[float, float]):
    """Medians over rounds of each quantity and of the per-round ratios."""
    from tilework.cluster import Link

    got = spawn(_world, pp, args=(shape, rounds, torch_peer, quiet), timeout=3600)[0]
    link, rows = Link(*got["link"]), []
    for name in NAMES:
        schedule = build(name, pp, shape.microbatches, V)
        paired = [one_round(run, stages[schedule.stages], schedule, link, shape)
                  for run, stages in zip(got["runs"][f"ours/{name}"], got["runs"]["stages"])]
        for r, background in zip(paired, got["runs"]["background"]):
            r["background_cores"] = background
            r["step_ratio"] = r["measured_s"] / r["predicted_s"]
            r["bubble_ratio"] = r["measured_bubble"] / r["predicted_bubble"]
        row = {"pp": pp, "schedule": schedule.name, "link_gbps": link.bandwidth_gbps,
               "link_latency_us": link.latency_us,
               **{k: _median(paired, k) for k in ("measured_s", "predicted_s", "step_ratio",
                                                   "measured_bubble", "predicted_bubble",
                                                   "bubble_ratio", "background_cores")},
               "rounds": [{k: v for k, v in r.items() if k not in ("sim", "timeline")}
                          for r in paired]}
        if torch_peer:
            row["torch_s"] = statistics.median(r["step_s"] for r in got["runs"][f"torch/{name}"])
        rows.append(row)
        if pictures:
            mid = sorted(paired, key=lambda r: r["step_ratio"])[len(paired) // 2]
            draw({"simulated": mid["sim"].timeline, "measured": mid["timeline"]},
                 pictures / f"pipeline-{schedule.name}-pp{pp}.png",
                 f"{schedule.name}, pp={pp}, m={shape.microbatches} (the median round)")
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| pp | schedule | measured step (ms) | predicted (ms) | ratio | measured bubble | "
             "predicted bubble | ratio | torch's step (ms) | ours / torch's | others' cores |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        torch_s = r.get("torch_s")
        peer = (f"{torch_s * 1e3:.1f} | {r['measured_s'] / torch_s:.2f}" if torch_s
                else "- | -")
        lines.append(
            f"| {r['pp']} | {r['schedule']} | {r['measured_s'] * 1e3:.1f} | "
            f"{r['predicted_s'] * 1e3:.1f} | {r['step_ratio']:.2f} | "
            f"{r['measured_bubble']:.3f} | {r['predicted_bubble']:.3f} | "
            f"{r['bubble_ratio']:.2f} | {peer} | {r['background_cores']:.2f} |")
    return "\n".join(lines)


def paper_table() -> str:
    """The simulator's throughput for Megatron-LM's Table 1 beside the published figures."""
    from tilework.pipeline.megatron import table as megatron_table

    rows = megatron_table()
    lines = [f"Compute rate calibrated on the 1.7B row: {rows[0]['hw_tflops']:.1f} TFLOP/s per GPU.",
             "", "| params (B) | t | p | d | batch | m | published TFLOP/s | 1F1B: predicted | "
             "ratio | bubble | interleaved (v): predicted | ratio | bubble |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        run, a, b = r["run"], r["1f1b"], r["interleaved"]
        inter = (f"({r['v']}) {b['tflops']:.0f} | {b['tflops'] / run.tflops:.2f} | "
                 f"{b['bubble']:.3f}" if r["v"] > 1 else "- | - | -")
        lines.append(f"| {run.params_b:g} | {run.t} | {run.p} | {r['d']} | {run.batch} | "
                     f"{r['m']} | {run.tflops:g} | {a['tflops']:.0f} | {a['tflops'] / run.tflops:.2f}"
                     f" | {a['bubble']:.3f} | {inter} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="bench/pipeline_schedules.py")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--pp", default="2,4")
    p.add_argument("--no-torch", action="store_true", help="skip torch's schedules")
    p.add_argument("--quick", action="store_true", help="a small model, 3 rounds")
    p.add_argument("--out", type=Path)
    p.add_argument("--pictures", type=Path, help="a folder for measured/simulated timelines")
    p.add_argument("--quiet-cores", type=float, default=0.3,
                   help="before each round, wait until other processes use fewer cores")
    p.add_argument("--max-wait", type=float, default=60.0, help="seconds to wait for that")
    p.add_argument("--paper", action="store_true",
                   help="only the paper-scale table (Megatron-LM's Table 1), no ranks")
    a = p.parse_args(argv)
    if a.paper:
        print(paper_table())
        return 0
    torch.set_num_threads(1)
    shape = Shape(dim=64, layers=8, seq=16, vocab=256) if a.quick else Shape()
    rounds = 3 if a.quick else a.rounds
    rows = []
    for pp in (int(x) for x in a.pp.split(",")):
        rows += measure(shape, pp, rounds, not a.no_torch, a.pictures,
                        (a.quiet_cores, a.max_wait))
    cores = len(os.sched_getaffinity(0))
    print(f"{cores} cores; shape {shape}")
    print(table(rows))
    if a.out:
        a.out.write_text(json.dumps({"cores": cores, "shape": vars(shape), "rows": rows},
                                    indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
