"""Pipeline schedules measured beside the simulator's prediction, and beside torch's own
schedules on the same stages (issue 14 item 4).

    .venv/bin/python bench/pipeline_schedules.py [--rounds 5] [--pp 2,4] [--out FILE]
        [--pictures DIR] [--no-torch] [--quick]

For pp in {2, 4}: GPipe, 1F1B and interleaved 1F1B (v = 2) run by tilework's PipelineRunner on
pp real gloo ranks (one thread each), the GPT of tilework/bench/pipeline_runs.Shape, 8
microbatches. Measured: the median step time over rounds and the bubble (1 - the ranks' mean
busy time / step). Predicted: pipeline.simulate replaying the same schedule with each stage's
forward and backward seconds timed on its rank in the same rounds (all ranks at once, one
microbatch, so under the machine's load of the moment) and the send/recv link fitted in the same
world (calibrate.time_points). torch.distributed.pipelining's ScheduleGPipe,
Schedule1F1B and ScheduleInterleaved1F1B run the same stage modules in the same rounds: their
step time beside ours. pp = 4 puts 4 ranks on however many cores the machine has: where they
are fewer, ranks that compute at once share them and the measured times grow past the
simulator's, which gives every rank its own processor (the table says how many cores).
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


def _world(rank, world_size, shape, rounds, torch_peer):
    link = link_fit(rank, world_size, shape.activation_bytes)
    runs = run_rank(rank, world_size, shape, list(NAMES), V, rounds, torch_peer)
    return {"link": (link.bandwidth_gbps, link.latency_us), "runs": runs}


def measured(runs: list[dict], pp: int) -> tuple[float, float, list]:
    """Median step seconds over rounds, the bubble of the median round (1 - the ranks' mean
    busy time / step), and that round's timeline as (rank, start, end, action) rows."""
    order = sorted(range(len(runs)), key=lambda i: runs[i]["step_s"])
    mid = runs[order[len(order) // 2]]
    busy = [sum(e - s for _, s, e in tl) for tl in mid["timelines"]]
    rows = [(r, s, e, a) for r, tl in enumerate(mid["timelines"]) for a, s, e in tl]
    return mid["step_s"], 1 - sum(busy) / pp / mid["step_s"], rows


def predicted(got: dict, schedule, link, shape: Shape):
    """The simulator on the stages' median forward and backward seconds over rounds, the ranks
    sharing this machine's cores."""
    per_round = [r[schedule.stages] for r in got["runs"]["stages"]]
    fwd = [statistics.median(r[s][0] for r in per_round) for s in range(schedule.stages)]
    bwd = [statistics.median(r[s][1] for r in per_round) for s in range(schedule.stages)]
    sim = simulate(schedule, fwd, bwd, link, shape.activation_bytes,
                   processors=len(os.sched_getaffinity(0)))
    return sim, fwd, bwd


def measure(shape: Shape, pp: int, rounds: int, torch_peer: bool, pictures: Path | None):
    from tilework.cluster import Link

    got = spawn(_world, pp, args=(shape, rounds, torch_peer), timeout=1800)[0]
    link = Link(*got["link"])
    rows = []
    for name in NAMES:
        schedule = build(name, pp, shape.microbatches, V)
        sim, fwd, bwd = predicted(got, schedule, link, shape)
        step, bubble, timeline = measured(got["runs"][f"ours/{name}"], pp)
        row = {"pp": pp, "schedule": schedule.name, "measured_s": step, "predicted_s": sim.step_s,
               "measured_bubble": bubble, "predicted_bubble": sim.bubble,
               "link_gbps": link.bandwidth_gbps, "link_latency_us": link.latency_us,
               "stage_forward_s": fwd, "stage_backward_s": bwd}
        if torch_peer:
            row["torch_s"] = statistics.median(r["step_s"] for r in got["runs"][f"torch/{name}"])
        rows.append(row)
        if pictures:
            draw({"simulated": sim.timeline, "measured (median round)": timeline},
                 pictures / f"pipeline-{schedule.name}-pp{pp}.png",
                 f"{schedule.name}, pp={pp}, m={shape.microbatches}")
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| pp | schedule | measured step (ms) | predicted (ms) | ratio | measured bubble | "
             "predicted bubble | ratio | torch's step (ms) | ours / torch's |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        torch_s = r.get("torch_s")
        peer = (f"{torch_s * 1e3:.1f} | {r['measured_s'] / torch_s:.2f}" if torch_s
                else "- | -")
        lines.append(
            f"| {r['pp']} | {r['schedule']} | {r['measured_s'] * 1e3:.1f} | "
            f"{r['predicted_s'] * 1e3:.1f} | {r['measured_s'] / r['predicted_s']:.2f} | "
            f"{r['measured_bubble']:.3f} | {r['predicted_bubble']:.3f} | "
            f"{r['measured_bubble'] / r['predicted_bubble']:.2f} | {peer} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="bench/pipeline_schedules.py")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--pp", default="2,4")
    p.add_argument("--no-torch", action="store_true", help="skip torch's schedules")
    p.add_argument("--quick", action="store_true", help="a small model, 3 rounds")
    p.add_argument("--out", type=Path)
    p.add_argument("--pictures", type=Path, help="a folder for measured/simulated timelines")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    shape = Shape(dim=64, layers=8, seq=16, vocab=256) if a.quick else Shape()
    rounds = 3 if a.quick else a.rounds
    rows = []
    for pp in (int(x) for x in a.pp.split(",")):
        rows += measure(shape, pp, rounds, not a.no_torch, a.pictures)
    cores = len(os.sched_getaffinity(0))
    print(f"{cores} cores; shape {shape}")
    print(table(rows))
    if a.out:
        a.out.write_text(json.dumps({"cores": cores, "shape": vars(shape), "rows": rows},
                                    indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
