"""The row-wise optimizers of the parameter server against torch's own (optim/rowwise.py)."""

import inspect

import pytest
import torch

from tilework.errors import PlanError
from tilework.optim.rowwise import RowOptimizer, family_of

LR, WEIGHT_DECAY, STEPS = 0.05, 0.1, 6


def _family(make):
    opt = make([torch.zeros(3, requires_grad=True)])
    return family_of(opt, opt.param_groups[0], "table.weight")


@pytest.mark.parametrize("make, family", [
    (lambda p: torch.optim.SGD(p, lr=0.1), "sgd"),
    (lambda p: torch.optim.Adagrad(p), "adagrad"),
    (lambda p: torch.optim.Adam(p), "adam"),
    (lambda p: torch.optim.SparseAdam(p), "adam"),
    (lambda p: torch.optim.AdamW(p, weight_decay=0), "adamw"),   # no decay: Adam's update
    (lambda p: torch.optim.AdamW(p), "adamw"),                   # weight_decay=0.01 by default
    pytest.param(lambda p: torch.optim.Adam(p, weight_decay=0.1, decoupled_weight_decay=True),
                 "adamw", marks=pytest.mark.skipif(
                     "decoupled_weight_decay" not in inspect.signature(torch.optim.Adam).parameters,
                     reason=f"torch {torch.__version__}'s Adam has no decoupled_weight_decay")),
])
def test_families(make, family):
    assert _family(make) == family


@pytest.mark.parametrize("make, expected", [
    (lambda p: torch.optim.Adam(p, weight_decay=0.1), "Adam with weight_decay (L2"),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), "SGD with momentum"),
    (lambda p: torch.optim.AdamW(p, amsgrad=True), "AdamW with amsgrad"),
    (lambda p: torch.optim.RMSprop(p), "RMSprop is not supported"),
])
def test_refusals_name_the_parameter_and_the_override_that_fixes_them(make, expected):
    with pytest.raises(PlanError) as e:
        _family(make)
    message = str(e.value)
    assert message.startswith(f"table.weight: {expected}"), message
    assert message.endswith("parallelize(model, opt, "
                            "overrides={'table.weight': 'allreduce'})"), message
    assert "\n" not in message


def _adamw_group(eps=1e-8):
    opt = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=LR, eps=eps,
                            weight_decay=WEIGHT_DECAY)
    return opt.param_groups[0]


def _reference_adamw(start, grads, eps=1e-8):
    w = start.clone().requires_grad_()
    opt = torch.optim.AdamW([w], lr=LR, eps=eps, weight_decay=WEIGHT_DECAY)
    for g in grads:
        w.grad = g.clone()
        opt.step()
    return w.detach()


def _row_optimizer(start, steps, lazy, eps=1e-8):
    """`steps`: (rows, gradient rows) per step."""
    shard = start.clone()
    opt = RowOptimizer("adamw", _adamw_group(eps), shard, lazy=lazy)
    for rows, grads in steps:
        opt.apply(rows, grads)
    return shard


def test_dense_served_rows_are_exactly_adamw():
    torch.manual_seed(0)
    start, grads = torch.randn(8, 4), [torch.randn(8, 4) for _ in range(STEPS)]
    every_row = torch.arange(8)
    got = _row_optimizer(start, [(every_row, g) for g in grads], lazy=False)
    torch.testing.assert_close(got, _reference_adamw(start, grads), rtol=0, atol=1e-6)
    # The decay is there: without it the rows land elsewhere.
    no_decay = start.clone()
    adam = RowOptimizer("adam", {**_adamw_group(), "weight_decay": 0}, no_decay, lazy=False)
    for g in grads:
        adam.apply(every_row, g)
    assert (got - no_decay).abs().max() > 1e-3


def test_lazy_rows_touched_every_step_get_adamws_update():
    """The lazy rule is SparseAdam's arithmetic: lr * sqrt(bias2) / bias1 * m / (sqrt(v) + eps),
    where AdamW has lr / bias1 * m / (sqrt(v) / sqrt(bias2) + eps). With eps = 0 the two are the
    same number computed in another order, so the reference is torch.optim.AdamW itself with
    eps=0 and the tolerance is rounding (1e-6). With the default eps the gap would be about
    eps / sqrt(v), some 1e-8 here: a tolerance that would also pass a wrong eps placement."""
    torch.manual_seed(1)
    start, grads = torch.randn(8, 4), [torch.randn(8, 4) for _ in range(STEPS)]
    got = _row_optimizer(start, [(torch.arange(8), g) for g in grads], lazy=True, eps=0.0)
    torch.testing.assert_close(got, _reference_adamw(start, grads, eps=0.0), rtol=0, atol=1e-6)


def test_lazy_rows_decay_only_on_the_steps_that_touch_them():
    """The documented lazy rule: decay the touched rows, then SparseAdam; untouched rows keep
    their value. A large eps makes its placement (SparseAdam's) matter."""
    torch.manual_seed(2)
    start, eps = torch.randn(10, 4), 1e-2
    touched = [torch.tensor(r) for r in ([0, 2, 5], [0, 1], [2, 5, 7], [0, 7], [1, 2])]
    steps = [(rows, torch.randn(len(rows), 4)) for rows in touched]
    got = _row_optimizer(start, steps, lazy=True, eps=eps)

    want = start.clone().requires_grad_()
    sparse_adam = torch.optim.SparseAdam([want], lr=LR, eps=eps)
    for rows, grads in steps:
        with torch.no_grad():
            want[rows] *= 1 - LR * WEIGHT_DECAY
        want.grad = torch.sparse_coo_tensor(rows[None], grads, want.shape,
                                             check_invariants=True)
        sparse_adam.step()
    torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-6)
    never = [3, 4, 6, 8, 9]
    assert torch.equal(got[never], start[never])


def test_parallelize_serves_a_table_trained_with_adamw():
    """One process through the engine: the table goes to the server, which decays the rows a
    step touched and leaves the others as they were."""
    import tilework

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 4, sparse=True), torch.nn.Linear(4, 1))
    start = model[0].weight.detach().clone()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    tilework.parallelize(model, opt, log=False)
    assert "0.weight" in model._tilework_engine.tables
    ids = torch.tensor([[1, 2, 3]])
    model(ids).pow(2).mean().backward()
    opt.step()
    with torch.no_grad():
        after = model[0].weight
    assert not torch.equal(after[1:4], start[1:4])
    assert torch.equal(after[4:], start[4:]) and torch.equal(after[0], start[0])
