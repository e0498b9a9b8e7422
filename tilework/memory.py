"""What one rank holds in memory under a plan: parameters, gradients, optimizer state,
activations, the dense all-reduce's bucket copies, and the peak. Pure: the model runs forward
on the meta device (no memory, no process group), so a model too large for this machine can be
estimated here.

Per rank, for the plan `tilework.plan` makes (ZeRO stages are not built yet: every dense
parameter is replicated):

- parameters: dense ones whole; a server table's shard (its rows in `TableLayout`); a dense
  parameter on the servers (mode="ps") whole plus its owner's shard.
- gradients: dense ones whole (torch accumulates into `.grad`); a server table's rows for the
  ids this rank looked up (at most one row per lookup: an upper bound).
- optimizer state: per element of what the optimizer updates on this rank (Adam's two moments,
  Adagrad's sum, SGD momentum's buffer), dense parameters whole and server tables on the shard.
- activations: what autograd saves for backward in a meta forward of `example_inputs`
  (parameters excluded), the forward's output included; attention taken as a fused kernel
  (`_FusedAttention`). A module the plan recomputes counts what its checkpoint keeps: its
  inputs, and under "selective" the outputs of the kept ops (`_Accounted`).
- recompute: what backward rebuilds of the largest recomputed module (saved inside it, not
  kept), a transient of the backward.
- buckets: the dense all-reduce's flat copy of the gradients it reduces (a bucket holding one
  parameter reduces in place, sync/dense.py).
- temporaries: backward's largest transient, taken as twice the largest saved activation (the
  gradient of that activation and the tensor it flows into), a rule of thumb, not a trace; and
  the optimizer step's: torch's foreach Adam-family steps build about one parameter-sized
  intermediate (`step_temporaries`), the others none.

The peak is parameters + optimizer state + the largest of (activations + temporaries) at the
end of forward, (gradients + buckets + recompute) at the end of backward and (gradients + the
step's temporaries) during the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

# Optimizer state, in elements per updated element; torch's Adam family and Adagrad also keep
# a float32 step counter per parameter tensor.
STATE_PER_ELEMENT = {"sgd": 0, "sgd-momentum": 1, "adagrad": 1, "adam": 2, "adamw": 2,
                     "sparseadam": 2, "rmsprop": 1}
STEP_COUNTER_BYTES = {"adagrad": 4, "adam": 4, "adamw": 4, "rmsprop": 4}


@dataclass(frozen=True)
class MemoryEstimate:
    rank: int
    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    buckets: int
    temporaries: int
    step_temporaries: int
    recompute: int = 0   # backward's rebuild of the largest recomputed module's activations

    @property
    def peak(self) -> int:
        forward = self.activations + self.temporaries
        backward = self.gradients + self.buckets + self.recompute
        step = self.gradients + self.step_temporaries
        return self.parameters + self.optimizer_state + max(forward, backward, step)

    def as_dict(self) -> dict:
        return {**vars(self), "peak": self.peak}


def optimizer_kind(optimizer) -> str:
    """The STATE_PER_ELEMENT key of a torch optimizer (instance or class) or a name."""
    if isinstance(optimizer, str):
        kind = optimizer.lower()
    else:
        cls = optimizer if isinstance(optimizer, type) else type(optimizer)
        kind = cls.__name__.lower()
        if kind == "sgd" and not isinstance(optimizer, type):
            momentum = any(g.get("momentum", 0) for g in optimizer.param_groups)
            kind = "sgd-momentum" if momentum else "sgd"
    if kind not in STATE_PER_ELEMENT:
        raise ValueError(f"optimizer: expected one of {', '.join(STATE_PER_ELEMENT)}, got {kind!r}")
    return kind


@dataclass(frozen=True)
class ForwardFacts:
    activations: int              # bytes autograd saves (parameters excluded), output included
    largest: int                  # the largest of them
    lookups: dict[str, int]       # ids each embedding table is asked for
    recomputed: int = 0           # the largest recomputed module's activations, rebuilt in backward


def meta_forward(model: nn.Module, example_inputs: tuple, recompute=()) -> ForwardFacts:
    """One forward of `example_inputs` on the meta device: what autograd saves (a storage saved
    twice counts once), or for the modules in `recompute` (`Plan.recompute`) what their
    checkpoint keeps, and how many ids each table looks up."""
    from .analysis import embedding_modules

    meta_model = _on_meta(model)
    seen = _Kept({_storage(p) for p in [*meta_model.parameters(), *meta_model.buffers()]})
    lookups: dict[str, int] = {}
    units = [_Accounted(meta_model.get_submodule(name), policy, seen)
             for name, policy in recompute]

    def count(name, args):
        lookups[name] = lookups.get(name, 0) + args[0].numel()

    handles = [m.register_forward_pre_hook(lambda m, args, name=name: count(name, args))
               for name, m in embedding_modules(meta_model).items()]
    inputs = tuple(x.to("meta") if torch.is_tensor(x) else x for x in example_inputs)
    try:
        with torch.autograd.graph.saved_tensors_hooks(seen.add, lambda t: t), _WorstCaseUnique(), \
                _FusedAttention():
            out = meta_model(*inputs)
    finally:
        for h in handles:
            h.remove()
    outs = [out] if torch.is_tensor(out) else [o for o in (out or ()) if torch.is_tensor(o)]
    for o in outs:
        seen.add(o)
    inside = [n for unit in units for n in unit.saved_inside]
    return ForwardFacts(sum(seen.values()), max([*seen.values(), *inside], default=0), lookups,
                        max((r for unit in units for r in unit.rebuilt), default=0))


class _Kept(dict):
    """Storage -> bytes of the tensors counted, parameters' and buffers' left out. Each
    storage counted is held until the forward's facts are taken: a meta storage has no data
    pointer, so its key is its address, which a later tensor would reuse once it is freed."""

    def __init__(self, params: set[int]):
        super().__init__()
        self.params, self._held = params, []

    def add(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage(t)
        if key not in self.params and key not in self:
            self[key] = t.untyped_storage().nbytes()
            self._held.append(t.untyped_storage())
        return t


class _Accounted:
    """A recomputed module's forward in the meta run, counting what torch's checkpoint keeps:
    its tensor inputs (what the recompute starts from) and, under "selective", every output
    of a `SAVED_OPS` op (selective checkpointing caches them whether or not backward reads
    them). The checkpoint's own saved-tensor hooks hide both from the model-wide hook, so they
    are counted here; what autograd saves inside and is not kept is `rebuilt` in backward."""

    def __init__(self, module: nn.Module, policy: str, kept: _Kept):
        self.forward, self.policy, self.kept = module.forward, policy, kept
        self.rebuilt: list[int] = []        # per call
        self.saved_inside: list[int] = []   # sizes, for the largest saved tensor
        module.forward = self   # on the meta copy only

    def __call__(self, *args, **kwargs):
        import contextlib

        from torch.utils._pytree import tree_leaves

        for t in tree_leaves((args, kwargs)):
            if torch.is_tensor(t):
                self.kept.add(t)
        inside = _Kept(self.kept.params)
        outputs = _KeptOutputs(self.kept) if self.policy == "selective" \
            else contextlib.nullcontext()
        with torch.autograd.graph.saved_tensors_hooks(inside.add, lambda t: t), outputs:
            out = self.forward(*args, **kwargs)
        self.rebuilt.append(sum(n for s, n in inside.items() if s not in self.kept))
        self.saved_inside += inside.values()
        return out


class _KeptOutputs(TorchDispatchMode):
    def __init__(self, kept: _Kept):
        super().__init__()
        self.kept = kept

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_leaves

        from .sync.recompute import SAVED_OPS

        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in SAVED_OPS:
            for t in tree_leaves(out):
                if torch.is_tensor(t):
                    self.kept.add(t)
        return out


class _FusedAttention:
    """Attention as a fused kernel, as CPU and GPU runs take it: on the meta device torch picks
    the math path, which saves the probabilities (batch x heads x tokens^2) that no fused
    kernel keeps. `F.scaled_dot_product_attention` is swapped for the meta forward's length:
    nn.MultiheadAttention calls it from inside torch, where no TorchFunctionMode can follow
    without re-entering itself; other devices' calls go to torch's own unchanged."""

    def __enter__(self):
        self.torch_own = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = self._attention

    def __exit__(self, *exc):
        F.scaled_dot_product_attention = self.torch_own

    def _attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                   scale=None, enable_gqa=False):
        if query.device.type != "meta" or enable_gqa:
            return self.torch_own(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                  enable_gqa=enable_gqa)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]


class _WorstCaseUnique(TorchDispatchMode):
    """torch.unique on the meta device, which has no kernel for it (its output's length
    depends on the values): every element distinct, the upper bound."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        x = args[0] if args else None
        if func in _UNIQUE and torch.is_tensor(x) and x.device.type == "meta":
            flat = x.reshape(-1)
            return (torch.empty_like(flat),
                    torch.empty(x.shape, dtype=torch.long, device="meta"),
                    torch.empty(flat.shape, dtype=torch.long, device="meta"))
        return func(*args, **kwargs)


