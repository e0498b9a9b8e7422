"""Pipeline stages cut from any model whose blocks are a stack: a ModuleList, Sequential or
ModuleDict of two or more modules of one class (nanoGPT's `transformer.h`, Hugging Face's
`model.layers`, torchtitan's `layers`, a ModuleDict its forward iterates).

Every stage runs the model's own forward on its microbatch, so what the model computes around
its blocks (embeddings, position or rotary tables, masks, the final norm, the head, the loss)
is computed as the model writes it; only the stack is changed while the forward runs:

    blocks before the stage's   pass their input on (not computed; the model's code between
                                blocks only carries the hidden states along)
    the stage's first block     takes the previous stage's activation as its input, instead
                                of what the model computed so far, which is thrown away
    the stage's blocks          run as the model calls them (their keyword arguments too:
                                HF's position embeddings and masks, computed on this stage)
    the next stage's first      stops the forward: its input is this stage's activation
    block

The last stage's forward runs to the end and its output's loss (a scalar tensor, `.loss`, or
the one scalar of a tuple: nanoGPT's `(logits, loss)`) is the stage's. Every stage must call
`model.step` with the same arguments the model takes (`model.step(x, y)` for nanoGPT,
`model.step(input_ids=x, labels=x)` for HF); tensors whose first dimension is the batch are cut
into microbatches. A model whose forward returns outputs, not a loss (torchtitan's logits),
is stepped as torch.distributed.pipelining's schedules are: `model.step(x, target=y,
loss_fn=fn)`, the last stage's loss `fn(output, target)` on each microbatch's part of `y`.

The parameters outside the stack (embeddings, final norm, head) belong to the first and the
last stage both: the first computes the embeddings' gradients, the last the head's, and each
step their gradients are summed over the pipeline, as Megatron-LM all-reduces a tied embedding
and head, so both copies take the same update. A tied embedding and head therefore need nothing
more. Middle stages compute the embeddings too (the cost of running the model's own code) but
keep no gradient of them.

The activation crossing a boundary is the first positional argument the model passes a block
(`x = block(x)`, `hidden_states = layer(hidden_states, ...)`); its shape is found once per
input shape by running the forward on fake tensors (`torch._subclasses.FakeTensorMode`: no
values, no compute), or for real, without gradients, where the model's code needs values.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from ...errors import PlanError
from .stages import balance, checked_cut, matmul_params


def find_stack(model: nn.Module) -> str:
    """The name of the model's outermost stack of blocks (see the module's docstring)."""
    from ...plans.analysis import is_stack

    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential, nn.ModuleDict)) and \
                is_stack(module):
            kind = type(blocks_of(module)[0])
            if issubclass(kind, (nn.ModuleDict, nn.ModuleList)):
                raise PlanError(f"pp: the blocks of {name} are {kind.__name__}s, which the model "
                                "indexes rather than calls; a stage swaps blocks the model "
                                "calls with its hidden states (make each block a module with "
                                "a forward)")
            return name
    raise PlanError(f"pp: {type(model).__name__} has no stack of blocks to cut into stages "
                    "(a ModuleList, Sequential or ModuleDict of two or more modules of one "
                    "class, each with parameters)")


def blocks_of(container: nn.Module) -> list[nn.Module]:
    """A stack's blocks in the order its forward runs them (a ModuleDict's: its values')."""
    return list(container.values() if isinstance(container, nn.ModuleDict) else container)


def _keys(container: nn.Module) -> list:
    """Where each block sits: its key in a ModuleDict (replacing one keeps its place), else
    its index."""
    return list(container.keys()) if isinstance(container, nn.ModuleDict) \
        else list(range(len(container)))


class _Reached(Exception):
    """Raised by the block after a stage's last: carries the activation it was given."""

    def __init__(self, activation: torch.Tensor):
        super().__init__("the stage's last block ran")
        self.activation = activation


def _activation(block: str, args: tuple, kwargs: dict) -> torch.Tensor:
    if args and torch.is_tensor(args[0]):
        return args[0]
    raise PlanError(f"pp: the model calls {block} without its hidden states as the first "
                    "positional argument, so the activation between stages is not known")


class _PassOn(nn.Module):
    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def forward(self, *args, **kwargs):
        return _activation(self.name, args, kwargs)


class _Stop(nn.Module):
    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def forward(self, *args, **kwargs):
        raise _Reached(_activation(self.name, args, kwargs))


class _Enter(nn.Module):
    """The stage's first block, given the received activation in place of its input."""

    def __init__(self, block: nn.Module, name: str, activation: torch.Tensor):
        super().__init__()
        self.block, self.name, self.activation = block, name, activation

    def forward(self, *args, **kwargs):
        _activation(self.name, args, kwargs)
        return self.block(self.activation, *args[1:], **kwargs)


