"""The workers of `tilework train`, `tilework demo` and `tilework calibrate`, started by the CLI
through this entry point with what to do spelled out (`tilework run` starts tilework.launch.script):

    python -u -m tilework.launch.worker train '{"job": {...}, "resume": false, "cluster": null}'

The CLI checks the user's input first, then serializes the task: the job as the CLI loaded and
changed it (`tilework demo --steps`), the cluster file's path, the flags the task reads. Each
worker reads its `WorkerEnv` once, here, and passes it down. A failure ends the rank as
faults.stop_worker says: one line, an exit code that tells the launcher whose fault it was.
"""

from __future__ import annotations

import dataclasses
import json
import sys

from ..cluster.worker_env import WorkerEnv
from ..errors import UserError


def argv(task: str, spec: dict) -> list[str]:
    """python's arguments that run `task` on `spec` in a worker."""
    return ["-m", "tilework.launch.worker", task, json.dumps(spec)]


def job_spec(job) -> dict:
    """A Job as JSON the worker turns back into the same Job (TOML has no null: Nones left out)."""
    def without_none(x):
        if isinstance(x, dict):
            return {k: without_none(v) for k, v in x.items() if v is not None}
        return [without_none(v) for v in x] if isinstance(x, (list, tuple)) else x
    return without_none(dataclasses.asdict(job))


def run_task(task: str, spec: dict, env: WorkerEnv) -> int:
    """Do `task` in this process: one rank of a launched group, or the only process."""
    return TASKS[task](spec, env)


def run_as_worker(task: str, spec: dict, env: WorkerEnv) -> int:
    """`run_task` as one rank of a launched group: a failure is reported, not raised
    (launch/faults.py)."""
    from .faults import stop_worker

    try:
        return run_task(task, spec, env)
    except Exception as e:  # noqa: BLE001 - every failure of a worker is reported
        stop_worker(e, env)


def _job(spec: dict, env: WorkerEnv):
    from ..config import files as config
    from ..train.job import Job

    job = config.from_dict(Job, spec["job"], source="the worker's job spec")
    return dataclasses.replace(job, cache_dir=job.cache_dir or str(env.cache_dir))


def _groups(env: WorkerEnv):
    """With more than one rank: join the world the launcher described."""
    if env.world_size <= 1:
        return None
    from ..comm import build_groups, init_from_env

    return build_groups(init_from_env(env=env), env=env)


def _done(groups) -> int:
    if groups is not None:
        from ..comm import exit_worker

        exit_worker(0)
    return 0


def _train(spec: dict, env: WorkerEnv) -> int:
    from ..cluster.topology import Cluster
    from ..train.trainer import train

    job, groups = _job(spec, env), _groups(env)
    # After a restart (`--max-restarts`) the workers pick up from the last checkpoint.
    resume = spec["resume"] or env.restart_count > 0
    cluster = Cluster.load(spec["cluster"]) if spec["cluster"] is not None else None
    train(job, groups=groups, resume=resume, cluster=cluster)
    return _done(groups)


def _demo(spec: dict, env: WorkerEnv) -> int:
    from ..train.trainer import train

    job, groups = _job(spec, env), _groups(env)
    result = train(job, groups=groups)
    if result.rank == 0:
        first, last = result.evals[0], result.evals[-1]
        print(f"perplexity: {first['ppl']:,.1f} at step {first['step']} -> {last['ppl']:,.1f} "
              f"at step {last['step']}")
    return _done(groups)


def _calibrate(spec: dict, env: WorkerEnv) -> int:
    from ..cluster import calibrate

    groups = _groups(env)
    sizes, repeats = ((calibrate.QUICK_SIZES, calibrate.QUICK_REPEATS) if spec["quick"]
                      else (calibrate.DEFAULT_SIZES, calibrate.DEFAULT_REPEATS))
    # On the ranks' own device: a GPU's under NCCL, which carries no CPU tensor, and whose
    # rate is the one the plans are priced at.
    device = groups.device
    results = calibrate.measure(groups.world, groups.world_size, sizes, repeats, device=device)
    flops = calibrate.measure_compute(groups.world, groups.world_size, device)
    curve = calibrate.measure_curve(groups.world, groups.world_size, device)
    speeds = calibrate.measure_speeds(groups.world, groups.world_size, groups.topology.hosts,
                                      device)
    if groups.rank == 0:
        key, json_path = calibrate.write_calibration(spec["cluster"], results,
                                                     spans_hosts=groups.topology.num_hosts > 1,
                                                     flops_per_s=flops, curve=curve,
                                                     speeds=speeds)
        print(calibrate.summary(results))
        print(f"compute: {flops / 1e9:.1f} GFLOP/s per rank (fp32 matmul, one thread); by "
              f"shape {min(min(min(r) for r in p) for p in curve.flops_per_s) / 1e9:.2f}-"
              f"{float(curve) / 1e9:.1f} GFLOP/s over (m, k, n) in {curve.sizes}")
        print(f"{spec['cluster']}: {key} set from the all_reduce fit; every fit in {json_path}"
              + (f"; hosts' speeds {speeds}" if speeds else "; the hosts compute alike"))
    return _done(groups)


TASKS = {"train": _train, "demo": _demo, "calibrate": _calibrate}


def main(args: list[str] | None = None) -> int:
    task, text = sys.argv[1:] if args is None else args
    try:
        env = WorkerEnv.from_environ()
    except UserError as e:  # no rank to name yet: the launcher's summary gives the exit code
        print(f"tilework: error: {e}", file=sys.stderr)
        return e.exit_code
    return run_as_worker(task, json.loads(text), env)


if __name__ == "__main__":
    raise SystemExit(main())
