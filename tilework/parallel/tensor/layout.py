"""A layout: which modules of an unmodified model are split over the tp ranks, and how.

Mesh-TensorFlow names, per tensor dimension, the mesh axis it is split over; for the modules a
model is built of, that comes down to one word per module, so a layout is a small dict of
module-name patterns (fnmatch, matched against the whole name) to styles:

    colwise          nn.Linear, output features split (weight rows, bias)
    colwise_fused:K  nn.Linear whose output packs K projections (nanoGPT's c_attn: q, k, v;
                     a gate_up_proj: 2): each split, this rank's parts packed again, so a
                     forward that splits the output in K equal parts gets its own heads
    colwise_gather   colwise, its output all-gathered (Megatron's gather_output; HF's
                     colwise_gather_output head): the model reads whole logits
    rowwise          nn.Linear, input features split (weight columns), outputs summed
    heads            nn.MultiheadAttention split by heads (in-projection colwise, out rowwise)
    vocab_embedding  nn.Embedding, rows (the vocabulary) split, lookups summed
    vocab_head       colwise over the vocabulary; F.cross_entropy on its logits is computed
                     without gathering them (loss.py)
    sequence         a module of the regions between (LayerNorm, a position table): replicated;
                     under sequence parallelism it works on this rank's slice of the sequence
    replicate        left as it is, on every rank

`plan_layout` is pure (a meta-device model will do); `apply_layout` replaces the matched modules
in place with this rank's shards of their current values, so the split model starts as the
one-process model. Without sequence parallelism a module the layout does not name stays
replicated, which is correct wherever its activations are whole; under sequence parallelism
every parameter must be named (a replicated norm on a slice of the sequence would see only
part of its gradient), so an unnamed one is refused.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from fnmatch import fnmatchcase

from torch import nn

from ...errors import PlanError
from . import attention
from .shards import local_shape

# style -> parameter name -> spec (shards.py); names not listed are replicated
SPECS = {
    "colwise": {"weight": 0, "bias": 0},
    "colwise_fused": {"weight": "fused:K", "bias": "fused:K"},
    "colwise_gather": {"weight": 0, "bias": 0},
    "vocab_head": {"weight": 0, "bias": 0},
    "rowwise": {"weight": 1},
    "vocab_embedding": {"weight": 0},
    "heads": {"in_proj_weight": "qkv", "in_proj_bias": "qkv", "out_proj.weight": 1},
    "sequence": {},
    "replicate": {},
}
STYLES = tuple(s if s != "colwise_fused" else "colwise_fused:K" for s in SPECS)


def base_style(style: str) -> str:
    """The style without its parameter ("colwise_fused:3" -> "colwise_fused")."""
    return style.partition(":")[0]


def style_specs(style: str) -> dict[str, object] | None:
    """Parameter name -> spec for `style`; None for a style that does not exist."""
    base, _, arg = style.partition(":")
    if base not in SPECS or bool(arg) != (base == "colwise_fused"):
        return None
    if base == "colwise_fused":
        if not arg.isdigit() or int(arg) < 1:
            return None
        return {name: f"fused:{arg}" for name in SPECS[base]}
    return SPECS[base]


@dataclass(frozen=True)
class Placement:
    """One named module's style, and its parameters as (name, full shape, spec)."""

    module: str
    style: str
    kind: str
    width: int      # features per token its regions move (0: none)
    params: tuple[tuple[str, tuple[int, ...], object], ...]


@dataclass(frozen=True)
class LayoutPlan:
    placements: tuple[Placement, ...]
    tp: int
    sequence_parallel: bool
    parameters: tuple[tuple[str, tuple[int, ...]], ...]   # every parameter's full shape
    ties: tuple[tuple[str, ...], ...] = ()   # keys of one tied parameter, split alike

    def specs(self) -> dict[str, object]:
        """State-dict key -> spec, for every split parameter."""
        return {_key(p.module, name): spec for p in self.placements
                for name, _, spec in p.params if spec is not None}

    def local_shapes(self) -> dict[str, tuple[int, ...]]:
        """Parameter name -> the shape one rank holds."""
        specs = self.specs()
        return {k: local_shape(shape, specs.get(k), self.tp) for k, shape in self.parameters}


