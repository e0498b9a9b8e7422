"""What `tilework.parallelize(..., pp=N)` returns: this rank's stages, trained one schedule a step.

    model, opt = tilework.parallelize(model, opt, pp=2, microbatches=4)
    loss = model.step(tokens, targets)    # replaces: loss = model(tokens, targets); loss.backward()
    opt.step(); opt.zero_grad()           # unchanged

`model.step` takes what the model's forward takes (`model.step(input_ids=x, labels=x)` for a
Hugging Face model) and returns the loss the model computes. The reference GPT is cut by
stages.py; any other model with a stack of blocks by generic.py, which runs the model's own
forward on each stage.

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

from ...errors import PlanError
from .generic import ModelStage, microbatches, split_model
from .runtime import PipelineRunner
from .schedule import Schedule
from .shared import SharedGradients
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


def stage_modules(stage: nn.Module) -> list[nn.Module]:
    """The model's own modules a stage holds (its layers, and the ends it owns)."""
    if isinstance(stage, ModelStage):
        return [*stage.layers, *getattr(stage, "ends", ())]
    return [*stage.layers, *(m for name, m in stage.named_children() if name != "layers")]


def is_reference_gpt(model: nn.Module) -> bool:
    from ...models.gpt import TinyGPT

    return isinstance(model, TinyGPT)


def cut_stages(model: nn.Module, stages: int, blocks=None, speeds=None) -> list[nn.Module]:
    """The reference GPT's stages (stages.py), or any model's over its stack (generic.py);
    `blocks`: a plan's cut (each stage's block range), else balanced here, by `speeds` (each
    stage's ranks' relative speed) where given."""
    if is_reference_gpt(model):
        return split_stages(model, stages, blocks=blocks, speeds=speeds)
    return split_model(model, stages, blocks=blocks, speeds=speeds)


def _blocks_of_stage(stage: nn.Module) -> nn.Module:
    return stage.layers if isinstance(stage, ModelStage) else stage