def loss_of(output: Any) -> torch.Tensor:
    """The loss in a model's output: a scalar tensor, `.loss` (HF), or a tuple's one scalar."""
    if torch.is_tensor(output) and output.numel() == 1:
        return output.reshape(())
    loss = getattr(output, "loss", None)
    if torch.is_tensor(loss):
        return loss.reshape(())
    if isinstance(output, (tuple, list)):
        scalars = [t for t in output if torch.is_tensor(t) and t.numel() == 1]
        if len(scalars) == 1:
            return scalars[0].reshape(())
    raise PlanError(f"pp: the model returned {type(output).__name__}, with no loss in it (a "
                    "scalar, .loss, or one scalar in a tuple); call model.step with the "
                    "arguments that make it compute its loss (its targets or labels)")


class Call:
    """One microbatch's arguments to the model (and, for a model that returns outputs, the
    loss function and the microbatch's target)."""

    def __init__(self, args: tuple, kwargs: dict, target=None, loss_fn=None):
        self.args, self.kwargs = args, kwargs
        self.target, self.loss_fn = target, loss_fn

    def loss(self, output) -> torch.Tensor:
        if self.loss_fn is None:
            return loss_of(output)
        loss = self.loss_fn(output, self.target)
        if not (torch.is_tensor(loss) and loss.numel() == 1):
            raise PlanError(f"pp: loss_fn returned {type(loss).__name__}"
                            f"{tuple(loss.shape) if torch.is_tensor(loss) else ''}, not a "
                            "scalar tensor")
        return loss.reshape(())

    def signature(self) -> tuple:
        leaves, _ = tree_flatten((self.args, self.kwargs))
        return tuple((tuple(t.shape), t.dtype) if torch.is_tensor(t) else repr(t)
                     for t in leaves)


def microbatches(args: tuple, kwargs: dict, m: int) -> list[Call]:
    """The call cut into `m` equal calls along the batch: every tensor whose first dimension
    is the batch's (the first tensor argument's) is cut, other values go to each as they are.
    `loss_fn=` in `kwargs` takes `target=` with it (neither goes to the model)."""
    kwargs = dict(kwargs)
    loss_fn = kwargs.pop("loss_fn", None)
    target = kwargs.pop("target", None) if loss_fn is not None else None
    if loss_fn is not None and target is None:
        raise PlanError("model.step(..., loss_fn=...) needs target= too: the loss is "
                        "loss_fn(output, target)")
    leaves = [t for t in tree_flatten((args, kwargs))[0] if torch.is_tensor(t) and t.dim()]
    if not leaves:
        raise PlanError("model.step: no tensor argument to cut into microbatches")
    batch = leaves[0].shape[0]
    if batch % m:
        raise PlanError(f"a batch of {batch} does not split into {m} equal microbatches (the "
                        "loss would not be the batch's mean)")

    def part(i):
        return tree_map(lambda t: t.chunk(m)[i] if torch.is_tensor(t) and t.dim()
                        and t.shape[0] == batch else t, (args, kwargs, target))

    return [Call(*part(i), loss_fn=loss_fn) for i in range(m)]


class ModelStage(nn.Module):
    """Stage `index` of `count`: blocks `blocks` of the model's stack (and, first or last, the
    parameters outside the stack). Called as the runtime calls a stage: (activation or the
    first stage's call, the microbatch's call)."""

    needs_call = True   # the runtime passes every stage its microbatch's call

    def __init__(self, model: nn.Module, stack: str, blocks: range, index: int, count: int,
                 shapes: "_BoundaryShapes"):
        super().__init__()
        self.index_range, self.index, self.count = blocks, index, count
        self.first, self.last = index == 0, index == count - 1
        self.stack_name = stack
        self.__dict__["model"] = model   # not a submodule: its parameters are not all ours
        self.__dict__["shapes"] = shapes
        container = blocks_of(model.get_submodule(stack))
        self.layers = nn.ModuleList([container[i] for i in blocks])
        if self.first or self.last:
            self.ends = nn.ModuleList(outside_stack(model, stack))

    def forward(self, x, call: Call) -> torch.Tensor:
        stack = self.model.get_submodule(self.stack_name)
        kept, keys = blocks_of(stack), _keys(stack)
        a, b = self.index_range.start, self.index_range.stop
        try:
            for i in range(a):
                stack[keys[i]] = _PassOn(f"{self.stack_name}.{keys[i]}")
            if not self.first:
                stack[keys[a]] = _Enter(kept[a], f"{self.stack_name}.{keys[a]}", x)
            if not self.last:
                stack[keys[b]] = _Stop(f"{self.stack_name}.{keys[b]}")
            try:
                output = self.model(*call.args, **call.kwargs)
            except _Reached as reached:
                return reached.activation
        finally:
            for key, block in zip(keys, kept):
                stack[key] = block
        if not self.last:
            raise PlanError(f"pp: the model's forward returned before calling "
                            f"{self.stack_name}.{keys[b]}: its blocks must all run, in order")
        return call.loss(output)

    def boundary_like(self, call: Call) -> torch.Tensor:
        """An empty activation as it enters this stage for this call (nothing travels ahead)."""
        shape, dtype = self.shapes.entering(self.index_range.start, call)
        return torch.empty(shape, dtype=dtype, device=_device_of(self.model))

    def output_like(self, call: Call) -> torch.Tensor:
        """An empty activation as it leaves this stage (its gradient comes back so shaped)."""
        shape, dtype = self.shapes.entering(self.index_range.stop, call)
        return torch.empty(shape, dtype=dtype, device=_device_of(self.model))


