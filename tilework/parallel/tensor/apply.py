"""Apply a layout to a model in place, and keep its checkpoints in single-device layout.

    tp = TensorParallel.from_mesh(groups, stats, sequence_parallel=True)
    plan = apply_layout(model, layout_for(model), tp)      # before the optimizer is made
    ...
    state = full_state_dict(model, plan, tp)             # every rank: the one-process keys
    load_full_state_dict(model, plan, tp, state)         # and back, each rank its shards
"""

from __future__ import annotations

import torch
from torch import nn

from ...comm import counted
from .attention import HeadParallelAttention
from .layers import (
    ColumnParallelLinear,
    GatheredColumnParallelLinear,
    RowParallelLinear,
    SequenceParallelEmbedding,
    SequenceParallelLayerNorm,
    VocabParallelEmbedding,
    VocabParallelHead,
)
from .layout import LayoutPlan, Placement, base_style, plan_layout
from .regions import TensorParallel
from .shards import shard, unshard

# colwise_fused holds its parts' slices packed (shards.py): a plain column-parallel layer.
_SPLIT = {"colwise": ColumnParallelLinear, "colwise_fused": ColumnParallelLinear,
          "colwise_gather": GatheredColumnParallelLinear, "rowwise": RowParallelLinear,
          "vocab_head": VocabParallelHead, "vocab_embedding": VocabParallelEmbedding,
          "heads": HeadParallelAttention}
_SEQUENCE = {nn.LayerNorm: SequenceParallelLayerNorm, nn.Embedding: SequenceParallelEmbedding}


def _replacement(module: nn.Module, p: Placement, tp: TensorParallel) -> nn.Module | None:
    if base_style(p.style) in _SPLIT:
        return _SPLIT[base_style(p.style)](module, tp)
    if p.style == "sequence" and tp.sequence_parallel and tp.size > 1:
        kind = next(k for k in _SEQUENCE if isinstance(module, k))
        return _SEQUENCE[kind](module, tp)
    return None


@torch.no_grad()
def apply_layout(model: nn.Module, layout: dict[str, str], tp: TensorParallel,
                 changes=None) -> LayoutPlan:
    """Replace the modules `layout` names by tensor-parallel ones holding this rank's shards of
    their current values; returns the plan. Every tp rank must start from the same values
    (seed alike, or load one checkpoint). Make the optimizer afterwards: the parameters it
    would hold are replaced. `changes` (sync.changes.Changes): each replacement recorded with
    its undo (the original module back, holding its values from before)."""
    plan = plan_layout(model, layout, tp.size, tp.sequence_parallel)
    record = changes.record if changes is not None else (lambda what, undo: None)
    for p in plan.placements:
        parent_name, _, attr = p.module.rpartition(".")
        if not attr:
            continue   # the model itself: only 'replicate' or 'sequence' would name it
        parent, module = model.get_submodule(parent_name), model.get_submodule(p.module)
        new = _replacement(module, p, tp)
        if new is None:
            continue
        new.train(module.training)
        specs = dict((name, spec) for name, _, spec in p.params)
        for name, param in new.named_parameters():
            full = module.get_parameter(name)
            param.copy_(shard(full, specs[name], tp.rank, tp.size))
            param.requires_grad_(full.requires_grad)
        setattr(parent, attr, new)
        record(f"{p.module}: replaced by {type(new).__name__} (tp {p.style})",
               lambda parent=parent, attr=attr, module=module: setattr(parent, attr, module))
    for keys in plan.ties:   # each owner was given a shard of its own: one again, as before
        shared = model.get_parameter(keys[0])
        for key in keys[1:]:
            owner, _, name = key.rpartition(".")
            owner = model.get_submodule(owner)
            before = owner._parameters.get(name)
            setattr(owner, name, shared)
            record(f"{key}: tied to {keys[0]}'s shard",
                   lambda owner=owner, name=name, before=before: setattr(owner, name, before))
    return plan


def full_state_dict(model: nn.Module, plan: LayoutPlan, tp: TensorParallel,
                    method: str = "checkpoint") -> dict[str, torch.Tensor]:
    """The one-process model's state dict, on every tp rank: split parameters all-gathered
    over tp (counted under `method`), everything else as this rank holds it."""
    specs = plan.specs()
    out = {}
    for key, value in model.state_dict().items():
        if key in specs and tp.size > 1:
            parts = counted.all_gather(value.contiguous(), tp.group, tp.stats, method)
            value = unshard(parts, specs[key])
        out[key] = value
    return out


@torch.no_grad()
def load_full_state_dict(model: nn.Module, plan: LayoutPlan, tp: TensorParallel,
                         state: dict[str, torch.Tensor]) -> None:
    """Load a one-process state dict: each rank copies in its shards (no communication)."""
    specs = plan.specs()
    mine = model.state_dict()
    if set(state) != set(mine):
        missing, extra = sorted(set(mine) - set(state)), sorted(set(state) - set(mine))
        raise ValueError(f"state dict keys differ: missing {missing}, unexpected {extra}")
    for key, value in mine.items():
        value.copy_(shard(state[key], specs.get(key), tp.rank, tp.size))


@torch.no_grad()
def average_gradients(model: nn.Module, group, stats: counted.Stats, method: str = "dp") -> None:
    """Data parallelism across the dp axis, plainly: every gradient (shards included: the dp
    group's ranks share a tp coordinate) averaged in one flat all-reduce after backward."""
    n = counted.group_size(group)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if n == 1 or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    counted.all_reduce(flat, group, stats, method)
    flat /= n
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))
