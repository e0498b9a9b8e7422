"""The planner's predictions against measured steps for the recommender: every candidate the
search considers (ZeRO 0-3 and offload, recompute), under each placement of its tables (the
planner's choice by cost, all-reduced, on the servers, all-gathered as DDP does; the whole
model on the servers), run for real.

    .venv/bin/python bench/planner_accuracy_sparse.py [--world 2] [--steps 20] [--rounds 3]
        [--hosts] [--mbit 1000] [--out FILE] [--png FILE]

tilework/bench/workloads.py's recommender (DLRM: tables of 200,000, 50,000 and 1,000 rows of 16,
Zipf ids, 256 samples a step) on `--world` gloo ranks: on loopback, or with `--hosts` (root)
each rank an emulated host of its own with links shaped to `--mbit` Mbit/s. Each candidate's
Plan, made by `tilework.plan` with the workload's Zipf traffic as the search makes it, is applied
by `tilework.parallelize(plan=...)` (the tables placed "by cost" at the search's default links:
the worlds have not measured theirs yet) and run `--steps` steps in each of `--rounds` fresh worlds
(each in its own shuffled order); its median step (barrier to the slowest rank's optimizer step,
each world's first two dropped) is set beside `estimate(plan)`'s, priced from what each world
measured first (the median over the worlds), never fitted to the steps:

- one rate: the model's counted FLOPs at the FLOP rate its plain forward and backward ran at
  (every rank at once), plus the exchanges on the link `tilework calibrate` would write (its
  sizes, 4 KB to 16 MB, its all-reduce fit and ZeRO's exchange factors);
- the op model (estimate/ops.py): every op the forward, backward, runtime and optimizer run,
  timed on every rank at once, with the framework's measured cost per call, scaled by the one
  factor that prices the plain forward and backward as measured.

Prints the table, the median |predicted - measured| / measured, Kendall's tau, and where the plan
the search chooses lands among the measured (bench/planner_accuracy.py's summary).
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from planner_accuracy import (  # noqa: E402
    _op_times,
    _summary,
    bench_main,
    op_times,
    print_summaries,
    run_world,
)

from tilework.bench.workloads import WORKLOADS  # noqa: E402
from tilework.cluster.topology import Cluster, Host, Link, Links  # noqa: E402
from tilework.config.parallel import ParallelConfig  # noqa: E402
from tilework.planner.search import Space, label, search  # noqa: E402

WORKLOAD = WORKLOADS["recommender"]
SPACE = Space(zero_scopes=("world",), tables=())   # its placements are run below, by name


def placements() -> dict[str, ParallelConfig]:
    """The tables' placements the benchmark runs every candidate under."""
    tables = {f"tables.{i}.weight": "allgather" for i in range(3)}
    return {"by cost": ParallelConfig(), "all-reduce": ParallelConfig(mode="allreduce"),
            "all-gather": ParallelConfig(overrides=tables),
            "servers": ParallelConfig(overrides={k: "ps" for k in tables}),
            "servers, dense too": ParallelConfig(mode="ps")}


def _model():
    torch.manual_seed(0)
    return WORKLOAD.make(True)


def run_plan(plan, steps: int, rank: int, world: int) -> list[float]:
    """`steps` steps of the recommender under `plan`: the slowest rank's seconds of each."""
    import tilework
    from tilework.bench.worker import timed_steps

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    tilework.parallelize(model, opt, plan=plan, log=False)
    times, _ = timed_steps(WORKLOAD, "hybrid", model, opt, None, rank, world, steps, 0)
    took = torch.tensor(times)
    torch.distributed.all_reduce(took, op=torch.distributed.ReduceOp.MAX)
    return took.tolist()


def _local_step(rank: int, world: int, repeats: int = 30) -> float:
    """The plain model's forward and backward on this rank's batch, every rank at once: the
    median seconds (the mean over ranks)."""
    import torch.distributed as dist

    model = _model()
    inputs = WORKLOAD.batch(0, rank, world)
    took = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        model(*inputs).backward()
        took.append(time.perf_counter() - start)
        model.zero_grad()
    mine = torch.tensor([statistics.median(took[5:])], dtype=torch.float64)
    dist.all_reduce(mine)
    return mine.item() / world


