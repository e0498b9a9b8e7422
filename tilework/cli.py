"""`tilework`: run, train, demo. User errors print one line and exit with code 2.

    tilework run -n 2 train.py [args]          local workers with torchrun semantics
    tilework run --hosts cluster.toml train.py on each host of the cluster file
    tilework train job.toml [--resume]         a reference workload from a job file
    tilework plan --job J --cluster C          the plan and its predicted cost (or --world-size N)
    tilework calibrate --cluster C [-n N]      measure collectives, fit the cluster file's link
    tilework demo                              the embedded default job
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib import resources
from pathlib import Path

from .cluster.worker_env import WorkerEnv
from .errors import UserError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own usage errors: one line, exit code 2
        raise UserError(f"{self.prog}: {message}")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="tilework", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = sub.add_parser("run", help="start worker processes (torchrun semantics)")
    where = run.add_mutually_exclusive_group(required=True)
    where.add_argument("-n", "--nproc", type=int, help="local worker processes")
    where.add_argument("--hosts", metavar="CLUSTER_TOML",
                       help="cluster file: run this host's share")
    run.add_argument("--host", help="this host's name in the cluster file (default: hostname)")
    run.add_argument("--run-id", default="tilework", help="rendezvous id, the same on every host")
    _fault_flags(run)
    run.add_argument("-v", "--verbose", action="store_true", help="show the launcher's own log")
    run.add_argument("script", help="the training script")
    run.add_argument("args", nargs=argparse.REMAINDER)

    train = sub.add_parser("train", help="train a reference workload from a job file")
    train.add_argument("job", help="job file (TOML)")
    where = train.add_mutually_exclusive_group()
    where.add_argument("-n", "--nproc", type=int, default=1, help="local worker processes")
    where.add_argument("--hosts", metavar="CLUSTER_TOML",
                       help="cluster file: run this host's share")
    train.add_argument("--host", help="this host's name in the cluster file (default: hostname)")
    train.add_argument("--run-id", default="tilework", help="rendezvous id, the same on every host")
    train.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    _fault_flags(train)

    plan = sub.add_parser("plan",
                          help="what tilework would do with a job on a cluster, and its cost")
    plan.add_argument("--job", required=True, help="job file (TOML)")
    where = plan.add_mutually_exclusive_group(required=True)
    where.add_argument("--cluster", help="cluster file (TOML)")
    where.add_argument("--world-size", type=int, metavar="N",
                       help="N ranks on one host with default links (no cluster file)")
    plan.add_argument("--gflops", type=float, metavar="GFLOPS",
                      help="compute per rank for a tp/pp/cp job's step time (default: one "
                           "thread's fp32 matmul measured here)")
    plan.add_argument("--json", action="store_true", help="machine-readable output")
    plan.add_argument("--search", action="store_true",
                      help="rank every dp x pp x cp x tp for the job's gpt model on this "
                           "cluster by predicted step, pruning those over its memory")
    plan.add_argument("--auto", action="store_true",
                      help="let the planner choose (as [parallel] plan = \"auto\"): ZeRO, "
                           "recompute and table placements by predicted step within 80%% of "
                           "each rank's memory; tp, cp, pp where the job gives them as \"auto\"")
    plan.add_argument("--trial", type=int, metavar="K",
                      help="with --auto and --world-size: train K candidates that fit (the "
                           "fastest predicted of each mesh split, table placement, sync and "
                           "shares first, then the next fastest) for a few steps on this "
                           "host's ranks and keep the fastest measured (the predictions "
                           "printed beside)")
    plan.add_argument("--write-job", metavar="OUT_TOML",
                      help="with --auto: write the job with the chosen [parallel] settings "
                           "(plan = \"config\"), for `tilework train OUT_TOML` to run as chosen")
    plan.add_argument("--trial-steps", type=int, default=3, metavar="S",
                      help="with --trial: steps per window (a warm-up window, then a measured "
                           "one; default 3)")
    plan.add_argument("--message-overhead-ms", type=float, default=0.0, metavar="MS",
                      help="with --search: each message's CPU cost at each end (LogP's o; "
                           "about 0 on GPUs, about 0.7 ms on this repo's CPU ranks: "
                           "docs/mesh-search.md)")

    cal = sub.add_parser("calibrate", help="time collectives here and fit the cluster file's link")
    cal.add_argument("--cluster", required=True, help="cluster file (TOML) to update")
    cal.add_argument("-n", "--nproc", type=int, default=2,
                     help="local worker processes (default 2)")
    cal.add_argument("--quick", action="store_true", help="fewer sizes and repeats")

    bench = sub.add_parser("bench", help="tilework beside DDP on emulated hosts (needs root for "
                                         "namespaces; else loopback)")
    bench.add_argument("--quick", action="store_true", help="under 2 minutes: lm100k and cnn")
    bench.add_argument("--workloads", nargs="+", help="lm100k lm800k cnn gpt recommender")
    bench.add_argument("--systems", nargs="+", help="ddp ddp-sparse allreduce ps hybrid "
                       "hybrid-ahead (hybrid reading its batches through tilework.prefetch) "
                       "torchrec torchrec-rw (the last two: recommender only, optional; "
                       "see README); "
                       "also, not by default: hybrid-zipf hybrid-hot (hot rows), "
                       "hybrid-contiguous (rows in contiguous ranges)")
    bench.add_argument("--speeds", type=float, nargs="+", metavar="CORES",
                       help="hosts that differ: one rank per host, each held to this many CPU "
                            "cores by a cgroup quota (needs root); runs ddp, hybrid and "
                            "hybrid-shares (the batch shared by speed) by default")
    bench.add_argument("--steps", type=int, default=5, help="measured steps (median)")
    bench.add_argument("--out", default="docs/benchmarks.md", help="markdown report (+ PNG beside)")

    demo = sub.add_parser("demo", help="the embedded default job (word LM on stdlib sources)")
    demo.add_argument("-n", "--nproc", type=int, default=2,
                      help="local worker processes (default 2, hybrid mode)")
    demo.add_argument("--steps", type=int, help="override the number of steps")
    demo.add_argument("--out-dir", help="where metrics and checkpoints go (default runs/demo)")
    return p


def _fault_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-restarts", type=int, default=0,
                   help="restart every worker after a failure, up to this many times (tilework "
                        "train resumes from the last checkpoint)")
    p.add_argument("--timeout", type=float, metavar="SECONDS",
                   help="fail a collective whose peers stay silent this long (default 300)")


def _cmd_run(a, argv, env) -> int:
    from .launch import launcher as launch

    if not os.path.isfile(a.script):  # unlike Path.is_file, never raises (e.g. on a long name)
        raise UserError(f"{a.script}: script not found")
    # Through the runner: a failing script is reported as a `tilework train` worker's failure is.
    return launch.run(_spec(a), ["-m", "tilework.launch.script", a.script, *a.args],
                      verbose=a.verbose)


def _spec(a):
    """Where the workers run: -n local processes, or this host's share of a cluster file."""
    from .cluster.topology import Cluster
    from .launch import launcher as launch

    restarts, timeout = getattr(a, "max_restarts", 0), getattr(a, "timeout", None)
    if getattr(a, "hosts", None) is not None:  # `--hosts ""` too: a path, and not a file
        return launch.cluster_spec(Cluster.load(a.hosts), a.host, a.run_id, restarts, timeout)
    return launch.local_spec(a.nproc, restarts, timeout)


