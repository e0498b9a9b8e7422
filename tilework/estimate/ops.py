"""A step's compute as the ops it runs, each at its measured time: what one FLOP rate and the
matmul curve cannot see.

On a CPU rank a training step is not only its matmuls: norms, softmax, GELU, dropout, the
copies tp and cp add, and every op's own dispatch cost are a fifth to a half of it at small
widths, and they are exactly what selective recompute runs again and what more pipeline
microbatches multiply. So, as Proteus and vTrain profile operators:

- `record` (pure): one forward and its backward of a module on the meta device (the rank's
  shape-only copy under tp and cp, one pipeline stage on one microbatch), with the plan's
  recompute applied as the runtime applies it (runtime/recompute.py), so what backward runs
  again is recorded where it runs. Each aten op is kept as an `OpCall`: its name and its
  arguments' shapes and dtypes. Forward and backward apart, since the pipeline simulator needs
  both.
- `measure` (on the device): each distinct call timed on real tensors of those shapes
  (floating point random, integers zero: valid indices, masks all false), repeated until a
  floor of time has passed; `OpTimes` holds the seconds.
- `framework_costs` (on the device): what the framework adds per call beside the op itself
  (the autograd engine's bookkeeping; inside a checkpointed module, torch's Python around
  every op), by region, from a tiny GPT whose ops are next to nothing.
- `OpTimes.seconds(recording)`: the sum over the calls, plus the framework's cost per call.
  Given a MatmulCurve, the matmul family not measured is priced by its shape there (a live
  plan="auto" measures the rest only); any other call not measured (or that failed on made-up
  values) at the median measured call, and counted in `missing`.

What a step runs around the model (the optimizer's update, the buckets' and ZeRO's copies) is
recorded apart, from the parameters a Recording keeps (estimate/runtime_ops.py).
"""

from __future__ import annotations

import functools
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes


class TensorSpec(NamedTuple):
    shape: tuple[int, ...]
    dtype: str
    # A sparse COO tensor's (sparse dimensions, stored entries): an embedding's sparse gradient
    # is its touched rows, which a dense tensor of its shape would price as the whole table.
    sparse_dims: int = 0
    nnz: int = 0


class OpCall(NamedTuple):
    op: str          # "aten::mm.default"
    args: tuple      # the arguments with tensors as TensorSpec (lists as tuples)
    kwargs: tuple    # sorted (name, value) pairs, the same way


@dataclass
class Recording:
    forward: Counter = field(default_factory=Counter)    # OpCall -> calls
    backward: Counter = field(default_factory=Counter)
    # (phase, policy) -> calls: how many ran inside a recomputed module ("full",
    # "selective") or outside any ("none"), which the framework charges differently
    regions: Counter = field(default_factory=Counter)
    # axis -> message ends (sends and receives) the tp and cp exchanges made, recompute's
    # second run included (estimate/op_stages.py counts them on the shape-only exchanges)
    messages: Counter = field(default_factory=Counter)
    # the recorded module's trainable parameters, in its order: what the rank's runtime
    # synchronises and steps (estimate/runtime_ops.py), and the ZeRO-3 unit of each
    params: tuple = ()
    units: tuple = ()

    def calls(self) -> set[OpCall]:
        return set(self.forward) | set(self.backward)


def _spec(x):
    if torch.is_tensor(x):
        dtype = str(x.dtype).removeprefix("torch.")
        if x.layout == torch.sparse_coo:
            return TensorSpec(tuple(x.shape), dtype, x.sparse_dim(), x._nnz())
        return TensorSpec(tuple(x.shape), dtype)
    if isinstance(x, torch.device):
        return "device"        # made on the measuring device
    if isinstance(x, list):
        return tuple(_spec(v) for v in x)
    if isinstance(x, (torch.dtype, torch.memory_format, torch.layout)):
        return str(x)
    return x


class _Recorder(TorchDispatchMode):
    def __init__(self, into: Counter, regions: Counter, phase: str, policy: list):
        super().__init__()
        self.into, self.regions, self.phase, self.policy = into, regions, phase, policy

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "aten":
            try:
                call = OpCall(f"aten::{func.__name__}", tuple(_spec(a) for a in args),
                              tuple(sorted((k, _spec(v)) for k, v in kwargs.items())))
                hash(call)
                self.into[call] += 1
                self.regions[self.phase, self.policy[-1]] += 1
            except TypeError:   # an argument with no hashable form: not priced
                pass
        return func(*args, **kwargs)


