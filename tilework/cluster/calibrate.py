"""Calibration: time real collectives on this world and fit the alpha-beta model to them.

    tilework calibrate --cluster cluster.toml [-n N] [--quick]

Each collective is timed over a range of buffer sizes (median of `repeats` after a warm-up) and
`t = alpha + bytes / beta` is fitted, where `bytes` is what one rank sends by the cost model's
definitions (`WIRE`): a ring all-reduce sends 2(n-1)/n of its buffer, an evenly split
all-to-all sends (n-1)/n of it to the others, a send sends all of it. Rank 0 then writes the
all-reduce fit into the cluster file as the link the world's ranks span (`links.inter` when they
are on several hosts, else `links.intra`), with `latency_us` per message (alpha over the
2(n-1) messages `cost.ring_allreduce` counts, so the planner reproduces the fitted time), and
every collective's fit into `<cluster stem>.calibration.json` beside it.

Alpha is what a small call costs busy ranks, as a step's exchanges fall between its compute: the
extra time `SMALL_CALLS` calls on the smallest buffer add to a loop of short computes (the
median of `SMALL_BLOCKS` blocks, so a burst of load elsewhere is dropped), the fit passing
through that point; beta is the least-squares slope of the sweep, so the large sizes decide it
(a small call lost in noise falls back to the least-squares intercept). (An ordinary least-
squares intercept, as before, let the large sizes decide alpha too: on CPU ranks it came out
anywhere from 0 to 0.94 ms a message between runs, where a 4 KB all-reduce after compute cost
0.9-2.2 ms a call; the median of single calls timed from a barrier misses the slow mode of calls
that are bimodal on few cores, which a step pays on average. Weighting by 1/t, to give small
sizes a say, was tried and fails on shaped links: a tbf bucket lets the first ~125 KB through
unshaped, so small sizes look fast, and a relative fit took beta from them: 1.5 to 9 times too
high for large messages; see docs/comm-model.md.)

`python -m tilework.cluster.calibrate` is a bare worker (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
in the environment, gloo over TCP) for benchmarks that start processes themselves, e.g. inside
emulated hosts; it writes rank 0's results as JSON.
"""

from __future__ import annotations

import datetime
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..checkpoint.atomic import write_atomic
from ..comm.wire import COLLECTIVES as ON_WIRE
from ..errors import UserError
from ..estimate import cost

# The calibration file beside the cluster file: written and read in calibration_file.py.
from .calibration_file import (  # noqa: F401, E402
    calibrated_flops,
    calibration_path,
    summary,
    write_calibration,
)
from .topology import Link

KB, MB = 1 << 10, 1 << 20
DEFAULT_SIZES = (4 * KB, 16 * KB, 64 * KB, 256 * KB, 1 * MB, 4 * MB, 16 * MB)
DEFAULT_REPEATS = 5
QUICK_SIZES = (4 * KB, 64 * KB, 1 * MB, 4 * MB)
QUICK_REPEATS = 3
SMALL_CALLS = 40    # calls a block between short computes, timing alpha (`time_small_calls`)
SMALL_BLOCKS = 3
COLLECTIVES = ("all_reduce", "all_to_all", "send_recv", "reduce_scatter", "all_gather",
               "ring_shift")


# The collectives calibration times, by the wire table's definitions of bytes and messages (a
# send/recv between two ranks is one message, timed as half a round trip).
WIRE = {name: ON_WIRE[name] for name in COLLECTIVES}


class CalibrationError(UserError):
    """The timings do not determine a model (e.g. times that do not grow with the size)."""