def _start(a, env: WorkerEnv, task: str, spec: dict) -> int:
    """Start the workers (-n, --hosts) on `task` (tilework.launch.worker), or do it in this process:
    one process with nothing to restart, or a worker already (e.g. of torchrun)."""
    from .launch import launcher as launch
    from .launch import worker

    where = _spec(a)  # checks -n, --hosts, --max-restarts, --timeout before anything starts
    alone = where.nnodes == 1 and where.nproc_per_node == 1 and not where.max_restarts
    if env.launched or alone:
        return worker.run_task(task, spec, env)
    return launch.run(where, worker.argv(task, spec))


def _cmd_train(a, argv, env) -> int:
    from .launch.worker import job_spec
    from .train.job import Job

    job = Job.load(a.job)  # checked here, before any worker starts
    # The cluster file's links plan the job (its path: each worker reads it, as `_spec` does).
    return _start(a, env, "train", {"job": job_spec(job), "resume": a.resume, "cluster": a.hosts})


def _cmd_plan(a, argv, env) -> int:
    import json

    from .cluster.topology import Cluster
    from .report.job import report
    from .train.job import Job

    job = Job.load(a.job)
    if a.cluster is not None:
        cluster, where = Cluster.load(a.cluster), a.cluster
    else:
        from .errors import ConfigError

        try:
            cluster = Cluster.local(a.world_size)
        except ConfigError as e:   # Host's own bounds on procs, named by this flag
            raise UserError(f"--world-size: {e.problem}") from None
        where = f"{a.world_size} local ranks"
    if a.write_job is not None and (a.search or not (a.auto or job.parallel.plan == "auto")):
        raise UserError("--write-job: with --auto (or the job's [parallel] plan = \"auto\"): "
                        "it writes the job as the planner chose it")
    if a.search:
        return _search(a, job, cluster, where)
    found = None
    if a.auto or job.parallel.plan == "auto":
        job, found = _auto(a, job, cluster)
        if a.write_job is not None:
            _write_job(job, a.write_job, found)
    flops, source = _plan_flops(a, job)
    out = report(job, cluster, flops, source)
    if a.json:
        print(json.dumps(out | ({"auto": found} if found else {}), indent=2))
        return 0
    from .report.tables import print_report

    if found:
        print("\n".join(_auto_lines(found, f"{a.job} on {where}")))
    print_report(out, f"{a.job} on {where}")
    return 0


