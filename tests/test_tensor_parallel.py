"""Tensor and sequence parallelism (tilework/tensor/) against one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tilework.mesh import parallel_mesh
from tilework.tensor import TensorParallel, apply_layout, vocab_parallel_cross_entropy
from tilework.tensor.groups import build_mesh_groups
from tilework.tensor.shards import unshard
from tilework.testing import spawn


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


def _groups_rank(rank, world_size):
    groups = build_mesh_groups(parallel_mesh(world_size, 2, tp=2))
    sums = {}
    for axis in ("tp", "dp"):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=groups.group(axis))
        sums[axis] = t.item()
    return sums, groups.group("pp") is None, groups.ranks("tp")


def test_mesh_groups_are_built_once_per_axis():
    results = spawn(_groups_rank, 4, timeout=60)
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


def _primitives_rank(rank, world_size, names):
    errors = {}
    for sp in (False, True):
        tp = TensorParallel(dist.group.WORLD, rank, world_size, sp)
        for name in names:
            errors |= {f"{k} (sp={sp})": v for k, v in _check_primitive(name, tp).items()}
    errors |= _check_cross_entropy(TensorParallel(dist.group.WORLD, rank, world_size))
    return errors


@pytest.mark.parametrize("tp_size, names", [(2, list(PRIMITIVES)), (4, ["heads", "mlp"])])
def test_primitives_forward_and_backward_equal_one_process(tp_size, names):
    for rank, errors in enumerate(spawn(_primitives_rank, tp_size, args=(names,), timeout=120)):
        worst = {k: v for k, v in errors.items() if not v <= TOL}
        assert not worst, f"rank {rank}: {worst}"
