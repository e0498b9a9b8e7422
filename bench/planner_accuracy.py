"""The planner's predictions against measured steps: every candidate plan="auto" would consider
(dp x pp x cp x tp, ZeRO 0-3 and its scope, recompute, microbatches), run for real.

    .venv/bin/python bench/planner_accuracy.py [--world 2] [--steps 5] [--rounds 3]
        [--hosts] [--mbit 1000] [--out FILE] [--png FILE]

The GPT of bench/mesh_search.py on `--world` gloo ranks on this machine: on loopback, or with
`--hosts` (root) each rank an emulated host of its own (tilework/bench/netns.py, a network
namespace), the links between them shaped to `--mbit` Mbit/s. Every
runnable candidate of tilework/planner/search.py is run through `tilework.parallelize` for
`--steps` steps in each of `--rounds` fresh worlds (each in its own shuffled order); its median
step over the rounds (barrier to the slowest rank's optimizer step, each world's first dropped)
(and each world measures the inputs below, each taken as the median over the worlds)
is set beside `estimate(plan)`'s step, priced with what was measured in the same world first and
never fitted to the steps (bench/mesh_search.py's way): the FLOP rate on the whole model (every
rank computing at once, averaged), calibrate's all-reduce fit for the link, the per-message CPU
overhead o. Each plan is priced twice from those measurements: at one FLOP rate, and with a
matmul efficiency curve (cluster/matmul_curve.py, measured on every rank at once) scaled by one
factor so that it prices the whole model's dp step as measured (the same one measurement the
rate comes from): the curve adds only how the rate changes with shape.

And a third way (estimate/ops.py): every op each candidate's stages run, recorded on the meta
device with its recompute, timed on every rank at once, plus the framework's measured cost per
call, scaled by the one factor that makes it price the plain dp step as measured.

Prints the table, the median |predicted - measured| / measured, Kendall's tau between the
predicted and measured orders, and where the plan the search chooses lands among the measured.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mesh_search as ms  # noqa: E402
import torch  # noqa: E402

from tilework.cluster.topology import Cluster, Host, Link, Links  # noqa: E402
from tilework.models.gpt import TinyGPT  # noqa: E402
from tilework.planner.search import Space, label, options_of, search  # noqa: E402
from tilework.testing import spawn  # noqa: E402

SPACE = Space(axes=("tp", "pp", "cp"), zero_scopes=("world",), microbatch_factors=(2,))


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's tau-b (scipy.stats.kendalltau's default): concordant minus discordant pairs
    over the pairs not tied in each list; the prediction ties plans whose step it cannot tell
    apart (ZeRO 0-2 of one mesh move the same bytes)."""
    n, concordant, discordant, tied_a, tied_b = len(a), 0, 0, 0, 0
    for i in range(n):
        for j in range(i + 1, n):
            x, y = a[i] - a[j], b[i] - b[j]
            if x == 0 and y == 0:
                continue
            if x == 0:
                tied_a += 1
            elif y == 0:
                tied_b += 1
            elif x * y > 0:
                concordant += 1
            else:
                discordant += 1
    pairs = (concordant + discordant + tied_a) * (concordant + discordant + tied_b)
    return (concordant - discordant) / pairs ** 0.5 if pairs else 1.0


