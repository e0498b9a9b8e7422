"""`tilework.unparallelize`, on any plan: the one-process state gathered to every rank
(checkpoint/gather.py), every change undone (the engine's, then a mesh's: the layout's and cp's
modules, the optimizer's parameters), and that state loaded into the plain model and
optimizer."""

from __future__ import annotations

import torch

from .gather import gathered_state


def unparallelize(engine, optimizer):
    """Every change undone, newest first, the servers' rows, ZeRO's chunks, tp's shards and
    pp's stages gathered back into the plain model and `optimizer` (the engine's; a collective:
    every rank calls it). Between steps: gradients not yet applied are dropped. Returns the
    whole model (under pp, not the pipeline) and the optimizer."""
    with engine.guard.call("tilework.unparallelize()"):
        engine.lookups.flush()
        state = gathered_state(engine, None)
    engine.discard_server_gradients()
    engine.changes.undo()
    engine.guard.stop()
    mesh = engine.mesh
    if mesh is not None:
        mesh.changes.undo()
    model = mesh.pipeline.whole if mesh is not None and mesh.pipeline is not None \
        else engine.model
    model.load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(_plain_optimizer_state(model, optimizer, state["optimizer"]))
    return model, optimizer


def _plain_optimizer_state(model, optimizer, gathered: dict) -> dict:
    """torch's state_dict of the plain `optimizer` from the gathered one (keyed by parameter
    name; server tables' row-wise state as gather.py gathers it)."""
    names = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    state, groups, index = {}, [], 0
    for saved, group in zip(gathered["groups"], optimizer.param_groups):
        ids = []
        for p in group["params"]:
            name = names.get(id(p))
            if name in gathered["dense"]:
                state[index] = gathered["dense"][name]
            elif name in gathered["rows"]:
                rows = _plain_row_state(optimizer, gathered["rows"][name])
                if rows is not None:
                    state[index] = rows
            ids.append(index)
            index += 1
        groups.append({**saved, "params": ids})
    return {"state": state, "param_groups": groups}


def _plain_row_state(optimizer, entry: dict) -> dict | None:
    """A server table's gathered row-wise state (the "rows" entry of `gathered_state`) as the
    plain `optimizer` keeps it for the whole table."""
    if "state" in entry and len(entry) == 2:   # a user's own optimizer: its plain entry
        return entry["state"] or None
    tensors = {k: v for k, v in entry.items() if k != "step"}
    if not tensors:
        return None
    step = entry["step"]
    return {**tensors, "step": step if isinstance(optimizer, torch.optim.SparseAdam)
            else torch.tensor(float(step), device="cpu")}
