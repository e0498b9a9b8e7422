"""Context parallelism (tilework/parallel/context/) against one process: ring attention forward and
backward vs F.scaled_dot_product_attention, the reference GPT trained at cp=2 and dp2 x cp2,
counted bytes vs the cost functions, and what is refused by name.

    .venv/bin/python -m pytest -p no:warnings tests/parallel/context/test_context_parallel.py -q
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests import tiny_gpt
from tilework.cluster.mesh import parallel_mesh
from tilework.comm.counted import Stats
from tilework.comm.wire import ring_allreduce_bytes
from tilework.models.gpt import TinyGPT
from tilework.parallel.context import (
    Ring,
    apply_context_parallel,
    chunks_of,
    cp_attention_bytes,
    cp_step_bytes,
    local_positions,
    ring_attention,
    shard,
    shard_sequence,
    unshard,
)
from tilework.parallel.context.ring import _block
from tilework.parallel.tensor import average_gradients, build_mesh_groups

# Relative to each tensor's largest magnitude. The blocks' softmax sums run in another order
# than SDPA's (seen: <= 4.4e-7 on the primitive at cp=2 and 4; after 3 GPT steps <= 5.4e-7 on
# the parameters, <= 8.9e-8 on the losses).
TOL = 1e-5


def _relative(got, want):
    assert got.shape == want.shape, f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    return (got.double() - want.double()).abs().max().item() / (want.abs().max().item() + 1e-12)


# -- the layout: pure --------------------------------------------------------------------------

def test_load_balanced_layout():
    assert [chunks_of(r, 2) for r in range(2)] == [(0, 3), (1, 2)]
    assert [chunks_of(r, 4) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert local_positions(8, 1, 2).tolist() == [2, 3, 4, 5]
    assert local_positions(16, 0, 4).tolist() == [0, 1, 14, 15]
    x = torch.arange(2 * 24).view(2, 24)
    for cp in (1, 2, 3):
        parts = [shard(x, r, cp) for r in range(cp)]
        assert torch.equal(unshard(parts), x)
        assert all(torch.equal(p[0], local_positions(24, r, cp)) for r, p in enumerate(parts))
    tokens, targets = shard_sequence(x, x + 1, 1, 2)
    assert tokens[0].tolist() == [6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]
    assert torch.equal(targets, tokens + 1)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_causal_work_is_even(cp):
    """Count, not time: the (query, key) score entries each rank computes over the ring's
    steps (a causal diagonal block counted whole, as it is computed) are the same on every
    rank, and the same every step after the first."""
    local = 4
    def size(s, n):
        return len(range(n)[s])
    work = [[size(rows, local) * size(cols, local)
             for rows, cols, _ in (_block(step, r, cp, local, True) for step in range(cp))]
            for r in range(cp)]
    assert all(w == work[0] for w in work)
    assert set(work[0][1:]) == {local * local // 2}


def test_cost_functions():
    assert cp_attention_bytes(2, 4, 16, 8, 1, 3) == 0
    block = 2 * 4 * 8 * 8 * 4                                        # cp=2: 8 tokens each
    assert cp_attention_bytes(2, 4, 16, 8, 2, 3) == 3 * (1 + 3) * 2 * block
    assert cp_attention_bytes(2, 4, 16, 8, 2, 3, backward=False) == 3 * 2 * block
    assert cp_step_bytes(2, 4, 16, 8, 2, 3, params=10) == \
        cp_attention_bytes(2, 4, 16, 8, 2, 3) + ring_allreduce_bytes(40, 2)


# -- ring attention vs SDPA on one process ------------------------------------------------------

SHAPE = (2, 2, 16, 4)   # batch, heads, sequence (16 = 2*cp*2 at cp=4), head_dim


def _check_ring(rank, cp, group, causal):
    g = torch.Generator().manual_seed(5)
    full = [torch.randn(SHAPE, generator=g).requires_grad_() for _ in range(3)]
    upstream = torch.randn(SHAPE, generator=g)
    want = F.scaled_dot_product_attention(*full, is_causal=causal)
    (want * upstream).sum().backward()
    mine = [shard(t.detach(), rank, cp, dim=2).requires_grad_() for t in full]
    stats = Stats()
    out = ring_attention(*mine, Ring(group, stats), causal)
    (out * shard(upstream, rank, cp, dim=2)).sum().backward()
    errors = {"out": _relative(out.detach(), shard(want.detach(), rank, cp, dim=2))}
    for name, t, ref in zip("qkv", mine, full):
        errors[f"d{name}"] = _relative(t.grad, shard(ref.grad, rank, cp, dim=2))
    traffic = stats.total["cp"]
    return {"errors": errors, "bytes": (traffic.sent, traffic.received),
            "expected": cp_attention_bytes(SHAPE[0], SHAPE[1], SHAPE[2], SHAPE[3], cp, 1)}


def _primitives(rank, world_size):
    import torch.distributed as dist
    out = {causal: _check_ring(rank, world_size, dist.group.WORLD, causal)
           for causal in (True, False)}
    try:   # every rank refuses before any message: no rank is left waiting
        q = torch.randn(1, 1, 3, 4)
        ring_attention(q, q, q, Ring(dist.group.WORLD, Stats()))
        out["odd"] = None
    except ValueError as e:
        out["odd"] = str(e)
    return out


@pytest.mark.parametrize("ranks", ["two_ranks", "four_ranks"], ids=["cp2", "cp4"])
def test_ring_attention_equals_sdpa(ranks, request):
    for rank, r in enumerate(request.getfixturevalue(ranks)):
        for causal in (True, False):
            worst = {k: v for k, v in r["primitives"][causal]["errors"].items() if not v <= TOL}
            assert not worst, f"rank {rank}, causal={causal}: {worst}"
            sent, received = r["primitives"][causal]["bytes"]
            assert sent == received == r["primitives"][causal]["expected"] > 0
        assert "local sequence of 3 tokens is not two equal chunks" in r["primitives"]["odd"]


def test_one_rank_ring_is_plain_attention():
    ring, g = Ring(None, Stats()), torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=g) for _ in range(3))
    assert _relative(ring_attention(q, k, v, ring),
                     F.scaled_dot_product_attention(q, k, v, is_causal=True)) <= TOL


# -- the reference GPT trained at cp=2 and dp2 x cp2 against one process ------------------------

STEPS, GLOBAL_BATCH, SEQ, VOCAB, HEADS, DIM, LAYERS = 3, 8, 8, 52, 4, 16, 2


def new_gpt() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab=VOCAB, dim=DIM, heads=HEADS, layers=LAYERS, seq_len=SEQ)


def gpt_batch(step: int, part: int = 0, parts: int = 1):
    return tiny_gpt.gpt_batch(step, VOCAB, SEQ, GLOBAL_BATCH, part, parts)


def _gpt_rank(rank, world_size, cp):
    groups = build_mesh_groups(parallel_mesh(world_size, world_size, cp=cp))
    stats = Stats()
    model = new_gpt()
    apply_context_parallel(model, groups.group("cp"), stats)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        tokens, targets = gpt_batch(step, groups.coord("dp"), groups.size("dp"))
        loss = model(*shard_sequence(tokens, targets, groups.coord("cp"), cp))
        loss.backward()
        average_gradients(model, groups.group("cp"), stats, "cp")
        average_gradients(model, groups.group("dp"), stats, "dp")
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        stats.end_step()
    return {"losses": losses, "state": {k: v.clone() for k, v in model.state_dict().items()},
            "bytes": {m: (t.sent, t.received) for m, t in stats.last_step.items()}}


@pytest.mark.parametrize("ranks", ["two_ranks", "four_ranks"], ids=["cp2", "dp2-cp2"])
def test_gpt_trains_as_one_process(ranks, request):
    results = [r["gpt"] for r in request.getfixturevalue(ranks)]
    dp, cp = len(results) // 2, 2
    model = new_gpt()
    losses = tiny_gpt.sgd_losses(model, gpt_batch, STEPS)
    state = model.state_dict()
    for rank, r in enumerate(results):
        assert list(r["state"]) == list(state)
        for k, v in state.items():
            assert _relative(r["state"][k], v) <= TOL, f"rank {rank}: {k}"
    for step in range(STEPS):   # each rank's mean over its tokens; equal counts: their mean
        mean = sum(r["losses"][step] for r in results) / len(results)
        assert abs(mean - losses[step]) <= TOL * abs(losses[step]), f"step {step}"
    params = sum(p.numel() for p in model.parameters())
    expected = {"cp": cp_step_bytes(GLOBAL_BATCH // dp, HEADS, SEQ, DIM // HEADS, cp, LAYERS,
                                    params)}
    if dp > 1:
        expected["dp"] = ring_allreduce_bytes(params * 4, dp)
    for r in results:
        assert r["bytes"] == {m: (b, b) for m, b in expected.items()}


# -- what is refused, by name (one process: refused before any message) ------------------------

def _causal(n):
    return torch.full((n, n), float("-inf")).triu(1)


@pytest.mark.parametrize("model, kwargs, message", [
    (nn.Sequential(nn.MultiheadAttention(8, 2)), {}, "'0' ring attention: batch_first=False"),
    (nn.Sequential(nn.MultiheadAttention(8, 2, batch_first=True, add_bias_kv=True)), {},
     "add_bias_kv"),
    (nn.Sequential(nn.MultiheadAttention(8, 2, batch_first=True, kdim=4)), {}, "kdim/vdim"),
    (nn.Sequential(nn.Linear(8, 8)), {}, "no nn.MultiheadAttention"),
    (nn.Sequential(nn.MultiheadAttention(8, 2, batch_first=True)), {},
     "no module 'positions'.*positions=None"),
    (TinyGPT(vocab=10, dim=8, heads=2, layers=1, seq_len=4), {"positions": "head"},
     "positions='head' is a Linear"),
])
def test_apply_refuses_by_name(model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        apply_context_parallel(model, None, Stats(), **kwargs)


@pytest.mark.parametrize("call, message", [
    (lambda a, x: a(x, x, x, attn_mask=_causal(4), is_causal=True), "need_weights=True"),
    (lambda a, x: a(x, x, x, need_weights=False, key_padding_mask=torch.zeros(2, 4).bool()),
     "key_padding_mask"),
    (lambda a, x: a(x, x, x, need_weights=False, attn_mask=torch.randn(4, 4)),
     "only a causal attn_mask or none"),
    (lambda a, x: a(x, x.clone(), x.clone(), need_weights=False), "self-attention only"),
])
def test_forward_refuses_by_name(call, message):
    model = nn.Sequential(nn.MultiheadAttention(8, 2, batch_first=True))
    apply_context_parallel(model, None, Stats(), positions=None)
    with pytest.raises(ValueError, match=f"^0 \\(ring attention over cp=1\\): .*{message}"):
        call(model[0], torch.randn(2, 4, 8))


def test_dropout_refused_in_training_only():
    model = nn.Sequential(nn.MultiheadAttention(8, 2, dropout=0.1, batch_first=True))
    apply_context_parallel(model, None, Stats(), positions=None)
    x = torch.randn(2, 4, 8)
    with pytest.raises(ValueError, match="attention dropout=0.1 in training"):
        model[0](x, x, x, need_weights=False)
    model.eval()
    model[0](x, x, x, need_weights=False)


def test_sharding_refuses():
    with pytest.raises(ValueError, match="6 tokens does not cut into 2\\*cp = 4 equal chunks"):
        shard_sequence(torch.zeros(2, 6), torch.zeros(2, 6), 0, 2)
    with pytest.raises(ValueError, match="cp rank 2 is not in a cp group of 2"):
        local_positions(8, 2, 2)


def test_one_rank_is_the_model_itself():
    """cp=1 (no group): the replaced model computes what the unmodified one does, in training
    and on torch's inference path; a boolean causal mask reads as causal."""
    reference, model = new_gpt(), new_gpt()
    assert apply_context_parallel(model, None, Stats()) == \
        ["blocks.layers.0.self_attn", "blocks.layers.1.self_attn"]
    assert list(model.state_dict()) == list(reference.state_dict())
    tokens, targets = gpt_batch(0)
    assert _relative(model(tokens, targets), reference(tokens, targets)) <= TOL
    model.eval(), reference.eval()
    with torch.no_grad():
        assert _relative(model(tokens, targets), reference(tokens, targets)) <= TOL
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    ring_model = nn.Sequential(mha)
    want = mha(*(3 * [torch.ones(1, 4, 8)]), attn_mask=_causal(4), need_weights=False)[0]
    apply_context_parallel(ring_model, None, Stats(), positions=None)
    x, mask = torch.ones(1, 4, 8), torch.ones(4, 4, dtype=torch.bool).triu(1)
    assert _relative(ring_model[0](x, x, x, attn_mask=mask, need_weights=False)[0], want) <= TOL


# -- one world per size for the whole file: each spawn costs seconds on a loaded machine -------

def _suite(rank, world_size):
    return {"primitives": _primitives(rank, world_size), "gpt": _gpt_rank(rank, world_size, 2)}

