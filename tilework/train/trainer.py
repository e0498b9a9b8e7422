"""The training loop behind `tilework train` and `tilework demo`.

Progress: a live bar on a terminal, and a log line every `log_every` steps with loss and throughput
everywhere (so CI logs and `tilework run` output show progress too). Metrics go to
`<out_dir>/metrics.jsonl`, checkpoints to `<out_dir>/checkpoints/` (atomic, see checkpoint.py).
Every rank computes the same global batch order; rank 0 alone prints and writes.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from .. import optim
from ..data import ShardedBatches
from . import checkpoint
from .job import Job
from .workloads import Workload, build


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)   # global mean loss of each step run here
    first_step: int = 0
    rank: int = 0
    evals: list[dict] = field(default_factory=list)     # {"step": s, metric: value}


class _Session:
    """Where this process stands: single process, or one rank of a group."""

    def __init__(self, groups):
        self.groups = groups
        self.rank = groups.rank
        self.world_size = groups.world_size

    def mean_over_ranks(self, values: list[float]) -> list[float]:
        if self.world_size == 1 or not values:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.groups.device)
        dist.all_reduce(t, group=self.groups.world)
        return (t / self.world_size).tolist()


def _prepare(job: Job, work: Workload, session: _Session, cluster=None):
    """The user's path exactly: a plain torch optimizer, then tilework.parallelize, planned as
    `tilework plan` plans the job: the job's model of its ids gives each table's traffic, the
    cluster file (when given) the links."""
    from ..api import parallelize
    from ..report import job_cluster, table_traffic

    model = work.model
    opt = optim.make(job.train.optimizer, model.parameters(), job.train.lr)
    cluster = job_cluster(session.groups.topology, cluster)
    from ..analysis import analyze

    traffic = table_traffic(job, analyze(model), cluster)
    parallelize(model, opt, job.parallel, groups=session.groups, cluster=cluster,
                traffic=traffic, log=session.rank == 0)
    return model, opt


def _state(model, opt, step: int) -> dict:
    from ..api import state_dict

    return {"step": step, **state_dict(model, opt)}


def train(job: Job, groups=None, resume: bool = False, console: Console | None = None,
          cluster=None) -> TrainResult:
    """Train `job` on `groups` (one process by default); `cluster` (a cluster file's) gives
    the planner its links."""
    from ..comm.groups import solo

    session = _Session(groups or solo())
    console = console or Console(quiet=session.rank != 0, soft_wrap=True)
    work = build(job)
    sampler = ShardedBatches(len(work.train_set), job.data.batch_size, session.rank,
                             session.world_size, seed=job.data.seed, scaling=job.data.scaling,
                             shuffle=job.data.shuffle)
    model, opt = _prepare(job, work, session, cluster)
    out = Path(job.train.out_dir)
    ckpt_dir = out / "checkpoints"
    start = 0
    if resume:
        found = checkpoint.latest(ckpt_dir)
        if found is None:
            console.print(f"no checkpoint in {ckpt_dir}; starting at step 0")
        else:
            from ..api import load_state_dict

            blob = checkpoint.load(found, job.fingerprint())
            load_state_dict(model, opt, blob["state"])
            start = blob["state"]["step"]
            console.print(f"resumed from {found} at step {start}")
    result = TrainResult(first_step=start, rank=session.rank)
    metrics = out / "metrics.jsonl"
    if session.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        # The plan this run executes, as `tilework plan --json` prints it under "plan".
        (out / "plan.json").write_text(json.dumps(model._tilework_engine.plan.as_dict(), indent=1))

    def evaluate(step: int):
        values = work.evaluate(model)
        result.evals.append({"step": step, **values})
        shown = "  ".join(f"{k} {v:,.2f}" for k, v in values.items())
        console.print(f"[bold]eval[/] step {step}: {shown}")
        _append(metrics, {"step": step, **values}, session.rank)

    if start == 0 or job.train.eval_every:
        evaluate(start)
    units_per_step = sampler.global_batch * work.units_per_sample
    pending: list[float] = []
    window_start, window_steps = time.perf_counter(), 0
    progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[status]}"), TimeRemainingColumn(),
                        console=console, disable=not console.is_terminal, transient=True)
    with progress:
        task = progress.add_task("train", total=job.train.steps, completed=start, status="")
        for step in range(start, job.train.steps):
            batch = work.train_set.collate(sampler.indices(step))
            loss = work.loss(model, batch, step)
            loss.backward()
            opt.step()
            opt.zero_grad()
            pending.append(loss.item())
            window_steps += 1
            done = step + 1
            if done % job.train.log_every == 0 or done == job.train.steps:
                global_losses = session.mean_over_ranks(pending)
                result.losses.extend(global_losses)
                pending = []
                elapsed = time.perf_counter() - window_start
                rate = units_per_step * window_steps / max(elapsed, 1e-9)
                window_start, window_steps = time.perf_counter(), 0
                last = global_losses[-1]
                traffic, traffic_text = _traffic(model, session)
                line = (f"step {done}/{job.train.steps}  loss {last:.4f}  "
                        f"{rate:,.0f} {work.unit}/s{traffic_text}")
                progress.console.print(line)
                progress.update(task, completed=done, status=f"loss {last:.3f}")
                _append(metrics, {"step": done, "loss": last, f"{work.unit}_per_s": rate,
                                  **traffic}, session.rank)
            if job.train.eval_every and done % job.train.eval_every == 0 and done != job.train.steps:
                evaluate(done)
            if job.train.checkpoint_every and (done % job.train.checkpoint_every == 0
                                               or done == job.train.steps):
                _checkpoint(ckpt_dir, done, model, opt, job, session)
    evaluate(job.train.steps)
    return result


def _traffic(model, session: _Session) -> tuple[dict, str]:
    """Bytes this rank sent in the last step, by method, beside what dense all-reduce of every
    parameter would have sent."""
    if session.world_size == 1:
        return {}, ""
    from ..api import stats

    s = stats(model)
    sent = {m: t["sent"] for m, t in s["last_step"].items()}
    dense = s["dense_allreduce_bytes_per_step"]
    parts = "  ".join(f"{m} {_human(b)}" for m, b in sent.items())
    return ({f"bytes_{m}": b for m, b in sent.items()} | {"bytes_all_dense_allreduce": dense},
            f"  | sent/step: {parts}  (all-dense all-reduce: {_human(dense)})")


def _human(n: float) -> str:
    if n < 1000:
        return f"{n:.0f} B"
    for unit in ("kB", "MB", "GB"):
        n /= 1000
        if n < 1000 or unit == "GB":
            return f"{n:,.1f} {unit}"


def _checkpoint(directory: Path, step: int, model, opt, job: Job, session: _Session) -> None:
    state = _state(model, opt, step)  # collective when tables are sharded: every rank joins
    if session.rank == 0:
        checkpoint.save(directory, step, state, job.fingerprint(), keep=job.train.keep_checkpoints)
    if session.world_size > 1:
        dist.barrier(group=session.groups.world)


def _append(path: Path, record: dict, rank: int) -> None:
    if rank != 0:
        return
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
             for k, v in record.items()}
    with path.open("a") as f:
        f.write(json.dumps(clean) + "\n")