def _key(module: str, param: str) -> str:
    return f"{module}.{param}" if module else param


def _plain(module: nn.Module, base: type) -> bool:
    """`base` itself, or a subclass that keeps its forward (MultiheadAttention's out_proj)."""
    return isinstance(module, base) and type(module).forward is base.forward


def _refusal(module: nn.Module, style: str, tp: int, sp: bool) -> str | None:
    base, _, arg = style.partition(":")
    if base in ("colwise", "colwise_fused", "colwise_gather", "vocab_head", "rowwise"):
        if not _plain(module, nn.Linear):
            return f"style {style!r} splits an nn.Linear, this is {type(module).__name__}"
        features = module.in_features if style == "rowwise" else module.out_features
        parts = int(arg) * tp if base == "colwise_fused" else tp
        if features % parts:
            side = "in" if style == "rowwise" else "out"
            over = f"{arg} parts x tp={tp}" if base == "colwise_fused" else f"tp={tp}"
            return f"{side}_features={features} does not split over {over}"
    elif style == "vocab_embedding":
        if not _plain(module, nn.Embedding):
            return f"style {style!r} splits an nn.Embedding, this is {type(module).__name__}"
        if module.num_embeddings % tp:
            return f"{module.num_embeddings} rows do not split over tp={tp}"
        if module.padding_idx is not None or module.max_norm is not None or module.sparse \
                or module.scale_grad_by_freq:
            return "padding_idx, max_norm, sparse and scale_grad_by_freq are not supported"
    elif style == "heads":
        if not _plain(module, nn.MultiheadAttention):
            return f"style 'heads' splits an nn.MultiheadAttention, this is {type(module).__name__}"
        return attention.refusal(module, tp)
    elif style == "sequence" and sp and not (_plain(module, nn.LayerNorm)
                                             or _plain(module, nn.Embedding)):
        return ("under sequence parallelism style 'sequence' takes an nn.LayerNorm or a "
                f"position nn.Embedding, this is {type(module).__name__}")
    return None


def _width(module: nn.Module, style: str) -> int:
    style = base_style(style)
    if style in ("colwise", "colwise_fused", "colwise_gather", "vocab_head"):
        return module.in_features
    if style == "rowwise":
        return module.out_features
    if style in ("vocab_embedding", "sequence") and isinstance(module, nn.Embedding):
        return module.embedding_dim
    if style == "heads":
        return module.embed_dim
    return 0


def _styles(model: nn.Module, layout: dict[str, str]) -> dict[str, str]:
    """Module name -> style; every pattern must match, and no module twice."""
    chosen: dict[str, tuple[str, str]] = {}
    names = [name for name, _ in model.named_modules()]
    for pattern, style in layout.items():
        if style_specs(style) is None:
            raise PlanError(f"layout {pattern!r}: unknown style {style!r} (styles: "
                             f"{', '.join(STYLES)})")
        hits = [n for n in names if fnmatchcase(n, pattern)]
        if not hits:
            raise PlanError(f"layout pattern {pattern!r} matches no module of "
                             f"{type(model).__name__}")
        for name in hits:
            if name in chosen and chosen[name][1] != style:
                raise PlanError(f"module {name!r}: patterns {chosen[name][0]!r} and {pattern!r} "
                                 f"give it styles {chosen[name][1]!r} and {style!r}")
            chosen[name] = (pattern, style)
    return {name: style for name, (_, style) in chosen.items()}