def record(module: nn.Module, inputs: tuple, recompute=(), grad_of_output: bool = False) \
        -> Recording:
    """The ops of one forward of `module` (on the meta device) on `inputs` and its backward:
    of the loss if the output is one element, else of the output against a made-up gradient
    (a pipeline stage's); `recompute`: the (module name, policy) pairs to run as the runtime
    runs them."""
    from ..runtime.changes import Changes
    from ..runtime.recompute import apply_recompute
    from .meta_forward import WorstCaseUnique

    changes = Changes()
    apply_recompute(module, recompute, changes)
    policy = ["none"]
    for name, chosen in recompute:   # both runs of a recomputed forward pass through here
        wrapped = module.get_submodule(name).forward
        wrapped.forward = _Marked(wrapped.forward, chosen, policy)
    from ..plans.analysis import owning_units

    owner = owning_units(module)
    trained = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    out = Recording(params=tuple(_spec(p) for _, p in trained),
                    units=tuple(owner[n] for n, _ in trained))
    before, hooks = [p.grad for _, p in trained], []
    try:
        with WorstCaseUnique(), _Recorder(out.forward, out.regions, "forward", policy):
            y = module(*inputs)
        outputs = [y] if torch.is_tensor(y) else [t for t in (y or ()) if torch.is_tensor(t)]
        outputs = [t for t in outputs if t.requires_grad]
        if outputs:
            # A gradient that arrives sparse (an embedding's, sparse=True) is what the runtime
            # copies into its buckets: the touched rows, made dense there.
            arriving: dict[int, TensorSpec] = {}
            hooks = [p.register_hook(functools.partial(_keep_sparse, arriving, k))
                     for k, (_, p) in enumerate(trained)]
            with WorstCaseUnique(), _Recorder(out.backward, out.regions, "backward", policy):
                grads = [None if t.numel() == 1 and not grad_of_output else torch.empty_like(t)
                         for t in outputs]
                torch.autograd.backward(outputs, grads)
            out.params = tuple(arriving.get(k, spec) for k, spec in enumerate(out.params))
    finally:
        for hook in hooks:
            hook.remove()
        for (_, p), grad in zip(trained, before):
            p.grad = grad
        changes.undo()
    return out


def _keep_sparse(arriving: dict, k: int, grad: torch.Tensor) -> None:
    if grad.layout == torch.sparse_coo:
        # Asked outside the recorder: its sparse_dim and nnz calls are not the step's.
        with _disable_current_modes():
            arriving[k] = _spec(grad)


# The products a MatmulCurve prices, and how their (m, k, n, count) reads off the arguments.
MATMULS = {"aten::mm.default": (0, 1), "aten::addmm.default": (1, 2),
           "aten::bmm.default": (0, 1), "aten::baddbmm.default": (1, 2)}


def matmul_shape(call: OpCall) -> tuple[int, int, int, int]:
    a, b = (call.args[i].shape for i in MATMULS[call.op])
    count = a[0] if len(a) == 3 else 1
    return a[-2], a[-1], b[-1], count


class _Marked:
    def __init__(self, forward, policy: str, stack: list):
        self.forward, self.policy, self.stack = forward, policy, stack

    def __call__(self, *args, **kwargs):
        self.stack.append(self.policy)
        try:
            return self.forward(*args, **kwargs)
        finally:
            self.stack.pop()


@dataclass(frozen=True)
class OpTimes:
    """Seconds per measured call, and what the framework adds per call beside the op itself
    (`per_call`, by region: "none" outside any recomputed module, "selective" and "full"
    inside one, where torch's checkpoint runs Python around every op: `framework_costs`;
    and, as "table ps" / "table allgather", what each table placed so adds to a step:
    runtime/table_costs.py); `scale` multiplies the total (1: as measured)."""
    seconds_of: dict = field(default_factory=dict)      # OpCall -> seconds
    scale: float = 1.0
    per_call: dict = field(default_factory=dict)        # region -> seconds
    curve: object = None   # a MatmulCurve: the matmul family priced by shape, not measured

    def priced(self, calls: Counter) -> tuple[float, int]:
        """(seconds of `calls`, how many were not measured)."""
        fallback = statistics.median(self.seconds_of.values()) if self.seconds_of else 0.0
        total, missing = 0.0, 0
        for call, n in calls.items():
            t = self.seconds_of.get(call)
            if t is None and self.curve is not None and call.op in MATMULS:
                t = self.curve.seconds(*matmul_shape(call))
            if t is None:
                t, missing = fallback, missing + n
            total += n * t
        return total * self.scale, missing

    def seconds(self, recording: Recording) -> tuple[float, float]:
        """(forward, backward) seconds of `recording`."""
        def framework(phase):
            return self.scale * sum(self.per_call.get(region, 0.0) * n
                                    for (p, region), n in recording.regions.items() if p == phase)

        return (self.priced(recording.forward)[0] + framework("forward"),
                self.priced(recording.backward)[0] + framework("backward"))

    def __float__(self) -> float:
        raise TypeError("OpTimes prices ops, not FLOPs: it has no one rate")