def _world(rank, world, plans, steps, calls, order):
    """The measurements, then every plan in `order`; steps come back in `plans`' order."""
    import torch.distributed as dist

    from tilework.cluster.calibrate import (
        DEFAULT_REPEATS,
        DEFAULT_SIZES,
        fit_points,
        time_points,
        time_small_calls,
    )
    from tilework.cluster.calibration_file import MEETINGS, exchange_factors, latency_factors

    # The link as `tilework calibrate` writes it into a cluster file: its sizes, its fit (alpha
    # from small calls between computes), and, to compare, the least-squares fit it wrote before.
    points = time_points(dist.group.WORLD, world, DEFAULT_SIZES, DEFAULT_REPEATS,
                         collectives=("all_reduce", "reduce_scatter", "all_gather"))
    small = time_small_calls(dist.group.WORLD, world, DEFAULT_SIZES[0],
                             ("all_reduce",) + MEETINGS)
    link = fit_points("all_reduce", world, points["all_reduce"], small["all_reduce"]).link()
    least_squares = fit_points("all_reduce", world, points["all_reduce"]).link()
    raw = {c: [(w, t) for _, w, t in points[c]] for c in ("reduce_scatter", "all_gather")}
    meetings = {c: small[c][1:] for c in MEETINGS}
    factors = exchange_factors(raw, link, world) | latency_factors(meetings, link, world)
    factors_ls = exchange_factors(raw, least_squares, world) | latency_factors(
        meetings, least_squares, world)
    local = _local_step(rank, world)
    op_seconds, framework = _op_times(world, calls)
    ran = {i: run_plan(plans[i], steps, rank, world) for i in order}
    return {"link": (link.bandwidth_gbps, link.latency_us), "factors": factors,
            "link_ls": (least_squares.bandwidth_gbps, least_squares.latency_us),
            "factors_ls": factors_ls,
            "local_s": local, "op_seconds": op_seconds, "framework": framework,
            "steps": [ran[i] for i in range(len(plans))]}


def _median_of(rounds: list[dict]) -> dict:
    def med(values):
        return statistics.median(values)

    ops = [r["op_seconds"] for r in rounds]
    return {**{key: tuple(med([r[key][i] for r in rounds]) for i in range(2))
               for key in ("link", "link_ls")},
            **{key: {k: med([r[key][k] for r in rounds]) for k in rounds[0][key]}
               for key in ("factors", "factors_ls")},
            "local_s": med([r["local_s"] for r in rounds]),
            "local_by_round": [r["local_s"] for r in rounds],
            "op_seconds": [med([o[i] for o in ops]) for i in range(len(ops[0]))],
            "framework": {k: med([r["framework"][k] for r in rounds])
                          for k in rounds[0]["framework"]}}


def _cluster(world: int, hosts: bool, link: Link | None = None) -> Cluster:
    made = [Host("localhost", world)] if not hosts else [Host(f"h{r}", 1) for r in range(world)]
    return Cluster(made) if link is None else Cluster(made, links=Links(intra=link, inter=link))


def candidates(meta, cluster: Cluster, rate) -> list[tuple[str, object]]:
    """(placement, candidate) for every runnable candidate of every placement, priced at
    `rate` (a FLOP/s or OpTimes) on `cluster`."""
    inputs = WORKLOAD.batch(0, 0, cluster.world_size)
    traffic = WORKLOAD.traffic(cluster.topology())
    out = []
    for name, base in placements().items():
        found = search(meta, cluster, inputs, rate, "sgd", base=base, space=SPACE,
                       traffic=traffic, every=True)
        out += [(name, c) for c in found if c.step_s is not None]
    return out


def _label(name: str, c) -> str:
    return f"{name}: {label(c)}"


def main(argv=None) -> int:
    return bench_main(__doc__, _world, _run, argv, steps=20)