def plan_layout(model: nn.Module, layout: dict[str, str], tp: int,
                sequence_parallel: bool = False) -> LayoutPlan:
    """Resolve `layout` on `model` for `tp` ranks, refusing by name what cannot be split."""
    styles = _styles(model, layout)
    modules = dict(model.named_modules())
    placements = []
    for name, style in styles.items():
        module = modules[name]
        why = _refusal(module, style, tp, sequence_parallel)
        if why:
            raise PlanError(f"tensor parallel: cannot apply {style!r} to {name or 'the model'!r}"
                             f" ({type(module).__name__}): {why}")
        specs = style_specs(style)
        params = tuple((p, tuple(v.shape), specs.get(p)) for p, v in module.named_parameters())
        placements.append(Placement(name, style, type(module).__name__, _width(module, style),
                                    params))
    keys = [(_key(p.module, name), p.module) for p in placements for name, _, _ in p.params]
    covered: dict[str, str] = {}
    for key, module in keys:
        if key in covered:
            raise PlanError(f"parameter {key!r} is named twice by the layout (as part of "
                             f"{covered[key] or 'the model'!r} and of {module or 'the model'!r})")
        covered[key] = module
    if sequence_parallel:
        loose = sorted({k.rpartition(".")[0] or k for k, _ in model.named_parameters()
                        if k not in covered})
        if loose:
            raise PlanError("sequence parallelism needs every module with parameters in the "
                             f"layout ('sequence' or 'replicate' where it is not split); not "
                             f"named: {', '.join(loose)}")
    return LayoutPlan(tuple(placements), tp, sequence_parallel,
                      tuple((k, tuple(v.shape)) for k, v in model.named_parameters()),
                      _ties(model, placements))


def _ties(model: nn.Module, placements) -> tuple[tuple[str, ...], ...]:
    """Parameters shared by several modules (an LM's embedding and head): kept one parameter
    when every owner splits it alike (vocab_embedding and vocab_head both split the vocabulary
    rows, as Megatron-LM ties them), refused when the owners would split it differently."""
    spec_of = {_key(p.module, name): spec for p in placements for name, _, spec in p.params}
    owners: dict[int, list[str]] = {}
    for key, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(key)
    ties = []
    for keys in owners.values():
        if len(keys) < 2:
            continue
        specs = {repr(spec_of.get(k)) for k in keys}
        if len(specs) > 1:
            raise PlanError(f"tensor parallel: {' and '.join(keys)} are one tied parameter, "
                             f"but the layout splits them differently "
                             f"({', '.join(f'{k}: {spec_of.get(k)}' for k in keys)}); give their "
                             "modules styles that split it alike (vocab_embedding with "
                             "vocab_head), or untie them")
        ties.append(tuple(keys))
    return tuple(ties)


# The reference GPT (models/gpt.py): Megatron-LM's split of a transformer, named.
GPT_LAYOUT = {
    "tokens": "vocab_embedding",
    "positions": "sequence",
    "blocks.layers.*.self_attn": "heads",
    "blocks.layers.*.linear1": "colwise",
    "blocks.layers.*.linear2": "rowwise",
    "blocks.layers.*.norm[12]": "sequence",
    "norm": "sequence",
    "head": "vocab_head",
}


# Hugging Face transformers' tensor-parallel styles (a model's `_tp_plan`, its config's
# `base_model_tp_plan`) in ours: the same splits under Megatron's names.
HF_STYLES = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "colwise_gather_output": "colwise_gather",   # the LM head: HF's loss reads whole logits
    "colwise_rep": "colwise_gather",             # its name in transformers 4.x
    "embedding_rowwise": "vocab_embedding",
    "packed_colwise": "colwise_fused:2",         # gate_up_proj: gate and up packed
    "replicate": "replicate",
}