class PipelineModel(nn.Module):
    def __init__(self, model: nn.Module, schedule: Schedule, group, rank: int, stats,
                 blocks=None):
        super().__init__()
        stages = cut_stages(model, schedule.stages, blocks)
        owned = {id(p) for s in stages for p in s.parameters()}
        stray = [n for n, p in model.named_parameters() if id(p) not in owned]
        if stray:
            raise PlanError(f"pp={schedule.pp}: {stray[0]} is in no pipeline stage (a stage "
                            "holds the embeddings, its blocks, or the final norm and head)")
        mine = {s: stages[s] for s in schedule.stages_of(rank)}
        self.part = local_part(model, [m for s in mine.values() for m in stage_modules(s)])
        held = {id(p) for p in self.part.parameters()}
        # Other ranks' blocks, which no forward here runs (generic.py passes over them; the
        # reference GPT's stages are their own modules). A generic model's parameters outside
        # the stack are not among them: every stage's forward computes with them.
        self.unheld = list({id(p): p for k, s in enumerate(stages) if k not in mine
                            for p in _blocks_of_stage(s).parameters()
                            if id(p) not in held}.values())
        self.runner = PipelineRunner(mine, schedule, group, stats)
        self.schedule = schedule
        self.generic = not is_reference_gpt(model)
        # The whole model, not a submodule: train() and eval() reach its modules that no
        # stage holds (a dropout or rotary table outside the stack runs in every stage).
        self.__dict__["whole"] = model
        # Parameters the stages of several ranks hold (a tied embedding and head; under
        # generic.py every parameter outside the stack): summed over the pipeline.
        self.shared = SharedGradients(model, stages, schedule, rank, group, stats)
        self.cut = None   # context parallelism's: (module, args, kwargs) -> this rank's part

    def train(self, mode: bool = True):
        super().train(mode)
        self.whole.train(mode)
        return self

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

    def step(self, *args, **kwargs) -> torch.Tensor | None:
        """One schedule: forward and backward of the batch in microbatches; the batch's mean
        loss on the last stage's rank, None on the others. Every rank of a pipeline passes the
        same batch (each data-parallel replica its own): the reference GPT's (inputs,
        targets), any other model what its forward takes."""
        if not torch.is_grad_enabled():
            raise PlanError("model.step runs the schedule's backward too, which torch.no_grad() "
                            "forbids: to evaluate with pp > 1, call model.evaluate(inputs, "
                            "targets) (forward only; any model: what model.step takes) on "
                            "every rank")
        part = self.part
        sync = self.require_backward_grad_sync
        engine = getattr(self, "_tilework_engine", None)
        if engine is not None and engine.mesh.same_batch is not None:
            engine.mesh.same_batch([*args, *kwargs.values()])
        if self.shared and engine is not None and engine.zero.owns_gradients:
            raise PlanError(f"pp={self.schedule.pp} with ZeRO stage 2 or 3: "
                            f"{self.shared.first_name()} is held by the stages of several ranks, "
                            "whose gradients are summed over the pipeline, and ZeRO keeps "
                            "them in shards; use zero=1 or 0")
        if self.cut is not None:
            args, kwargs = self.cut(self, args, kwargs)
        inputs, context = self._microbatches(args, kwargs)
        self.shared.start_step()
        with _local_backwards(part):
            loss = self.runner.run(inputs, context, on_last_backward=lambda: setattr(
                part, "require_backward_grad_sync", sync))
        self.shared.check_unheld()
        if sync:
            self.shared.sum()
        return loss

    def counted_elsewhere(self) -> set[int]:
        """ids of the shared parameters another rank counts in a norm (shared.py)."""
        return self.shared.counted_elsewhere()

    def _microbatches(self, args: tuple, kwargs: dict):
        m = self.schedule.microbatches
        if self.generic:
            calls = microbatches(args, kwargs, m)
            return calls, calls
        inputs, targets = _reference_arguments(args, kwargs)
        if inputs.shape[0] % m:
            raise PlanError(f"a batch of {inputs.shape[0]} does not split into {m} equal "
                            "microbatches (the loss would not be the batch's mean)")
        return inputs.chunk(m), targets.chunk(m)

    @torch.no_grad()
    def evaluate(self, *args, **kwargs) -> float | None:
        """The batch's mean loss, forward only: stage after stage, each boundary sent to the
        next stage's rank; the loss on the last stage's rank, None on the others. Every rank
        of the pipeline calls it, with what `step` takes. Uncounted point-to-point sends:
        evaluation is not a training step's traffic."""
        import torch.distributed as dist

        if self.cut is not None:
            args, kwargs = self.cut(self, args, kwargs)
        if self.generic:
            call = microbatches(args, kwargs, 1)[0]
            inputs, context = call, call
        else:
            inputs, context = _reference_arguments(args, kwargs)
        runner = self.runner
        schedule, rank = runner.schedule, runner.rank
        x, loss = inputs, None
        for s in range(schedule.stages):
            last = s == schedule.stages - 1
            if schedule.rank_of(s) == rank:
                x = runner.stages[s](x, context if last or self.generic else None)
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


def _reference_arguments(args: tuple, kwargs: dict):
    """The reference GPT's step arguments: (inputs, targets)."""
    named = dict(zip(("inputs", "targets"), args), **kwargs)
    if set(named) != {"inputs", "targets"} or len(args) > 2:
        raise PlanError("model.step(inputs, targets): the reference GPT's pipeline takes its "
                        "token ids and their targets")
    return named["inputs"], named["targets"]


@contextlib.contextmanager
def _local_backwards(part: nn.Module):
    """Backwards keep their gradients local until the rank's last one (set by the runner)."""
    before = getattr(part, "require_backward_grad_sync", True)
    part.require_backward_grad_sync = False
    try:
        yield
    finally:
        part.require_backward_grad_sync = before