def _write_job(job, path: str, found: dict) -> None:
    """The job as chosen, atomically: `tilework train` reads it back as the same Job."""
    import dataclasses
    from pathlib import Path

    from .checkpoint.atomic import write_atomic
    from .config.toml_writer import dump_toml
    from .launch.worker import job_spec

    chosen = dataclasses.replace(job, parallel=dataclasses.replace(job.parallel, plan="config",
                                                                   auto_axes=None))
    head = f"# tilework plan --auto: {found['why']}\n"
    write_atomic(Path(path), head + dump_toml(job_spec(chosen)))


def _auto(a, job, cluster):
    """`tilework plan --auto`: the planner's search and choice for the job. Returns the job
    with the chosen configuration (whose plan the report then shows), and what was chosen."""
    import dataclasses

    from .planner.search import Space, choose, label, search, trial_candidates
    from .plans.analysis import analyze
    from .train.planning import example_batch, meta_model, table_traffic

    if a.trial is not None and (a.trial < 1 or a.world_size is None):
        raise UserError("--trial K: K >= 1, with --world-size N (the trials run on this host's "
                        "ranks; a cluster file's hosts are not started from here)")
    flops, source = _rate(a)
    model = meta_model(job)
    config = dataclasses.replace(job.parallel, plan="auto")
    choice = choose(search(model, cluster, example_batch(job, cluster), flops,
                           job.train.optimizer, config, Space.of(config),
                           table_traffic(job, analyze(model), cluster),
                           every=a.trial is not None))
    found = {"chosen": label(choice.chosen),
             "runner_up": choice.runner_up and label(choice.runner_up),
             "why": choice.why(), "flops_per_s": float(flops), "flops_source": source,
             "candidates": [{"plan": label(c), "predicted_step_s": c.step_s,
                             "peak_bytes": c.parts.get("peak_bytes"), "why": c.why}
                            for c in choice.candidates]}
    chosen = choice.chosen.config
    if a.trial is not None:
        from .train.trial import fastest, run_trials

        trials = run_trials(job, trial_candidates(list(choice.candidates), a.trial),
                            a.world_size, a.trial_steps)
        best = fastest(trials)
        chosen = best["config"]
        found["trials"] = [{k: v for k, v in t.items() if k != "config"} for t in trials]
        found["chosen"] = best["plan"]
        found["why"] += (f"; trials of {len(trials)} candidates: {best['plan']} "
                         f"measured fastest ({best['measured_step_s'] * 1e3:,.1f} ms a step)")
    return dataclasses.replace(job, parallel=chosen), found


