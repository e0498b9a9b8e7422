"""The training loop behind `tilework train` and `tilework demo`.

Progress: a live bar on a terminal, and a log line every `log_every` steps with loss and throughput
everywhere (so CI logs and `tilework run` output show progress too). Metrics go to
`<out_dir>/metrics.jsonl`, checkpoints to `<out_dir>/checkpoints/` (atomic, see checkpoint.py).
Every rank computes the same global batch order; rank 0 alone prints and writes. On a dp x pp x
cp x tp mesh (job [parallel] tp, pp, cp) each dp replica reads its slice, the pipeline runs the
step (`model.step`), and the logged loss is the batch's on every rank (broadcast from the last
stage).
"""

from __future__ import annotations

import json
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from .. import batch_shares, full_parameters, optim, prefetch
from ..checkpoint import file as checkpoint
from ..data import ShardedBatches
from .job import Job
from .workloads import Workload, build


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)   # global mean loss of each step run here
    first_step: int = 0
    rank: int = 0
    evals: list[dict] = field(default_factory=list)     # {"step": s, metric: value}


class _Session:
    """Where this process stands: single process, or one rank of a group; on a dp x pp x cp x
    tp mesh (`mesh`, set once the model is parallelized) also its place in the mesh."""

    def __init__(self, groups):
        self.groups = groups
        self.rank = groups.rank
        self.world_size = groups.world_size
        self.mesh = None   # runtime/apply.MeshParallel under tp, pp or cp > 1
        # Uneven batch shares: this rank's mean counts W n_r / N times in the mean over ranks
        # (planner/shares.gradient_weights), so the logged loss is the global batch's.
        self.weight = 1.0

    @property
    def pipelined(self) -> bool:
        return self.mesh is not None and self.mesh.pipeline is not None

    def data_shard(self) -> tuple[int, int]:
        """Which slice of the global batch this rank reads, of how many: on a mesh one per dp
        replica, every tp, pp and cp rank of a replica reading the same (a pipeline's ranks
        each take their stage's part of it, cp's ranks theirs of its sequences)."""
        if self.mesh is None:
            return self.rank, self.world_size
        return self.mesh.groups.coord("dp"), self.mesh.mesh.size_of("dp")

    def mean_over_ranks(self, values: list[float | None]) -> list[float]:
        """The ranks' mean of each value. Under pp only the last stage's ranks know a loss
        (None elsewhere): it is broadcast over each pipeline first, so every rank's log shows
        the batch's loss. On a mesh each rank's value is its tokens' mean: equal counts of
        tokens per rank (tp's ranks see all of a replica's, cp's equal parts), so the mean of
        the ranks' is the global batch's."""
        if not values:
            return values
        if self.pipelined:
            values = self._from_last_stage(values)
        if self.world_size == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.groups.device) * self.weight
        dist.all_reduce(t, group=self.groups.world)
        return (t / self.world_size).tolist()

    def _from_last_stage(self, values: list[float | None]) -> list[float]:
        group = self.mesh.groups.group("pp")
        last = dist.get_world_size(group) - 1   # every schedule puts the last stage there
        known = [math.nan if v is None else v for v in values]
        t = torch.tensor(known, dtype=torch.float64, device=self.groups.device)
        dist.broadcast(t, dist.get_global_rank(group, last), group=group)
        return t.tolist()


def _prepare(job: Job, work: Workload, session: _Session, cluster=None):
    """The user's path exactly: a plain torch optimizer, then tilework.parallelize, planned as
    `tilework plan` plans the job: the job's model of its ids gives each table's traffic, the
    cluster file (when given) the links."""
    from ..api import parallelize
    from .planning import example_batch, job_cluster, job_config, table_traffic

    model = work.model
    opt = optim.make(job.train.optimizer, model.parameters(), job.train.lr)
    given = cluster   # the cluster file's (its links), or None: the defaults, or timed here
    cluster = job_cluster(session.groups.topology, cluster)
    from ..plans.analysis import analyze

    traffic = table_traffic(job, analyze(model), cluster)
    # On a mesh with pp > 1 what comes back is another module (a PipelineModel: model.step).
    # plan="auto" prices its candidates on one rank's batch: its shapes, as the loop makes it.
    example = example_batch(job, cluster) if job.parallel.plan == "auto" else None
    model, opt = parallelize(model, opt, job_config(job, cluster), groups=session.groups,
                             cluster=given if job.parallel.plan == "auto" else cluster,
                             traffic=traffic, log=session.rank == 0, example_inputs=example)
    session.mesh = getattr(model._tilework_engine, "mesh", None)
    return model, opt


