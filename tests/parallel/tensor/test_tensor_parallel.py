"""Tensor and sequence parallelism (tilework/parallel/tensor/) against one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests import tiny_gpt
from tilework.cluster.mesh import parallel_mesh
from tilework.comm.counted import Stats
from tilework.comm.groups import build_mesh_groups
from tilework.models.gpt import TinyGPT
from tilework.parallel.tensor import (
    GPT_LAYOUT,
    TensorParallel,
    apply_layout,
    average_gradients,
    full_state_dict,
    layout_for,
    load_full_state_dict,
    plan_layout,
    step_bytes,
    vocab_parallel_cross_entropy,
)
from tilework.parallel.tensor.loss import ShardedLogits
from tilework.parallel.tensor.shards import unshard


def test_parallel_mesh_puts_tp_inside_a_host():
    mesh = parallel_mesh(8, ranks_per_host=4, tp=2, pp=2)
    assert mesh.names == ("dp", "pp", "cp", "tp") and mesh.shape == (2, 2, 1, 2)
    assert mesh.groups("tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert mesh.groups("pp") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert mesh.groups("dp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert all(len({r // 4 for r in g}) == 1 for g in mesh.groups("tp"))
    assert parallel_mesh(8, 4, tp=8).groups("tp") == [tuple(range(8))]   # whole hosts


@pytest.mark.parametrize("kwargs, message", [
    ({"world_size": 6, "tp": 4}, "does not divide the world of 6"),
    ({"world_size": 12, "ranks_per_host": 4, "tp": 3}, "straddle hosts"),
    ({"world_size": 4, "tp": 0}, "tp must be an integer >= 1"),
])
def test_parallel_mesh_refuses(kwargs, message):
    with pytest.raises(ValueError, match=message):
        parallel_mesh(**kwargs)


def _groups_check(rank, world_size):
    groups = build_mesh_groups(parallel_mesh(world_size, 2, tp=2))
    sums = {}
    for axis in ("tp", "dp"):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=groups.group(axis))
        sums[axis] = t.item()
    return sums, groups.group("pp") is None, groups.ranks("tp")


def test_mesh_groups_are_built_once_per_axis(four_ranks):
    results = [r["groups"] for r in four_ranks]
    assert [r[0] for r in results] == [{"tp": 1, "dp": 2}, {"tp": 1, "dp": 4},
                                       {"tp": 5, "dp": 2}, {"tp": 5, "dp": 4}]
    assert all(r[1] for r in results)
    assert [r[2] for r in results] == [(0, 1), (0, 1), (2, 3), (2, 3)]


# -- primitives: each forward and backward against the same module in one process -----------

TOL = 1e-5   # relative to each tensor's largest magnitude: row-parallel sums reorder additions


class SelfAttention(nn.Module):
    """nn.MultiheadAttention called as nn.TransformerEncoderLayer calls it (causal)."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 4, batch_first=True)

    def forward(self, x):
        mask = torch.full((x.shape[1], x.shape[1]), float("-inf")).triu(1)
        return self.attn(x, x, x, attn_mask=mask, need_weights=False, is_causal=True)[0]


# name: (module factory, layout, input, the input's part, the output's part); a part is how a
# rank holds the one-process tensor: "full", "seq" (its slice of dim 1, under sequence
# parallelism; whole otherwise) or "features" (its slice of the last dim)
PRIMITIVES = {
    "colwise": (lambda: nn.Linear(16, 8), {"0": "colwise"}, "x", "seq", "features"),
    "rowwise": (lambda: nn.Linear(8, 16), {"0": "rowwise"}, "h", "features", "seq"),
    "vocab_embedding": (lambda: nn.Embedding(52, 16), {"0": "vocab_embedding"}, "ids", "full",
                        "seq"),
    "heads": (SelfAttention, {"0.attn": "heads"}, "x", "seq", "seq"),
    "layernorm": (lambda: nn.LayerNorm(16), {"0": "sequence"}, "x", "seq", "seq"),
    "positions": (lambda: nn.Embedding(8, 16), {"0": "sequence"}, "pos", "full", "seq"),
    "mlp": (lambda: nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)),
            {"0.0": "colwise", "0.2": "rowwise"}, "x", "seq", "seq"),
}


