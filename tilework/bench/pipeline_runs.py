"""What bench/pipeline_schedules.py runs: per-stage compute timed in one process, and timed
steps of each schedule on real ranks, by tilework's PipelineRunner and by
torch.distributed.pipelining's schedules on the same stages.

A step's time is from the barrier before it to the last rank's return (the clocks are the
machine's one monotonic clock, so ranks' timestamps compare); a rank's busy time is the sum of
its actions' compute intervals in the runner's timeline (after the input arrived).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..comm.counted import Stats
from ..models.gpt import TinyGPT
from ..parallel.pipeline.runtime import PipelineRunner
from ..parallel.pipeline.schedule import build
from ..parallel.pipeline.stages import split_stages


@dataclass(frozen=True)
class Shape:
    vocab: int = 1024
    dim: int = 256
    heads: int = 4
    layers: int = 8
    seq: int = 64
    microbatch: int = 8
    microbatches: int = 8

    def model(self) -> TinyGPT:
        torch.manual_seed(0)
        return TinyGPT(self.vocab, self.dim, self.heads, self.layers, self.seq)

    def batch(self, step: int):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, self.vocab, (self.microbatch * self.microbatches, self.seq + 1),
                               generator=g, device="cpu")   # the benchmark runs gloo on the CPU
        return tokens[:, :-1], tokens[:, 1:]

    @property
    def activation_bytes(self) -> int:
        return self.microbatch * self.seq * self.dim * 4


def time_stage(stage, tokens, targets, dim: int, repeats: int = 5) -> tuple[float, float]:
    """Median forward and backward seconds of one stage on one microbatch (after one warm-up)."""
    x = tokens if stage.first else torch.randn(*tokens.shape, dim, requires_grad=True,
                                               device=tokens.device)
    f, b = [], []
    for i in range(repeats + 1):
        start = time.perf_counter()
        out = stage(x, targets if stage.last else None)
        mid = time.perf_counter()
        out.backward(None if stage.last else torch.ones_like(out))
        end = time.perf_counter()
        if i:
            f.append(mid - start)
            b.append(end - mid)
    return statistics.median(f), statistics.median(b)


def _stage_timer(shape: Shape, stages: int, rank: int, pp: int):
    """Times this rank's stages of the model cut in `stages`: {stage: (forward s, backward s)}."""
    modules = split_stages(shape.model(), stages)
    tokens, targets = (t[:shape.microbatch] for t in shape.batch(0))

    def timed() -> dict[int, tuple[float, float]]:
        out = {s: time_stage(modules[s], tokens, targets, shape.dim)
               for s in range(rank, stages, pp)}
        for p in (p for m in modules for p in m.parameters()):
            p.grad = None
        return out

    return timed


def _ours(shape: Shape, name: str, pp: int, v: int):
    schedule = build(name, pp, shape.microbatches, v)
    model = shape.model()
    stages = split_stages(model, schedule.stages)
    rank = dist.get_rank()
    runner = PipelineRunner({s: stages[s] for s in schedule.stages_of(rank)}, schedule,
                            stats=Stats())

    def step(tokens, targets):
        runner.step(tokens, targets)
        return [(str(a), start, end) for a, start, end in runner.timeline]

    return step, runner.parameters()


def _torch(shape: Shape, name: str, pp: int, v: int):
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    n = pp * (v if name == "interleaved" else 1)
    model, rank = shape.model(), dist.get_rank()
    mine = [s for s in range(n) if s % pp == rank]
    modules = split_stages(model, n)
    stages = [PipelineStage(modules[s], s, n, torch.device("cpu")) for s in mine]

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    m = shape.microbatches
    if name == "interleaved":
        schedule = ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn)
    else:
        schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name](stages[0], m, loss_fn)

    def step(tokens, targets):
        args = (tokens,) if 0 in mine else ()
        schedule.step(*args, target=targets if n - 1 in mine else None)
        return []   # torch's schedules keep no per-action timestamps

    return step, [p for s in mine for p in modules[s].parameters()]


def _timed(step, params, tokens, targets) -> dict:
    """One step from a barrier, on every rank: {"step_s": slowest rank's end - first start,
    "timelines": per rank [(action, start, end)] relative to that first start}."""
    dist.barrier()
    start = time.perf_counter()
    timeline = step(tokens, targets)
    mine = (start, time.perf_counter(), timeline)
    for p in params:
        p.grad = None
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    t0 = min(s for s, _, _ in every)
    return {"step_s": max(e for _, e, _ in every) - t0,
            "timelines": [[(a, s - t0, e - t0) for a, s, e in tl] for _, _, tl in every]}


def _stage_round(timers: dict) -> dict[int, dict[int, tuple[float, float]]]:
    """The ranks time their stages one after another, each alone on the machine (the
    simulator shares the cores between ranks itself); per cut, every stage's (forward,
    backward) seconds."""
    out, rank = {}, dist.get_rank()
    for n, timer in timers.items():
        mine = {}
        for turn in range(dist.get_world_size()):
            dist.barrier()
            if turn == rank:
                mine = timer()
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        out[n] = {s: t for part in every for s, t in part.items()}
    return out


