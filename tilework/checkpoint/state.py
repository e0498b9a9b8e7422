"""Checkpoints of a parallelized model in single-device layout: checked before anything is
loaded (a mismatch never half-loads), and loaded at any world size and plan. Optimizer state is
keyed by parameter name; the server tables' row-wise state is gathered and scattered by rows."""

from __future__ import annotations

import torch

from ..errors import CheckpointError
from ..optim.own import OwnRowOptimizer, take_rows


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
    """Everything a load would touch, checked before anything is: a mismatch never
    half-loads."""
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
            if key == "step" or (key == "state" and _own(part)):   # see gathered_state
                continue
            if tuple(value.shape)[:1] != (part.layout.rows,):
                problem = (f"optimizer {key} of {name} has {tuple(value.shape)[:1]} rows, "
                           f"the table {part.layout.rows}")
    here = engine.optimizer.param_groups if engine.optimizer is not None else []
    if not problem and len(opt["groups"]) != len(here):
        problem = (f"{len(opt['groups'])} optimizer parameter groups in the checkpoint, "
                   f"{len(here)} here")
    if problem:
        raise CheckpointError(f"checkpoint does not match the model: {problem}")


def load_state(engine, state: dict) -> None:
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


def _own(part) -> bool:
    return isinstance(part.optimizer, OwnRowOptimizer)


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


def _unshard(engine, by_name: dict) -> None:
    """ZeRO shards' optimizer state, by parameter name, gathered whole in place (a collective:
    every rank, the same order)."""
    for name in engine.zero.by_name:
        if by_name.get(name) is not None:
            by_name[name] = engine.zero.full_state(name, by_name[name])


# -- the user's own optimizer.state_dict() / load_state_dict(): the plain optimizer's layout ------

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
        _unshard(engine, by_name)
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


def plain_row_state(optimizer, entry: dict) -> dict | None:
    """A server table's gathered row-wise state (`gathered_state`'s "rows" entry) as the plain
    `optimizer` keeps it for the whole table."""
    if "state" in entry and len(entry) == 2:   # a user's own optimizer: its plain entry
        return entry["state"] or None
    tensors = {k: v for k, v in entry.items() if k != "step"}
    if not tensors:
        return None
    step = entry["step"]
    return {**tensors, "step": step if isinstance(optimizer, torch.optim.SparseAdam)
            else torch.tensor(float(step), device="cpu")}


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


def parallel_optimizer_state(engine, state: dict) -> dict | None:
    """The inverse, for optimizer.load_state_dict(): a plain optimizer's state dict (from one
    process, DDP, or this optimizer's state_dict()) split into the servers' rows, loaded here,
    and the rest, renumbered for torch's own load. Anything else goes to torch unchanged (its
    own checks name what does not match)."""
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


def _own_state(part, dst: int | None) -> dict:
    """A user's optimizer's state of a server parameter in its plain layout: per-row tensors
    gathered into the table's rows, the rest (step counts, scalars) as this rank holds them."""
    optimizer = part.optimizer
    return {**optimizer.scalars(),
            **{k: part.gather(v, dst) for k, v in optimizer.state_tensors().items()}}


def _own_rows(entry: dict):
    """(step, whole-table state) for a user's optimizer, from its plain state: whatever the
    class keeps, unchecked, as its own load_state_dict takes it in one process."""
    step = entry.get("step", 0)
    try:
        step = int(step.item() if torch.is_tensor(step) else step)
    except (TypeError, ValueError, RuntimeError):   # a class's own kind of step: not ours
        step = 0
    return step, dict(entry)


def gathered_state(engine, dst: int | None) -> dict:
    """The model and optimizer in single-device layout, server rows and their row-wise state
    gathered to rank `dst` (every rank when None); optimizer state keyed by parameter name."""
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
    _unshard(engine, dense_state)
    groups = [] if optimizer is None else [
        {k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {"model": model_state,
            "optimizer": {"dense": dense_state, "groups": groups, "rows": rows}}


def gathered_model_state(engine, gather_to) -> dict:
    """model.state_dict() with the tables gathered to rank `gather_to` (None: every rank;
    "meta": shapes only, no communication)."""
    for module in [*engine.table_modules.values(), engine.zero]:
        module.gather_to = gather_to
    try:
        return dict(engine.model.state_dict())
    finally:
        for module in [*engine.table_modules.values(), engine.zero]:
            module.gather_to = None
