"""What `tilework.parallelize(..., pp=N)` returns: this rank's stages, trained one schedule a step.

    model, opt = tilework.parallelize(model, opt, pp=2, microbatches=4)
    loss = model.step(tokens, targets)    # replaces: loss = model(...); loss.backward()
    opt.step(); opt.zero_grad()           # unchanged

`part` is a module tree holding only this rank's stages' modules under their one-process names
("blocks.layers.2.linear1.weight"), so the data-parallel engine, the optimizer and the
checkpoint all see one-process keys; the model's other stages are left to the other ranks (and
out of this rank's optimizer). Gradients accumulate locally over the microbatches and are
averaged over dp at the rank's last backward, as DDP's no_sync does for accumulation.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..errors import PlanError
from .runtime import PipelineRunner
from .schedule import Schedule
from .stages import split_stages


def local_part(model: nn.Module, modules: list[nn.Module]) -> nn.Module:
    """A module tree of `modules` (submodules of `model`) under their names in `model`, with
    plain containers for the modules in between: its parameters' names are the model's."""
    names = {id(m): n for n, m in model.named_modules()}
    root = nn.Module()
    for module in modules:
        path = names[id(module)].split(".")
        parent = root
        for step in path[:-1]:
            if not hasattr(parent, step):
                parent.add_module(step, nn.Module())
            parent = getattr(parent, step)
        parent.add_module(path[-1], module)
    return root


def _stage_modules(stage: nn.Module) -> list[nn.Module]:
    """The model's own modules a GPTStage holds (its layers, and the ends it owns)."""
    return [*stage.layers, *(m for name, m in stage.named_children() if name != "layers")]


class PipelineModel(nn.Module):
    def __init__(self, model: nn.Module, schedule: Schedule, group, rank: int, stats):
        super().__init__()
        stages = split_stages(model, schedule.stages)
        owned = {id(p) for s in stages for p in s.parameters()}
        stray = [n for n, p in model.named_parameters() if id(p) not in owned]
        if stray:
            raise PlanError(f"pp={schedule.pp}: {stray[0]} is in no pipeline stage (a stage "
                            "holds the embeddings, its blocks, or the final norm and head)")
        _refuse_ties_across_ranks(model, stages, schedule)
        mine = {s: stages[s] for s in schedule.stages_of(rank)}
        self.part = local_part(model, [m for s in mine.values() for m in _stage_modules(s)])
        self.runner = PipelineRunner(mine, schedule, group, stats)
        self.schedule = schedule
        self.cut = None   # context parallelism's: (module, args, kwargs) -> this rank's part

    @property
    def require_backward_grad_sync(self) -> bool:
        """DDP's flag: False keeps this step's gradients local (accumulation)."""
        return self.__dict__.get("_sync", True)

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self.__dict__["_sync"] = bool(value)

    @contextlib.contextmanager
    def no_sync(self):
        """DDP's no_sync: steps inside accumulate locally; the next step outside averages the
        sum over dp."""
        before, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = before

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """One schedule: forward and backward of the batch in microbatches; the batch's mean
        loss on the last stage's rank, None on the others. Every rank of a pipeline passes the
        same batch (each data-parallel replica its own)."""
        if not torch.is_grad_enabled():
            raise PlanError("model.step runs the schedule's backward too, which torch.no_grad() "
                            "forbids: to evaluate with pp > 1, call model.evaluate(inputs, "
                            "targets) (forward only) on every rank")
        part = self.part
        sync = self.require_backward_grad_sync
        engine = getattr(self, "_tilework_engine", None)
        if engine is not None and engine.mesh.same_batch is not None:
            engine.mesh.same_batch([inputs, targets])
        if self.cut is not None:
            (inputs, targets), _ = self.cut(self, (inputs, targets), {})
        with _local_backwards(part):
            return self.runner.step(inputs, targets, on_last_backward=lambda: setattr(
                part, "require_backward_grad_sync", sync))

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> float | None:
        """The batch's mean loss, forward only: stage after stage, each boundary sent to the
        next stage's rank; the loss on the last stage's rank, None on the others. Every rank
        of the pipeline calls it. Uncounted point-to-point sends: evaluation is not a
        training step's traffic."""
        import torch.distributed as dist

        if self.cut is not None:
            (inputs, targets), _ = self.cut(self, (inputs, targets), {})
        runner = self.runner
        schedule, rank = runner.schedule, runner.rank
        x, loss = inputs, None
        for s in range(schedule.stages):
            last = s == schedule.stages - 1
            if schedule.rank_of(s) == rank:
                x = runner.stages[s](x, targets if last else None)
                loss = x.item() if last else None
            if last or schedule.rank_of(s + 1) == schedule.rank_of(s):
                continue
            if schedule.rank_of(s) == rank:
                dist.send(x.contiguous(),
                          dist.get_global_rank(runner.group, schedule.rank_of(s + 1)),
                          group=runner.group)
            elif schedule.rank_of(s + 1) == rank:
                x = runner.stages[s + 1].boundary_like(inputs)
                dist.recv(x, dist.get_global_rank(runner.group, schedule.rank_of(s)),
                          group=runner.group)
        return loss

    def forward(self, *args, **kwargs):
        raise PlanError(f"with pp={self.schedule.pp} the pipeline runs forward and backward "
                        "together: call model.step(inputs, targets) instead of model(...) and "
                        "loss.backward() (model.evaluate(inputs, targets) to evaluate)")


def _refuse_ties_across_ranks(model: nn.Module, stages, schedule: Schedule) -> None:
    """A parameter two ranks' stages share (a tied embedding and head) would train as two
    copies: refused by name (Megatron-LM all-reduces such a pair's gradients; not done yet)."""
    ranks_of: dict[int, set[int]] = {}
    for s, stage in enumerate(stages):
        for p in stage.parameters():
            ranks_of.setdefault(id(p), set()).add(schedule.rank_of(s))
    for name, p in model.named_parameters():
        if len(ranks_of.get(id(p), ())) > 1:
            keys = [k for k, q in model.named_parameters(remove_duplicate=False) if q is p]
            raise PlanError(f"pp={schedule.pp}: {' and '.join(keys)} are one tied parameter in "
                            "stages on different ranks; untie them (or use pp=1)")


@contextlib.contextmanager
def _local_backwards(part: nn.Module):
    """Backwards keep their gradients local until the rank's last one (set by the runner)."""
    before = getattr(part, "require_backward_grad_sync", True)
    part.require_backward_grad_sync = False
    try:
        yield
    finally:
        part.require_backward_grad_sync = before
