"""A hand-written update (`parallelize(model, None)`, nanoGPT's and many papers' loops without
torch.optim) on a tp mesh: it trains as one process does, and the mesh's counted step ends with
the synchronised backward, as the data-parallel engine's does."""

from __future__ import annotations

import torch

import tilework
from tests import tiny_gpt
from tilework.estimate.step_bytes import mesh_step_bytes
from tilework.models.gpt import TinyGPT
from tilework.testing import spawn

VOCAB, SEQ, BATCH, LR, STEPS = 52, 8, 8, 0.1, 2


def _gpt() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab=VOCAB, dim=16, heads=4, layers=2, seq_len=SEQ)


def _train(model, part=0, parts=1):
    for step in range(STEPS):
        model(*tiny_gpt.gpt_batch(step, VOCAB, SEQ, BATCH, part, parts)).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
                p.grad = None


def _hand_updated(rank, world_size):
    model, _ = tilework.parallelize(_gpt(), None, tp=2, log=False)
    _train(model, *tilework.data_parallel_rank(model))
    sent = {k: v["sent"] for k, v in tilework.stats(model)["last_step"].items()}
    return sent, tilework.state_dict(model, None)["model"]


def test_hand_written_update_on_a_tp_mesh_is_one_process_and_ends_its_step():
    reference = _gpt()
    _train(reference)
    want = reference.state_dict()
    config = tilework.ParallelConfig(tp=2)
    for rank, (sent, state) in enumerate(spawn(_hand_updated, 2, timeout=120)):
        for key, value in want.items():
            assert (state[key] - value).abs().max() <= 1e-5 * value.abs().max(), (rank, key)
        assert sent == mesh_step_bytes(_gpt(), config, 2, rank, BATCH, SEQ), rank
