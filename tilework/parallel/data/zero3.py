"""ZeRO stage 3: a parameter's values live only as shards between uses. Its full tensor is
all-gathered just before the module that owns it runs forward, freed after; gathered again
just before that module's backward, and freed once its gradient is reduce-scattered.

Parameters are grouped into units as the plan says (`ParamPlan.unit`, from
`analysis.owning_units`): one per repeated block (a transformer's layers, a ResNet's blocks)
plus the model itself for the rest (embeddings, heads, norms, tied weights), as torchtitan
applies FSDP2's `fully_shard` per block and to the root. The root unit stays
gathered from its forward to the end of backward, since it is used at both ends.

Freeing keeps the parameter object and its tensor, and resizes the tensor's storage to zero
(as FSDP2 does): views autograd saved in forward see the values again once the storage is
regathered, so backward needs nothing from forward's copy. Values are gathered into the same
tensor each time; writes under no_grad do not bump the parameter's version counter, so saved
tensors stay valid.

Prefetch: the forward order of units is recorded in the first forward; after a unit is
gathered, the next one's all-gather is launched (the previous one's in backward), so it
travels while this unit computes. Every rank records the same order and issues the same
collectives.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ...runtime.hooks import PicklesAsNoop


def in_backward() -> bool:
    """Inside autograd's backward (a recompute of a checkpointed forward, for one)."""
    return torch._C._current_graph_task_id() != -1


class Unit:
    """The stage-3 parameters one module owns (not those of a unit inside it)."""

    def __init__(self, name: str, module: nn.Module, shards, zero):
        self.name, self.module, self.shards, self.zero = name, module, shards, zero
        self.gathered, self.pending = False, None
        for s in shards:
            s.nbytes = s.param.data.untyped_storage().nbytes()

    def launch(self) -> None:
        """Start the all-gather of the shards (the prefetch), unless under way or done."""
        if self.gathered or self.pending is not None or not self.shards:
            return
        self.pending = self.zero.gather_async(self.shards)

    def gather(self) -> None:
        """The full values in the parameters (waiting for a prefetch under way)."""
        if self.gathered:
            return
        self.launch()
        if self.pending is None:   # no parameters
            self.gathered = True
            return
        for s in self.shards:
            s.param.data.untyped_storage().resize_(s.nbytes)
        pending, self.pending = self.pending, None
        self.zero.write_gathered(self.shards, pending)
        self.gathered = True

    def free(self) -> None:
        if self.pending is not None:   # a prefetch nobody used: finished, then dropped
            self.pending.wait()
            self.pending = None
        for s in self.shards:
            s.param.data.untyped_storage().resize_(0)
        self.gathered = False

    def materialize(self) -> None:
        """Storage back for the full values, their contents undefined (a load overwrites)."""
        for s in self.shards:
            s.param.data.untyped_storage().resize_(s.nbytes)
        self.gathered = False


