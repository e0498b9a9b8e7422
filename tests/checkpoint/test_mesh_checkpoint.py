"""Saving a meshed model: the one-process state is assembled on rank 0 alone, where
tilework.save writes it (checkpoint.gather.gathered_state(dst=0)), equal to what every rank
assembles for tilework.state_dict."""

from __future__ import annotations

import torch

import tilework
from tests.runtime.test_mesh_parallelize import _steps, new_gpt, new_optimizer
from tilework.testing import spawn


def _gathered_to_rank_0(rank, world_size):
    """gathered_state(dst=0), what tilework.save writes, against every rank's gathered_state
    (dst=None): whole on rank 0 alone; the other ranks receive no checkpoint bytes."""
    from tilework.checkpoint.gather import gathered_state

    out = []
    for options in ({"tp": 2, "pp": 2, "microbatches": 2}, {"tp": 2}):   # dp 1, and dp 2
        model = new_gpt()
        opt = new_optimizer(model.parameters())
        model, opt = tilework.parallelize(model, opt, log=False, **options)
        mesh = model._tilework_engine.mesh
        dp, at = mesh.mesh.size_of("dp"), mesh.groups.coord("dp")
        _steps(model, opt, 1, at, dp, options.get("pp", 1) > 1)
        everywhere = gathered_state(model._tilework_engine, None)
        received = mesh.stats.total["checkpoint"].received
        first = gathered_state(model._tilework_engine, dst=0)
        received = mesh.stats.total["checkpoint"].received - received
        same = first is not None and all(
            torch.equal(first["model"][k], v) for k, v in everywhere["model"].items()) and all(
            torch.equal(first["optimizer"]["dense"][n]["momentum_buffer"], per["momentum_buffer"])
            for n, per in everywhere["optimizer"]["dense"].items())
        coords = (mesh.groups.coord("dp"), mesh.groups.coord("tp"))
        out.append((first is None, same, received, coords))
    return out


def test_a_saved_mesh_state_is_assembled_on_rank_0_alone():
    """Only the first rank of a tp group of the first replica receives tp shards (its stage's
    whole tensors, which it hands on to rank 0); every other rank receives none."""
    results = spawn(_gathered_to_rank_0, 4, timeout=300)
    for case in range(2):
        none, same, received, _ = results[0][case]
        assert same and not none and received > 0
        for rank in range(1, 4):
            none, _, received, (dp, tp) = results[rank][case]
            assert none, (case, rank)
            assert (received > 0) == (dp == 0 and tp == 0), (case, rank, received)