def _inputs():
    g = torch.Generator().manual_seed(3)
    return {"x": torch.randn(4, 8, 16, generator=g), "h": torch.randn(4, 8, 8, generator=g),
            "ids": torch.randint(0, 52, (4, 8), generator=g), "pos": torch.arange(8)[None]}


def _part(t, how, tp):
    if how == "features":
        return t.chunk(tp.size, -1)[tp.rank]
    if how == "seq" and tp.sequence_parallel:
        return t.chunk(tp.size, 1)[tp.rank]
    return t


def _relative(got, want):
    assert got.shape == want.shape, f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    return (got.double() - want.double()).abs().max().item() / (want.abs().max().item() + 1e-12)


def _full_grads(model, plan, tp):
    """Every parameter's gradient as one process holds it: shards all-gathered over tp."""
    specs, out = plan.specs(), {}
    for name, p in model.named_parameters():
        grad = p.grad
        if name in specs:
            parts = [torch.empty_like(grad) for _ in range(tp.size)]
            dist.all_gather(parts, grad.contiguous(), group=tp.group)
            grad = unshard(parts, specs[name])
        out[name] = grad
    return out


def _check_primitive(name, tp):
    make, layout, key, in_part, out_part = PRIMITIVES[name]
    x = _inputs()[key]
    torch.manual_seed(1)
    ref = nn.Sequential(make())
    x_ref = x.clone().requires_grad_(x.is_floating_point())
    y_ref = ref(x_ref)
    upstream = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(2))
    (y_ref * upstream).sum().backward()
    torch.manual_seed(1)
    model = nn.Sequential(make())
    plan = apply_layout(model, layout, tp)
    x_mine = _part(x, in_part, tp).clone().requires_grad_(x.is_floating_point())
    y = model(x_mine)
    (y * _part(upstream, out_part, tp)).sum().backward()
    errors = {f"{name}: output": _relative(y, _part(y_ref, out_part, tp))}
    if x.is_floating_point():
        errors[f"{name}: input grad"] = _relative(x_mine.grad, _part(x_ref.grad, in_part, tp))
    ref_grads = dict(ref.named_parameters())
    for pname, grad in _full_grads(model, plan, tp).items():
        errors[f"{name}: {pname} grad"] = _relative(grad, ref_grads[pname].grad)
    return errors


def _check_cross_entropy(tp):
    g = torch.Generator().manual_seed(4)
    logits = (3 * torch.randn(32, 52, generator=g)).requires_grad_()
    targets = torch.randint(0, 52, (32,), generator=g)
    targets[::5] = -100
    F.cross_entropy(logits, targets).backward()
    mine = _part(logits.detach(), "features", tp).clone().requires_grad_()
    start = tp.rank * mine.shape[1]
    loss = vocab_parallel_cross_entropy(mine, targets, tp, start)
    loss.backward()
    errors = {"cross-entropy: loss": _relative(loss.detach(), F.cross_entropy(logits, targets)),
              "cross-entropy: grad": _relative(mine.grad, _part(logits.grad, "features", tp))}
    # as an unmodified model calls it: F.cross_entropy on the vocab_head's reshaped logits
    x, targets = _inputs()["x"], targets.view(4, 8)
    torch.manual_seed(1)
    ref = nn.Sequential(nn.Linear(16, 52))
    logits = ref(x)
    ref_loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    ref_loss.backward()
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(16, 52))
    plan = apply_layout(model, {"0": "vocab_head"}, tp)
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    errors["vocab_head + F.cross_entropy: loss"] = _relative(loss.detach(), ref_loss.detach())
    for pname, grad in _full_grads(model, plan, tp).items():
        errors[f"vocab_head: {pname} grad"] = _relative(grad, ref.get_parameter(pname).grad)
    return errors


def _primitives(rank, world_size, names):
    errors = {}
    for sp in (False, True):
        tp = TensorParallel(dist.group.WORLD, rank, world_size, sp)
        for name in names:
            errors |= {f"{k} (sp={sp})": v for k, v in _check_primitive(name, tp).items()}
    errors |= _check_cross_entropy(TensorParallel(dist.group.WORLD, rank, world_size))
    return errors