class Units:
    """Every unit of a model, the hooks that gather and free them, and the recorded order."""

    def __init__(self, model: nn.Module, shards, zero, changes):
        self.model, self.zero = model, zero
        names = ["", *dict.fromkeys(s.unit for s in shards if s.unit)]   # the plan's units
        self.units = [Unit(name, model.get_submodule(name),
                           [s for s in shards if s.unit == name], zero) for name in names]
        self.root = self.units[0]
        self.order: list[Unit] = []   # forward order, recorded once
        self.recorded = False
        self.pinned = False   # inside tilework.full_parameters: nothing is freed
        for unit in self.units:
            changes.hook(f"{unit.name or 'model'}: forward pre-hook (ZeRO-3 gather)",
                         unit.module.register_forward_pre_hook(
                             PicklesAsNoop(lambda m, a, unit=unit: self._before_forward(unit))))
            changes.hook(f"{unit.name or 'model'}: forward hook (ZeRO-3 free)",
                         unit.module.register_forward_hook(
                             PicklesAsNoop(lambda m, a, out, unit=unit:
                                           self._after_forward(unit, out))))
        self._hook_root_owners(model, changes)
        changes.record("ZeRO-3: full values back in the parameters' storage", self.materialize)
        self.free_all()

    def _hook_root_owners(self, model: nn.Module, changes) -> None:
        """The model's own unit is gathered by the model's forward; a method other than forward
        (an evaluation's `perplexity`, a `generate`) may call the modules that own its
        parameters directly: they gather it too (and free it again under no_grad)."""
        mine = {id(s.param) for s in self.root.shards}
        self.in_model = False   # inside the model's forward, which manages the unit itself
        for name, module in model.named_modules():
            if module is not model and any(id(p) in mine for p in module.parameters(recurse=False)):
                changes.hook(f"{name}: forward hooks (ZeRO-3: the model's unit used directly)",
                             module.register_forward_pre_hook(PicklesAsNoop(self._root_used)))
                changes.hook(f"{name}: forward hook (ZeRO-3)",
                             module.register_forward_hook(PicklesAsNoop(self._root_done)))

    @torch.compiler.disable
    def _root_used(self, *_) -> None:
        if not self.in_model and not in_backward() and not self.root.gathered:
            with self.zero.guard("the all-gather of the model's own values (ZeRO-3, a call "
                                 "outside its forward)"):
                self.root.gather()

    @torch.compiler.disable
    def _root_done(self, *_) -> None:
        # With grad on, backward needs the values: the end of backward frees them.
        if not (self.in_model or self.pinned or in_backward() or torch.is_grad_enabled()):
            self.root.free()

    def in_backward_order(self) -> list[Unit]:
        """The units with parameters, each one gradient bucket: the root's last (its
        embedding's gradient comes last)."""
        return [u for u in reversed(self.units) if u.shards]

    # -- forward ---------------------------------------------------------------------------------
    # Outside torch.compile's graphs: collectives and storage resizing are not for dynamo to
    # trace (a compiled model graph-breaks around each unit, as around a table's lookup).
    @torch.compiler.disable
    def _before_forward(self, unit: Unit) -> None:
        with self.zero.guard(f"the all-gather of {unit.name or 'the model'}'s values (ZeRO-3)"):
            self._gather_for_forward(unit)

    def _gather_for_forward(self, unit: Unit) -> None:
        if in_backward():   # a checkpointed forward recomputed: its backward gathered it
            unit.gather()
            return
        if unit is self.root:
            self.recorded, self.in_model = bool(self.order), True
        elif not self.recorded and unit not in self.order:
            self.order.append(unit)
        unit.gather()
        following = self._next(unit, +1)
        if following is not None:
            following.launch()

    @torch.compiler.disable
    def _after_forward(self, unit: Unit, output) -> None:
        if in_backward():
            return
        if unit is self.root:
            self.in_model = False
        if torch.is_grad_enabled():
            tensors = [t for t in tree_leaves(output) if torch.is_tensor(t) and t.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, lambda grads, unit=unit: self._before_backward(unit), mode="any")
        if (unit is not self.root or not torch.is_grad_enabled()) and not self.pinned:
            unit.free()

    def _next(self, unit: Unit, step: int) -> Unit | None:
        if not self.recorded:
            return None
        if unit is self.root:
            return self.order[0] if step > 0 and self.order else None
        i = self.order.index(unit) + step if unit in self.order else -1
        return self.order[i] if 0 <= i < len(self.order) else None

    # -- backward --------------------------------------------------------------------------------
    def _before_backward(self, unit: Unit) -> None:
        with self.zero.guard(f"the all-gather of {unit.name or 'the model'}'s values (ZeRO-3, "
                             "backward)"):
            unit.gather()
            previous = self._next(unit, -1)
            if previous is not None:
                previous.launch()

    def free_all(self) -> None:
        for unit in self.units:
            unit.free()

    def gather_all(self) -> None:
        for unit in self.units:
            unit.gather()

    def materialize(self) -> None:
        for unit in self.units:
            unit.materialize()
