"""Pipeline schedules as data: per rank, the ordered actions `stage, F|B|W, microbatch`.

    >>> s = one_f_one_b(pp=2, m=4)
    >>> print(s)                 # a rank x time table (unit times), "." where a rank idles
    >>> validate(s)              # ValueError naming the first bad action, or None

The same object is executed by the runtime (runtime.py) and replayed by the simulator
(simulate.py), so what is predicted is what ran. An action's string form is "<stage><kind><mb>"
("0F3", "1B0"), as torch.distributed.pipelining writes its `_Action`s. Stage s lives on rank
s % pp, so with v stages per rank (interleaved 1F1B) rank r holds stages r, r + pp, r + 2pp, ...
B is the full backward of a stage (input and weight gradients); a schedule may split it into B
(input gradient, which the previous stage waits for) and W (weight gradient, which nobody waits
for). Pure: no torch.
"""

from __future__ import annotations

import functools
import re
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Callable

KINDS = ("F", "B", "W")
_ACTION = re.compile(r"^(\d+)([FBW])(\d+)$")


@dataclass(frozen=True)
class Action:
    stage: int
    kind: str
    microbatch: int

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"action kind must be one of {'/'.join(KINDS)}, got {self.kind!r}")
        if self.stage < 0 or self.microbatch < 0:
            raise ValueError(f"stage and microbatch must be >= 0, got {self.stage}, "
                             f"{self.microbatch}")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        match = _ACTION.match(text.strip())
        if not match:
            raise ValueError(f"not an action: {text!r} (expected e.g. '0F3': stage, F|B|W, "
                             "microbatch)")
        return cls(int(match[1]), match[2], int(match[3]))


@dataclass(frozen=True)
class Schedule:
    name: str
    pp: int                      # ranks in the pipeline
    stages: int                  # pp * stages per rank
    microbatches: int
    ranks: tuple[tuple[Action, ...], ...]   # ranks[r]: rank r's actions in order

    def __post_init__(self):
        if self.pp < 1 or self.microbatches < 1 or self.stages < 1:
            raise ValueError(f"pp, stages and microbatches must be >= 1, got {self.pp}, "
                             f"{self.stages}, {self.microbatches}")
        if self.stages % self.pp:
            raise ValueError(f"{self.stages} stages do not divide over {self.pp} ranks")
        if len(self.ranks) != self.pp:
            raise ValueError(f"a schedule for {self.pp} ranks needs {self.pp} action lists, "
                             f"got {len(self.ranks)}")

    def rank_of(self, stage: int) -> int:
        return stage % self.pp

    def per_stage(self, values) -> tuple | None:
        """Each stage's value from `values`, one per pp rank (None: None)."""
        return None if values is None else tuple(values[self.rank_of(k)]
                                                 for k in range(self.stages))

    def stages_of(self, rank: int) -> list[int]:
        return list(range(rank, self.stages, self.pp))

    def as_text(self) -> str:
        """One line per rank, its actions separated by spaces (`from_text` reads it back)."""
        return "\n".join(" ".join(map(str, actions)) for actions in self.ranks)

    @classmethod
    def from_text(cls, text: str, pp: int | None = None, stages: int | None = None,
                  microbatches: int | None = None, name: str = "custom") -> "Schedule":
        ranks = tuple(tuple(Action.parse(a) for a in line.split())
                      for line in text.strip().splitlines())
        everything = [a for r in ranks for a in r]
        return cls(name, pp or len(ranks),
                   stages or 1 + max((a.stage for a in everything), default=0),
                   microbatches or 1 + max((a.microbatch for a in everything), default=0), ranks)

    def format(self) -> str:
        """The rank x time table (`format_schedule`)."""
        return format_schedule(self)

    def __str__(self) -> str:
        return format_schedule(self)


# -- dependencies and the replay both the validator and the simulator use --------------------

def inputs_of(action: Action, stages: int) -> list[Action]:
    """What an action waits for: F the previous stage's F (its input activation), B its own F
    (the graph) and the next stage's B (its output gradient), W its own B."""
    s, mb = action.stage, action.microbatch
    if action.kind == "F":
        return [Action(s - 1, "F", mb)] if s > 0 else []
    if action.kind == "B":
        return [Action(s, "F", mb)] + ([Action(s + 1, "B", mb)] if s < stages - 1 else [])
    return [Action(s, "B", mb)]