def _world(rank, world_size, configs, steps, calls, order, calibrate):
    """bench/mesh_search.py's measurements (with `calibrate`), but the FLOP rate taken on every
    rank at once and averaged: with more ranks than cores (4 on this machine's 2) a rank
    computes at the rate it gets beside the others, not at one rank's alone. Then the
    candidates in `order`; their steps come back in `configs`' order."""
    import torch.distributed as dist

    if not calibrate:
        ran = {i: ms.run_candidate(configs[i], steps) for i in order}
        return {"steps": [ran[i] for i in range(len(configs))]}

    from tilework.bench.pipeline_runs import Shape, message_overhead

    nbytes = ms.BATCH // world_size * ms.SEQ * ms.DIM * 4
    link, least_squares = _link(world_size, nbytes)
    factors = _exchange_factors(world_size, nbytes, link)
    factors_ls = _exchange_factors(world_size, nbytes, least_squares)
    shape = Shape(ms.VOCAB, ms.DIM, ms.HEADS, ms.LAYERS, ms.SEQ,
                  microbatch=ms.BATCH // world_size)
    overhead = message_overhead(world_size, shape, quiet=(2.0, 0.0))["overhead_s"]
    dist.barrier()
    rate = torch.tensor([ms.flops_rate(ms.BATCH // world_size)], dtype=torch.float64)
    dist.all_reduce(rate)
    from tilework.cluster.calibrate import measure_curve

    curve = measure_curve(dist.group.WORLD, world_size)
    op_seconds, framework = _op_times(world_size, calls)
    return {"link": (link.bandwidth_gbps, link.latency_us), "factors": factors,
            "link_ls": (least_squares.bandwidth_gbps, least_squares.latency_us),
            "factors_ls": factors_ls,
            "flops": rate.item() / world_size,
            "curve": curve.as_dict(), "overhead_s": overhead, "op_seconds": op_seconds,
            "framework": framework} | _world(rank, world_size, configs, steps, calls, order,
                                             False)


def _round(world: int, configs, steps: int, calls, order, cluster) -> dict:
    """One fresh world running every candidate in `order`."""
    return run_world(_world, world, (configs, steps, calls, order, True), cluster, __file__)


def run_world(fn, world: int, args: tuple, cluster, script: str) -> dict:
    """`fn(rank, world, *args)` on a fresh world of `world` ranks, rank 0's result: spawned on
    loopback, or (a `cluster` of emulated hosts) one rank per host, each running `script
    --worker`, which calls `worker_main(fn, args)`)."""
    if cluster is None:
        return spawn(fn, world, args=args, timeout=3600)[0]
    import tempfile

    from tilework.bench.suite import _free_port, launch_ranks
    from tilework.cluster.worker_env import WorkerEnv

    with tempfile.TemporaryDirectory() as tmp:
        job, result = Path(tmp) / "job.pickle", Path(tmp) / "result.pickle"
        job.write_bytes(pickle.dumps(args))
        argv = [sys.executable, str(Path(script).resolve()), "--worker", "--job", str(job),
                "--result", str(result)]
        port = _free_port()
        base = {**os.environ, "OMP_NUM_THREADS": "1"}
        envs = [{**base, **WorkerEnv(launched=True, rank=r, world_size=world, local_rank=0,
                                     local_world_size=1, master_addr="127.0.0.1",
                                     master_port=port).to_environ(),
                 **cluster.gloo_env(r, port)} for r in range(world)]
        launch_ranks([cluster.command(r, argv) for r in range(world)], envs, timeout=3600)
        return pickle.loads(result.read_bytes())


def worker_main(fn, a) -> None:
    """One rank of an emulated host's world (`run_world`): `fn`'s arguments from the job file,
    rank 0's result to the result file."""
    import torch.distributed as dist

    args = pickle.loads(Path(a.job).read_bytes())
    dist.init_process_group("gloo")
    out = fn(dist.get_rank(), dist.get_world_size(), *args)
    if dist.get_rank() == 0:
        Path(a.result).write_bytes(pickle.dumps(out))
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)   # past the last collective: no teardown to wait in


def _link(world_size: int, nbytes: int, tries: int = 3):
    """bench/mesh_search.py's all-reduce fits (calibrate's, and least squares to compare),
    measured again when a burst of load made its times not grow with the size (every rank sees
    the same points, so all retry together)."""
    from tilework.cluster.calibrate import CalibrationError

    for attempt in range(tries):
        try:
            return ms._allreduce_links(world_size, nbytes)
        except CalibrationError:
            if attempt == tries - 1:
                raise


def _exchange_factors(world_size: int, nbytes: int, link) -> dict:
    """ZeRO's exchanges and ring attention's shift as the runtime makes them against `link`
    (the all-reduce's fit), as `tilework calibrate` writes them into a link
    (cluster/calibration_file.exchange_factors), on buffers of 1-16x the activations' size."""
    import torch.distributed as dist

    from tilework.cluster.calibrate import time_points
    from tilework.cluster.calibration_file import exchange_factors

    points = time_points(dist.group.WORLD, world_size, [nbytes, 4 * nbytes, 16 * nbytes],
                         repeats=5, collectives=("reduce_scatter", "all_gather", "ring_shift"))
    return exchange_factors({c: [(w, t) for _, w, t in pts] for c, pts in points.items()},
                            link, world_size)


def _op_times(world_size: int, calls: list) -> tuple[list, dict]:
    """Every recorded call's seconds and the framework's per-call costs (estimate/ops.py),
    measured on every rank at once and averaged; a call that fails on made-up values is -1."""
    import torch.distributed as dist

    from tilework.estimate.ops import framework_costs, measure
    from tilework.runtime.table_costs import table_costs

    dist.barrier()
    got = measure(calls)
    mine = torch.tensor([got.get(c, -1.0) for c in calls], dtype=torch.float64)
    dist.all_reduce(mine)
    costs = framework_costs() | table_costs()
    regions = sorted(costs)
    each = torch.tensor([costs[r] for r in regions], dtype=torch.float64)
    dist.all_reduce(each)
    return ((mine / world_size).tolist(),
            {r: v / world_size for r, v in zip(regions, each.tolist())})


def _median_of(rounds: list[dict]) -> dict:
    """The calibration of several worlds, each figure the median over them (the curve and the
    op times element by element)."""
    from tilework.cluster.matmul_curve import MatmulCurve

    def med(values):
        return statistics.median(values)

    curves = [MatmulCurve.from_dict(r["curve"]) for r in rounds]
    c0, n = curves[0], len(curves[0].sizes)
    grid = [[[med([c.flops_per_s[i][j][k] for c in curves]) for k in range(n)]
             for j in range(n)] for i in range(n)]
    ops = [r["op_seconds"] for r in rounds]
    return {"flops": med([r["flops"] for r in rounds]),
            **{key: tuple(med([r[key][i] for r in rounds]) for i in range(2))
               for key in ("link", "link_ls")},
            **{key: {k: med([r[key][k] for r in rounds]) for k in rounds[0][key]}
               for key in ("factors", "factors_ls")},
            "overhead_s": med([r["overhead_s"] for r in rounds]),
            "curve": MatmulCurve(c0.sizes, grid).as_dict(),
            "op_seconds": [med([o[i] for o in ops]) for i in range(len(ops[0]))],
            "framework": {k: med([r["framework"][k] for r in rounds])
                          for k in rounds[0]["framework"]},
            "flops_by_round": [r["flops"] for r in rounds]}


def op_times(calls: list, seconds: list, framework: dict, scale: float = 1.0):
    from tilework.estimate.ops import OpTimes

    return OpTimes({c: s for c, s in zip(calls, seconds) if s > 0}, scale, framework)


def scaled_curve(curve, flops: float, world: int):
    """`curve` times the one factor that makes it price the whole model's step at
    `ms.BATCH // world` sequences as `flops` (that step's measured rate) does."""
    from tilework.cluster.matmul_curve import MatmulCurve
    from tilework.estimate.step import forward_flops, stage_seconds

    with torch.device("meta"):
        meta = TinyGPT(ms.VOCAB, ms.DIM, ms.HEADS, ms.LAYERS, ms.SEQ)
    tokens = ms.BATCH // world * ms.SEQ
    children = [*meta.children()]
    measured = 3 * forward_flops(children, tokens, ms.SEQ, 1) / flops
    factor = sum(stage_seconds(children, tokens, ms.SEQ, 1, curve)) / measured
    return MatmulCurve(curve.sizes, tuple(tuple(tuple(v * factor for v in row) for row in plane)
                                          for plane in curve.flops_per_s))


def forward_flops_of(meta, world: int) -> float:
    """The search's forward FLOP count of the whole model on one rank's batch."""
    from tilework.estimate.step import forward_flops

    return forward_flops([*meta.children()], ms.BATCH // world * ms.SEQ, ms.SEQ, 1)


def _priced(meta, cluster, world: int, rate: float, o: float = 0.0) -> list:
    ids = torch.zeros(ms.BATCH // world, ms.SEQ, dtype=torch.long)
    return [c for c in search(meta, cluster, (ids, ids), rate, "sgd", space=SPACE, every=True,
                              message_overhead_s=o) if c.step_s is not None]


def main(argv=None) -> int:
    return bench_main(__doc__, _world, _run, argv, steps=5)


def bench_main(doc: str, world_fn, run, argv=None, steps: int = 5) -> int:
    """The accuracy benchmarks' command line (this one's and planner_accuracy_sparse.py's):
    `run(args, cluster)` on loopback (cluster None) or, with --hosts, on emulated hosts; with
    --worker, one rank of an emulated host's world running `world_fn`."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hosts", action="store_true",
                    help="each rank an emulated host of its own (root)")
    ap.add_argument("--mbit", type=float, default=1000.0,
                    help="with --hosts: the links between hosts, Mbit/s")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--png", type=Path)
    ap.add_argument("--only", type=re.compile, default=None, metavar="REGEX",
                    help="run only the plans whose label this matches (re.search)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker_main(world_fn, a)
        return 0
    if not a.hosts:
        return run(a, None)
    from tilework.bench.netns import LinkShape, available, emulated_cluster

    link = LinkShape(rate_mbit=a.mbit)
    ok, why = available(link)
    if not ok:
        sys.exit(f"{Path(sys.argv[0]).stem}: cannot emulate hosts here: {why}")
    with emulated_cluster(a.world, link) as cluster:
        return run(a, cluster)


def _hosts(world: int, cluster, link=None) -> Cluster:
    """The cluster the search plans for: one host of `world` ranks (loopback), or one host per
    rank; `link` measured (None: the search's defaults)."""
    hosts = [Host("localhost", world)] if cluster is None else \
        [Host(f"h{r}", 1) for r in range(world)]
    return Cluster(hosts) if link is None else Cluster(hosts, links=Links(intra=link, inter=link))


def _run(a, cluster) -> int:
    with torch.device("meta"):
        meta = TinyGPT(ms.VOCAB, ms.DIM, ms.HEADS, ms.LAYERS, ms.SEQ)
    here = _hosts(a.world, cluster)
    runnable = [c for c in _priced(meta, here, a.world, 1e11)
                if a.only is None or a.only.search(label(c))]
    from tilework.estimate.ops import Collecting

    asked = Collecting()   # every op any candidate runs, to be timed on the ranks
    _priced(meta, here, a.world, asked)
    calls = sorted(asked.asked, key=repr)
    # Rounds, each a fresh world running the candidates in its own shuffled order: a slow
    # drift over a long run (it was seen: 350 to 590 ms for five pp2 plans of the same work run
    # one after another) then spreads over every plan instead of landing on the last ones.
    configs = [options_of(c.config) for c in runnable]
    rounds, steps = [], [[] for _ in runnable]
    for r in range(a.rounds):
        order = list(range(len(configs)))
        random.Random(r).shuffle(order)
        ran = _round(a.world, configs, a.steps, calls, order, cluster)
        rounds.append(ran)
        for i, s in enumerate(ran["steps"]):
            steps[i] += s[1:]   # each world's first step of a plan warms it up
    # Every world measures the inputs too, and each is the median over the worlds: one
    # measurement disturbed (by anything else the machine ran then) moves every prediction.
    got = _median_of(rounds)
    link = Link(*got["link"], **got["factors"])
    measured_here = _hosts(a.world, cluster, link)
    from tilework.cluster.matmul_curve import MatmulCurve

    curve = scaled_curve(MatmulCurve.from_dict(got["curve"]), got["flops"], a.world)
    predicted = {label(c): c for c in _priced(meta, measured_here, a.world, got["flops"],
                                              got["overhead_s"])}
    by_curve = {label(c): c for c in _priced(meta, measured_here, a.world, curve,
                                             got["overhead_s"])}
    # The op model is scaled by the one factor that makes it price the plain dp step as
    # measured (the measurement the rate comes from): it adds how the ops change by plan.
    unscaled = op_times(calls, got["op_seconds"], got["framework"])
    plain = next(c for c in _priced(meta, measured_here, a.world, unscaled, got["overhead_s"])
                 if label(c) == f"dp{a.world}")
    measured_step = 3 * forward_flops_of(meta, a.world) / got["flops"]
    scale = measured_step / plain.parts["compute"]
    scaled = op_times(calls, got["op_seconds"], got["framework"], scale)
    by_ops = {label(c): c for c in _priced(meta, measured_here, a.world, scaled,
                                           got["overhead_s"])}
    # The same op model on the link least squares gave (calibrate's fit before 2026-12-07).
    before = _hosts(a.world, cluster, Link(*got["link_ls"], **got["factors_ls"]))
    by_ops_ls = {label(c): c for c in _priced(meta, before, a.world, scaled,
                                              got["overhead_s"])}
    rows = []
    for c, taken in zip(runnable, steps):
        p, q, r = predicted[label(c)], by_curve[label(c)], by_ops[label(c)]
        u = by_ops_ls[label(c)]
        measured = statistics.median(taken)
        rows.append({"plan": label(c), "predicted_ms": p.step_s * 1e3,
                     "curve_ms": q.step_s * 1e3, "ops_ms": r.step_s * 1e3,
                     "ops_ls_ms": u.step_s * 1e3, "measured_ms": measured * 1e3,
                     "error": abs(p.step_s - measured) / measured,
                     "curve_error": abs(q.step_s - measured) / measured,
                     "ops_error": abs(r.step_s - measured) / measured,
                     "ops_ls_error": abs(u.step_s - measured) / measured})
    summary = _summary(rows, "predicted_ms", "error") | {
        "curve": _summary(rows, "curve_ms", "curve_error"),
        "ops": _summary(rows, "ops_ms", "ops_error") | {"scale": scale, "calls": len(calls)},
        "ops_least_squares": _summary(rows, "ops_ls_ms", "ops_ls_error") | {
            "link": got["link_ls"], "factors": got["factors_ls"]},
        "flops": got["flops"], "flops_by_round": got["flops_by_round"],
        "framework": got["framework"],
        "link": got["link"], "factors": got["factors"], "overhead_s": got["overhead_s"],
        "world": a.world,
        "hosts": cluster is not None, "mbit": a.mbit if cluster is not None else None}
    where = "loopback" if cluster is None else f"{a.world} emulated hosts at {a.mbit:g} Mbit/s"
    print(f"{a.world} ranks on {where}: FLOP/s per rank {got['flops']:.3g} (each world: "
          + ", ".join(f"{f:.3g}" for f in got["flops_by_round"]) + "), link "
          f"{link.bandwidth_gbps:.3g} Gb/s {link.latency_us:.0f} us (ZeRO's reduce-scatter "
          f"{link.reduce_scatter_factor:.2f}x, all-gather {link.all_gather_factor:.2f}x, cp's "
          f"shift {link.ring_shift_factor:.2f}x; least squares {got['link_ls'][0]:.3g} Gb/s "
          f"{got['link_ls'][1]:.0f} us), o "
          f"{got['overhead_s'] * 1e3:.2f} ms")
    print(f"op model: {len(calls)} distinct calls, scale {scale:.2f}, framework per call "
          + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in got["framework"].items()))
    print("| plan | predicted ms (one rate) | (curve) | (ops) | measured ms | error (rate) "
          "| (curve) | (ops) |\n|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in sorted(rows, key=lambda r: r["measured_ms"]):
        print(f"| {r['plan']} | {r['predicted_ms']:.1f} | {r['curve_ms']:.1f} | "
              f"{r['ops_ms']:.1f} | {r['measured_ms']:.1f} | {r['error'] * 100:.0f}% | "
              f"{r['curve_error'] * 100:.0f}% | {r['ops_error'] * 100:.0f}% |")
    print_summaries((("one rate", summary), ("curve", summary["curve"]),
                     ("ops", summary["ops"]),
                     ("ops, least-squares link", summary["ops_least_squares"])))
    if a.out:
        a.out.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    if a.png:
        _plot(rows, summary, a.png)
    return 0


def print_summaries(pricings) -> None:
    """Each pricing's (name, `_summary`) in one line."""
    for name, m in pricings:
        print(f"{name}: {m['plans']} plans, median error {m['median_error'] * 100:.1f}%, "
              f"Kendall's tau {m['kendall_tau']:.2f}; chosen {m['chosen']} measured "
              f"{(m['chosen_over_fastest'] - 1) * 100:.1f}% over the fastest ({m['fastest']})")


def _summary(rows: list[dict], predicted: str, error: str) -> dict:
    chosen = min(rows, key=lambda r: r[predicted])
    fastest = min(rows, key=lambda r: r["measured_ms"])
    return {"plans": len(rows), "median_error": statistics.median(r[error] for r in rows),
            "kendall_tau": kendall_tau([r[predicted] for r in rows],
                                       [r["measured_ms"] for r in rows]),
            "chosen": chosen["plan"], "fastest": fastest["plan"],
            "chosen_over_fastest": chosen["measured_ms"] / fastest["measured_ms"]}


def _plot(rows: list[dict], summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 5))
    xs = [r["measured_ms"] for r in rows]
    ys = [r["predicted_ms"] for r in rows]
    zs = [r["curve_ms"] for r in rows]
    ax.scatter(xs, ys, s=14, label=f"one rate: median error {summary['median_error']:.0%}, "
                                   f"tau {summary['kendall_tau']:.2f}")
    ax.scatter(xs, zs, s=14, marker="x", label=f"matmul curve: median error "
               f"{summary['curve']['median_error']:.0%}, tau {summary['curve']['kendall_tau']:.2f}")
    us = [r["ops_ms"] for r in rows]
    ax.scatter(xs, us, s=14, marker="+", label=f"recorded ops: median error "
               f"{summary['ops']['median_error']:.0%}, tau {summary['ops']['kendall_tau']:.2f}")
    ax.legend(fontsize=7)
    top = max(xs + ys + zs + us) * 1.05
    ax.plot([0, top], [0, top], lw=0.8, color="grey")
    ax.set_xlabel("measured step (ms)")
    ax.set_ylabel("predicted step (ms)")
    where = f"emulated hosts at {summary['mbit']:g} Mbit/s" if summary.get("hosts") \
        else "loopback"
    ax.set_title(f"{summary['plans']} plans, {summary['world']} ranks on {where}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
