"""The user-facing entry points: parallelize, state_dict / load_state_dict, save / load."""

from __future__ import annotations

from typing import Any


def state_dict(model, opt) -> dict[str, Any]:
    """Model and optimizer state, world-size independent (sharded tables are gathered)."""
    engine = getattr(model, "_tilework_engine", None)
    if engine is not None:
        return engine.state_dict()
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def load_state_dict(model, opt, state: dict[str, Any]) -> None:
    engine = getattr(model, "_tilework_engine", None)
    if engine is not None:
        return engine.load_state_dict(state)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])


def parallelize(model, opt, groups=None, **options):
    raise NotImplementedError("the sparsity-aware engine arrives with the Parallax-core issue")