def _state(model, opt, step: int) -> dict | None:
    """What rank 0 writes (None elsewhere on a mesh, which gathers to rank 0 alone)."""
    from ..api import state_to_write

    state = state_to_write(model, opt)
    return None if state is None else {"step": step, **state}


def train(job: Job, groups=None, resume: bool = False, console: Console | None = None,
          cluster=None) -> TrainResult:
    """Train `job` on `groups` (one process by default); `cluster` (a cluster file's) gives
    the planner its links."""
    from ..comm.groups import solo

    session = _Session(groups or solo())
    console = console or Console(quiet=session.rank != 0, soft_wrap=True)
    work = build(job)
    model, opt = _prepare(job, work, session, cluster)
    shares = batch_shares(model)   # per data-parallel rank, or replica on a mesh
    if shares is not None:
        from ..planner.shares import gradient_weights

        session.weight = gradient_weights(shares)[session.data_shard()[0]]
    sampler = _sampler(job, work, session, shares)
    out = Path(job.train.out_dir)
    ckpt_dir = out / "checkpoints"
    start = _resume(job, model, opt, ckpt_dir, console) if resume else 0
    result = TrainResult(first_step=start, rank=session.rank)
    if session.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        # The plan this run executes, as `tilework plan --json` prints it under "plan".
        (out / "plan.json").write_text(json.dumps(model._tilework_engine.plan.as_dict(), indent=1))
    log = _Log(work, model, session, console, out / "metrics.jsonl", result)
    if start == 0 or job.train.eval_every:
        log.evaluate(start)
    _run_steps(job, work, sampler, model, opt, session, log, start, ckpt_dir)
    log.evaluate(job.train.steps)
    return result


def _sampler(job: Job, work: Workload, session: _Session, shares=None) -> ShardedBatches:
    shard, shards = session.data_shard()
    sampler = ShardedBatches(len(work.train_set), job.data.batch_size, shard, shards,
                             seed=job.data.seed, scaling=job.data.scaling,
                             shuffle=job.data.shuffle, shares=shares)
    if session.pipelined:
        per_replica = shares[shard] if shares else sampler.global_batch // shards
        m = session.mesh.pipeline.schedule.microbatches
        if per_replica % m:
            from ..errors import ConfigError

            raise ConfigError("data.batch_size", f"expected each data-parallel replica's "
                              f"{per_replica} sequences to split into parallel.microbatches = "
                              f"{m} equal microbatches (the pipeline's loss is the batch's mean)")
    return sampler


def _resume(job: Job, model, opt, ckpt_dir: Path, console: Console) -> int:
    """The step to start at: the latest checkpoint's, loaded into model and optimizer, else 0."""
    found = checkpoint.latest(ckpt_dir)
    if found is None:
        console.print(f"no checkpoint in {ckpt_dir}; starting at step 0")
        return 0
    from ..api import load_state_dict

    blob = checkpoint.load(found, job.fingerprint())
    load_state_dict(model, opt, blob["state"])
    start = blob["state"]["step"]
    console.print(f"resumed from {found} at step {start}")
    return start


def _run_steps(job: Job, work: Workload, sampler: ShardedBatches, model, opt, session: _Session,
               log: "_Log", start: int, ckpt_dir: Path) -> None:
    """Steps `start` to the end, logging, evaluating and checkpointing on the job's schedule."""
    steps = job.train.steps
    log.open_window(sampler.global_batch * work.units_per_sample)
    batches = (work.train_set.collate(sampler.indices(step)) for step in range(start, steps))
    if not session.pipelined and getattr(model, "_tilework_engine", None) is not None:
        batches = prefetch(batches, model)   # the next batch's ids routed during this step
    with log.bar(steps, start):
        for step, batch in enumerate(batches, start):
            if session.pipelined:   # the runtime owns forward and backward; the loss is the
                loss = model.step(*batch)  # last stage's (None on the others' ranks)
            else:
                loss = work.loss(model, batch, step)
                loss.backward()
            opt.step()
            opt.zero_grad()
            log.step_done(None if loss is None else loss.item())
            done = step + 1
            if done % job.train.log_every == 0 or done == steps:
                log.report(done, steps)
            if job.train.eval_every and done % job.train.eval_every == 0 and done != steps:
                log.evaluate(done)
            if job.train.checkpoint_every and (done % job.train.checkpoint_every == 0
                                               or done == steps):
                _checkpoint(ckpt_dir, done, model, opt, job, session)