@pytest.mark.parametrize("ranks", ["two_ranks", "four_ranks"])
def test_primitives_forward_and_backward_equal_one_process(ranks, request):
    for rank, r in enumerate(request.getfixturevalue(ranks)):
        worst = {k: v for k, v in r["primitives"].items() if not v <= TOL}
        assert not worst, f"rank {rank}: {worst}"


# -- the reference GPT trained at (dp, tp) against one process ---------------------------------

STEPS, GLOBAL_BATCH, SEQ, VOCAB = 3, 8, 8, 52
GPT_TOL = 1e-5   # SGD; the tp sums and the dp all-reduce reorder additions (seen: <= 1.2e-6)


def new_gpt(device=None) -> TinyGPT:
    torch.manual_seed(0)
    with torch.device(device or "cpu"):
        return TinyGPT(vocab=VOCAB, dim=16, heads=4, layers=2, seq_len=SEQ)


def gpt_batch(step: int, part: int = 0, parts: int = 1):
    return tiny_gpt.gpt_batch(step, VOCAB, SEQ, GLOBAL_BATCH, part, parts)


def gpt_reference():
    model = new_gpt()
    losses = tiny_gpt.sgd_losses(model, gpt_batch, STEPS)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _gpt_rank(rank, world_size, tp_size, sp):
    groups = build_mesh_groups(parallel_mesh(world_size, world_size, tp=tp_size))
    stats = Stats()
    tp = TensorParallel.from_mesh(groups, stats, sequence_parallel=sp)
    model = new_gpt()
    plan = apply_layout(model, layout_for(model), tp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        loss = model(*gpt_batch(step, groups.coord("dp"), groups.size("dp")))
        loss.backward()
        average_gradients(model, groups.group("dp"), stats)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        stats.end_step()
    state = full_state_dict(model, plan, tp)
    # and back: a fresh split model loads the one-process checkpoint and gives it back
    again = new_gpt()
    again_plan = apply_layout(again, layout_for(again), tp)
    load_full_state_dict(again, again_plan, tp, state)
    same = all(torch.equal(v, state[k]) for k, v in full_state_dict(again, again_plan, tp).items())
    step_bytes = {m: t.sent for m, t in stats.last_step.items()}
    return {"losses": losses, "state": state, "bytes": step_bytes, "round_trip": same,
            "dp": groups.coord("dp")}


@pytest.mark.parametrize("ranks, sp", [("two_ranks", False), ("two_ranks", True),
                                      ("four_ranks", True)],
                         ids=["dp1-tp2", "dp1-tp2-sp", "dp2-tp2-sp"])
def test_gpt_trains_as_one_process(ranks, sp, request):
    results = [r["gpt"][sp] for r in request.getfixturevalue(ranks)]
    world_size, tp_size = len(results), 2
    losses, state = gpt_reference()
    dp = world_size // tp_size
    for rank, r in enumerate(results):
        assert r["round_trip"]
        assert set(r["state"]) == set(state)
        for k, v in state.items():
            assert _relative(r["state"][k], v) <= GPT_TOL, f"rank {rank}: {k}"
    for step in range(STEPS):
        mean = sum(r["losses"][step] for r in results) / world_size   # tp ranks agree
        assert abs(mean - losses[step]) <= GPT_TOL * abs(losses[step]), f"step {step}"
    plan = plan_layout(new_gpt("meta"), GPT_LAYOUT, tp_size, sp)   # pure: a meta model
    expected = step_bytes(plan, GLOBAL_BATCH // dp, SEQ, dp)
    for r in results:
        assert r["bytes"] == {axis: b for axis, b in expected.items() if b}


# -- what a layout refuses, by name ----------------------------------------------------------

@pytest.mark.parametrize("model, layout, tp, sp, message", [
    (nn.Sequential(nn.Linear(16, 6)), {"0": "colwise"}, 4, False,
     "cannot apply 'colwise' to '0' .*out_features=6 does not split over tp=4"),
    (nn.Sequential(nn.Linear(6, 16)), {"0": "rowwise"}, 4, False, "in_features=6"),
    (nn.Sequential(nn.Conv1d(4, 4, 3)), {"0": "colwise"}, 2, False,
     "splits an nn.Linear, this is Conv1d"),
    (nn.Sequential(nn.MultiheadAttention(16, 2)), {"0": "heads"}, 2, False, "batch_first=False"),
    (nn.Sequential(nn.MultiheadAttention(16, 2, batch_first=True)), {"0": "heads"}, 4, False,
     "2 heads do not split over tp=4"),
    (nn.Sequential(nn.Embedding(10, 4, padding_idx=0)), {"0": "vocab_embedding"}, 2, False,
     "padding_idx"),
    (nn.Sequential(nn.Linear(4, 4)), {"*.fc1": "colwise"}, 2, False, "matches no module"),
    (nn.Sequential(nn.Linear(4, 4)), {"0": "diagonal"}, 2, False, "unknown style 'diagonal'"),
    (nn.Sequential(nn.Linear(4, 4)), {"0": "colwise", "[0]": "rowwise"}, 2, False,
     "patterns '0' and '\\[0\\]'"),
    (nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)), {"0": "colwise"}, 2, True,
     "not named: 1"),
    (nn.Sequential(nn.Sequential(nn.Linear(4, 4))), {"0": "replicate", "0.0": "colwise"}, 2,
     False, "'0.0.weight' is named twice"),
    (new_gpt("meta"), GPT_LAYOUT, 3, False, "'tokens'.*52 rows do not split over tp=3"),
])
def test_layout_refuses_by_name(model, layout, tp, sp, message):
    with pytest.raises(ValueError, match=message):
        plan_layout(model, layout, tp, sp)