def fit_alpha_beta(sizes_bytes, seconds, small: tuple[float, float] | None = None
                   ) -> tuple[float, float]:
    """(alpha in s, beta in bytes/s) of `t = alpha + bytes / beta`: beta from the ordinary
    least-squares slope of the points (the large sizes decide it), alpha from the intercept,
    or, given `small` = (bytes, seconds) of a small call (`time_small_calls`), from that point
    (alpha = seconds - bytes / beta). alpha is clamped at 0 (refitting beta alone, through the
    origin) since a latency cannot be negative; times that do not grow with the size raise
    ValueError, as does an unusable `small`."""
    x = np.asarray(sizes_bytes, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    if x.shape != t.shape or x.ndim != 1:
        raise ValueError("sizes and seconds must be two equal-length lists, "
                         f"got {x.shape} and {t.shape}")
    if len(np.unique(x)) < 2:
        raise ValueError("need points at two or more distinct sizes")
    if not (np.all(np.isfinite(t)) and np.all(t > 0) and np.all(np.isfinite(x)) and np.all(x >= 0)):
        raise ValueError("sizes must be finite and >= 0, seconds finite and > 0")
    design = np.stack([np.ones_like(x), x], axis=1)
    (alpha, inv_beta), *_ = np.linalg.lstsq(design, t, rcond=None)
    if small is not None:
        x0, t0 = (float(v) for v in small)
        if not (np.isfinite(x0) and x0 >= 0 and np.isfinite(t0) and t0 > 0):
            raise ValueError(f"the small call must be (bytes >= 0, seconds > 0), got {small}")
        alpha = t0 - x0 * inv_beta
    if alpha < 0:
        alpha = 0.0
        inv_beta = float(np.sum(x * t) / np.sum(x * x))
    if not inv_beta > 0:
        raise ValueError("the times do not grow with the size, so they give no bandwidth "
                         f"(sizes {x.tolist()} bytes, seconds {t.tolist()}); use larger sizes")
    return float(alpha), float(1.0 / inv_beta)


@dataclass(frozen=True)
class Measurement:
    """One collective timed on `world_size` ranks: the points and their alpha-beta fit."""

    collective: str
    world_size: int
    buffer_bytes: tuple[int, ...]
    wire_bytes: tuple[int, ...]      # what one rank sends per call (the cost model's bytes)
    seconds: tuple[float, ...]       # median per size
    alpha_s: float
    bytes_per_s: float
    # (buffer bytes, wire bytes, extra mean seconds) of small calls between computes: alpha
    small_call: tuple[int, int, float] | None = None

    @property
    def points(self) -> list[tuple[int, float]]:
        return list(zip(self.wire_bytes, self.seconds))

    @property
    def messages(self) -> int:
        return WIRE[self.collective].messages(self.world_size)

    @property
    def alpha_us(self) -> float:
        return self.alpha_s * 1e6

    @property
    def bandwidth_gbps(self) -> float:
        return self.bytes_per_s * 8 / 1e9

    def link(self) -> Link:
        """The fit as a cost-model link: latency per message, so `cost.seconds(bytes, link,
        self.messages)` is the fitted time."""
        return Link(bandwidth_gbps=self.bandwidth_gbps, latency_us=self.alpha_us / self.messages)

    def predict(self, buffer_bytes: int, link: Link | None = None) -> float:
        """Seconds the cost model gives one call on a buffer of `buffer_bytes` (on `link`, by
        default this fit's own)."""
        wire = WIRE[self.collective].sent(buffer_bytes, self.world_size)
        return cost.seconds(wire, link or self.link(), self.messages)

    @classmethod
    def from_dict(cls, collective: str, d: dict[str, Any]) -> "Measurement":
        """The inverse of `as_dict` (what the worker and the calibration JSON hold)."""
        pts = d["points"]
        small = d.get("small_call")
        return cls(collective, d["world_size"], tuple(p["buffer_bytes"] for p in pts),
                   tuple(p["wire_bytes"] for p in pts), tuple(p["seconds"] for p in pts),
                   d["alpha_us"] * 1e-6, d["bandwidth_gbps"] * 1e9 / 8,
                   None if small is None else
                   (small["buffer_bytes"], small["wire_bytes"], small["seconds"]))

    def as_dict(self) -> dict[str, Any]:
        out = {"world_size": self.world_size, "messages": self.messages,
               "alpha_us": self.alpha_us, "bandwidth_gbps": self.bandwidth_gbps,
               "latency_us_per_message": self.alpha_us / self.messages,
               "points": [{"buffer_bytes": b, "wire_bytes": w, "seconds": s}
                          for b, w, s in zip(self.buffer_bytes, self.wire_bytes, self.seconds)]}
        if self.small_call is not None:
            b, w, s = self.small_call
            out["small_call"] = {"buffer_bytes": b, "wire_bytes": w, "seconds": s}
        return out


# -- measuring ----------------------------------------------------------------------------------

def _elements(nbytes: int, n: int) -> int:
    """float32 elements for a buffer of about `nbytes`, a multiple of n (even all-to-all splits)."""
    return max(n, (nbytes // 4) // n * n)


def time_points(group, world_size: int, sizes, repeats: int = DEFAULT_REPEATS,
                collectives=COLLECTIVES, warmup: int = 1,
                device=None) -> dict[str, list[tuple[int, int, float]]]:
    """Time each collective on every buffer size in `group` (every rank calls this, with the same
    arguments): {collective: [(buffer bytes, wire bytes, median seconds)]}, the same on every rank.

    A call's time is the slowest rank's, from a barrier to the collective's return; send/recv is
    a ping-pong between group ranks 0 and 1, timed on rank 0 as half the round trip. Buffers are
    float32, rounded down to a multiple of `world_size` elements (the points carry the real size),
    on `device` (default the CPU; a GPU's where the group is NCCL's, which carries no other).
    """
    import torch
    import torch.distributed as dist

    _check_timing_args(group, world_size, collectives, repeats, warmup)
    sizes = sorted({_elements(int(s), world_size) * 4 for s in sizes})
    device = torch.device(device or "cpu")
    call = _call_timer(group, device)
    _open_connections(call, collectives, sizes[0], rounds=3 if warmup else 0, device=device)
    times = torch.zeros(len(collectives), len(sizes), repeats, dtype=torch.float64,
                        device=device)
    for c, name in enumerate(collectives):
        times[c] = _time_sizes(call, name, sizes, repeats, warmup, device)
    # Every rank must report the same points, and a call is only as fast as its slowest rank.
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    return {name: [(b, WIRE[name].sent(b, world_size), statistics.median(times[c, s].tolist()))
                   for s, b in enumerate(sizes)]
            for c, name in enumerate(collectives)}


def _check_timing_args(group, world_size: int, collectives, repeats: int, warmup: int) -> None:
    import torch.distributed as dist

    if world_size < 2:
        raise ValueError(f"calibration needs at least 2 ranks, got {world_size}")
    if dist.get_world_size(group) != world_size:
        raise ValueError(f"world_size {world_size} but the group has "
                         f"{dist.get_world_size(group)} ranks")
    unknown = sorted(set(collectives) - set(WIRE))
    if unknown:
        raise ValueError(f"unknown collective {unknown[0]!r} (expected one of {', '.join(WIRE)})")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats} and {warmup}")


def _issuer(group):
    """`issue(name, send, recv) -> share`: one call of a collective in `group`, and the share
    of its elapsed time that is the call's on this rank (send/recv is a ping-pong between
    group ranks 0 and 1, timed on rank 0 as half the round trip: 1/2 there, 0 elsewhere)."""
    import torch.distributed as dist

    from ..comm.counted import Stats, all_gather_async, reduce_scatter_async

    me, size = dist.get_rank(group), dist.get_world_size(group)
    peer = {0: dist.get_global_rank(group, 1), 1: dist.get_global_rank(group, 0)}.get(me)
    following = dist.get_global_rank(group, (me + 1) % size)
    preceding = dist.get_global_rank(group, (me - 1) % size)

    def issue(name: str, send, recv) -> float:
        if name == "all_reduce":
            dist.all_reduce(send, group=group)
        elif name == "all_to_all":
            dist.all_to_all_single(recv, send, group=group)
        elif name == "reduce_scatter":
            reduce_scatter_async(send, group, Stats(), "calibrate").wait()
        elif name == "all_gather":   # `send` is this rank's part
            all_gather_async(send, group, Stats(), "calibrate").wait()
        elif name == "ring_shift":   # as parallel/context/comm.py passes ring attention's blocks
            works = [dist.isend(send, following, group=group),
                     dist.irecv(recv, preceding, group=group)]
            for work in works:
                work.wait()
        elif me == 0:
            dist.send(send, dst=peer)
            dist.recv(recv, src=peer)
            return 0.5
        elif me == 1:
            dist.recv(recv, src=peer)
            dist.send(recv, dst=peer)
            return 0.0   # rank 0 times the round trip
        else:
            return 0.0
        return 1.0

    return issue


def _call_timer(group, device):
    """`call(name, send, recv) -> seconds`: one call of a collective in `group`, timed from a
    barrier (so that every rank starts together) to its return on this rank (on a GPU, to its
    end: NCCL's calls return once queued)."""
    import torch.distributed as dist

    issue, done = _issuer(group), _finisher(device)

    def call(name: str, send, recv) -> float:
        dist.barrier(group=group)
        done()
        start = time.perf_counter()
        share = issue(name, send, recv)
        done()
        return (time.perf_counter() - start) * share

    return call


def _finisher(device):
    """`done()`: waits for `device`'s queued work (a GPU's); nothing on the CPU."""
    import torch

    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _open_connections(call, collectives, nbytes: int, rounds: int, device) -> None:
    """Connections and buffers come up on the first calls, which a per-size warm-up of one
    would charge to the smallest size: a few untimed calls of each collective first."""
    import torch

    first = torch.ones(nbytes // 4, device=device)
    for name in collectives:
        for _ in range(rounds):
            call(name, first, torch.empty_like(first))


def _time_sizes(call, name: str, sizes, repeats: int, warmup: int, device):
    """Seconds of `repeats` calls of collective `name` on each size: a [size, repeat] tensor."""
    import torch

    times = torch.zeros(len(sizes), repeats, dtype=torch.float64, device=device)
    buffers = [(torch.ones(nbytes // 4, device=device), torch.empty(nbytes // 4, device=device))
               for nbytes in sizes]
    for send, recv in buffers:
        for _ in range(warmup):
            call(name, send, recv)
    # Sizes interleaved within each round: a burst of load elsewhere on the machine then
    # slows one round of every size, which the median drops, not every repeat of one size.
    for r in range(repeats):
        for s, (send, recv) in enumerate(buffers):
            times[s, r] = call(name, send, recv)
    return times


def time_small_calls(group, world_size: int, nbytes: int = DEFAULT_SIZES[0],
                     collectives=COLLECTIVES, calls: int = SMALL_CALLS,
                     blocks: int = SMALL_BLOCKS,
                     device=None) -> dict[str, tuple[int, int, float]]:
    """What a small call costs busy ranks, as a step's exchanges fall between its compute
    (every rank calls this, with the same arguments): `calls` rounds of a short compute (about
    `SMALL_COMPUTE_S` of matmuls) each followed by one call on a buffer of about `nbytes`,
    against the same rounds without the calls; {collective: (buffer bytes, wire bytes, the
    extra mean seconds a call)}, the median of `blocks` blocks, each block's the slowest
    rank's; the same on every rank. A mean over many calls, not the median of single calls
    from a barrier: on few cores a small call is bimodal (about 0.3 ms or 3 ms here) and a
    step pays the mixture; and after compute, as in a step, not back to back (which measured
    twice as slow on CPU ranks here). On `device` (time_points's)."""
    import torch
    import torch.distributed as dist

    _check_timing_args(group, world_size, collectives, calls, 0)
    if blocks < 1:
        raise ValueError(f"blocks must be >= 1, got {blocks}")
    size = _elements(int(nbytes), world_size) * 4
    device = torch.device(device or "cpu")
    issue, done = _issuer(group), _finisher(device)
    send, recv = torch.ones(size // 4, device=device), torch.empty(size // 4, device=device)
    compute = _small_compute(group, device)
    # [talking, quiet] per collective and block: each the slowest rank's, then subtracted,
    # so that a slow rank's longer computes (which the fast ranks wait for when they talk) are
    # not taken for the calls' cost: the planner prices a slow rank by its pace.
    times = torch.zeros(2, len(collectives), blocks, dtype=torch.float64, device=device)
    for c, name in enumerate(collectives):
        for _ in range(3):   # connections and buffers come up on the first calls
            issue(name, send, recv)
        for b in range(blocks):
            dist.barrier(group=group)
            start, share = time.perf_counter(), 0.0
            for _ in range(calls):
                compute()
                share = issue(name, send, recv)
            done()
            times[0, c, b] = (time.perf_counter() - start) * share
            dist.barrier(group=group)
            done()
            start = time.perf_counter()
            for _ in range(calls):
                compute()
            done()
            times[1, c, b] = (time.perf_counter() - start) * share
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    extra = (times[0] - times[1]).clamp(min=0.0) / calls
    return {name: (size, WIRE[name].sent(size, world_size), statistics.median(extra[c].tolist()))
            for c, name in enumerate(collectives)}


SMALL_COMPUTE_S = 0.5e-3


def _small_compute(group, device):
    """`compute()`: about SMALL_COMPUTE_S of 128 x 128 matmuls on every rank (the count is the
    largest any rank needs, so every rank runs the same)."""
    import torch
    import torch.distributed as dist

    a, done = torch.randn(128, 128, device=device), _finisher(device)
    for _ in range(3):   # a GPU's first products load its kernels
        a @ a
    done()
    start = time.perf_counter()
    for _ in range(20):
        a @ a
    done()
    each = (time.perf_counter() - start) / 20
    count = torch.tensor([max(1, round(SMALL_COMPUTE_S / each))], dtype=torch.int64,
                         device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    rounds = int(count.item())

    def compute() -> None:
        for _ in range(rounds):
            a @ a

    return compute


def measure(group, world_size: int, sizes=DEFAULT_SIZES, repeats: int = DEFAULT_REPEATS,
            collectives=COLLECTIVES, warmup: int = 1, device=None) -> dict[str, Measurement]:
    """`time_points` and `time_small_calls` (on the smallest size), then each collective's
    alpha-beta fit (at least two sizes). Every rank returns the same result. A collective
    other than the all-reduce (whose fit is the link) whose times give no fit (a burst of
    load) is left out: ZeRO's exchanges then keep a factor of 1 rather than stop the
    calibration. On `device` (time_points's)."""
    small = time_small_calls(group, world_size, min(sizes), collectives, device=device)
    out = {}
    for name, pts in time_points(group, world_size, sizes, repeats, collectives,
                                 warmup, device).items():
        try:
            out[name] = fit_points(name, world_size, pts, small[name])
        except CalibrationError:
            if name == "all_reduce":
                raise
    return out


def fit_points(collective: str, world_size: int, points,
               small: tuple[int, int, float] | None = None) -> Measurement:
    """The Measurement of `time_points`' points for one collective, alpha from `small` (a
    point of `time_small_calls`) where given."""
    buffers, wire, seconds = (tuple(col) for col in zip(*points))
    try:
        alpha, beta = fit_alpha_beta(wire, seconds, None if small is None else small[1:])
    except ValueError as e:
        if small is None:
            raise CalibrationError(f"{collective}: {e}") from None
        # A small call lost in noise (no extra over the computes): least squares, as before.
        return fit_points(collective, world_size, points)
    return Measurement(collective, world_size, buffers, wire, seconds, alpha, beta, small)


# -- writing the cluster file -------------------------------------------------------------------

def matmul_flops(size: int = 512, repeats: int = 20, device=None) -> float:
    """One thread's fp32 matmul FLOP/s on this machine (what one rank computes with), or a GPU's
    where `device` is one: the compute rate the pipeline simulator and the mesh search time
    stages at."""
    import torch

    device = torch.device(device or "cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    done = _finisher(device)
    try:
        a = torch.randn(size, size, device=device)
        b = torch.randn(size, size, device=device)
        a @ b
        done()
        start = time.perf_counter()
        for _ in range(repeats):
            a @ b
        done()
        return 2 * size**3 * repeats / (time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)


def measure_curve(group, world_size: int, device=None):
    """Every rank's matmul efficiency curve at once (cluster/matmul_curve.py; ranks share the
    host as in training), the slowest rank's rate at each shape: a step waits for it."""
    import torch
    import torch.distributed as dist

    from .matmul_curve import MatmulCurve, measure

    mine = measure(device)
    if world_size < 2:
        return mine
    grid = torch.tensor(mine.flops_per_s, dtype=torch.float64,
                        device=device or torch.device("cpu"))
    dist.all_reduce(grid, op=dist.ReduceOp.MIN, group=group)
    return MatmulCurve(mine.sizes, tuple(tuple(tuple(r) for r in p) for p in grid.tolist()))


def own_cpu_s() -> float:
    """This process's CPU seconds, every thread's (gloo's too)."""
    import resource

    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def message_trial(compute, x, group, world_size: int, actions: int, lag: int, talk: bool):
    """One rank's loop of `actions` calls of `compute(x)`; with `talk`, action i also takes
    the previous rank's message i - lag as its input and sends its output, message i, to the
    next rank, posted as the pipeline runtime posts them (the receive one action ahead, waited
    when the action starts; the send after the compute, waited at the end of the loop). The
    lag keeps the link's latency (the cost model's alpha-beta) off the loop: what remains is
    each message's cost to the ranks. Returns (wall seconds, this process's CPU seconds,
    seconds inside the actions: from the input's arrival to the send's posting)."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank(group)
    nxt = dist.get_global_rank(group, (rank + 1) % world_size) if group is not None \
        else (rank + 1) % world_size
    prv = dist.get_global_rank(group, (rank - 1) % world_size) if group is not None \
        else (rank - 1) % world_size
    incoming, sends, last = {}, [], actions - lag   # messages 0 .. last - 1

    def post(i: int) -> None:
        if talk and lag <= i < actions and i not in incoming:
            buffer = torch.empty_like(x)
            incoming[i] = (dist.irecv(buffer, prv, group=group, tag=i - lag), buffer)

    dist.barrier(group=group)
    wall, cpu, inside = time.perf_counter(), own_cpu_s(), 0.0
    for i in range(actions):
        post(i)
        post(i + 1)
        inp = x
        if i in incoming:
            work, inp = incoming.pop(i)
            work.wait()
        start = time.perf_counter()
        with torch.no_grad():
            out = compute(inp)
        if talk and i < last:
            sends.append((dist.isend(out, nxt, group=group, tag=i), out))
        inside += time.perf_counter() - start
    for work, _ in sends:
        work.wait()
    return time.perf_counter() - wall, own_cpu_s() - cpu, inside


def message_overhead(group, world_size: int, compute, x, actions: int = 40, lag: int = 2,
                     repeats: int = 9, before_repeat=None) -> dict:
    """LogP's o on busy ranks (what each message costs a CPU rank at each end beside the
    link's time), measured apart from any schedule: every rank runs the same loop of
    `compute` on `x` (its output shaped as `x`), with and without exchanging one `x`-sized
    message per action (`message_trial`), alternately. Every rank computing all along, the
    pipeline simulator would replay a loop as (compute + o x its messages' ends) / rate,
    rate = min(1, cores / ranks): so o = the extra wall time per rank x rate / (messages it
    sends + receives). Returns {"overhead_s": o (median over repeats, mean over ranks),
    "cpu_s": the extra CPU seconds (all threads, gloo's too) per message end, "per_rank_s":
    each rank's o, "inside": the share of the extra time inside the actions' timed intervals
    (which a runner's timeline counts as busy; the rest, posting and waiting, as idle)}."""
    import os
    import statistics

    import torch.distributed as dist

    ends = 2 * (actions - lag)                        # each rank's sends + receives
    rate = min(1.0, len(os.sched_getaffinity(0)) / world_size)
    for talk in (False, True):                        # warm up: connections, allocator
        message_trial(compute, x, group, world_size, actions, lag, talk)
    wall, cpu, inside = [], [], []
    for _ in range(repeats):
        if before_repeat is not None:
            before_repeat()
        plain = message_trial(compute, x, group, world_size, actions, lag, False)
        talking = message_trial(compute, x, group, world_size, actions, lag, True)
        wall.append((talking[0] - plain[0]) * rate / ends)
        cpu.append((talking[1] - plain[1]) / ends)
        extra = talking[0] - plain[0]
        inside.append((talking[2] - plain[2]) / extra if extra else 0.0)
    mine = (statistics.median(wall), statistics.median(cpu), statistics.median(inside))
    every = [None] * world_size
    dist.all_gather_object(every, mine, group=group)
    return {"overhead_s": statistics.mean(o for o, _, _ in every),
            "cpu_s": statistics.mean(c for _, c, _ in every),
            "inside": min(1.0, max(0.0, statistics.mean(i for _, _, i in every))),
            "per_rank_s": [o for o, _, _ in every], "actions": actions, "lag": lag,
            "message_bytes": x.numel() * x.element_size()}


def measure_compute(group, world_size: int, device=None) -> float:
    """Every rank's matmul FLOP/s at once (ranks share the host as in training; on `device`,
    default the CPU), the slowest rank's: a step waits for it."""
    import torch
    import torch.distributed as dist

    rate = torch.tensor([matmul_flops(device=device)], dtype=torch.float64,
                        device=device or torch.device("cpu"))
    if world_size > 1:
        dist.all_reduce(rate, op=dist.ReduceOp.MIN, group=group)
    return float(rate.item())


# Hosts whose slowest ranks compute within this factor of each other are taken as equal: a
# calibration's noise must not turn an even cluster uneven (issue 27: its plan is unchanged).
SPEED_SPREAD = 1.15


def measure_speeds(group, world_size: int, hosts: list[list[int]],
                   device=None) -> list[float] | None:
    """Every rank's matmul rate at once (as they compute in training; on `device`, default
    the CPU), each host's slowest rank's over the fastest host's: the hosts' relative
    `speed`s, or None where they are within SPEED_SPREAD of each other."""
    import torch
    import torch.distributed as dist

    # The best of three: what interference takes away is noise, what a quota takes is not.
    # Each long enough (about 0.3 s at full speed) to span several scheduler periods: a CPU
    # quota (a cgroup's, a VM's) is enforced per period, and a short run can fit in the
    # runtime one period grants.
    mine = torch.tensor([max(matmul_flops(repeats=100, device=device) for _ in range(3))],
                        dtype=torch.float64, device=device or torch.device("cpu"))
    rates = [mine.clone() for _ in range(world_size)]
    if world_size > 1:
        dist.all_gather(rates, mine, group=group)
    return host_speeds([float(r) for r in rates], hosts)


def host_speeds(rates: list[float], hosts: list[list[int]]) -> list[float] | None:
    """Each host's slowest rank's rate over the fastest host's (two digits), or None where
    the hosts are within SPEED_SPREAD of each other. Pure."""
    per_host = [min(rates[r] for r in ranks) for ranks in hosts]
    if max(per_host) < SPEED_SPREAD * min(per_host):
        return None
    return [float(f"{rate / max(per_host):.2g}") for rate in per_host]


# -- a bare worker for benchmarks ---------------------------------------------------------------

def _sizes_arg(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s.strip()]


def main(argv: list[str] | None = None) -> int:
    """`python -m tilework.cluster.calibrate --sizes A,B --out results.json [--judge C,D]`: time the
    collectives on --sizes and --judge, fit on --sizes only (alpha from calls between computes
    on the smallest of them); rank 0 writes {"fit": ..., "judge":
    ...} to --out."""
    import argparse

    import torch
    import torch.distributed as dist

    from .worker_env import WorkerEnv

    p = argparse.ArgumentParser(prog="python -m tilework.cluster.calibrate")
    p.add_argument("--sizes", type=_sizes_arg, required=True, help="bytes, comma-separated")
    p.add_argument("--judge", type=_sizes_arg, default=[], help="bytes, comma-separated")
    p.add_argument("--repeats", type=int, default=DEFAULT_REPEATS)
    p.add_argument("--collectives", default=",".join(COLLECTIVES))
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    env = WorkerEnv.from_environ()  # this bare worker's entry point: the one read
    rank, world, addr = env.rank, env.world_size, env.master_addr or "127.0.0.1"
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{env.master_port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    collectives = tuple(c for c in a.collectives.split(",") if c)
    # All sizes in one go, interleaved round by round, so that fitted and judged points see the
    # same load on the machine; the fit is then made on --sizes alone.
    points = time_points(dist.group.WORLD, world, [*a.sizes, *a.judge], a.repeats, collectives)
    small = time_small_calls(dist.group.WORLD, world, min(a.sizes), collectives)
    fitted = {_elements(s, world) * 4 for s in a.sizes}
    fit = {name: fit_points(name, world, [p for p in pts if p[0] in fitted], small[name])
           for name, pts in points.items()}
    judged = {name: [p for p in pts if p[0] not in fitted] for name, pts in points.items()}
    if rank == 0:
        out = {"world_size": world,
               "fit": {name: m.as_dict() for name, m in fit.items()},
               "judge": {name: [{"buffer_bytes": b, "wire_bytes": w, "seconds": s}
                                for b, w, s in pts] for name, pts in judged.items()}}
        write_atomic(Path(a.out), json.dumps(out, indent=2) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
