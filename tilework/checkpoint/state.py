"""Checkpoints in single-device layout, checked and loaded: into any engine (`load_state`),
at any world size, plan and mesh, and into the parallelized optimizer from a plain one's state
dict (`parallel_optimizer_state`). Everything a load would touch is checked before anything is
loaded: a mismatch never half-loads. Optimizer state is keyed by parameter name; the server
tables' row-wise state is scattered by rows (checkpoint/gather.py assembles the state)."""

from __future__ import annotations

import torch

from ..errors import CheckpointError
from ..optim.own import take_rows
from .gather import _own, gathered_model_state, own_hooks_aside, split_specs


def state_mismatch(expected: dict[str, tuple], given) -> str | None:
    """What differs between the shapes a model expects and a saved model state, or None."""
    if not isinstance(given, dict):
        return "no model state"
    for key in sorted(set(expected) | set(given)):
        if key not in given:
            return f"{key} is missing"
        if key not in expected:
            return f"{key} is unexpected"
        value = given[key]
        if not torch.is_tensor(value) or tuple(value.shape) != expected[key]:
            shape = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
            return f"{key} has shape {shape} in the checkpoint, {expected[key]} in the model"
    return None


def check_state(engine, state: dict) -> None:
    """Everything a load into the engine would touch (this rank's part of the state, on a
    mesh), checked before anything is: a mismatch never half-loads."""
    expected = {k: tuple(v.shape)
                for k, v in gathered_model_state(engine, gather_to="meta").items()}
    opt = state.get("optimizer") if isinstance(state, dict) else None
    if not isinstance(opt, dict) or not {"dense", "groups", "rows"} <= set(opt):
        raise CheckpointError("checkpoint does not match the model: no optimizer state in "
                              "tilework's layout")
    problem = state_mismatch(expected, state.get("model"))
    params = dict(engine.model.named_parameters())
    for name, saved in opt["dense"].items():
        if problem:
            break
        if name not in params:
            problem = f"optimizer state for {name}, which the model does not train here"
        for key, value in saved.items():
            if torch.is_tensor(value) and value.dim() and value.shape != params[name].shape:
                problem = (f"optimizer {key} of {name} has shape {tuple(value.shape)}, "
                           f"the parameter {tuple(params[name].shape)}")
    for name, part in [*engine.tables.items(), *engine.served.items()]:
        if problem:
            break
        saved = opt["rows"].get(name)
        if saved is None or "step" not in saved:
            problem = f"no row-wise optimizer state for {name}"
            continue
        for key, value in saved.items():
            if key == "step" or (key == "state" and _own(part)):   # see gather._over_dp
                continue
            if tuple(value.shape)[:1] != (part.layout.rows,):
                problem = (f"optimizer {key} of {name} has {tuple(value.shape)[:1]} rows, "
                           f"the table {part.layout.rows}")
    saved, own = _compressor_parts(engine, state)
    if not problem and saved is not None:
        misfit = engine.dense.compressor.misfit(saved, own)
        if misfit:
            problem = f"{misfit} has another size here (another bucket_mb, powersgd_rank)"
    here = engine.optimizer.param_groups if engine.optimizer is not None else []
    if not problem and len(opt["groups"]) != len(here):
        problem = (f"{len(opt['groups'])} optimizer parameter groups in the checkpoint, "
                   f"{len(here)} here")
    if problem:
        raise CheckpointError(f"checkpoint does not match the model: {problem}")


def load_state(engine, state: dict) -> None:
    """The one-process state (`gathered_state`'s, from any plan) into any engine: on a mesh
    each rank takes its stages' keys and its tp shards of them; then, checked, the engine's
    own layout (tables and served rows their shards, ZeRO its chunks, optimizer state by
    name)."""
    with own_hooks_aside(engine, "load") as taken, own_hooks_aside(engine, "save"):
        state = _this_ranks_part(engine, state, taken)
        check_state(engine, state)
        engine.model.load_state_dict(state["model"])  # tables and served rows take their shards
        engine.discard_server_gradients()
        opt_state = state["optimizer"]
        by_name = {n: p for n, p in engine.model.named_parameters()}
        by_name |= {s.name: s.shard for s in engine.zero.shards}
        if engine.optimizer is not None:
            for name, s in opt_state["dense"].items():
                engine.optimizer.state[by_name[name]] = _sharded(engine, name, {
                    k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()})
            for group, saved in zip(engine.optimizer.param_groups, opt_state["groups"]):
                group.update(saved)
        for name, part in [*engine.tables.items(), *engine.served.items()]:
            saved = dict(opt_state["rows"][name])
            step = saved.pop("step")
            _load_rows(part, step, saved.get("state", {}) if _own(part) else saved)
        if engine.outer is not None:
            _load_outer(engine, state.get("outer"))
        _load_compressor(engine, state)