def _run(a, emulated) -> int:
    from tilework.estimate.compute import step_flops
    from tilework.estimate.ops import Collecting

    hosts = emulated is not None
    with torch.device("meta"):
        meta = WORKLOAD.make(True)
    here = _cluster(a.world, hosts)
    runnable = [(n, c) for n, c in candidates(meta, here, 1e11)
                if a.only is None or a.only.search(_label(n, c))]
    asked = Collecting()
    candidates(meta, here, asked)
    calls = sorted(asked.asked, key=repr)
    plans = [c.parts["plan"] for _, c in runnable]
    labels = [_label(n, c) for n, c in runnable]
    rounds, steps = [], [[] for _ in plans]
    for r in range(a.rounds):
        order = list(range(len(plans)))
        random.Random(r).shuffle(order)
        ran = run_world(_world, a.world, (plans, a.steps + 2, calls, order), emulated, __file__)
        rounds.append(ran)
        for i, s in enumerate(ran["steps"]):
            steps[i] += s[2:]   # each world's first steps of a plan warm it up
    got = _median_of(rounds)
    link = Link(*got["link"], **got["factors"])
    measured_here = _cluster(a.world, hosts, link)
    fitted_before = _cluster(a.world, hosts, Link(*got["link_ls"], **got["factors_ls"]))
    inputs = WORKLOAD.batch(0, 0, a.world)
    rate = step_flops(meta, inputs).step / got["local_s"]
    unscaled = op_times(calls, got["op_seconds"], got["framework"])
    from tilework.estimate.op_stages import model_recording
    from tilework.estimate.plan_cost import estimate

    scale = got["local_s"] / sum(unscaled.seconds(model_recording(meta, inputs, ())))
    by_ops = op_times(calls, got["op_seconds"], got["framework"], scale)
    traffic = WORKLOAD.traffic(measured_here.topology())

    def priced(plan, rate, cluster=measured_here):   # as it ran, at what the worlds measured
        return estimate(plan, cluster, meta, inputs, traffic=traffic, optimizer="sgd",
                        flops=rate, with_memory=False)

    rows = []
    for name, plan, taken in zip(labels, plans, steps):
        p, q = priced(plan, rate), priced(plan, by_ops)
        before = priced(plan, by_ops, fitted_before)
        measured = statistics.median(taken)
        rows.append({"plan": name, "predicted_ms": p.step_s * 1e3, "ops_ms": q.step_s * 1e3,
                     "ops_ls_ms": before.step_s * 1e3, "measured_ms": measured * 1e3,
                     "error": abs(p.step_s - measured) / measured,
                     "ops_error": abs(q.step_s - measured) / measured,
                     "ops_ls_error": abs(before.step_s - measured) / measured,
                     "ops_parts_ms": {k: v * 1e3 for k, v in q.parts.items()
                                      if isinstance(v, float)}})
    summary = _summary(rows, "predicted_ms", "error") | {
        "ops": _summary(rows, "ops_ms", "ops_error") | {"scale": scale, "calls": len(calls)},
        "ops_least_squares": _summary(rows, "ops_ls_ms", "ops_ls_error") | {
            "link": got["link_ls"], "factors": got["factors_ls"]},
        "flops": rate, "local_ms_by_round": [s * 1e3 for s in got["local_by_round"]],
        "framework": got["framework"], "link": got["link"], "factors": got["factors"],
        "world": a.world, "hosts": hosts, "mbit": a.mbit if hosts else None}
    where = f"{a.world} emulated hosts at {a.mbit:g} Mbit/s" if hosts else "loopback"
    print(f"recommender, {a.world} ranks on {where}: plain forward and backward "
          f"{got['local_s'] * 1e3:.2f} ms (each world: "
          + ", ".join(f"{s * 1e3:.2f}" for s in got["local_by_round"])
          + f") = {rate:.3g} FLOP/s; link {link.bandwidth_gbps:.3g} Gb/s "
          f"{link.latency_us:.0f} us (reduce-scatter {link.reduce_scatter_factor:.2f}x, "
          f"all-gather {link.all_gather_factor:.2f}x; small calls: all-to-all "
          f"{link.all_to_all_latency_factor:.2f}x, all-gather "
          f"{link.all_gather_latency_factor:.2f}x; the least-squares fit "
          f"{got['link_ls'][0]:.3g} Gb/s {got['link_ls'][1]:.0f} us); op model {len(calls)} "
          f"calls, scale {scale:.2f}")
    print("| plan | predicted ms (one rate) | (ops) | (ops, least-squares link) | measured ms "
          "| error (rate) | (ops) | (ops, least squares) |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in sorted(rows, key=lambda r: r["measured_ms"]):
        print(f"| {r['plan']} | {r['predicted_ms']:.2f} | {r['ops_ms']:.2f} | "
              f"{r['ops_ls_ms']:.2f} | {r['measured_ms']:.2f} | {r['error'] * 100:.0f}% | "
              f"{r['ops_error'] * 100:.0f}% | {r['ops_ls_error'] * 100:.0f}% |")
    print_summaries((("one rate", summary), ("ops", summary["ops"]),
                     ("ops, least-squares link", summary["ops_least_squares"])))
    if a.out:
        a.out.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    if a.png:
        _plot(rows, summary, a.png)
    return 0


def _plot(rows: list[dict], summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 5))
    xs = [r["measured_ms"] for r in rows]
    for key, marker, name, m in (("predicted_ms", "o", "one rate", summary),
                                 ("ops_ms", "+", "recorded ops", summary["ops"]),
                                 ("ops_ls_ms", "x", "recorded ops, least-squares link",
                                  summary["ops_least_squares"])):
        ax.scatter(xs, [r[key] for r in rows], s=14, marker=marker,
                   label=f"{name}: median error {m['median_error']:.0%}, "
                         f"tau {m['kendall_tau']:.2f}")
    top = max(xs + [r[k] for r in rows for k in ("predicted_ms", "ops_ms", "ops_ls_ms")]) * 1.05
    ax.plot([0, top], [0, top], lw=0.8, color="grey")
    ax.legend(fontsize=7)
    ax.set_xlabel("measured step (ms)")
    ax.set_ylabel("predicted step (ms)")
    where = f"emulated hosts at {summary['mbit']:g} Mbit/s" if summary["hosts"] else "loopback"
    ax.set_title(f"recommender: {summary['plans']} plans, {summary['world']} ranks on {where}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
