"""Checkpoints of a parallelized model in single-device layout: checked before anything is
loaded (a mismatch never half-loads), and loaded at any world size and plan. Optimizer state is
keyed by parameter name; the server tables' row-wise state is gathered and scattered by rows."""

from __future__ import annotations

import torch

from ..errors import CheckpointError


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
    expected = {k: tuple(v.shape) for k, v in engine.model_state(gather_to="meta").items()}
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
            if key != "step" and tuple(value.shape)[:1] != (part.layout.rows,):
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
    if engine.optimizer is not None:
        for name, s in opt_state["dense"].items():
            engine.optimizer.state[by_name[name]] = {
                k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()}
        for group, saved in zip(engine.optimizer.param_groups, opt_state["groups"]):
            group.update(saved)
    for name, part in [*engine.tables.items(), *engine.served.items()]:
        saved = dict(opt_state["rows"][name])
        step = saved.pop("step")
        part.optimizer.load(step, {k: part.take_shard(v) for k, v in saved.items()})
