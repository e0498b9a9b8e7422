"""Inspect a model: each parameter's size, and whether its gradient is sparse (touches few rows).

Pure: reads module types and shapes only (works on the meta device). A gradient is sparse when
PyTorch makes it a sparse tensor (`nn.Embedding(sparse=True)`, `nn.EmbeddingBag(sparse=True)`);
a table with a dense-layout gradient is "embedding-like" and its touched-row fraction can be
measured (`measure_density`) and given to the planner. A table tied to another module (a word
LM's decoder sharing its encoder's weight) has one gradient, the sum of every use: autograd adds
the embedding's sparse part to the Linear's dense one and gives a dense `.grad`, so such a table
is "embedding" whatever its `sparse` flag, and `ParamInfo.tied` names its other registrations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .plan import Kind, TensorFacts


@dataclass(frozen=True)
class ParamInfo(TensorFacts):
    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: Kind                 # sparse gradient / embedding with dense-layout gradient / dense
    density: float | None = None  # measured touched-row fraction, where known
    tied: tuple[str, ...] = ()    # the parameter's other names (tied weights), as registered


def embedding_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Parameter name -> the Embedding/EmbeddingBag that owns it."""
    return {f"{m_name}.weight" if m_name else "weight": m for m_name, m in model.named_modules()
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag))}


def analyze(model: nn.Module, density: dict[str, float] | None = None) -> list[ParamInfo]:
    tables = embedding_modules(model)
    density = density or {}
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    infos = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        module = tables.get(name)
        tied = tuple(n for n in names[id(p)] if n != name)
        kind: Kind = "dense" if module is None else (
            "sparse" if all(_sparse_table(tables.get(n)) for n in (name, *tied)) else "embedding")
        infos.append(ParamInfo(name, tuple(p.shape), str(p.dtype).removeprefix("torch."), kind,
                               density.get(name), tied))
    return infos


def _sparse_table(module: nn.Module | None) -> bool:
    return module is not None and bool(module.sparse)


def row_density(grad: torch.Tensor) -> float:
    """Fraction of a table's rows that a gradient touches."""
    rows = grad.shape[0]
    if grad.is_sparse:
        return grad.coalesce().indices()[0].unique().numel() / rows
    return (grad.reshape(rows, -1) != 0).any(dim=1).sum().item() / rows


def measure_density(model: nn.Module, loss_fn, batches) -> dict[str, float]:
    """Mean per-step touched-row fraction of every embedding table's gradient on `batches`.

    Runs forward and backward locally, then clears the gradients: no step is taken.
    """
    tables = {name: m.weight for name, m in embedding_modules(model).items()}
    fractions: dict[str, list[float]] = {name: [] for name in tables}
    for batch in batches:
        model.zero_grad(set_to_none=True)
        loss_fn(model, batch).backward()
        for name, w in tables.items():
            fractions[name].append(0.0 if w.grad is None else row_density(w.grad))
    model.zero_grad(set_to_none=True)
    return {name: sum(f) / len(f) for name, f in fractions.items() if f}


# -- activation recompute: which modules, by a rule or by name patterns ------------------------

def recompute_units(model: nn.Module) -> list[str]:
    """The modules that `recompute="full"` or `"selective"` recomputes when no names are given:
    the model's repeated blocks.

    Rule: walking `named_modules()` from the root, an `nn.ModuleList` or `nn.Sequential` of at
    least two children of one class, each owning parameters and none an embedding, is a stack
    of blocks; its children are the units, and nothing inside them is looked at again (the
    outermost stack wins). A transformer's layers and a ResNet's residual blocks are such
    stacks; DLRM's tables (embeddings) and an MLP's Linear/ReLU `Sequential` (two classes) are
    not. A block with no forward of its own (a ModuleDict the model's loop indexes) gives its
    children instead. A model without one: the root's direct children that own parameters,
    have a forward of their own (not a ModuleList/ModuleDict) and are not embeddings.
    """
    units: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(u + ".") for u in units):
            continue
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and is_stack(module):
            for child, block in module.named_children():
                units += _called(f"{name}.{child}" if name else child, block)
    if units:
        return units
    return [name for name, child in model.named_children()
            if _has_forward(child) and not _is_table(child) and _owns_parameters(child)]


