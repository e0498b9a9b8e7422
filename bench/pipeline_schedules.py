"""Pipeline schedules measured beside the simulator's prediction, and beside torch's own
schedules on the same stages (issue 14 item 4).

    .venv/bin/python bench/pipeline_schedules.py [--rounds 5] [--pp 2,4] [--out FILE]
        [--pictures DIR] [--no-torch] [--quick] [--quiet-cores 0.3] [--max-wait 60]
        [--microbatch 8]
    .venv/bin/python bench/pipeline_schedules.py --paper    # Megatron-LM's Table 1, simulated

For pp in {2, 4}: GPipe, 1F1B and interleaved 1F1B (v = 2) run by tilework's PipelineRunner on
pp real gloo ranks (one thread each), the GPT of tilework/bench/pipeline_runs.Shape, 8
microbatches. Each round: every rank times its stages' forward and backward on one microbatch
(one rank at a time), then each system runs one step, interleaved so that drifts hit all alike.
Measured: the median over rounds of the step (barrier to the last rank's return) and of the
bubble (1 - the ranks' mean busy time / step, busy from the runner's timeline). Predicted:
pipeline.simulate replaying the same schedule with each stage's median times, the send/recv
link fitted in the same world (calibrate.time_points), and the ranks sharing the machine's
cores (`processors`: pp = 4 puts 4 ranks on 2 cores here); once with the link alone, once with
a per-message CPU overhead (LogP's o) that the same world measures first, apart from any
schedule (pipeline_runs.message_overhead: busy ranks with and without activation-sized
messages); its bubble counts as busy the share of o that the same microbenchmark found inside
the actions' timed intervals, as the runner's timeline does. torch.distributed.pipelining's
ScheduleGPipe, Schedule1F1B and ScheduleInterleaved1F1B run the same stage modules in the same
rounds: their step time beside ours. The machine may be shared: before each round the
benchmark waits (--max-wait seconds at most) until other processes keep fewer than
--quiet-cores cores busy, measures the cores they used during the round (/proc/stat less our
ranks' own CPU time), and keeps only the rounds under that figure (all, if none is): their
load is not modelled.
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

from tilework.bench.pipeline_runs import Shape, link_fit, message_overhead, run_rank
from tilework.parallel.pipeline.schedule import build  # noqa: E402
from tilework.parallel.pipeline.simulate import simulate  # noqa: E402
from tilework.parallel.pipeline.timeline import draw  # noqa: E402
from tilework.testing import spawn  # noqa: E402

NAMES = ("gpipe", "1f1b", "interleaved")
V = 2


def _world(rank, world_size, shape, rounds, torch_peer, quiet):
    link = link_fit(rank, world_size, shape.activation_bytes)
    overhead = message_overhead(world_size, shape, quiet=quiet)
    runs = run_rank(rank, world_size, shape, list(NAMES), V, rounds, torch_peer, quiet)
    return {"link": (link.bandwidth_gbps, link.latency_us), "overhead": overhead, "runs": runs}


def measured(run: dict) -> dict:
    """One round's step, bubble (1 - the ranks' mean busy time / step) and timeline rows."""
    busy = [sum(e - s for _, s, e in tl) for tl in run["timelines"]]
    return {"step_s": run["step_s"], "bubble": 1 - sum(busy) / len(busy) / run["step_s"],
            "timeline": [(r, s, e, a) for r, tl in enumerate(run["timelines"]) for a, s, e in tl]}


def predicted(stage_rounds: list[dict], schedule, link, shape: Shape, overhead_s: float):
    """The simulator on each stage's median forward and backward seconds over these rounds,
    the ranks sharing this machine's cores: with the link alone, and with the link and the
    per-message overhead measured apart from the schedules (`message_overhead`)."""
    fwd = [statistics.median(r[s][0] for r in stage_rounds) for s in range(schedule.stages)]
    bwd = [statistics.median(r[s][1] for r in stage_rounds) for s in range(schedule.stages)]
    sims = [simulate(schedule, fwd, bwd, link, shape.activation_bytes,
                     processors=len(os.sched_getaffinity(0)), message_overhead_s=o)
            for o in (0.0, overhead_s)]
    return sims, fwd, bwd


def as_timed(sim, inside: float) -> float:
    """The simulated bubble as the runner's timeline measures it: the share `inside` of each
    rank's message overhead falls within its actions' timed intervals (busy), the rest in the
    gaps between them (idle); `message_overhead` measured that share."""
    busy = [b + inside * o for b, o in zip(sim.busy_s, sim.overhead_s)]
    return 1 - sum(busy) / len(busy) / sim.step_s


def measure(shape: Shape, pp: int, rounds: int, torch_peer: bool, pictures: Path | None,
            quiet: tuple[float, float]):
    """Per schedule, medians over the quiet rounds (others used under quiet[0] cores; every
    round if none was): measured step and bubble, and the simulator on the stages' medians."""
    from tilework.cluster.topology import Link

    got = spawn(_world, pp, args=(shape, rounds, torch_peer, quiet), timeout=3600)[0]
    link, rows, background = Link(*got["link"]), [], got["runs"]["background"]
    overhead = got["overhead"]
    keep = [i for i, b in enumerate(background) if b < quiet[0]] or list(range(len(background)))
    for name in NAMES:
        schedule = build(name, pp, shape.microbatches, V)
        (plain, sim), fwd, bwd = predicted(
            [got["runs"]["stages"][i][schedule.stages] for i in keep], schedule, link, shape,
            overhead["overhead_s"])
        runs = [measured(got["runs"][f"ours/{name}"][i]) for i in keep]
        step = statistics.median(r["step_s"] for r in runs)
        bubble = statistics.median(r["bubble"] for r in runs)
        row = {"pp": pp, "schedule": schedule.name, "measured_s": step, "predicted_s": sim.step_s,
               "step_ratio": step / sim.step_s, "measured_bubble": bubble,
               "predicted_bubble": as_timed(sim, overhead["inside"]),
               "bubble_ratio": bubble / as_timed(sim, overhead["inside"]),
               "predicted_bubble_overhead_idle": sim.bubble,
               "overhead_inside": overhead["inside"],
               "link_only_s": plain.step_s, "link_only_step_ratio": step / plain.step_s,
               "link_only_bubble": plain.bubble, "link_only_bubble_ratio": bubble / plain.bubble,
               "overhead_s": overhead["overhead_s"], "overhead_cpu_s": overhead["cpu_s"],
               "overhead_per_rank_s": overhead["per_rank_s"],
               "rounds_kept": len(keep), "rounds": len(background),
               "background_cores": statistics.median(background[i] for i in keep),
               "round_step_s": [r["step_s"] for r in runs],
               "round_bubble": [r["bubble"] for r in runs],
               "link_gbps": link.bandwidth_gbps, "link_latency_us": link.latency_us,
               "stage_forward_s": fwd, "stage_backward_s": bwd}
        if torch_peer:
            row["torch_s"] = statistics.median(got["runs"][f"torch/{name}"][i]["step_s"]
                                               for i in keep)
        rows.append(row)
        if pictures:
            mid = sorted(runs, key=lambda r: r["step_s"])[len(runs) // 2]
            draw({"simulated": sim.timeline, "measured (the median round)": mid["timeline"]},
                 pictures / f"pipeline-{schedule.name}-pp{pp}.png",
                 f"{schedule.name}, pp={pp}, m={shape.microbatches}")
    return rows


def table(rows: list[dict]) -> str:
    """Measured beside two predictions: the link alone (alpha-beta), and the link with the
    measured per-message overhead (+o); ratios are measured / predicted."""
    lines = ["| pp | schedule | measured step (ms) | link only (ms) | ratio | +o (ms) | ratio | "
             "measured bubble | link only | ratio | +o | ratio | torch's step (ms) | "
             "ours / torch's | rounds kept |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        torch_s = r.get("torch_s")
        peer = (f"{torch_s * 1e3:.1f} | {r['measured_s'] / torch_s:.2f}" if torch_s
                else "- | -")
        lines.append(
            f"| {r['pp']} | {r['schedule']} | {r['measured_s'] * 1e3:.1f} | "
            f"{r['link_only_s'] * 1e3:.1f} | {r['link_only_step_ratio']:.2f} | "
            f"{r['predicted_s'] * 1e3:.1f} | {r['step_ratio']:.2f} | "
            f"{r['measured_bubble']:.3f} | {r['link_only_bubble']:.3f} | "
            f"{r['link_only_bubble_ratio']:.2f} | {r['predicted_bubble']:.3f} | "
            f"{r['bubble_ratio']:.2f} | {peer} | {r['rounds_kept']}/{r['rounds']} |")
    return "\n".join(lines)


def overheads(rows: list[dict]) -> str:
    """One line per pp: the per-message overhead its world measured."""
    seen = {r["pp"]: r for r in rows}
    return "\n".join(
        f"pp={pp}: message overhead o = {r['overhead_s'] * 1e3:.3f} ms per message end "
        f"(ranks: {', '.join(f'{x * 1e3:.2f}' for x in r['overhead_per_rank_s'])}), "
        f"CPU {r['overhead_cpu_s'] * 1e3:.3f} ms, {r['overhead_inside']:.0%} inside the "
        f"actions' timed intervals; link {r['link_gbps']:.1f} Gb/s, "
        f"{r['link_latency_us']:.0f} us" for pp, r in seen.items())


def paper_table() -> str:
    """The simulator's throughput for Megatron-LM's Table 1 beside the published figures."""
    from tilework.parallel.pipeline.megatron import table as megatron_table

    rows = megatron_table()
    rate = rows[0]["hw_tflops"]
    lines = [f"Compute rate calibrated on the 1.7B row: {rate:.1f} TFLOP/s per GPU.",
             "", "| params (B) | t | p | d | batch | m | published TFLOP/s | 1F1B: predicted | "
             "ratio | bubble | interleaved (v): predicted | ratio | bubble |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        run, a, b = r["run"], r["1f1b"], r["interleaved"]
        inter = (f"({r['v']}) {b['tflops']:.0f} | {b['tflops'] / run.tflops:.2f} | "
                 f"{b['bubble']:.3f}" if r["v"] > 1 else "- | - | -")
        lines.append(f"| {run.params_b:g} | {run.t} | {run.p} | {r['d']} | {run.batch} | "
                     f"{r['m']} | {run.tflops:g} | {a['tflops']:.0f} | "
                     f"{a['tflops'] / run.tflops:.2f} | {a['bubble']:.3f} | {inter} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="bench/pipeline_schedules.py")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--pp", default="2,4")
    p.add_argument("--no-torch", action="store_true", help="skip torch's schedules")
    p.add_argument("--quick", action="store_true", help="a small model, 3 rounds")
    p.add_argument("--microbatch", type=int, default=Shape.microbatch,
                   help="sequences per microbatch (compute per action)")
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
    if a.pictures:
        a.pictures.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    shape = (Shape(dim=64, layers=8, seq=16, vocab=256) if a.quick
             else Shape(microbatch=a.microbatch))
    rounds = 3 if a.quick else a.rounds
    rows = []
    for pp in (int(x) for x in a.pp.split(",")):
        rows += measure(shape, pp, rounds, not a.no_torch, a.pictures,
                        (a.quiet_cores, a.max_wait))
    cores = len(os.sched_getaffinity(0))
    print(f"{cores} cores; shape {shape}")
    print(overheads(rows))
    print(table(rows))
    if a.out:
        a.out.write_text(json.dumps({"cores": cores, "shape": vars(shape), "rows": rows},
                                    indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