def test_built_in_layouts():
    mlp = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 8),
                        nn.Linear(8, 8))
    assert layout_for(mlp) == {"0": "colwise", "3": "rowwise"}
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, batch_first=True), 2,
                                    norm=nn.LayerNorm(16), enable_nested_tensor=False)
    layout = layout_for(encoder)
    assert layout["layers.1.self_attn"] == "heads" and layout["norm"] == "sequence"
    assert len(plan_layout(encoder, layout, 2, True).placements) == 11
    assert layout_for(new_gpt("meta")) == GPT_LAYOUT
    with pytest.raises(ValueError, match="no built-in layout fits Conv1d"):
        layout_for(nn.Conv1d(2, 2, 1))


def test_split_logits_refuse_what_would_read_a_part_of_the_vocabulary():
    logits = ShardedLogits.wrap(torch.randn(4, 26), TensorParallel(None, 0, 2), 0)
    assert logits.reshape(2, 2, 26).shape == (2, 2, 26)
    assert isinstance(logits.reshape(-1, logits.shape[-1]), ShardedLogits)
    with pytest.raises(TypeError, match="softmax on logits split over the vocabulary"):
        logits.softmax(-1)
    with pytest.raises(ValueError, match="label_smoothing"):
        F.cross_entropy(logits, torch.zeros(4, dtype=torch.long), label_smoothing=0.1)


# -- one world per size for the whole file: each spawn costs seconds on a loaded machine ------

def _suite(rank, world_size):
    """Everything a world of `world_size` ranks checks, in one start."""
    if world_size == 2:
        return {"primitives": _primitives(rank, world_size, list(PRIMITIVES)),
                "gpt": {sp: _gpt_rank(rank, world_size, 2, sp) for sp in (False, True)}}
    return {"groups": _groups_check(rank, world_size),
            "primitives": _primitives(rank, world_size, ["heads", "mlp"]),
            "gpt": {True: _gpt_rank(rank, world_size, 2, True)}}



def test_a_models_own_plan_that_splits_parameters_says_they_stay_whole():
    """Hugging Face's MoE plans name parameters (`experts.gate_up_proj`), not modules: tilework
    splits modules only, so those stay whole on every tp rank, and it says so once."""
    from tilework.parallel.tensor.layout import models_own_layout

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.zeros(4, 8, 16))

    class MoE(nn.Module):
        _tp_plan = {"up": "colwise", "down": "rowwise", "experts.gate_up_proj": "packed_colwise"}

        def __init__(self):
            super().__init__()
            self.up, self.down, self.experts = nn.Linear(8, 16), nn.Linear(16, 8), Experts()

    with pytest.warns(UserWarning, match=r"splits parameters, not modules: "
                                         r"experts.gate_up_proj \(packed_colwise\)"):
        assert models_own_layout(MoE()) == {"up": "colwise", "down": "rowwise"}