def is_stack(container: nn.Module) -> bool:
    children = list(container.children())
    return (len(children) >= 2 and len({type(c) for c in children}) == 1
            and not _is_table(children[0])
            and all(_owns_parameters(c) for c in children))


def _owns_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _called(name: str, block: nn.Module) -> list[str]:
    """`block` as units whose forward runs: a block that is a ModuleDict or ModuleList (a
    layer written as `layer["attn"](layer["norm"](x))`) is never called itself, so its
    children that own parameters are, each its own unit (a hook on it would never fire)."""
    if _has_forward(block):
        return [name]
    return [unit for child, part in block.named_children() if _owns_parameters(part)
            for unit in _called(f"{name}.{child}", part)]


def _has_forward(module: nn.Module) -> bool:
    return not isinstance(module, (nn.ModuleList, nn.ModuleDict))


def _is_table(module: nn.Module) -> bool:
    return isinstance(module, (nn.Embedding, nn.EmbeddingBag))


def recompute_choices(model: nn.Module, setting) -> tuple[tuple[str, str], ...]:
    """(module name, "full" | "selective") for each module `setting` recomputes: "none",
    "full" or "selective" for every `recompute_units` module, or {glob pattern: policy} over
    `named_modules()` names (the first pattern matching a module decides; a module inside one
    already chosen is not chosen again, so "blocks.*" takes the blocks, not their parts).
    Raises PlanError naming `recompute` and the pattern that matches nothing."""
    from fnmatch import fnmatchcase

    from ..errors import PlanError

    if setting in (None, "none"):
        return ()
    if isinstance(setting, str):
        units = recompute_units(model)
        if not units:
            raise PlanError(f"recompute={setting!r}: the model has no blocks to recompute "
                            "(no repeated blocks, no child with parameters): name modules, "
                            "recompute={'pattern': 'full'}")
        return tuple((name, setting) for name in units)
    chosen: dict[str, str] = {}
    used: set[str] = set()
    shadowed: dict[str, str] = {}   # pattern -> a module it matched that was taken already
    for name, module in model.named_modules():
        matching = [p for p in setting if fnmatchcase(name, p)]
        if not name or not matching or not _has_forward(module):
            continue
        outer = next((c for c in chosen if name.startswith(c + ".")), None)
        if outer is None:
            chosen[name] = setting[matching[0]]
            used.add(matching[0])
        for pattern in matching[1:] if outer is None else matching:
            shadowed.setdefault(pattern, name)
    for pattern in setting:
        if pattern in used:
            continue
        if pattern in shadowed:
            raise PlanError(f"recompute: pattern {pattern!r} chooses nothing: what it matches "
                            f"(e.g. {shadowed[pattern]!r}) an earlier pattern chose already, "
                            "or sits inside a module chosen whole")
        names = [n for n, m in model.named_modules() if n and _has_forward(m)]
        raise PlanError(f"recompute: pattern {pattern!r} matches no module with a forward "
                        f"(names as model.named_modules() gives them, e.g. "
                        f"{', '.join(repr(n) for n in names[:4])})")
    return tuple(chosen.items())


def owning_units(model: nn.Module) -> dict[str, str]:
    """Parameter name -> the unit that ZeRO stage 3 gathers it with: the `recompute_units`
    block holding it, or "" (the model itself) for the rest."""
    owner = {name: "" for name, _ in model.named_parameters()}
    units_of: dict[int, set[str]] = {id(p): set() for p in model.parameters()}
    for unit in recompute_units(model):   # outermost stacks only: no unit inside another
        for name, p in model.get_submodule(unit).named_parameters(prefix=unit):
            units_of[id(p)].add(unit)
            if name in owner:
                owner[name] = unit
    # A parameter shared by two modules (tied weights) is gathered with the model, which is
    # gathered whenever either runs. Every registration once, not once a parameter: a walk
    # of the model per parameter made this quadratic (most of a mesh search's time).
    registered: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        registered.setdefault(id(p), []).append(name)
    for name, p in model.named_parameters():
        if len(units_of[id(p)]) > 1 or (units_of[id(p)] and _tied_outside(registered[id(p)],
                                                                          owner[name])):
            owner[name] = ""
    return owner


def _tied_outside(names: list[str], unit: str) -> bool:
    """One of a parameter's registered `names` lies outside `unit` (tied to the model's head,
    say)."""
    return any(not name.startswith(unit + ".") for name in names)