def replay(schedule: Schedule, duration: Callable[[Action], float],
           delay: Callable[[Action, Action], float] = lambda src, dst: 0.0,
           ) -> dict[Action, tuple[int, float, float]]:
    """Run the ranks' lists as the runtime does: each rank takes its actions in order, an action
    starts when its rank is free and its inputs have arrived (`delay(src, dst)` after `src`
    ends, for inputs from another rank: receives block, sends do not). Returns {action: (rank,
    start, end)}; raises ValueError naming where each stuck rank waits if the lists deadlock.
    Event-driven: a rank blocked on an input is woken when that input's action ends, so times
    do not depend on the order ranks are visited."""
    stages = schedule.stages
    pos, free = [0] * schedule.pp, [0.0] * schedule.pp
    done: dict[Action, tuple[int, float, float]] = {}
    waiting: dict[Action, list[int]] = defaultdict(list)
    ready = deque(range(schedule.pp))
    while ready:
        r = ready.popleft()
        actions = schedule.ranks[r]
        while pos[r] < len(actions):
            a = actions[pos[r]]
            deps = inputs_of(a, stages)
            missing = next((d for d in deps if d not in done), None)
            if missing is not None:
                waiting[missing].append(r)
                break
            arrive = [done[d][2] + (delay(d, a) if done[d][0] != r else 0.0) for d in deps]
            start = max([free[r], *arrive])
            free[r] = start + duration(a)
            done[a] = (r, start, free[r])
            pos[r] += 1
            ready.extend(waiting.pop(a, ()))
    stuck = [r for r in range(schedule.pp) if pos[r] < len(schedule.ranks[r])]
    if stuck:
        raise ValueError("the schedule deadlocks: " + "; ".join(
            _stuck_at(schedule, r, schedule.ranks[r][pos[r]], done) for r in stuck))
    return done


def _stuck_at(schedule: Schedule, r: int, a: Action, done) -> str:
    missing = [d for d in inputs_of(a, schedule.stages) if d not in done]
    return (f"rank {r} waits at {a} for " + ", ".join(
        f"{d} (rank {schedule.rank_of(d.stage)})" for d in missing))


# -- validation --------------------------------------------------------------------------------

def validate(schedule: Schedule) -> None:
    """Raise ValueError naming the first bad action: one outside the schedule's stages and
    microbatches or on the wrong rank; a (stage, microbatch) without exactly one F and one B (or
    with two W); an action placed before an input on its own rank (B before its F, F of stage
    s+1 before F of s, B of s before B of s+1, W before B); or orders that deadlock when
    receives block (replayed with unit times)."""
    seen: dict[Action, tuple[int, int]] = {}
    for r, actions in enumerate(schedule.ranks):
        for i, a in enumerate(actions):
            _check_placement(schedule, r, a)
            if a in seen:
                raise ValueError(f"{a} appears twice (rank {seen[a][0]} position {seen[a][1]}, "
                                 f"rank {r} position {i})")
            seen[a] = (r, i)
    for s in range(schedule.stages):
        for mb in range(schedule.microbatches):
            for kind in "FB":
                if Action(s, kind, mb) not in seen:
                    raise ValueError(f"no {kind} for stage {s}, microbatch {mb} (expected "
                                     f"{Action(s, kind, mb)} on rank {schedule.rank_of(s)})")
    for a, (r, i) in sorted(seen.items(), key=lambda item: item[1]):
        for d in inputs_of(a, schedule.stages):
            if seen[d][0] == r and seen[d][1] > i:
                raise ValueError(f"{a} on rank {r} (position {i}) comes before {d} "
                                 f"(position {seen[d][1]}), which it needs")
    replay(schedule, lambda a: 1.0)


def _check_placement(schedule: Schedule, r: int, a: Action) -> None:
    if a.stage >= schedule.stages or a.microbatch >= schedule.microbatches:
        raise ValueError(f"{a} on rank {r}: outside {schedule.stages} stages x "
                         f"{schedule.microbatches} microbatches")
    if schedule.rank_of(a.stage) != r:
        raise ValueError(f"{a} is on rank {r}, but stage {a.stage} lives on rank "
                         f"{schedule.rank_of(a.stage)} (stage s on rank s % {schedule.pp})")


def in_flight(schedule: Schedule) -> list[int]:
    """Per rank, the most microbatch-stages whose forward activations it holds at once (after
    F, until B, or W when the backward is split): what a schedule costs in memory."""
    split = {(a.stage, a.microbatch) for actions in schedule.ranks for a in actions
             if a.kind == "W"}
    peaks = []
    for actions in schedule.ranks:
        held = peak = 0
        for a in actions:
            releases = "W" if (a.stage, a.microbatch) in split else "B"
            held += 1 if a.kind == "F" else -1 if a.kind == releases else 0
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def format_schedule(schedule: Schedule) -> str:
    """A table, rank rows x time columns, every action one time unit; "." where a rank waits.
    A schedule that does not replay prints its lists and the reason instead."""
    try:
        times = replay(schedule, lambda a: 1.0)
    except ValueError as e:
        return f"{schedule.as_text()}\n({e})"
    end = int(max((t[2] for t in times.values()), default=0))
    grid = [["."] * end for _ in range(schedule.pp)]
    for a, (r, start, _) in times.items():
        grid[r][int(start)] = str(a)
    width = max([len(str(end))] + [len(c) for row in grid for c in row])
    head = f"{schedule.name}: pp={schedule.pp} stages={schedule.stages} m={schedule.microbatches}"
    lines = [head, "t".ljust(7) + " ".join(str(t).rjust(width) for t in range(end))]
    lines += [f"rank {r}".ljust(7) + " ".join(c.rjust(width) for c in row)
              for r, row in enumerate(grid)]
    return "\n".join(lines)


