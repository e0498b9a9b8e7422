"""The input checks on a tp mesh: one tensor-parallel shard's NaN gradient drops the step on
every rank of the world, not only in the dp group that holds the shard (each dp group agrees on
its own, then the verdict crosses the tp group). Without that, under dp2 x tp2 the other dp
group would step, and the replicas' copies of the replicated parameters would part silently."""

from __future__ import annotations

import pytest
import torch

import tilework
from tests import tiny_gpt
from tilework.errors import InputError
from tilework.models.gpt import TinyGPT
from tilework.testing import spawn

VOCAB, SEQ, BATCH = 52, 8, 8


def _poisoned_step(rank, world_size):
    torch.manual_seed(0)
    model = TinyGPT(vocab=VOCAB, dim=16, heads=4, layers=2, seq_len=SEQ)
    whole = {n: p.shape for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = tilework.parallelize(model, opt, tp=2, log=False)
    dp_rank, dp = tilework.data_parallel_rank(model)
    split = next(p for n, p in model.named_parameters() if p.shape != whole[n])

    def step(s, poison=False):
        handle = split.register_hook(lambda g: torch.full_like(g, float("nan"))) \
            if poison else None
        loss = model(*tiny_gpt.gpt_batch(s, VOCAB, SEQ, BATCH, dp_rank, dp))
        loss.backward()
        if handle is not None:
            handle.remove()
        try:
            opt.step()
            return None
        except InputError as e:
            return str(e), e.ranks
        finally:
            opt.zero_grad()

    step(0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    refused = step(1, poison=rank == 1)     # one shard of one replica
    unchanged = all(torch.equal(before[n], p) for n, p in model.named_parameters())
    step(2)                                 # the job goes on, every rank together
    state = tilework.state_dict(model, opt)["model"]
    return refused, unchanged, {k: v.clone() for k, v in state.items()}


@pytest.mark.parametrize("world", [2, 4])   # tp2 (dp = 1), dp2 x tp2
def test_one_tp_shards_nan_drops_the_step_on_every_rank(world):
    results = spawn(_poisoned_step, world, timeout=240)
    for rank, (refused, unchanged, _) in enumerate(results):
        assert refused is not None, f"rank {rank} stepped past rank 1's NaN gradient"
        message, ranks = refused
        assert ranks == (1,) and "rank 1:" in message and "NaN or inf" in message, message
        assert unchanged, f"rank {rank} moved a parameter in the refused step"
    states = [state for *_, state in results]
    for key, value in states[0].items():   # the full model, alike on every rank after it
        assert all(torch.equal(value, s[key]) for s in states[1:]), key