def _auto_lines(found: dict, title: str) -> list[str]:
    refused = [c for c in found["candidates"] if c["predicted_step_s"] is None]
    lines = [f"plan='auto' for {title}: {len(found['candidates'])} candidates "
             f"({len(refused)} refused), compute {found['flops_per_s'] / 1e9:,.1f} GFLOP/s "
             f"per rank ({found['flops_source']})", f"  {found['why']}"]
    lines += [f"  trial {t['plan']}: predicted {t['predicted_step_s'] * 1e3:,.1f} ms, measured "
              + (f"{t['measured_step_s'] * 1e3:,.1f} ms" if t["measured_step_s"] is not None
                 else "did not finish") for t in found.get("trials", [])]
    return lines + [f"  refused {c['plan']}: {c['why']}" for c in refused[:3]]


def _search(a, job, cluster, where: str) -> int:
    """`tilework plan --search`: mesh_search's ranking for the job's model."""
    import dataclasses
    import json

    from .planner.search import search_mesh
    from .train.planning import meta_model

    if job.workload != "gpt":
        raise UserError(f"--search: the mesh search splits the gpt workload's model; this job "
                        f"trains {job.workload!r} (its plan: tilework plan without --search)")
    flops, source = _plan_flops(a, dataclasses.replace(
        job, parallel=dataclasses.replace(job.parallel, tp=2)))   # a rate is needed here
    batch = job.data.batch_size * (cluster.world_size if job.data.scaling == "weak" else 1)
    if not 0 <= a.message_overhead_ms < float("inf"):
        raise UserError(f"--message-overhead-ms: expected a number >= 0, got "
                        f"{a.message_overhead_ms}")
    found = search_mesh(meta_model(job), cluster, batch, job.gpt.seq_len, flops,
                        job.train.optimizer, a.message_overhead_ms * 1e-3)
    rows = [{"mesh": c.label, "config": {k: getattr(c.config, k) for k in
                                         ("tp", "pp", "cp", "microbatches")},
             "predicted_step_s": c.step_s, "why": c.why,
             "parts": {k: v for k, v in c.parts.items() if isinstance(v, (int, float))}}
            for c in found]
    if a.json:
        print(json.dumps({"flops_per_s": float(flops), "flops_source": source,
                          "candidates": rows},
                         indent=2))
        return 0
    print(f"mesh search for {a.job} on {where}: global batch {batch}, compute "
          f"{float(flops) / 1e9:,.1f} GFLOP/s per rank ({source}); fastest first")
    for r in rows:
        p = r["parts"]
        if r["predicted_step_s"] is None:
            print(f"  {r['mesh']:<24} refused: {r['why']}")
            continue
        print(f"  {r['mesh']:<24} {r['predicted_step_s'] * 1e3:10.3f} ms  (compute "
              f"{p['compute'] * 1e3:.3f}, tp {p['tp'] * 1e3:.3f}, cp {p['cp'] * 1e3:.3f}, "
              f"bubble {p['bubble']:.2f}, dp {p['dp'] * 1e3:.3f} ms; peak "
              f"{p.get('peak_bytes', 0) / 1e6:,.1f} MB)")
    return 0


def _plan_flops(a, job) -> tuple[float | None, str]:
    """The compute rate a model-parallel plan times its stages at (a data-parallel plan's
    report times only communication and needs none)."""
    if a.gflops is None and not job.parallel.model_parallel:
        return None, ""
    return _rate(a)


def _rate(a) -> tuple:
    """--gflops, else what `tilework calibrate` measured for the cluster file (its matmul
    curve where it wrote one: each product priced by its shape), else one thread's matmul
    here."""
    from .cluster.calibrate import matmul_flops
    from .cluster.calibration_file import calibrated_curve, calibrated_flops

    if a.gflops is not None:
        if not 0 < a.gflops < float("inf"):
            raise UserError(f"--gflops: expected a positive number, got {a.gflops}")
        return a.gflops * 1e9, "--gflops"
    found = calibrated_flops(a.cluster) if a.cluster is not None else None
    curve = calibrated_curve(a.cluster) if found is not None else None
    if curve is not None:
        return curve, f"tilework calibrate's matmul curve (best {float(curve) / 1e9:,.1f}): " \
                      f"{found[1]}"
    if found is not None:
        return found[0], f"tilework calibrate: {found[1]}"
    return matmul_flops(), ("measured here: one thread's fp32 matmul; `tilework calibrate` "
                            "or --gflops to set it")


