"""Replay a pipeline schedule with per-stage compute times and alpha-beta links: step time,
each rank's busy time and bubble, the bytes each rank sends, and the timeline.

    sim = simulate(one_f_one_b(4, 8), forward_s=[1e-3] * 4, link=Link(100, 5),
                   activation_bytes=mb * seq * dim * 4)
    sim.step_s, sim.bubble

The replay is schedule.replay, the one the validator runs: a rank takes its actions in order; an
action starts when the rank is free and its input has arrived, `alpha + bytes / beta` after the
sending action ended when the stages are on different ranks (cost.seconds with SEND_RECV's one
message); sends do not hold the sender. Transfers do not contend for a link. By default compute
does not slow while a rank sends: an accelerator with its own copy engines and NIC. On CPU ranks
a message also costs CPU on both sides (gloo's threads copy it through a socket, posting a
receive takes the pair's lock): `message_overhead_s`, LogP's o, is charged to an action once for
each message it receives from and sends to another rank, before its compute. Pure: no torch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ...cluster.topology import Link
from ...comm.wire import SEND_RECV
from ...estimate.cost import seconds
from .schedule import Action, Schedule, inputs_of, replay


@dataclass(frozen=True)
class Simulation:
    step_s: float
    busy_s: tuple[float, ...]          # per rank: seconds computing (message overhead not)
    sent_bytes: tuple[int, ...]        # per rank: activations and gradients sent
    timeline: tuple[tuple[int, float, float, Action], ...] = field(repr=False)
    overhead_s: tuple[float, ...] = ()   # per rank: seconds spent on message overhead

    @property
    def bubbles(self) -> tuple[float, ...]:
        """Per rank, the fraction of the step it does not compute: idle, or (with
        `message_overhead_s`) moving messages."""
        return tuple(1.0 - b / self.step_s if self.step_s else 0.0 for b in self.busy_s)

    @property
    def bubble(self) -> float:
        """The ranks' mean idle fraction: (p - 1) / (m + p - 1) for GPipe and 1F1B with equal
        stages and free links."""
        return sum(self.bubbles) / len(self.bubbles)


def p2p_bytes(schedule: Schedule, activation_bytes: int) -> list[int]:
    """Per rank, the bytes one step sends: an F's output to the next stage and a B's input
    gradient to the previous one, when that stage is on another rank (every boundary carries
    `activation_bytes`, the activation of one microbatch). The runtime's counters show these."""
    return [n * SEND_RECV.sent(activation_bytes, 2) for n in _boundary_sends(schedule)]


@functools.lru_cache(maxsize=256)
def _boundary_sends(schedule: Schedule) -> tuple[int, ...]:
    """Per rank, how many of its actions send to another rank (once per schedule: a mesh
    search prices thousands of candidates on a few schedules)."""
    sent = [0] * schedule.pp
    for r, actions in enumerate(schedule.ranks):
        for a in actions:
            peer = _peer(schedule, a)
            sent[r] += peer is not None and schedule.rank_of(peer) != r
    return tuple(sent)


def _peer(schedule: Schedule, a: Action) -> int | None:
    """The stage an action sends to, if any."""
    if a.kind == "F" and a.stage < schedule.stages - 1:
        return a.stage + 1
    if a.kind == "B" and a.stage > 0:
        return a.stage - 1
    return None


def durations(schedule: Schedule, forward_s: Sequence[float],
              backward_s: Sequence[float] | None = None,
              weight_s: Sequence[float] | None = None) -> dict[str, list[float]]:
    """Per kind, per stage seconds. Backward defaults to twice the forward (two matmuls per
    forward one); when the schedule splits it, W takes `weight_s` (default half the backward)
    and B the rest."""
    if len(forward_s) != schedule.stages:
        raise ValueError(f"forward_s has {len(forward_s)} entries for {schedule.stages} stages")
    backward = list(backward_s) if backward_s is not None else [2 * f for f in forward_s]
    weight = list(weight_s) if weight_s is not None else [b / 2 for b in backward]
    if len(backward) != schedule.stages or len(weight) != schedule.stages:
        raise ValueError(f"backward_s and weight_s need {schedule.stages} entries")
    split = any(a.kind == "W" for actions in schedule.ranks for a in actions)
    return {"F": list(forward_s),
            "B": [b - w for b, w in zip(backward, weight)] if split else backward,
            "W": weight}


def shared_replay(schedule: Schedule, duration: Callable[[Action], float],
                  delay: Callable[[Action, Action], float], processors: int
                  ) -> dict[Action, tuple[int, float, float]]:
    """`schedule.replay` for ranks that share `processors` processors (more ranks than cores):
    while k ranks compute, each advances at min(1, processors / k) of its own speed, as a
    scheduler shares cores between busy processes. Advances from event to event (an action
    ending, an input arriving), so it is exact for that model."""
    return _shared(schedule, duration, delay, processors, lambda a: 0.0)[0]


