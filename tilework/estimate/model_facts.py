"""What pricing a mesh candidate reads of the model, worked out once per search: the pipeline's
stage cut for each stage count, the tensor-parallel layout for each tp degree, the module names,
ZeRO-3's gather units. A mesh search prices thousands of candidates that share a handful of
these; walking the model's modules again for each was most of its time (a 16-block GPT at
64 ranks: 4,656 candidates in minutes). Pure: built from the model, which must not change while
one is in use (a search's models are its own, or the user's before anything is applied)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

from torch import nn

T = TypeVar("T")


class ModelFacts:
    def __init__(self, model: nn.Module):
        self.model = model
        self._known: dict[Hashable, object] = {}

    @classmethod
    def of(cls, model: nn.Module, facts: ModelFacts | None = None) -> ModelFacts:
        """`facts`, which must be `model`'s, or new ones."""
        if facts is None:
            return cls(model)
        if facts.model is not model:
            raise ValueError("these ModelFacts are another model's")
        return facts

    def once(self, key: Hashable, make: Callable[[], T]) -> T:
        """`make()`, the first time `key` is asked for."""
        if key not in self._known:
            self._known[key] = make()
        return self._known[key]  # type: ignore[return-value]

    def names(self) -> dict[int, str]:
        """id(module) -> its name in the model."""
        return self.once("names", lambda: {id(m): n for n, m in self.model.named_modules()})

    def stages(self, count: int, speeds: Sequence[float] | None = None) -> list:
        """parallel.pipeline.split_stages's cut into `count` stages (balanced by `speeds`)."""
        from ..parallel.pipeline import split_stages

        return self.once(("stages", count, None if speeds is None else tuple(speeds)),
                          lambda: split_stages(self.model, count, speeds=speeds))

    def cut(self, count: int, blocks: tuple[tuple[int, int], ...]) -> list:
        """split_stages taking a plan's cut as it is (`blocks`: each stage's block range)."""
        from ..parallel.pipeline import split_stages

        return self.once(("cut", count, tuple(blocks)), lambda: split_stages(
            self.model, count, blocks=[range(a, b) for a, b in blocks]))

    def layout(self, layout: dict[str, str] | None, tp: int, sequence_parallel: bool):
        """parallel.tensor.plan_layout's resolution of `layout` (the model's default where
        None) on `tp` ranks."""
        from ..parallel.tensor import layout_for, plan_layout

        key = ("layout", None if layout is None else tuple(sorted(layout.items())), tp,
               sequence_parallel)
        return self.once(key, lambda: plan_layout(self.model, layout or layout_for(self.model),
                                                   tp, sequence_parallel))

    def units(self) -> int:
        """How many units ZeRO-3 gathers the model in (plans.analysis.owning_units)."""
        from ..plans.analysis import owning_units

        return self.once("units", lambda: len(set(owning_units(self.model).values())))