def _cmd_calibrate(a, argv, env) -> int:
    from .cluster.topology import Cluster

    Cluster.load(a.cluster)  # checked here, before any worker starts
    if a.nproc < 2 and env.world_size < 2:
        raise UserError(f"-n/--nproc: calibration needs at least 2 processes, got {a.nproc}")
    return _start(a, env, "calibrate", {"cluster": a.cluster, "quick": a.quick})


def _cmd_bench(a, argv, env) -> int:
    from .bench.suite import run_suite, write_report

    speeds = tuple(a.speeds or ())
    workloads = a.workloads or (["gpt", "cnn"] if speeds else ["lm100k", "cnn"] if a.quick else
                                ["lm100k", "lm800k", "cnn", "gpt", "recommender"])
    from .bench.worker import SYSTEMS

    systems = a.systems or (["ddp", "hybrid", "hybrid-shares"] if speeds else [
        s for s in SYSTEMS
        if s not in ("hybrid-zipf", "hybrid-hot", "hybrid-contiguous", "hybrid-shares")])
    from .bench.workloads import WORKLOADS

    for kind, names, known in (("--workloads", workloads, WORKLOADS),
                               ("--systems", systems, SYSTEMS)):
        unknown = [n for n in names if n not in known]
        if unknown:
            raise UserError(f"{kind}: unknown {unknown[0]!r} (expected one of: {', '.join(known)})")
    if a.steps < 1:
        raise UserError(f"--steps: expected at least 1, got {a.steps}")
    if speeds and (len(speeds) < 2 or not all(0 < c < float("inf") for c in speeds)):
        raise UserError(f"--speeds: expected a positive number of cores for each of at least 2 "
                        f"hosts, got {list(speeds)}")
    try:
        suite = run_suite(workloads, systems, a.quick, a.steps, warmup=2, speeds=speeds)
    except RuntimeError as e:
        if not str(e).startswith("--speeds"):
            raise
        raise UserError(str(e)) from None
    out = Path(a.out)
    write_report(suite, out, out.with_suffix(".png"), "tilework bench " + " ".join(argv[1:]))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def _cmd_demo(a, argv, env) -> int:
    import dataclasses

    from .config import files as config
    from .launch.worker import job_spec
    from .train.job import Job

    text = resources.files("tilework").joinpath("demo.toml").read_text()
    job = config.from_dict(Job, config.tomllib.loads(text), source="demo.toml")
    if a.steps is not None:
        if a.steps < 1:
            raise UserError(f"--steps: expected at least 1, got {a.steps}")
        job.train = dataclasses.replace(job.train, steps=a.steps,
                                        eval_every=min(job.train.eval_every, a.steps))
    if a.out_dir:
        job.train = dataclasses.replace(job.train, out_dir=a.out_dir)
    return _start(a, env, "demo", {"job": job_spec(job)})


def _run_worker(command, args, argv, env: WorkerEnv) -> int:
    """One rank of a group someone else launched (`torchrun ... -m tilework train`): a failure
    is one line, and the exit code tells the launcher whether this rank caused it
    (launch/faults.py)."""
    from .launch.faults import stop_worker

    try:
        return command(args, argv, env)
    except Exception as e:  # noqa: BLE001 - every failure of a worker is reported
        stop_worker(e, env)


def main(argv: list[str] | None = None) -> int:
    try:
        argv = sys.argv[1:] if argv is None else argv
        args = _parser().parse_args(argv)
        commands = {"run": _cmd_run, "train": _cmd_train, "plan": _cmd_plan, "bench": _cmd_bench,
                    "demo": _cmd_demo,
                    "calibrate": _cmd_calibrate}
        env = WorkerEnv.from_environ()  # the one read; everything below is passed it
        if env.launched:
            return _run_worker(commands[args.command], args, argv, env)
        return commands[args.command](args, argv, env)
    except UserError as e:
        print(f"tilework: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("tilework: interrupted", file=sys.stderr)
        return 130