def _shared(schedule: Schedule, duration, delay, processors: int,
            overhead: Callable[[Action], float]):
    """shared_replay, and per action the wall seconds spent on its first `overhead(a)` seconds
    of work (its messages' overhead, done before its compute): with the processors shared,
    that wall time is not the work, and the compute is the rest."""
    pending = {r: 0 for r in range(schedule.pp)}   # rank -> index of its next action
    running: dict[int, list] = {}  # rank -> [action, start, work left, overhead left, its wall]
    done: dict[Action, tuple[int, float, float]] = {}
    spent: dict[Action, float] = {}
    now = 0.0
    while True:
        wake = _start_ready(schedule, pending, running, done, delay, duration, overhead, now)
        if not running:
            if wake == float("inf"):
                break
            now = wake
            continue
        rate = min(1.0, processors / len(running))
        least = min(item[2] for item in running.values())
        until = min(now + least / rate, wake)
        for r, item in list(running.items()):
            work = (until - now) * rate
            on_overhead = min(work, item[3])
            item[2], item[3], item[4] = item[2] - work, item[3] - on_overhead, (
                item[4] + on_overhead / rate)
            if item[2] <= 1e-12 * max(1.0, least):
                done[item[0]], spent[item[0]] = (r, item[1], until), item[4]
                del running[r]
                pending[r] += 1
        now = until
    stuck = [r for r, i in pending.items() if i < len(schedule.ranks[r])]
    if stuck:   # the same lists deadlock in `replay`, which names where
        replay(schedule, duration, delay)
    return done, spent


def _start_ready(schedule, pending, running, done, delay, duration, overhead, now) -> float:
    """Start every idle rank whose next action's inputs have arrived by `now`; return the
    earliest later arrival (inf if none)."""
    wake = float("inf")
    for r, i in pending.items():
        if r in running or i >= len(schedule.ranks[r]):
            continue
        a = schedule.ranks[r][i]
        deps = inputs_of(a, schedule.stages)
        if any(d not in done for d in deps):
            continue
        arrive = max([done[d][2] + (delay(d, a) if done[d][0] != r else 0.0) for d in deps],
                     default=0.0)
        if arrive <= now:
            running[r] = [a, now, duration(a), overhead(a), 0.0]
        else:
            wake = min(wake, arrive)
    return wake


def messages(schedule: Schedule, a: Action) -> int:
    """How many messages `a` receives from and sends to other ranks (0, 1 or 2): its input
    from the neighbouring stage and its output to it, when that stage is on another rank."""
    r = schedule.rank_of(a.stage)
    peers = [d.stage for d in inputs_of(a, schedule.stages) if d.stage != a.stage]
    sent = _peer(schedule, a)
    peers += [sent] if sent is not None else []
    return sum(schedule.rank_of(s) != r for s in peers)


@functools.lru_cache(maxsize=256)
def _message_counts(schedule: Schedule) -> dict[Action, int]:
    """`messages` of every action, once per schedule (read only)."""
    return {a: messages(schedule, a) for actions in schedule.ranks for a in actions}


def simulate(schedule: Schedule, forward_s: Sequence[float],
             backward_s: Sequence[float] | None = None, link: Link | None = None,
             activation_bytes: int = 0, weight_s: Sequence[float] | None = None,
             processors: int | None = None, message_overhead_s: float = 0.0) -> Simulation:
    """Replay `schedule` with these per-stage seconds (see `durations`) and, between stages on
    different ranks, `link` (None: free) carrying `activation_bytes` per microbatch boundary.
    `processors`: fewer than the ranks share them (`shared_replay`); None: one per rank.
    `message_overhead_s`: CPU seconds each message costs the rank sending it and, again, the
    rank receiving it (`messages`), taken by the action that sends or receives it; it delays
    the action and what waits for it, and is not counted as computing (`busy_s`)."""
    times = durations(schedule, forward_s, backward_s, weight_s)
    hop = 0.0 if link is None else seconds(SEND_RECV.sent(activation_bytes, 2), link,
                                           SEND_RECV.messages(2))
    overhead = {a: message_overhead_s * n for a, n in _message_counts(schedule).items()}
    args = (schedule, lambda a: times[a.kind][a.stage] + overhead[a], lambda src, dst: hop)
    if processors is not None and processors < schedule.pp:
        done, spent = _shared(*args, processors, overhead.__getitem__)
    else:
        done, spent = replay(*args), overhead
    busy, messaging = [0.0] * schedule.pp, [0.0] * schedule.pp
    for a, (r, start, end) in done.items():
        busy[r] += end - start - spent[a]
        messaging[r] += spent[a]
    timeline = tuple(sorted(((r, s, e, a) for a, (r, s, e) in done.items()),
                            key=lambda t: (t[0], t[1])))
    return Simulation(max((e for _, _, e in done.values()), default=0.0), tuple(busy),
                      tuple(p2p_bytes(schedule, activation_bytes)), timeline, tuple(messaging))
