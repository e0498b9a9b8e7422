"""A model's own state-dict hooks under tensor parallelism.

A model may rename or cut its entries in `state_dict` and put them back in `load_state_dict`
(a fused `wqkv.weight` saved as `wq`, `wk`, `wv`; torchtitan and Hugging Face do such things).
Under tp a rank holds shards, and the checkpoint's tp gather finds them by parameter name: the
hooks, run on the shards, would cut a shard and rename it out of the layout's reach. So the
checkpoint runs without them and replays them on the one-process state once it is whole, in
torch's order: a module's state-dict hooks after its children's (post-order), its load
pre-hooks before its children's. tilework's own hooks (PicklesAsNoop) stay where they are.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from torch import nn

from ...runtime.hooks import PicklesAsNoop

SAVE, LOAD = "_state_dict_hooks", "_load_state_dict_pre_hooks"


def _ours(hook) -> bool:
    return isinstance(hook, PicklesAsNoop) or isinstance(getattr(hook, "hook", None), PicklesAsNoop)


def has_own_hooks(model: nn.Module) -> bool:
    return any(not _ours(h) for m in model.modules() for kind in (SAVE, LOAD)
               for h in getattr(m, kind).values())


@contextlib.contextmanager
def set_aside(model: nn.Module, kind: str) -> Iterator[list[tuple[str, nn.Module, list]]]:
    """The model's own hooks of `kind` removed inside; yields (prefix, module, hooks) for each
    module that had some, in pre-order. Put back in their places after."""
    taken = []
    kept = []
    for name, module in model.named_modules():
        hooks = getattr(module, kind)
        if any(not _ours(h) for h in hooks.values()):
            before = dict(hooks)
            taken.append((f"{name}." if name else "", module,
                          [h for h in before.values() if not _ours(h)]))
            kept.append((hooks, before))
            for key in [k for k, h in before.items() if not _ours(h)]:
                del hooks[key]
    try:
        yield taken
    finally:
        for hooks, before in kept:
            hooks.clear()
            hooks.update(before)


def replay_save(taken, state: dict) -> dict:
    """The state-dict hooks set aside, on the whole state: deepest modules first."""
    for prefix, module, hooks in sorted(taken, key=lambda t: -t[0].count(".")):
        for hook in hooks:
            result = hook(module, state, prefix, {"version": getattr(module, "_version", 1)})
            if result is not None and not getattr(hook, "_from_public_api", False):
                state = result
    return state


def replay_load(taken, state: dict) -> dict:
    """The load pre-hooks set aside, on a copy of the whole state: outermost modules first."""
    state = dict(state)
    for prefix, module, hooks in sorted(taken, key=lambda t: t[0].count(".")):
        for hook in hooks:
            hook(state, prefix, {"version": getattr(module, "_version", 1)}, True, [], [], [])
    return state
