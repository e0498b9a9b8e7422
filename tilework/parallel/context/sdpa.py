"""Context parallelism wherever a model calls `F.scaled_dot_product_attention`.

Models rarely hold an `nn.MultiheadAttention` to replace: nanoGPT calls
`F.scaled_dot_product_attention(q, k, v, is_causal=True)` in its own forward, and Hugging Face's
models reach it through their attention registry (`ALL_ATTENTION_FUNCTIONS["sdpa"]`, chosen by
`config._attn_implementation`). There is no module to swap, so while a cp model's forward runs,
a `RingSDPA` torch function mode sees every torch call it makes and changes two kinds:

- `F.scaled_dot_product_attention(q, k, v, ...)` on this rank's tokens runs as
  `ring_attention` over the cp group: causal (`is_causal=True`, or an `attn_mask` that is the
  causal mask over the local sequence: local order is global order, so that is the global
  causal mask restricted to this rank) or unmasked. GQA (`enable_gqa=True`) repeats the key
  and value heads first. Anything else (other masks, dropout, cross-attention) is refused with a
  PlanError naming the calling module and line.
- Learned position tables: a tensor from `torch.arange(n)` (n = the local sequence length), or
  a reshape of it, looked up by `F.embedding` (nanoGPT's `wpe(torch.arange(0, t))`) is read as
  local slots and looked up at this rank's global positions.
- Position tables held as buffers: a model buffer sliced `[0:n]` or `[:n]` along its first
  dimension (torchtitan's rotary table, `freqs_cis[0:seqlen]`) gives this rank's global
  positions' rows instead. Only the model's own buffers, only that slice: other tensors of the
  local length are not positions.

A forward that returns one per-token tensor (batch, local sequence, ...) (torchtitan's logits,
which its trainer's loss reads beside whole targets) returns it whole: gathered over cp, its
backward keeping this rank's tokens' gradient. Every cp rank then computes the loss over the
whole sequence, the gather costs what the output weighs (counted under "cp"), and a model that
takes its targets computes its loss on its own tokens instead (nothing gathered).

Why a mode: it reaches every call site, including names bound by `from torch.nn.functional
import scaled_dot_product_attention` that patching the attribute would miss, and it is
thread-local, so other models in the process are untouched. Its cost is a Python call per torch
call inside the forward. Backward needs no mode: `ring_attention` is an autograd Function.

`RingForward` holds the hooks that enter and leave the mode around the model's forward (after
the sequence is cut), and passes global `position_ids` to a forward that takes them (Hugging
Face's convention: rotary embeddings and absolute positions are computed from them), and
re-enters the mode for activation recompute. docs/context-parallel.md says what is covered.
"""

from __future__ import annotations

import inspect
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ...comm import counted
from ...errors import PlanError
from .comm import Ring
from .layout import global_of_local, local_positions, shard, unshard
from .ring import ring_attention

_SDPA = F.scaled_dot_product_attention
# Ops that keep an index tensor's values, only moving them around: a reshape of the positions
# arange is still local slots.
_KEEPS_VALUES = {torch.Tensor.unsqueeze, torch.unsqueeze, torch.Tensor.expand,
                 torch.Tensor.expand_as, torch.Tensor.view, torch.Tensor.reshape, torch.reshape,
                 torch.Tensor.contiguous, torch.Tensor.to, torch.Tensor.flatten, torch.flatten}
_TORCH_DIR = os.path.dirname(torch.__file__)
_HERE = os.path.dirname(__file__)


def _arange_is_slots(args, kwargs, local: int) -> bool:
    """Whether torch.arange(args, kwargs) is 0..local-1 (read from its arguments: no sync)."""
    if len(args) == 1 and not {"start", "end", "step"} & set(kwargs):
        start, end, step = 0, args[0], 1
    else:
        named = dict(zip(("start", "end", "step"), args), **kwargs)
        start, end, step = named.get("start", 0), named.get("end"), named.get("step", 1)
    dtype = kwargs.get("dtype")
    return (start == 0 and end == local and step == 1
            and (dtype is None or not dtype.is_floating_point))


def _causal_or_none(mask: torch.Tensor, lq: int, lk: int) -> bool | None:
    """True: the mask is causal; False: it masks nothing; None: neither. SDPA's convention: a
    boolean mask is True where attention is allowed, a float mask is added to the scores."""
    if mask.shape[-2:] != (lq, lk):
        return None
    if mask.dtype == torch.bool:
        allowed = mask
    else:
        blocked = mask <= torch.finfo(mask.dtype).min
        if not bool(((mask == 0) | blocked).all()):
            return None
        allowed = ~blocked
    if bool(allowed.all()):
        return False
    keep = torch.ones(lq, lk, dtype=torch.bool, device=mask.device).tril()
    return True if bool((allowed == keep).all()) else None