def _machine_busy_s() -> float:
    """CPU seconds all of this machine's cores have spent busy since boot (/proc/stat)."""
    with open("/proc/stat", encoding="ascii") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")   # less idle, iowait


def _own_cpu_s() -> float:
    from ..cluster.calibrate import own_cpu_s

    return own_cpu_s()


class Background:
    """Cores other processes keep busy (the machine's busy time less our ranks', per second),
    over a stretch every rank brackets with `start()` and `stop()`."""

    def start(self) -> None:
        dist.barrier()
        self.wall, self.machine, self.own = time.perf_counter(), _machine_busy_s(), _own_cpu_s()

    def stop(self) -> float:
        own = torch.tensor([_own_cpu_s() - self.own], dtype=torch.float64, device="cpu")
        dist.all_reduce(own)
        return (_machine_busy_s() - self.machine - own.item()) / (time.perf_counter() - self.wall)


def wait_for_quiet(cores: float, max_wait_s: float) -> float:
    """Wait (up to `max_wait_s`) until other processes keep fewer than `cores` cores busy over a
    second; returns the last second's figure. Every rank calls it."""
    meter, deadline = Background(), time.perf_counter() + max_wait_s
    while True:
        meter.start()
        time.sleep(1.0)
        busy = meter.stop()
        if busy < cores or time.perf_counter() > deadline:
            return busy


def run_rank(rank: int, world_size: int, shape: Shape, names: list[str], v: int,
             rounds: int, torch_peer: bool, quiet: tuple[float, float] = (0.3, 60.0)) -> dict:
    """Build every system, warm each up, then per round: wait for a quiet machine (`quiet`:
    cores other processes may use, seconds to wait at most), every rank times its own stages on
    one microbatch (the simulator's compute), then one step of each system (interleaved, so
    drifts hit all alike). Returns {"stages": per round `_stage_round`, "background": per round
    the cores others used, "<system>/<schedule>": per round `_timed`}."""
    systems = {}
    for name in names:
        systems[f"ours/{name}"] = _ours(shape, name, world_size, v)
        if torch_peer:
            systems[f"torch/{name}"] = _torch(shape, name, world_size, v)
    timers = {n: _stage_timer(shape, n, rank, world_size)
              for n in sorted({world_size, world_size * v})}
    tokens, targets = shape.batch(0)
    for step, params in systems.values():
        for _ in range(2):
            _timed(step, params, tokens, targets)
    out: dict = {key: [] for key in [*systems, "stages", "background"]}
    meter = Background()
    for _ in range(rounds):
        wait_for_quiet(*quiet)
        meter.start()
        out["stages"].append(_stage_round(timers))
        for key, (step, params) in systems.items():
            out[key].append(_timed(step, params, tokens, targets))
        out["background"].append(meter.stop())
    return out


def link_fit(rank: int, world_size: int, nbytes: int):
    """This world's send/recv fitted to alpha + bytes / beta around `nbytes` (calibrate's
    timing and fit)."""
    from ..cluster.calibrate import fit_points, time_points

    sizes = [nbytes // 4, nbytes, 4 * nbytes, 16 * nbytes]
    points = time_points(dist.group.WORLD, world_size, sizes, repeats=15,
                         collectives=("send_recv",))
    return fit_points("send_recv", world_size, points["send_recv"]).link()


def message_overhead(world_size: int, shape: Shape, actions: int = 40, lag: int = 2,
                     repeats: int = 9, quiet: tuple[float, float] = (0.3, 60.0)) -> dict:
    """LogP's o on this world's busy ranks, for pipeline.simulate's `message_overhead_s`,
    measured apart from any schedule: every rank runs the same loop of one GPT block's forward
    on a microbatch, with and without exchanging an activation-sized message per action
    (`_message_trial`), alternately. Every rank computing all along, the simulator would
    replay a loop as (compute + o x its messages' ends) / rate, rate = min(1, cores / ranks):
    so o = the extra wall time per rank x rate / (messages it sends + receives). Returns
    {"overhead_s": o (median over repeats, mean over ranks), "cpu_s": the extra CPU seconds
    (all threads, gloo's too) per message end, "per_rank_s": each rank's o, "inside": the
    share of the extra time that fell inside the actions' timed intervals, which the runner's
    timeline counts as busy (the rest, posting and waiting for receives, it counts as idle)}."""
    from ..cluster.calibrate import message_overhead as measure

    torch.manual_seed(0)
    block = shape.model().blocks.layers[0]
    x = torch.randn(shape.microbatch, shape.seq, shape.dim, device="cpu")   # gloo on the CPU
    return measure(None, world_size, block, x, actions, lag, repeats,
                   before_repeat=lambda: wait_for_quiet(*quiet))