# -- builders ------------------------------------------------------------------------------------

def _check(pp: int, m: int) -> None:
    if pp < 1 or m < 1:
        raise ValueError(f"pp and microbatches must be >= 1, got pp={pp}, m={m}")


def gpipe(pp: int, m: int) -> Schedule:
    """Every microbatch's forward, then every backward (GPipe; in microbatch order as
    torch's ScheduleGPipe does): all m microbatches' activations are held at once."""
    _check(pp, m)
    ranks = tuple(tuple([Action(r, "F", i) for i in range(m)]
                        + [Action(r, "B", i) for i in range(m)]) for r in range(pp))
    return Schedule("gpipe", pp, pp, m, ranks)


def one_f_one_b(pp: int, m: int) -> Schedule:
    """1F1B (PipeDream-Flush, Megatron's non-interleaved schedule): rank r runs pp - r - 1
    warm-up forwards, then alternates one forward and one backward, then drains; it holds at
    most pp - r microbatches instead of GPipe's m, with the same bubble."""
    _check(pp, m)
    ranks = []
    for r in range(pp):
        warmup = min(pp - r - 1, m)
        order = [Action(r, "F", i) for i in range(warmup)]
        for i in range(m - warmup):
            order += [Action(r, "F", warmup + i), Action(r, "B", i)]
        order += [Action(r, "B", i) for i in range(m - warmup, m)]
        ranks.append(tuple(order))
    return Schedule("1f1b", pp, pp, m, tuple(ranks))


def interleaved_1f1b(pp: int, m: int, v: int) -> Schedule:
    """Megatron's interleaved 1F1B (Narayanan et al. 2021, sec. 2.2.2): v model chunks per rank,
    microbatches in groups of pp that go through one chunk before the next; warm-up
    (pp - r - 1) * 2 + (v - 1) * pp forwards (all of them when m == pp). The bubble shrinks v
    times; Megatron needs m to be a multiple of pp."""
    _check(pp, m)
    if v < 1:
        raise ValueError(f"stages per rank v must be >= 1, got {v}")
    if v == 1:
        return one_f_one_b(pp, m)
    if m % pp:
        raise ValueError(f"interleaved 1F1B needs microbatches a multiple of pp "
                         f"(as Megatron does), got m={m}, pp={pp}")
    total, ranks = m * v, []

    def action(r: int, k: int, kind: str) -> Action:
        chunk = (k % (pp * v)) // pp
        if kind == "B":
            chunk = v - 1 - chunk
        return Action(chunk * pp + r, kind, (k // (pp * v)) * pp + k % pp)

    for r in range(pp):
        warmup = total if m == pp else min((pp - r - 1) * 2 + (v - 1) * pp, total)
        order = [action(r, k, "F") for k in range(warmup)]
        for k in range(total - warmup):
            order += [action(r, k + warmup, "F"), action(r, k, "B")]
        order += [action(r, k, "B") for k in range(total - warmup, total)]
        ranks.append(tuple(order))
    return Schedule(f"interleaved-v{v}", pp, pp * v, m, tuple(ranks))


def split_backward(schedule: Schedule) -> Schedule:
    """The same schedule with every B split into B (input gradient) and W (weight gradient)
    right after it: the smallest valid use of W, for runtimes and tests."""
    def split(a: Action) -> tuple[Action, ...]:
        return (a, Action(a.stage, "W", a.microbatch)) if a.kind == "B" else (a,)

    ranks = tuple(tuple(x for a in actions for x in split(a)) for actions in schedule.ranks)
    return Schedule(schedule.name + "+W", schedule.pp, schedule.stages, schedule.microbatches,
                    ranks)


BUILDERS = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved_1f1b}


@functools.lru_cache(maxsize=256)
def build(name: str, pp: int, m: int, v: int = 2) -> Schedule:
    """A schedule by name ("gpipe", "1f1b", "interleaved" with v stages per rank), validated.
    Schedules are frozen values, so each is built and validated once (the planner's search
    asks for the same ones for many candidates)."""
    if name not in BUILDERS:
        raise ValueError(f"unknown schedule {name!r} (expected one of {', '.join(BUILDERS)})")
    schedule = interleaved_1f1b(pp, m, v) if name == "interleaved" else BUILDERS[name](pp, m)
    validate(schedule)
    return schedule