class RingSDPA(TorchFunctionMode):
    """The mode: SDPA calls as ring attention, position-table lookups at global positions.
    `names` maps id(module) to its name in the model, to name a refused call."""

    def __init__(self, ring: Ring, names: dict[int, str]):
        super().__init__()
        self.ring, self.names = ring, names
        self.local = 0
        self.calls = 0        # SDPA calls run as ring attention in this forward
        self.slots: list[torch.Tensor] = []   # this forward's local-slot aranges
        self.buffers: set[int] = set()        # ids of the model's buffers (position tables)

    def start(self, local: int, buffers: set[int] = frozenset()) -> None:
        self.local, self.calls, self.slots, self.buffers = local, 0, [], set(buffers)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA:
            return self.attention(*args, **kwargs)
        if func is F.embedding and args and self._is_slots(args[0]):
            ids = global_of_local(args[0], self.local, self.ring.rank, self.ring.size)
            args = (ids, *args[1:])
        if func is torch.Tensor.__getitem__ and len(args) == 2 and id(args[0]) in self.buffers \
                and self._is_leading_slice(args[1]):
            return self._global_rows(args[0])
        out = func(*args, **kwargs)
        if (func is torch.arange and _arange_is_slots(args, kwargs, self.local)) or \
                (func in _KEEPS_VALUES and args and self._is_slots(args[0])):
            self.slots.append(out)
        return out

    def _is_slots(self, t) -> bool:
        return any(t is s for s in self.slots)

    def _is_leading_slice(self, index) -> bool:
        """`[0:local]` or `[:local]` on the first dimension (alone, or first of a tuple)."""
        if isinstance(index, tuple) and len(index) == 1:
            index = index[0]
        return isinstance(index, slice) and index.start in (None, 0) and \
            index.stop == self.local and index.step in (None, 1)

    def _global_rows(self, table: torch.Tensor) -> torch.Tensor:
        whole = self.local * self.ring.size
        if table.shape[0] < whole:
            raise PlanError(f"a position buffer of {table.shape[0]} rows sliced [0:{self.local}]"
                             f" under cp={self.ring.size}: the whole sequence needs {whole}")
        return table[local_positions(whole, self.ring.rank, self.ring.size, table.device)]

    def attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                  scale=None, enable_gqa=False):
        causal = self._causal(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
        if enable_gqa and key.shape[-3] != query.shape[-3]:
            # Each query head's key/value head, repeated: the ring carries them repeated.
            repeat = query.shape[-3] // key.shape[-3]
            key, value = (t.repeat_interleave(repeat, dim=-3) for t in (key, value))
        self.calls += 1
        return ring_attention(query, key, value, self.ring, causal, scale)

    def _causal(self, query, key, value, attn_mask, dropout_p, is_causal, enable_gqa) -> bool:
        """Refuse by call site what ring attention cannot do; else whether it is causal."""
        def refuse(problem: str):
            raise PlanError(f"{self.call_site()} (ring attention over cp={self.ring.size}): "
                             f"{problem}")

        if dropout_p > 0:
            refuse(f"dropout_p={dropout_p} (each rank would drop its own pattern, not one "
                   "process's); set the attention dropout to 0 under context parallelism")
        if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
            refuse("q, k and v must be (batch, heads, sequence, head_dim)")
        if not query.shape[-2] == key.shape[-2] == value.shape[-2]:
            refuse(f"queries over {query.shape[-2]} tokens and keys over {key.shape[-2]}: "
                   "self-attention over the sequence only (no cross-attention or KV cache)")
        if not query.shape[-1] == key.shape[-1] == value.shape[-1]:
            refuse("q, k and v must share one head_dim")
        hq, hk = query.shape[-3], key.shape[-3]
        if hk != value.shape[-3] or (hq != hk and not (enable_gqa and hq % hk == 0)) or \
                query.shape[0] != key.shape[0]:
            refuse(f"q {tuple(query.shape)}, k {tuple(key.shape)}, v {tuple(value.shape)}: "
                   "one key/value head per query head, or enable_gqa=True with a divisor")
        if attn_mask is None:
            return bool(is_causal)
        if is_causal:
            refuse("attn_mask together with is_causal=True; pass one of them")
        kind = _causal_or_none(attn_mask, query.shape[-2], key.shape[-2])
        if kind is None:
            refuse(f"this {tuple(attn_mask.shape)} {attn_mask.dtype} attn_mask is neither "
                   "causal nor empty; ring attention runs causal or unmasked attention only "
                   "(pass is_causal=True or no mask)")
        return kind

    def call_site(self) -> str:
        """'module name: F.scaled_dot_product_attention at file:line (function)', from the
        stack: the first frame outside torch and this package, and the nearest module in it."""
        frame, line, module = sys._getframe(1), None, None
        while frame is not None and (line is None or module is None):
            path = frame.f_code.co_filename
            if line is None and not path.startswith((_TORCH_DIR, _HERE)):
                short = os.path.join(*path.split(os.sep)[-2:])
                line = f"{short}:{frame.f_lineno} ({frame.f_code.co_name})"
            if module is None:
                for key in ("self", "module"):
                    name = self.names.get(id(frame.f_locals.get(key)))
                    if name is not None:
                        module = name or "the model"
                        break
            frame = frame.f_back
        return f"{module or 'the model'}: F.scaled_dot_product_attention at {line}"


class RingForward:
    """The model's forward run under RingSDPA: `before` (a forward pre-hook with kwargs, after
    the sequence is cut) and `after` (a forward hook with kwargs, always called).

    A forward that takes `position_ids` and is given none gets this rank's global positions,
    shape (1, local); one given 1-D global positions gets its part. Hugging Face reads
    positions that jump as packed sequences when no `attention_mask` is passed, so a forward
    that also takes `attention_mask` and is given none gets all ones (no padding), as its
    tokenizer would pass. `modules_ring`: attention modules already run the ring, so a forward
    without SDPA calls is not refused."""

    def __init__(self, model: nn.Module, ring: Ring, modules_ring: bool):
        self.mode = RingSDPA(ring, {id(m): name for name, m in model.named_modules()})
        self.model = model
        self.ring, self.modules_ring = ring, modules_ring
        self.model_name = type(model).__name__
        self.signature = inspect.signature(model.forward)
        self.active = None   # the module whose hook entered the mode

    def before(self, module, args, kwargs):
        if self.active is not None:   # a nested call of the model: already under the mode
            return None
        seqs = [t for t in (*args, *kwargs.values()) if torch.is_tensor(t) and t.dim() >= 2]
        if not seqs:
            raise PlanError(f"{self.model_name}: context parallelism cuts (batch, sequence) "
                             "tensor inputs, and this call has none")
        local, device, batch = seqs[0].shape[1], seqs[0].device, seqs[0].shape[0]
        self._refuse_local_label_shift(module, kwargs)
        args, kwargs = self._positions(args, kwargs, local, device, batch)
        # Read each forward: a model may assign its buffers anew (torchtitan's init_weights).
        self.mode.start(local, {id(b) for b in self.model.buffers()})
        self.mode.__enter__()
        self.active = module
        return args, kwargs

    def _refuse_local_label_shift(self, module, kwargs) -> None:
        # Hugging Face's causal-LM losses shift `labels` by one token inside the sequence they
        # are given: on a rank's two chunks that pairs tokens that are not neighbours.
        if type(module).__module__.startswith("transformers.") and \
                kwargs.get("labels") is not None and kwargs.get("shift_labels") is None:
            raise PlanError(f"{self.model_name}(labels=...) under context parallelism: the "
                             "loss would shift labels within this rank's chunks; pass the "
                             "next tokens as shift_labels= too (labels=y, shift_labels=y)")

    def _positions(self, args, kwargs, local: int, device, batch: int):
        params = self.signature.parameters
        if "position_ids" not in params:
            return args, kwargs
        bound = self.signature.bind_partial(*args, **kwargs)
        given = bound.arguments.get("position_ids")
        n = self.ring.size
        if given is None:
            bound.arguments["position_ids"] = local_positions(
                local * n, self.ring.rank, n, device).unsqueeze(0)
            if "attention_mask" in params and bound.arguments.get("attention_mask") is None:
                bound.arguments["attention_mask"] = torch.ones(batch, local, dtype=torch.long,
                                                               device=device)
        elif torch.is_tensor(given) and given.dim() == 1 and given.shape[0] == local * n:
            bound.arguments["position_ids"] = shard(given, self.ring.rank, n, dim=0)
        return bound.args, bound.kwargs

    def inside_before(self, module, args, kwargs):
        """Activation recompute reruns a block's forward in backward, outside the model's:
        hooked on the children of a recomputed block, this puts their SDPA calls under the
        mode again (the same local length as the forward they repeat)."""
        if self.active is None:
            self.mode.__enter__()
            self.active = module

    def inside_after(self, module, args, kwargs, output):
        if self.active is module:
            self.mode.__exit__(None, None, None)
            self.active = None

    def after(self, module, args, kwargs, output):
        if self.active is not module:
            return None
        self.mode.__exit__(None, None, None)
        self.active = None
        if output is not None and self.mode.calls == 0 and not self.modules_ring:
            raise PlanError(
                f"{self.model_name}: context parallelism found no attention to run as ring "
                "attention (no nn.MultiheadAttention, and its forward called no "
                "F.scaled_dot_product_attention); a Hugging Face model needs "
                "attn_implementation='sdpa'")
        if torch.is_tensor(output) and output.dim() >= 2 and \
                output.shape[1] == self.mode.local and self.ring.size > 1:
            return _GatherSequence.apply(output, self.ring)
        return None


class _GatherSequence(torch.autograd.Function):
    """A per-token output whole over cp; backward: this rank's tokens' gradient, times cp.
    Every cp rank computes the same loss on the whole output, so rank r's gradient is its
    tokens' share of the loss's; the engine averages gradients over cp, hence the factor."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, ring: Ring) -> torch.Tensor:
        ctx.ring = ring
        parts = counted.all_gather(local.contiguous(), ring.group, ring.stats, ring.method)
        return unshard(parts, dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ring = ctx.ring
        return shard(grad, ring.rank, ring.size, dim=1) * ring.size, None