class _Log:
    """What a run shows and records: eval results, and per log window the global mean loss and
    the throughput, on the console, the progress bar and metrics.jsonl (rank 0 writes)."""

    def __init__(self, work: Workload, model, session: _Session, console: Console, metrics: Path,
                 result: TrainResult):
        self.work, self.model, self.session = work, model, session
        self.console, self.metrics, self.result = console, metrics, result
        self._progress: Progress | None = None
        self._task = None
        self.units_per_step, self.pending = 0, []
        self.window_start, self.window_steps = 0.0, 0

    def evaluate(self, step: int) -> None:
        # Evaluation methods read parameters directly (the LM's perplexity): under ZeRO-3 they
        # are gathered for it.
        with full_parameters(self.model):
            values = self.work.evaluate(self.model)
        if self.session.mesh is not None:
            # Every rank evaluates the same held-out batch: tp's ranks agree, cp's each hold
            # a part, pp's last stage alone knows it. The evaluation's tp sends are no step's.
            names = sorted(values)
            values = dict(zip(names, self.session.mean_over_ranks([values[k] for k in names])))
            self.session.mesh.stats.discard_step()
        self.result.evals.append({"step": step, **values})
        shown = "  ".join(f"{k} {v:,.2f}" for k, v in values.items())
        self.console.print(f"[bold]eval[/] step {step}: {shown}")
        _append(self.metrics, {"step": step, **values}, self.session.rank)

    def open_window(self, units_per_step: int) -> None:
        """Start counting losses and time; opened after the first eval so as not to charge its
        time to the training throughput."""
        self.units_per_step, self.pending = units_per_step, []
        self.window_start, self.window_steps = time.perf_counter(), 0

    @contextmanager
    def bar(self, steps: int, start: int):
        progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[status]}"), TimeRemainingColumn(),
                            console=self.console, disable=not self.console.is_terminal,
                            transient=True)
        with progress:
            self._progress = progress
            self._task = progress.add_task("train", total=steps, completed=start, status="")
            yield

    def step_done(self, loss: float | None) -> None:
        # Kept here, not reduced per step: one all-reduce per log window, not per step.
        self.pending.append(loss)
        self.window_steps += 1

    def report(self, done: int, steps: int) -> None:
        """Close the window: the ranks' mean losses, the throughput since the last report."""
        global_losses = self.session.mean_over_ranks(self.pending)
        self.result.losses.extend(global_losses)
        self.pending = []
        elapsed = time.perf_counter() - self.window_start
        steps_in_window = self.window_steps
        rate = self.units_per_step * self.window_steps / max(elapsed, 1e-9)
        self.window_start, self.window_steps = time.perf_counter(), 0
        last = global_losses[-1]
        traffic, traffic_text = _traffic(self.model, self.session)
        unit = self.work.unit
        self._progress.console.print(f"step {done}/{steps}  loss {last:.4f}  "
                                     f"{rate:,.0f} {unit}/s{traffic_text}")
        self._progress.update(self._task, completed=done, status=f"loss {last:.3f}")
        _append(self.metrics, {"step": done, "loss": last, f"{unit}_per_s": rate,
                               "step_s": elapsed / max(steps_in_window, 1), **traffic},
                self.session.rank)


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
    if session.mesh is not None:  # the gathers over tp and pp are no training step's bytes
        session.mesh.stats.discard_step()


def _append(path: Path, record: dict, rank: int) -> None:
    if rank != 0:
        return
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
             for k, v in record.items()}
    with path.open("a") as f:
        f.write(json.dumps(clean) + "\n")