def _device_of(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def outside_stack(model: nn.Module, stack: str) -> list[nn.Module]:
    """The modules that own parameters outside the stack, outermost first (one per subtree)."""
    out: list[nn.Module] = []
    inside = model.get_submodule(stack)
    taken: set[str] = set()
    for name, module in model.named_modules():
        if module is model or module is inside or name.startswith(stack + ".") \
                or any(name.startswith(t + ".") for t in taken):
            continue
        if next(module.parameters(), None) is None:
            continue
        if stack.startswith(name + "."):   # an ancestor of the stack: its other children
            if next(module.parameters(recurse=False), None) is not None:
                raise PlanError(f"pp: {name} holds parameters of its own beside the stack "
                                f"{stack}; a stage can only take whole modules")
            continue
        out.append(module)
        taken.add(name)
    if next(model.parameters(recurse=False), None) is not None:
        raise PlanError(f"pp: {type(model).__name__} holds parameters of its own (not in a "
                        "submodule); a stage can only take whole modules")
    return out


class _BoundaryShapes:
    """The shape and dtype of each block's input, per call signature, found by a forward on
    fake tensors (or, where the model's code reads values, a real one without gradients)."""

    def __init__(self, model: nn.Module, stack: str):
        self.model, self.stack = model, stack
        self.known: dict[tuple, list] = {}

    def entering(self, block: int, call: Call) -> tuple[tuple[int, ...], torch.dtype]:
        # Autocast changes the dtypes a block's input may have (a Linear's output is bf16
        # under it): the same call probed under another autocast state is another call.
        device = _device_of(self.model).type
        key = (call.signature(), torch.is_autocast_enabled(device),
               torch.get_autocast_dtype(device))
        if key not in self.known:
            self.known[key] = self._probe(call)
        return self.known[key][block]

    def _released(self) -> dict[str, torch.Tensor]:
        """Other ranks' blocks hold no values here (runtime/changes.release_values): stand-ins
        of their shape for the probe's forward (fake under FakeTensorMode: no memory)."""
        return {n: torch.zeros(p.released_shape, dtype=p.dtype, device=p.device)
                for n, p in self.model.named_parameters() if hasattr(p, "released_shape")}

    def _probe(self, call: Call) -> list:
        stack = blocks_of(self.model.get_submodule(self.stack))
        seen: list = [None] * len(stack)
        handles = [block.register_forward_pre_hook(
            lambda m, args, i=i: seen.__setitem__(i, (tuple(args[0].shape), args[0].dtype))
            if args and torch.is_tensor(args[0]) else None) for i, block in enumerate(stack)]
        try:
            with torch.no_grad():
                try:
                    from torch._subclasses.fake_tensor import FakeTensorMode

                    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                        fake = tree_map(lambda t: mode.from_tensor(t) if torch.is_tensor(t)
                                        else t, (call.args, call.kwargs))
                        torch.func.functional_call(self.model, self._released(), *fake)
                except Exception:   # noqa: BLE001 - code that needs values: run it for real
                    torch.func.functional_call(self.model, self._released(), call.args,
                                               call.kwargs)
        finally:
            for h in handles:
                h.remove()
            # Under autocast the probe's casts of the weights are cached for the rest of the
            # autocast region: fake ones, which the real forward would then compute with.
            torch.clear_autocast_cache()
        if any(s is None for s in seen):
            raise PlanError(f"pp: the model's forward did not call every block of "
                            f"{self.stack} with its hidden states first")
        return seen


def split_model(model: nn.Module, stages: int, stack: str | None = None,
                costs: Sequence[float] | None = None,
                blocks: Sequence[range] | None = None,
                speeds: Sequence[float] | None = None) -> list[ModelStage]:
    """`model` cut into `stages` ModelStages over its stack of blocks (found, or named),
    balanced by each block's matmul weights; the head's count towards the last stage.
    `blocks`: the cut a plan made, taken as it is."""
    stack = stack or find_stack(model)
    container = blocks_of(model.get_submodule(stack))
    if costs is None:
        costs = [matmul_params(block) for block in container]
    if len(costs) != len(container):
        raise PlanError(f"{len(costs)} costs for {len(container)} blocks")
    last = sum(matmul_params(m) for m in outside_stack(model, stack))
    shapes = _BoundaryShapes(model, stack)
    cut = balance(costs, stages, last=last, speeds=speeds) if blocks is None \
        else checked_cut(blocks, stages, len(container))
    return [ModelStage(model, stack, part, k, stages, shapes) for k, part in enumerate(cut)]