def models_own_layout(model: nn.Module) -> dict[str, str] | None:
    """The tensor-parallel plan a model ships, in our styles: Hugging Face's `_tp_plan` (the
    instance's, which prefixes its base model's `config.base_model_tp_plan`), else the
    config's base plan under `base_model_prefix`. Patterns that match no module of this
    model (a plan covers optional parts) are left out; a style we do not have is refused
    by name. None where the model ships no plan."""
    plan = dict(getattr(model, "_tp_plan", None) or {})
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None) if config is not None else None
    if not plan and base:
        prefix = getattr(model, "base_model_prefix", "")
        inner = prefix if prefix and hasattr(model, prefix) else ""
        plan = {(f"{inner}.{k}" if inner else k): v for k, v in base.items()}
    if not plan:
        return None
    names = [name for name, _ in model.named_modules()]
    parameters = [name for name, _ in model.named_parameters()]
    layout, by_parameter = {}, []
    for pattern, style in plan.items():
        if not any(fnmatchcase(n, pattern) for n in names):
            if any(fnmatchcase(n, pattern) for n in parameters):
                by_parameter.append(f"{pattern} ({style})")
            continue
        if style not in HF_STYLES:
            raise PlanError(f"{type(model).__name__}'s own tensor-parallel plan gives "
                            f"{pattern!r} the style {style!r}, which tilework does not have "
                            f"(it has {', '.join(sorted(HF_STYLES))}); pass layout= instead")
        layout[pattern] = HF_STYLES[style]
    if by_parameter:   # training stays right (replicated), but not as the plan meant
        warnings.warn(f"{type(model).__name__}'s own tensor-parallel plan splits parameters, "
                      f"not modules: {', '.join(by_parameter)}; tilework splits modules only, "
                      "so these stay whole on every tp rank (pass layout= to split them)",
                      stacklevel=2)
    return layout or None


def layout_for(model: nn.Module) -> dict[str, str]:
    """A built-in layout: the reference GPT's; else the plan the model ships (Hugging Face's
    `_tp_plan` / `base_model_tp_plan`, `models_own_layout`); else one from common module
    shapes found in `model`: every nn.TransformerEncoderLayer (attention by heads, its MLP
    colwise then rowwise, its norms 'sequence') and every nn.Sequential holding Linear,
    elementwise modules, Linear (colwise, rowwise: one sum per pair). Modules it does not name
    stay replicated; under sequence parallelism name them too."""
    from ...models.gpt import TinyGPT

    if type(model) is TinyGPT:
        return dict(GPT_LAYOUT)
    own = models_own_layout(model)
    if own is not None:
        return own
    layout: dict[str, str] = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, nn.TransformerEncoderLayer):
            layout |= {f"{prefix}self_attn": "heads", f"{prefix}linear1": "colwise",
                       f"{prefix}linear2": "rowwise", f"{prefix}norm1": "sequence",
                       f"{prefix}norm2": "sequence"}
        elif isinstance(module, nn.TransformerEncoder) and module.norm is not None:
            layout[f"{prefix}norm"] = "sequence"
        elif isinstance(module, nn.Sequential):
            layout |= _mlp_pairs(prefix, list(module.named_children()))
    if not layout:
        raise PlanError(f"no built-in layout fits {type(model).__name__}: no transformer "
                         "encoder layer or Linear-Linear MLP found; write a layout")
    return layout


_ELEMENTWISE = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Dropout, nn.Identity)


def _mlp_pairs(prefix: str, children: list[tuple[str, nn.Module]]) -> dict[str, str]:
    """Linear, elementwise..., Linear with matching widths: the first colwise, the second
    rowwise (the hidden activations stay split between them)."""
    out: dict[str, str] = {}
    i = 0
    while i < len(children):
        name, first = children[i]
        j = i + 1
        while j < len(children) and isinstance(children[j][1], _ELEMENTWISE):
            j += 1
        if (j < len(children) and _plain(first, nn.Linear) and _plain(children[j][1], nn.Linear)
                and first.out_features == children[j][1].in_features):
            out[f"{prefix}{name}"] = "colwise"
            out[f"{prefix}{children[j][0]}"] = "rowwise"
            i = j + 1
        else:
            i += 1
    return out
