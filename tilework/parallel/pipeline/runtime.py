"""Execute a pipeline Schedule on real ranks: each rank runs its own list of actions, in order.

    stages = split_stages(model, schedule.stages)
    runner = PipelineRunner({s: stages[s] for s in schedule.stages_of(rank)}, schedule, group)
    opt = torch.optim.SGD(runner.parameters(), lr=0.1)
    loss = runner.step(tokens, targets)     # the batch's mean loss on the last stage's rank
    opt.step(); opt.zero_grad()

F runs a stage's forward on one microbatch and sends the activation on; B receives the output
gradient, runs the backward and sends the input gradient back; W (when the schedule splits the
backward) accumulates the weight gradients. The last stage's F computes the microbatch's mean
loss and its B starts from 1/m, so the gradients sum to the whole batch's mean loss's, as one
process computes them. Messages go through parallel/pipeline/comm.py, counted; a schedule's bytes
are `simulate.p2p_bytes(schedule, activation_bytes)`. Each step records when every action computed
(`timeline`: action, start, end; perf_counter, after its input arrived), for the benchmark.
"""

from __future__ import annotations

import time
from typing import Mapping

import torch
import torch.distributed as dist
from torch import nn

from ...comm.counted import Stats
from ...errors import PlanError
from . import comm
from .schedule import Action, Schedule, validate


class PipelineRunner:
    def __init__(self, stages: Mapping[int, nn.Module], schedule: Schedule, group=None,
                 stats: Stats | None = None):
        validate(schedule)
        # One rank sends nothing: no group needed (a mesh's size-1 axis has None for a group).
        self.group, self.rank = None, 0
        if schedule.pp > 1:
            self.group = group if group is not None else dist.group.WORLD
            if dist.get_world_size(self.group) != schedule.pp:
                raise PlanError(f"the schedule is for {schedule.pp} ranks, the group has "
                                 f"{dist.get_world_size(self.group)}")
            self.rank = dist.get_rank(self.group)
        if sorted(stages) != schedule.stages_of(self.rank):
            raise PlanError(f"rank {self.rank} runs stages {schedule.stages_of(self.rank)} of "
                             f"this schedule, got modules for {sorted(stages)}")
        self.stages, self.schedule = dict(stages), schedule
        self.stats = stats if stats is not None else Stats()
        self.timeline: list[tuple[Action, float, float]] = []
        # What the last stage's backward is seeded with beside 1/m: a data-parallel replica's
        # weight under uneven batch shares (planner/shares.gradient_weights), else 1.
        self.loss_weight = 1.0

    def parameters(self) -> list[nn.Parameter]:
        """This rank's stages' parameters, each once (for its optimizer)."""
        seen: dict[int, nn.Parameter] = {}
        for s in sorted(self.stages):
            for p in self.stages[s].parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, on_last_backward=None
             ) -> torch.Tensor | None:
        """One forward and backward of the batch, in `schedule.microbatches` equal microbatches
        along dim 0; gradients accumulate into `.grad` (the optimizer is the caller's). Every
        rank passes the batch (stage 0 reads the inputs, the last stage the targets, the others
        their shapes). Returns the batch's mean loss on the last stage's rank, None elsewhere.
        `on_last_backward()` runs before this rank's last backward action (B or W): where a
        data-parallel sync may start, the gradients then being whole."""
        m = self.schedule.microbatches
        if inputs.shape[0] % m:
            raise PlanError(f"a batch of {inputs.shape[0]} does not split into {m} equal "
                             "microbatches (the loss would not be the batch's mean)")
        return self.run(inputs.chunk(m), targets.chunk(m), on_last_backward)

    def run(self, inputs, targets, on_last_backward=None) -> torch.Tensor | None:
        """`step` on microbatches already cut: what stage 0 takes and what the last stage
        (or every stage that `needs_call`: parallel/pipeline/generic.py's) is given beside it."""
        m = self.schedule.microbatches
        run = _Step(self, inputs, targets)
        self.timeline = []
        actions = self.schedule.ranks[self.rank]
        last = max(i for i, a in enumerate(actions) if a.kind != "F")
        for i, action in enumerate(actions):
            if i == last and on_last_backward is not None:
                on_last_backward()
            run.do(action, actions[i + 1] if i + 1 < len(actions) else None)
        for work, _ in run.sends:
            work.wait()
        self.stats.end_step()
        return torch.stack(run.losses).sum() / m if run.losses else None


