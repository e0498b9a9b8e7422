"""The hook that weights a rank's gradients by its batch share (runtime/shares.py): pure, one
process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tilework.errors import PlanError
from tilework.runtime.shares import weight_output


def grads(model, weight=None):
    torch.manual_seed(0)
    x = torch.randn(4, 3)
    if weight is not None:
        handle = model.register_forward_hook(weight_output(weight))
    model.zero_grad()
    out = model(x)
    (out["y"] if isinstance(out, dict) else out).sum().backward()
    if weight is not None:
        handle.remove()
    return [p.grad.clone() for p in model.parameters()], out


def test_every_gradient_is_weighted_and_the_output_is_not():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
    plain, y = grads(model)
    weighted, y2 = grads(model, 0.25)
    for a, b in zip(plain, weighted):
        torch.testing.assert_close(b, 0.25 * a)
    torch.testing.assert_close(y, y2)


class DictOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x):
        return {"y": self.lin(x), "n": 3}


class Opaque:
    def __init__(self, y):
        self.y = y


class OpaqueOut(DictOut):
    def forward(self, x):
        return Opaque(self.lin(x))


def test_a_dict_output_is_reached_and_an_opaque_one_refused():
    model = DictOut()
    plain, _ = grads(model)
    weighted, _ = grads(model, 3.0)
    torch.testing.assert_close(weighted[0], 3.0 * plain[0])
    model = OpaqueOut()
    model.register_forward_hook(weight_output(3.0))
    with pytest.raises(PlanError, match="batch_shares: the model's output \\(Opaque\\)"):
        model(torch.randn(2, 3))
    with torch.no_grad():   # evaluation: nothing to weigh
        model(torch.randn(2, 3))


def test_the_user_may_change_the_output_in_place():
    """`loss /= steps` on what the model returned, as accumulation loops write it."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    x = torch.randn(4, 3)
    plain = model(x).sum()
    plain.backward()
    expected = model.weight.grad.clone() * 0.5 / 2
    model.zero_grad()
    model.register_forward_hook(weight_output(0.5))
    out = model(x)
    out /= 2
    out.sum().backward()
    torch.testing.assert_close(model.weight.grad, expected)