def _compressor_parts(engine, state: dict) -> tuple[dict | None, dict | None]:
    """The saved state of the compressed buckets (None: the checkpoint has none of this
    `grad_compress`: they start afresh) and this rank's own errors in it (None at another
    world size: they start at zero; what a rank had not sent yet is dropped)."""
    saved = state.get("grad_compress") if isinstance(state, dict) else None
    if engine.dense.compressor is None or not isinstance(saved, dict) \
            or saved.get("kind") != engine.plan.grad_compress:
        return None, None
    errors = saved.get("errors")
    same_world = bool(errors) and len(errors) == engine.groups.world_size
    return saved, errors[engine.groups.rank] if same_world else None


def _load_compressor(engine, state: dict) -> None:
    """The compressed buckets' state, checked by `check_state`; from a checkpoint without it,
    a fresh start (PowerSGD's plain steps first)."""
    saved, own = _compressor_parts(engine, state)
    if saved is not None:
        engine.dense.compressor.load_state_dict(saved, own)
    elif engine.dense.compressor is not None:
        engine.dense.compressor.reset()


def _load_outer(engine, saved: dict | None) -> None:
    """Local SGD's outer state: the saved one, or, from a checkpoint of synchronous training,
    a fresh outer loop from the loaded parameters (no momentum yet)."""
    outer = engine.outer
    if saved is None:
        outer.restart()
        return
    missing = sorted(set(outer.anchors) - set(saved.get("anchors", {})))
    if missing:
        raise CheckpointError(f"checkpoint does not match the model: its local SGD state has "
                              f"no {missing[0]}")
    if int(saved.get("inner_steps", 0)) >= outer.outer.every:
        raise CheckpointError(f"checkpoint was taken {saved['inner_steps']} steps into a local "
                              f"SGD period; this job's sync_every is {outer.outer.every}")
    outer.load_state_dict(saved)
    inner = saved.get("inner")
    # Each rank its own inner optimizer state, where the world is the one that saved it (at
    # another world size every rank keeps rank 0's, loaded above).
    own = saved.get("own")
    same_world = bool(inner) and len(inner) == engine.groups.world_size
    # Error feedback is owed by the rank that encoded, and a rank's own parameters are its own:
    # kept at the same world, else dropped (at most one sync's rounding; rank 0's parameters).
    if not outer.load_own_state(own[engine.groups.rank] if own and same_world else None):
        raise CheckpointError("checkpoint does not match this job: its local SGD state per "
                              "rank is another outer_compress's, bucket_mb's or model's")
    if own and same_world and "params" in own[engine.groups.rank]:
        engine.zero.after_load()   # this rank's own parameters: ZeRO's shards follow
    if same_world and engine.optimizer is not None:
        by_name = dict(engine.model.named_parameters())
        by_name |= {s.name: s.shard for s in engine.zero.shards}
        for name, s in inner[engine.groups.rank].items():
            engine.optimizer.state[by_name[name]] = _sharded(engine, name, {
                k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()})


def _this_ranks_part(engine, state: dict, taken: list) -> dict:
    """On a mesh, this rank's stages' keys of the one-process state and its tp shards of them
    (the model's own load hooks, set aside in `taken`, run on the whole state first); data
    parallel alone, the state as it is."""
    mesh = engine.mesh
    if mesh is None:
        return state
    model = state.get("model") if isinstance(state, dict) else None
    if not isinstance(model, dict):
        raise CheckpointError("checkpoint has no 'model' state dict")
    if taken:
        from ..parallel.tensor.own_hooks import replay_load

        model = replay_load(taken, model)
    mine = gathered_model_state(engine, "meta")   # keys only: no gather
    missing = sorted(set(mine) - set(model))
    if missing:
        raise CheckpointError(f"checkpoint does not match the model: missing {missing[:3]}")
    specs, tp = split_specs(mesh), mesh.tp

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
    return {"model": {k: local(k, model[k]) for k in mine},
            "optimizer": {**opt,
                          "dense": {n: {k: local(n, v) for k, v in per.items()}
                                    for n, per in (opt.get("dense") or {}).items()
                                    if n in names},
                          "rows": {n: v for n, v in (opt.get("rows") or {}).items()
                                   if n in names}}}