class _Step:
    """One step's state on one rank: the activations held between F and B (or W), the sends
    in flight, the receives posted ahead, and hand-offs between stages this rank holds both
    of."""

    def __init__(self, runner: PipelineRunner, inputs, targets):
        self.r, self.inputs, self.targets = runner, inputs, targets
        s = runner.schedule
        self.split = {(a.stage, a.microbatch) for a in s.ranks[runner.rank] if a.kind == "W"}
        self.held: dict[tuple[int, int], list] = {}
        self.local: dict[tuple[str, int, int], torch.Tensor] = {}
        self.incoming: dict[tuple[str, int, int], tuple[object, torch.Tensor]] = {}
        self.sends: list[tuple[object, torch.Tensor]] = []
        self.losses: list[torch.Tensor] = []

    def do(self, a: Action, upcoming: Action | None) -> None:
        # The next action's receive is posted before this one computes, so that its bytes
        # move meanwhile: a gloo send waits for its receive to be posted, and one posted only
        # when needed put a round trip, and the busy sender's wake-up, on the critical path
        # of every hop (5-9% of an interleaved step on 2 CPU ranks).
        for b in (a, upcoming):
            if b is not None:
                self.prefetch(b)
        if a.kind == "F":
            self.forward(a.stage, a.microbatch)
        elif a.kind == "B":
            self.backward(a.stage, a.microbatch)
        else:
            self.weights(a.stage, a.microbatch)

    def forward(self, s: int, mb: int) -> None:
        stage, last = self.r.stages[s], s == self.r.schedule.stages - 1
        x = self.inputs[mb] if s == 0 else self.take("F", s - 1, mb).requires_grad_()
        start = time.perf_counter()
        out = stage(x, self.targets[mb] if last or getattr(stage, "needs_call", False) else None)
        if last:
            self.losses.append(out.detach())
        else:
            self.give("F", s, mb, out.detach(), s + 1)
        self.held[(s, mb)] = [x, out, None]
        self.r.timeline.append((Action(s, "F", mb), start, time.perf_counter()))

    def backward(self, s: int, mb: int) -> None:
        x, out, _ = held = self.held[(s, mb)]
        if s == self.r.schedule.stages - 1:
            grad = torch.full_like(out, self.r.loss_weight / self.r.schedule.microbatches)
        else:
            grad = self.take("B", s + 1, mb)
        start = time.perf_counter()
        if (s, mb) in self.split:   # the input gradient now, the weights' at W
            held[2] = grad
            gx = torch.autograd.grad(out, x, grad, retain_graph=True)[0] if s > 0 else None
        else:
            torch.autograd.backward(out, grad)
            gx = x.grad if s > 0 else None
            del self.held[(s, mb)]
        if gx is not None:
            self.give("B", s, mb, gx, s - 1)
        self.r.timeline.append((Action(s, "B", mb), start, time.perf_counter()))

    def weights(self, s: int, mb: int) -> None:
        _, out, grad = self.held.pop((s, mb))
        start = time.perf_counter()
        torch.autograd.backward(out, grad, inputs=list(self.r.stages[s].parameters()))
        self.r.timeline.append((Action(s, "W", mb), start, time.perf_counter()))

    def give(self, kind: str, s: int, mb: int, tensor: torch.Tensor, to_stage: int) -> None:
        """Pass `tensor` from stage s to `to_stage`: in place if this rank holds both, else a
        counted send."""
        schedule = self.r.schedule
        if schedule.rank_of(to_stage) == self.r.rank:
            self.local[(kind, s, mb)] = tensor
            return
        t = comm.tag(kind, s, mb, schedule.stages, schedule.microbatches)
        self.sends.append((comm.send(tensor, schedule.rank_of(to_stage), self.r.group, t,
                                     self.r.stats), tensor))

    def prefetch(self, a: Action) -> None:
        """Post the receive of what `a` needs from another rank, if anything, unless posted."""
        last = self.r.schedule.stages - 1
        if a.kind == "F" and a.stage > 0:
            key = ("F", a.stage - 1, a.microbatch)
        elif a.kind == "B" and a.stage < last:
            key = ("B", a.stage + 1, a.microbatch)
        else:
            return
        schedule = self.r.schedule
        if key in self.incoming or schedule.rank_of(key[1]) == self.r.rank:
            return
        kind, s, mb = key
        stage = self.r.stages[a.stage]
        # A gradient comes back shaped as the stage's output (a stage that knows it says so;
        # the reference GPT's boundaries are all alike).
        like = getattr(stage, "output_like", stage.boundary_like) if kind == "B" \
            else stage.boundary_like
        buffer = like(self.inputs[mb])
        t = comm.tag(kind, s, mb, schedule.stages, schedule.microbatches)
        self.incoming[key] = (comm.recv(buffer, schedule.rank_of(s), self.r.group, t,
                                        self.r.stats), buffer)

    def take(self, kind: str, s: int, mb: int) -> torch.Tensor:
        """What stage s passed for microbatch mb (an activation for "F", a gradient for "B"),
        once it has arrived."""
        if (kind, s, mb) in self.local:
            return self.local.pop((kind, s, mb)).detach()
        work, buffer = self.incoming.pop((kind, s, mb))
        work.wait()
        return buffer
