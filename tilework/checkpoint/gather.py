"""The one-process state of a parallelized model, assembled: `gathered_state`, for any engine.

Step by step, each doing nothing where its axis spreads nothing (`engine.mesh is None`: only
the first):
- over dp, the engine's own group: model.state_dict() with the server tables' shards gathered
  by rows and ZeRO-3's values whole; the optimizer state keyed by parameter name, the tables'
  row-wise state gathered by rows, ZeRO's chunks of the rest whole;
- over tp: the split tensors all-gathered whole (counted under "checkpoint"), the model's own
  state-dict hooks set aside meanwhile and replayed on the whole state;
- over pp: the stages' states gathered, so that every one-process key is there.
The file loads into a plain model, or at any world size, plan and mesh (checkpoint/state.py).

`dst`: None assembles it on every rank (`tilework.state_dict` on a mesh). Data parallel alone,
the tables and ZeRO state go to rank `dst` and every rank keeps the rest (`tilework.state_dict`
and `tilework.save`: `dst=0`). On a mesh `dst=0` is rank 0 alone, where `tilework.save` writes
(None elsewhere): no other rank holds more than its own shards and, as the first rank of its
tp group, one whole tensor at a time.

Also the parallel optimizer's own `state_dict()` in the plain optimizer's layout
(`plain_optimizer_state`, its post-hook).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ..comm import counted
from ..optim.own import OwnRowOptimizer


def gathered_state(engine, dst: int | None) -> dict | None:
    """The one-process model and optimizer state, optimizer state keyed by parameter name (a
    collective over the world, run inside the engine's call guard: `Engine.state_dict`,
    `unparallelize`)."""
    if engine.mesh is not None and dst not in (None, 0):
        raise ValueError(f"a mesh's state gathers to every rank or to rank 0, not {dst!r}")
    to_first = dst == 0
    with own_hooks_aside(engine, "save") as taken:
        state = _over_dp(engine, dst)
        state = _over_tp(engine, state, to_first)
        state = _over_pp(engine, state, to_first)
    if state is not None and taken:
        from ..parallel.tensor.own_hooks import replay_save

        state["model"] = replay_save(taken, state["model"])
    return state


def gathered_model_state(engine, gather_to) -> dict:
    """model.state_dict() with the tables gathered to rank `gather_to` of the engine's group
    (None: every rank; "meta": shapes only, no communication)."""
    for module in [*engine.table_modules.values(), engine.zero]:
        module.gather_to = gather_to
    try:
        return dict(engine.model.state_dict())
    finally:
        for module in [*engine.table_modules.values(), engine.zero]:
            module.gather_to = None


def own_hooks_aside(engine, kind: str):
    """Under tp, the model's own state-dict hooks of `kind` ("save" or "load") set aside
    (parallel/tensor/own_hooks.py): yields what was taken, to replay on the whole state;
    elsewhere nothing is taken."""
    mesh = engine.mesh
    tp = mesh.tp if mesh is not None else None
    if tp is None or tp.size == 1:
        return contextlib.nullcontext([])
    from ..parallel.tensor import own_hooks

    # The whole model's: under pp a rank's part holds its stages only, and the assembled
    # state is every stage's, so every stage's hooks replay on it, the same on every rank.
    model = mesh.pipeline.whole if mesh.pipeline is not None else engine.model
    if not own_hooks.has_own_hooks(model):
        return contextlib.nullcontext([])
    return own_hooks.set_aside(model, {"save": own_hooks.SAVE, "load": own_hooks.LOAD}[kind])


def split_specs(mesh) -> dict:
    """How the layout splits each one-process key over tp (none where nothing is split)."""
    return mesh.layout.specs() if mesh is not None and mesh.layout is not None else {}


# -- over dp: the engine's group --------------------------------------------------------------

def _over_dp(engine, dst: int | None) -> dict:
    """The engine's state in single-device layout, server rows and their row-wise state
    gathered to rank `dst` of its group (every rank when None); on a mesh each rank's part:
    one-process names, tp shards, its pipeline stages' keys."""
    model_state = gathered_model_state(engine, gather_to=dst)
    rows: dict[str, dict] = {}
    for name, part in [*engine.tables.items(), *engine.served.items()]:
        if _own(part):   # its own keys may hold a "step": the plain entry goes whole, nested
            rows[name] = {"step": part.optimizer.step_count, "state": _own_state(part, dst)}
            continue
        state = {k: part.gather(v, dst) for k, v in part.optimizer.state_tensors().items()}
        rows[name] = {"step": part.optimizer.step_count, **state}
    optimizer = engine.optimizer
    dense_state = {} if optimizer is None else {
        engine.param_names[id(p)]: {k: v for k, v in s.items()} for p, s in optimizer.state.items()}
    _whole_zero_state(engine, dense_state)
    groups = [] if optimizer is None else [
        {k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    out = {"model": model_state,
           "optimizer": {"dense": dense_state, "groups": groups, "rows": rows}}
    if engine.outer is not None:
        out["outer"] = _outer_state(engine, dense_state, dst)
    if engine.dense.compressor is not None:
        out["grad_compress"] = _compressor_state(engine, dst)
    return out


def _every_rank(engine, mine, dst: int | None) -> list | None:
    """Every rank's `mine` in rank order, gathered to rank `dst` of the world (every rank when
    None; None on the others)."""
    group, n = engine.groups.world, engine.groups.world_size
    if n == 1:
        return [mine]
    if dst is None:
        every = [None] * n
        dist.all_gather_object(every, mine, group=group)
        return every
    every = [None] * n if engine.groups.rank == dst else None
    dist.gather_object(mine, every, dst=dist.get_global_rank(group, dst), group=group)
    return every


def _compressor_state(engine, dst: int | None) -> dict:
    """The compressed buckets' state (PowerSGD's, top-k's): what every rank holds alike, and
    each rank's own error feedback in rank order, gathered to `dst` (None elsewhere)."""
    compressor = engine.dense.compressor
    return {"kind": engine.plan.grad_compress, **compressor.state_dict(),
            "errors": _every_rank(engine, compressor.own_state(), dst)}


def _outer_state(engine, dense_state: dict, dst: int | None) -> dict | None:
    """Local SGD's state: the outer loop's (the same on every rank) and, since each rank's
    inner optimizer state is its own (Adam's moments of its own steps), every rank's dense
    optimizer state in rank order, gathered to `dst` (None elsewhere), with what else only
    that rank holds (`LocalSGD.own_state`)."""
    mine = ({name: dict(s) for name, s in dense_state.items()}, engine.outer.own_state())
    every = _every_rank(engine, mine, dst)
    if every is None:
        return {**engine.outer.state_dict(), "inner": None}
    # Each rank's own error feedback and, where ranks differ at a sync, its parameters.
    return {**engine.outer.state_dict(), "inner": [s for s, _ in every],
            **({"own": [o for _, o in every]} if mine[1] else {})}


def _own(part) -> bool:
    """A server parameter updated by a user's own row-wise optimizer (optim/own.py)."""
    return isinstance(part.optimizer, OwnRowOptimizer)


def _own_state(part, dst: int | None) -> dict:
    """A user's optimizer's state of a server parameter in its plain layout: per-row tensors
    gathered into the table's rows, the rest (step counts, scalars) as this rank holds them."""
    optimizer = part.optimizer
    return {**optimizer.scalars(),
            **{k: part.gather(v, dst) for k, v in optimizer.state_tensors().items()}}


def _whole_zero_state(engine, by_name: dict) -> None:
    """ZeRO shards' optimizer state, by parameter name, gathered whole in place (a collective:
    every rank, the same order)."""
    for name in engine.zero.by_name:
        if by_name.get(name) is not None:
            by_name[name] = engine.zero.full_state(name, by_name[name])


# -- over tp and pp: a mesh's ------------------------------------------------------------------

def _over_tp(engine, state: dict, to_first: bool) -> dict | None:
    """Split tensors whole: on every rank, or (`to_first`) on each tp group's first rank of the
    first replica, None elsewhere."""
    mesh = engine.mesh
    if mesh is None:
        return state
    if to_first and engine.groups.rank != 0:
        # Not the first of its dp group: it holds no gathered tables or ZeRO state, and no
        # rank of its tp or pp groups does either (they share its dp coordinates).
        return None
    # Shapes only: under ZeRO-3 or server tables a real state_dict() would gather again.
    shapes = {k: tuple(v.shape) for k, v in gathered_model_state(engine, "meta").items()}
    model = {k: _whole_over_tp(mesh, k, v, shapes, to_first) for k, v in state["model"].items()}
    dense = {name: {k: _whole_over_tp(mesh, name, v, shapes, to_first) for k, v in per.items()}
             for name, per in state["optimizer"]["dense"].items()}
    optimizer = dict(state["optimizer"], dense=dense)
    if to_first and mesh.tp is not None and mesh.tp.rank != 0:
        return None
    return {"model": model, "optimizer": optimizer}


def _whole_over_tp(mesh, key: str, value, shapes: dict, to_first: bool):
    """A split tensor gathered whole over tp: a parameter, or its optimizer state of its shape
    (every tp rank calls this for the same keys in the same order). `to_first`: on tp rank 0
    only (None on the others)."""
    spec, tp = split_specs(mesh).get(key), mesh.tp
    if (spec is None or tp is None or tp.size == 1 or not torch.is_tensor(value)
            or tuple(value.shape) != shapes[key]):
        return value
    from ..parallel.tensor.shards import unshard

    if to_first:
        parts = counted.gather(value.contiguous(), 0, tp.group, mesh.stats, "checkpoint")
        return None if parts is None else unshard(parts, spec)
    return unshard(counted.all_gather(value.contiguous(), tp.group, mesh.stats, "checkpoint"),
                   spec)


def _over_pp(engine, state: dict | None, to_first: bool) -> dict | None:
    """Every stage's keys: on every rank, or (`to_first`) on the pp group's first rank alone."""
    pp = engine.mesh.groups.group("pp") if engine.mesh is not None and state is not None \
        else None
    if pp is None:
        return state
    model, optimizer = state["model"], state["optimizer"]
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


# -- the user's own optimizer.state_dict(): the plain optimizer's layout ----------------------

def plain_optimizer_state(engine, state: dict) -> dict:
    """torch's state_dict of the parallelized optimizer (the server parameters removed from its
    groups) turned into the plain optimizer's: every parameter back at its index, the servers'
    row-wise state gathered (a collective: every rank calls optimizer.state_dict())."""
    optimizer = engine.optimizer
    now = [engine.param_names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    by_name = {now[i]: s for i, s in state["state"].items()}
    with engine.guard.call("optimizer.state_dict(), which gathers the servers' rows"):
        for name, part in [*engine.tables.items(), *engine.served.items()]:
            by_name[name] = _torch_row_state(optimizer, part)
        _whole_zero_state(engine, by_name)
    plain, groups, index = {}, [], 0
    for saved, names in zip(state["param_groups"], engine.original_groups):
        ids = []
        for name in names:
            if by_name.get(name) is not None:
                plain[index] = by_name[name]
            ids.append(index)
            index += 1
        groups.append({**saved, "params": ids})
    return {"state": plain, "param_groups": groups}


def _torch_row_state(optimizer, part) -> dict | None:
    """A server parameter's state as its torch optimizer keeps it (SGD without momentum: none)."""
    if _own(part):
        return _own_state(part, None) or None
    tensors = part.optimizer.state_tensors()
    if not tensors:
        return None
    step = part.optimizer.step_count
    state = {k: part.gather(v, None) for k, v in tensors.items()}
    # SparseAdam counts in a Python int; Adam, AdamW and Adagrad in a float32 tensor.
    # On the CPU, as torch keeps a step that is neither capturable nor fused.
    state["step"] = step if isinstance(optimizer, torch.optim.SparseAdam) else \
        torch.tensor(float(step), device="cpu")
    return state