class Collecting(OpTimes):
    """Prices every call at zero and keeps what it was asked for: a first pass over the
    candidates gathers the calls to `measure`."""

    def __init__(self):
        super().__init__({}, 1.0)
        object.__setattr__(self, "asked", set())

    def priced(self, calls: Counter) -> tuple[float, int]:
        self.asked.update(calls)
        return 0.0, 0


def _resolve(name: str):
    packet, _, overload = name.removeprefix("aten::").partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default")


def _made(spec, device):
    if isinstance(spec, TensorSpec) and spec.sparse_dims:
        values = TensorSpec((spec.nnz, *spec.shape[spec.sparse_dims:]), spec.dtype)
        indices = torch.zeros(spec.sparse_dims, spec.nnz, dtype=torch.long, device=device)
        return torch.sparse_coo_tensor(indices, _made(values, device), spec.shape,
                                       check_invariants=True)
    if isinstance(spec, TensorSpec):
        dtype = getattr(torch, spec.dtype)
        if dtype.is_floating_point or dtype.is_complex:
            return torch.randn(spec.shape, dtype=dtype, device=device)
        return torch.zeros(spec.shape, dtype=dtype, device=device)
    if spec == "device":
        return device
    if isinstance(spec, str) and spec.startswith("torch."):
        return getattr(torch, spec.removeprefix("torch."))
    if isinstance(spec, tuple):
        return [_made(v, device) for v in spec]
    return spec


def measure(calls, device=None, min_seconds: float = 2e-3, matmuls: bool = True) -> dict:
    """Seconds of each of `calls` on `device` (default the CPU, on the threads this process
    has), run on tensors of the recorded shapes until `min_seconds` have passed (at least
    twice, after one warm-up). A call that fails on made-up values is left out, and so is the
    matmul family without `matmuls` (a curve prices it: a large model's products would take
    long to time one by one on a CPU)."""
    device = torch.device(device or "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    out = {}
    with torch.no_grad():
        for call in sorted(calls, key=repr):
            if not matmuls and call.op in MATMULS:
                continue
            try:
                func = _resolve(call.op)
                args = tuple(_made(a, device) for a in call.args)
                kwargs = {k: _made(v, device) for k, v in call.kwargs}
                func(*args, **kwargs)
            except Exception:   # noqa: BLE001 - values the op refuses: priced by the median
                continue
            sync(device)
            repeats = 2
            while True:
                start = time.perf_counter()
                for _ in range(repeats):
                    func(*args, **kwargs)
                sync(device)
                elapsed = time.perf_counter() - start
                if elapsed >= min_seconds:
                    out[call] = elapsed / repeats
                    break
                repeats *= 2
    return out


def framework_costs(device=None, steps: int = 12) -> dict:
    """What the framework adds per call, by region, measured on a tiny reference GPT (width 16,
    where the ops are next to nothing): its measured step minus its recorded calls' measured
    seconds, over its calls; outside recompute first, then each policy's calls beyond that."""
    from ..models.gpt import TinyGPT
    from ..plans.analysis import recompute_choices
    from ..runtime.changes import Changes
    from ..runtime.recompute import apply_recompute
    from .meta_forward import on_meta

    device = torch.device(device or "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    policies = ("none", "selective", "full")
    torch.manual_seed(0)
    model = TinyGPT(64, 16, 2, 2, 8)
    ids = torch.zeros(2, 8, dtype=torch.long, device="cpu")
    meta_ids = ids.to("meta")
    recordings = {p: record(on_meta(model), (meta_ids, meta_ids), recompute_choices(model, p))
                  for p in policies}
    # The calls are microseconds each: half a millisecond of repeats times them well.
    times = OpTimes(measure(set().union(*(r.calls() for r in recordings.values())), device,
                            min_seconds=5e-4))
    ids = ids.to(device)
    costs: dict = {}
    for policy in policies:
        recording, chosen = recordings[policy], recompute_choices(model, policy)
        ops = sum(times.seconds(recording))
        torch.manual_seed(0)
        model = TinyGPT(64, 16, 2, 2, 8).to(device)
        apply_recompute(model, chosen, Changes())
        took = []
        for _ in range(steps + 2):
            sync(device)
            start = time.perf_counter()
            model(ids, ids).backward()
            sync(device)
            took.append(time.perf_counter() - start)
        step = statistics.median(took[2:])
        inside = sum(n for (_, region), n in recording.regions.items() if region == policy)
        outside = sum(n for (_, region), n in recording.regions.items() if region == "none")
        if policy == "none":
            costs["none"] = max(0.0, (step - ops) / outside)
        else:
            costs[policy] = max(0.0, (step - ops - costs["none"] * outside) / inside)
    return costs


__all__ = ["Collecting", "OpCall", "OpTimes", "Recording", "TensorSpec", "framework_costs",
           "measure", "record"]
