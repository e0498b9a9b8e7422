"""One forward on the meta device, to learn what a training step would hold without holding
it: the bytes autograd saves for backward (or, in modules the plan recomputes, what their
checkpoint keeps), the largest of them, and how many ids each embedding table is asked for.
Read by the memory estimator (estimate/memory.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


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
    from ..plans.analysis import embedding_modules

    meta_model = on_meta(model)
    seen = _Kept({_storage(p) for p in [*meta_model.parameters(), *meta_model.buffers()]})
    lookups: dict[str, int] = {}
    units = [_Accounted(meta_model.get_submodule(name), policy, seen)
             for name, policy in recompute]

    def count(name, args, kwargs):
        ids = args[0] if args else kwargs.get("input")   # `emb(input=ids)` counts too
        if ids is not None:
            lookups[name] = lookups.get(name, 0) + ids.numel()

    handles = [m.register_forward_pre_hook(
        lambda m, args, kwargs, name=name: count(name, args, kwargs), with_kwargs=True)
        for name, m in embedding_modules(meta_model).items()]
    inputs = tuple(x.to("meta") if torch.is_tensor(x) else x for x in example_inputs)
    try:
        with torch.autograd.graph.saved_tensors_hooks(seen.add, lambda t: t), WorstCaseUnique(), \
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

        from ..runtime.recompute import SAVED_OPS

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


class WorstCaseUnique(TorchDispatchMode):
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


def on_meta(model: nn.Module) -> nn.Module:
    """The model with every parameter and buffer on the meta device; the user's is untouched
    and never copied (a deep copy whose memo maps each tensor to an empty meta one)."""
    import copy

    memo = {}
    for t in [*model.parameters(), *model.buffers()]:
        empty = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) \
            else empty
    return copy.deepcopy(model, memo)