def _load_rows(part, step: int, full: dict) -> None:
    """A server parameter's row-wise state from whole tables (a table's hot head too)."""
    if hasattr(part, "load_optimizer"):
        part.load_optimizer(step, full)
    else:
        part.optimizer.load(step, take_rows(full, part.layout.rows, part.take_shard))


def _sharded(engine, name: str, state: dict) -> dict:
    """A parameter's optimizer state in the layout the optimizer holds it: a ZeRO shard's
    chunk of each parameter-shaped tensor."""
    return engine.zero.shard_state(name, state) if name in engine.zero.by_name else state


# -- the user's own optimizer.load_state_dict(): from the plain optimizer's layout -------------

def parallel_optimizer_state(engine, state: dict) -> dict | None:
    """The inverse of gather.plain_optimizer_state, for optimizer.load_state_dict(): a plain
    optimizer's state dict (from one process, DDP, or this optimizer's state_dict()) split into
    the servers' rows, loaded here, and the rest, renumbered for torch's own load. Anything
    else goes to torch unchanged (its own checks name what does not match)."""
    groups = state.get("param_groups") if isinstance(state, dict) else None
    original = engine.original_groups
    if not isinstance(groups, list) or len(groups) != len(original) or \
            [len(g.get("params", ())) for g in groups] != [len(names) for names in original]:
        return None
    name_of = {i: name for saved, names in zip(groups, original)
               for i, name in zip(saved["params"], names)}
    server = {**engine.tables, **engine.served}
    rows = {name: _checked_rows(name, part, state["state"], name_of)
            for name, part in server.items()}  # every check before anything is loaded
    for name, (step, tensors) in rows.items():
        _load_rows(server[name], step, tensors)
    now = [engine.param_names[id(p)] for g in engine.optimizer.param_groups for p in g["params"]]
    index_now = {name: i for i, name in enumerate(now)}
    return {"state": {index_now[name_of[i]]: _sharded(engine, name_of[i], s)
                      for i, s in state["state"].items() if name_of.get(i) in index_now},
            "param_groups": [{**saved, "params": [index_now[n] for n in names if n in index_now]}
                             for saved, names in zip(groups, original)]}


def _checked_rows(name: str, part, saved_state: dict, name_of: dict):
    """(step, full tensors) for one server parameter from a plain optimizer state; a fresh
    state where it has none yet (torch creates Adam's at the first step)."""
    expected = part.optimizer.state_tensors()
    entry = next((s for i, s in saved_state.items() if name_of.get(i) == name), None)
    if _own(part):
        return _own_rows(entry or {})
    shape = (part.layout.rows, *part.shard.shape[1:])
    if entry is None:
        return 0, {k: torch.zeros(shape, dtype=v.dtype, device=v.device)
                   for k, v in expected.items()}
    tensors = {k: v for k, v in entry.items() if k != "step" and v is not None}
    if set(tensors) != set(expected):
        raise CheckpointError(f"optimizer state for {name} holds {sorted(tensors)}, the "
                              f"optimizer here keeps {sorted(expected)}")
    for key, value in tensors.items():
        if not torch.is_tensor(value) or value.numel() != part.layout.rows * part.shard.shape[1]:
            raise CheckpointError(f"optimizer {key} of {name} does not have the table's "
                                  f"{part.layout.rows} rows of width {part.shard.shape[1]}")
    step = entry.get("step", 0)
    return int(step.item() if torch.is_tensor(step) else step), \
        {k: v.reshape(part.layout.rows, -1) for k, v in tensors.items()}


def _own_rows(entry: dict):
    """(step, whole-table state) for a user's optimizer, from its plain state: whatever the
    class keeps, unchecked, as its own load_state_dict takes it in one process."""
    step = entry.get("step", 0)
    try:
        step = int(step.item() if torch.is_tensor(step) else step)
    except (TypeError, ValueError, RuntimeError):   # a class's own kind of step: not ours
        step = 0
    return step, dict(entry)
