"""The compute of a training step, counted, not assumed: torch's FlopCounterMode over one forward
of the model on the meta device (no memory, no process group), per module. Any model: the
matmuls, convolutions and attention torch has FLOP formulas for, wherever the model calls them
(a shape-only copy under tp or cp counts this rank's share).

A step is the forward, its backward (twice the forward: a weight's and an input's gradient per
matmul, as Megatron-LM counts) and, for each module the plan recomputes, its forward once more.
Its seconds are those FLOPs at the rank's rate (`tilework calibrate`'s measured matmul rate, or
the cluster's given one), or, given a `MatmulCurve` (cluster/matmul_curve.py), each matmul's
FLOPs at the rate of its own shape: the forward's (m x k) @ (k x n), and in backward the input's
gradient (m x n) @ (n x k) and the weight's (k x m) @ (m x n). The few FLOPs of ops that are no
matmul torch counts (convolutions) go at the curve's best rate, and a recomputed forward at the
forward's average.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass(frozen=True)
class StepFlops:
    forward: float                     # one forward of the example inputs
    recomputed: float = 0.0            # the recomputed modules' forwards, again in backward
    matmuls: tuple = ()                # the forward's products: (m, k, n, count)

    @property
    def step(self) -> float:
        return 3 * self.forward + self.recomputed

    def seconds(self, rate) -> float:
        """The step at `rate`: one FLOP/s, or a MatmulCurve pricing each product's shape."""
        from ..cluster.matmul_curve import MatmulCurve

        if not isinstance(rate, MatmulCurve) or not self.matmuls:
            return self.step / float(rate)
        forward = sum(rate.seconds(m, k, n, c) for m, k, n, c in self.matmuls)
        backward = sum(rate.seconds(m, n, k, c) + rate.seconds(k, m, n, c)
                       for m, k, n, c in self.matmuls)
        counted = sum(2.0 * m * k * n * c for m, k, n, c in self.matmuls)
        rest = max(0.0, self.forward - counted)
        per_flop = forward / counted if counted else 1.0 / float(rate)
        return forward + backward + 3 * rest / float(rate) + self.recomputed * per_flop


def step_flops(model: nn.Module, example_inputs: tuple, recompute=()) -> StepFlops:
    """FLOPs of one training step of `model` on `example_inputs` (`recompute`: a plan's
    (module name, policy) pairs; "selective" keeps the matmul outputs, so only "full" pays the
    matmuls again). The model may live on the meta device; a real one is copied there."""
    from torch.utils.flop_counter import FlopCounterMode

    from .meta_forward import WorstCaseUnique, on_meta

    meta = model if _on_meta(model) else on_meta(model)
    inputs = tuple(x.to("meta") if torch.is_tensor(x) else x for x in example_inputs)
    per_module = _ModuleFlops(meta, [name for name, policy in recompute if policy == "full"])
    # torch.unique has no meta kernel: every element distinct, as the memory estimate takes it.
    with FlopCounterMode(display=False) as counter, per_module, WorstCaseUnique(), \
            _Products() as products:
        meta(*inputs)
    return StepFlops(float(counter.get_total_flops()), float(sum(per_module.flops.values())),
                     tuple(products.shapes))


class _Products(TorchDispatchMode):
    """The shape of every matmul a forward runs, (m, k, n, count): mm and addmm, bmm and
    baddbmm (count: the batch), and attention's two products per head."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, int, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func.overloadpacket
        a = torch.ops.aten
        if packet in (a.mm, a.addmm):
            x, w = args[-2], args[-1]
            self.shapes.append((x.shape[0], x.shape[1], w.shape[1], 1))
        elif packet in (a.bmm, a.baddbmm):
            x, w = args[-2], args[-1]
            self.shapes.append((x.shape[1], x.shape[2], w.shape[2], x.shape[0]))
        elif "scaled_dot_product" in packet.__name__ and len(args) >= 3:
            q, k = args[0], args[1]
            heads = q.shape[:-2].numel()
            s, t, d = q.shape[-2], k.shape[-2], q.shape[-1]
            self.shapes += [(s, d, t, heads), (s, t, d, heads)]
        return func(*args, **(kwargs or {}))


def _on_meta(model: nn.Module) -> bool:
    return all(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()])


class _ModuleFlops:
    """The forward FLOPs of named modules, each counted by its own FlopCounterMode around its
    calls (a module called twice counts twice)."""

    def __init__(self, model: nn.Module, names: list[str]):
        self.model, self.names = model, names
        self.flops: dict[str, float] = {n: 0.0 for n in names}
        self.handles = []

    def __enter__(self):
        from torch.utils.flop_counter import FlopCounterMode

        for name in self.names:
            module = self.model.get_submodule(name)
            counters: list = []

            def before(_module, _args, counters=counters):
                counters.append(FlopCounterMode(display=False))
                counters[-1].__enter__()

            def after(_module, _args, _out, name=name, counters=counters):
                counter = counters.pop()
                counter.__exit__(None, None, None)
                self.flops[name] += counter.get_total_flops()

            self.handles += [module.register_forward_pre_hook(before),
                             module.register_forward_hook(after)]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