_UNIQUE = {torch.ops.aten._unique2.default, torch.ops.aten.unique_dim.default}


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata   # the storage itself: views of one count once


def _on_meta(model: nn.Module) -> nn.Module:
    """The model with every parameter and buffer on the meta device; the user's is untouched
    and never copied (a deep copy whose memo maps each tensor to an empty meta one)."""
    import copy

    memo = {}
    for t in [*model.parameters(), *model.buffers()]:
        empty = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) \
            else empty
    return copy.deepcopy(model, memo)


def estimate_memory(model: nn.Module, config=None, example_inputs: tuple = (), cluster=None,
                    optimizer="adam", rank: int = 0) -> MemoryEstimate:
    """Bytes rank `rank` holds training `model` on `example_inputs` (one rank's batch) under
    the plan `tilework.plan(model, config, cluster)` makes, with `optimizer` (a torch optimizer,
    its class or its name). Pure: runs on the meta device, needs no process group."""
    from .planner import plan as make_plan

    plan = make_plan(model, config, cluster)
    if not 0 <= rank < plan.world_size:
        raise ValueError(f"rank: expected 0..{plan.world_size - 1}, got {rank}")
    return estimate_per_rank(model, plan, example_inputs, optimizer, ranks=[rank])[0]


def estimate_per_rank(model: nn.Module, plan, example_inputs: tuple, optimizer="adam",
                      ranks=None) -> list[MemoryEstimate]:
    """`estimate_memory` for `ranks` (default: every rank) of a given plan: the forward runs
    once, each table's layout is built once."""
    from .layout import TableLayout

    kind = optimizer_kind(optimizer)
    per_element = STATE_PER_ELEMENT[kind]
    facts = meta_forward(model, example_inputs, plan.recompute)
    dense = [pp.nbytes for pp in plan.of("allreduce")]
    dense_state = per_element * sum(dense) + STEP_COUNTER_BYTES.get(kind, 0) * len(dense)
    served = [(pp, TableLayout(pp, plan.world_size, device="meta").shard_sizes)
              for pp in plan.of("ps")]
    # Flat bucket copies of the dense gradients (a lone large parameter is reduced in place).
    buckets = sum(dense) if plan.world_size > 1 and len(dense) > 1 else 0
    step = sum(dense) if kind in ("adam", "adamw") else 0
    out = []
    for rank in range(plan.world_size) if ranks is None else ranks:
        params, grads, state = sum(dense), sum(dense), dense_state
        for pp, sizes in served:
            shard = sizes[rank] * pp.row_bytes
            if pp.is_table:
                params += shard
                grads += min(facts.lookups.get(pp.name, pp.shape[0]), pp.shape[0]) * pp.row_bytes
            else:   # mode="ps": a replica to compute with, the shard its owner updates
                params, grads = params + pp.nbytes + shard, grads + pp.nbytes
            state += per_element * shard
        out.append(MemoryEstimate(rank, params, grads, state, facts.activations, buckets,
                                  2 * facts.largest, step, facts.recomputed))
    return out
