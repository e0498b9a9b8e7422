"""Checkpoints of a meshed model in single-device layout, and back at any mesh.

Saving: the engine gives each rank its dp-level state (one-process names; tensor-parallel
shards; only its pipeline stages'), the shards are gathered over tp (counted under
"checkpoint") and the stages' states over pp, so the one-process state dict is assembled: the
file loads into a plain model, or at another mesh. `tilework.state_dict` assembles it on every
rank; `tilework.save` on rank 0 only (`dst=0`), where the file is written: no other rank holds
more than its own shards and, as the first rank of its tp group, one whole tensor at a time.
Loading takes each rank's stages' keys and its tp shards of them, then hands that to the engine
(which shards over dp as it does for data parallelism: ZeRO chunks, server rows).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ..comm import counted
from ..errors import CheckpointError


def _specs(mesh) -> dict:
    return mesh.layout.specs() if mesh.layout is not None else {}


def _unshard(mesh, key: str, value, shapes: dict, to_first: bool):
    """A split tensor gathered whole over tp: a parameter, or its optimizer state of its shape
    (every tp rank calls this for the same keys in the same order). `to_first`: on tp rank 0
    only (None on the others)."""
    spec, tp = _specs(mesh).get(key), mesh.tp
    if (spec is None or tp is None or tp.size == 1 or not torch.is_tensor(value)
            or tuple(value.shape) != shapes[key]):
        return value
    from ..parallel.tensor.shards import unshard

    if to_first:
        parts = counted.gather(value.contiguous(), 0, tp.group, mesh.stats, "checkpoint")
        return None if parts is None else unshard(parts, spec)
    return unshard(counted.all_gather(value.contiguous(), tp.group, mesh.stats, "checkpoint"),
                   spec)


def _own_hooks_aside(engine, kind: str):
    """Under tp, the model's own state-dict hooks of `kind` set aside
    (parallel/tensor/own_hooks.py): yields what was taken, to replay on the whole state; elsewhere
    nothing is taken."""
    from ..parallel.tensor import own_hooks

    tp = engine.mesh.tp
    # The whole model's: under pp a rank's part holds its stages only, and the assembled
    # state is every stage's, so every stage's hooks replay on it, the same on every rank.
    pipeline = engine.mesh.pipeline
    model = pipeline.whole if pipeline is not None else engine.model
    if tp is None or tp.size == 1 or not own_hooks.has_own_hooks(model):
        return contextlib.nullcontext([])
    return own_hooks.set_aside(model, kind)


def full_state(engine, dst: int | None = None) -> dict | None:
    """The one-process model and optimizer state (a collective over the world): on every rank,
    or (`dst=0`) on rank 0 only, None elsewhere."""
    from ..parallel.tensor.own_hooks import SAVE, replay_save

    if dst not in (None, 0):
        raise ValueError(f"a mesh's state gathers to every rank or to rank 0, not {dst!r}")
    to_first = dst == 0
    with _own_hooks_aside(engine, SAVE) as taken:
        state = _assembled(engine, dst, to_first)
    if state is not None and taken:
        state["model"] = replay_save(taken, state["model"])
    return state


def _assembled(engine, dst, to_first: bool) -> dict | None:
    mesh = engine.mesh
    state = engine.state_dict(dst=dst)
    if to_first and engine.groups.rank != 0:
        # Not the first of its dp group: it holds no gathered tables or ZeRO state, and no
        # rank of its tp or pp groups does either (they share its dp coordinates).
        return None
    # Shapes only: under ZeRO-3 or server tables a real state_dict() would gather again.
    from .state import gathered_model_state

    shapes = {k: tuple(v.shape) for k, v in gathered_model_state(engine, "meta").items()}
    model = {k: _unshard(mesh, k, v, shapes, to_first) for k, v in state["model"].items()}
    dense = {name: {k: _unshard(mesh, name, v, shapes, to_first) for k, v in per.items()}
             for name, per in state["optimizer"]["dense"].items()}
    optimizer = dict(state["optimizer"], dense=dense)
    if to_first and mesh.tp is not None and mesh.tp.rank != 0:
        return None
    pp = mesh.groups.group("pp")
    if pp is not None:
        # On the host: a pickled CUDA tensor would come back on its sender's device number.
        mine = torch.utils._pytree.tree_map(
            lambda v: v.cpu() if torch.is_tensor(v) else v,
            (model, optimizer["dense"], optimizer["rows"]))
        parts = [None] * dist.get_world_size(pp)
        if to_first:
            first = dist.get_global_rank(pp, 0)
            dist.gather_object(mine, parts if dist.get_rank() == first else None, dst=first,
                               group=pp)
            if dist.get_rank() != first:
                return None
        else:
            dist.all_gather_object(parts, mine, group=pp)
        model = {k: v for part in parts for k, v in part[0].items()}
        optimizer["dense"] = {k: v for part in parts for k, v in part[1].items()}
        optimizer["rows"] = {k: v for part in parts for k, v in part[2].items()}
    return {"model": model, "optimizer": optimizer}


def load_full_state(engine, state: dict) -> None:
    """Each rank its stages' keys and its tp shards of them, then the engine's own load."""
    from ..parallel.tensor.own_hooks import LOAD, SAVE, replay_load

    model = state.get("model") if isinstance(state, dict) else None
    if not isinstance(model, dict):
        raise CheckpointError("checkpoint has no 'model' state dict")
    with _own_hooks_aside(engine, LOAD) as taken, _own_hooks_aside(engine, SAVE):
        _load_parts(engine, state, replay_load(taken, model) if taken else model)


def _load_parts(engine, state: dict, model: dict) -> None:
    from .state import gathered_model_state

    mesh = engine.mesh
    mine = gathered_model_state(engine, "meta")   # keys only: no gather
    missing = sorted(set(mine) - set(model))
    if missing:
        raise CheckpointError(f"checkpoint does not match the model: missing {missing[:3]}")
    specs, tp = _specs(mesh), mesh.tp

    def local(key, value):
        spec = specs.get(key)
        if spec is None or tp is None or not torch.is_tensor(value):
            return value
        from ..parallel.tensor.shards import shard

        full_shape = tuple(model[key].shape)
        if tuple(value.shape) != full_shape:
            return value
        return shard(value, spec, tp.rank, tp.size).clone()

    names = {n for n, _ in engine.model.named_parameters()}
    opt = state.get("optimizer") or {}
    sub = {"model": {k: local(k, model[k]) for k in mine},
           "optimizer": {**opt,
                         "dense": {n: {k: local(n, v) for k, v in per.items()}
                                   for n, per in (opt.get("dense") or {}).items() if n in names},
                         "rows": {n: v for n, v in (opt.get("rows") or {}).items()
                                  if n in names}}}
    engine.load_state_dict(sub)


def unparallelize_mesh(engine, optimizer):
    """`tilework.unparallelize` on a mesh: the one-process state gathered to every rank (as
    `tilework.state_dict` does), every change undone (the engine's, then the mesh's: the
    layout's and cp's modules, the optimizer's parameters), and that state loaded into the
    plain model and optimizer. Returns the whole model (under pp, not the pipeline)."""
    mesh = engine.mesh
    state = full_state(engine)
    engine.discard_server_gradients()
    engine.changes.undo()
    engine.guard.stop()
    mesh.changes.undo()
    model = mesh.pipeline.whole if mesh.pipeline is not None else engine.model
    model.load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(_plain_optimizer_state(model, optimizer, state["optimizer"]))
    return model, optimizer


def _plain_optimizer_state(model, optimizer, gathered: dict) -> dict:
    """torch's state_dict of the plain `optimizer` from the gathered one (keyed by parameter
    name; server tables' row-wise state as checkpoint/state.py gathers it)."""
    from .state import plain_row_state

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
                rows = plain_row_state(optimizer, gathered["rows"][name])
                if rows is not None:
                    state[index] = rows
            ids.append(index)
            index += 1
        groups.append({**saved, "params": ids})
    return {"state": state, "param_groups": groups}
