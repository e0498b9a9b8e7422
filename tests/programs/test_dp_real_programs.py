"""Public programs data-parallel as their users run them (issue 24, item 7).

- pytorch/examples' word_language_model with --tied and sparse embeddings: the encoder's table
  is the decoder's weight, so its gradient is dense; the planner keeps it all-reduced and two
  ranks train as one process, with the example's own hand-written update and with Adam.
- DLRM's own row-wise optimizer (RWSAdagrad: one accumulator per row, sparse gradients): each
  server runs the user's class on its rows, and two ranks train, checkpoint and resume as one
  process; a class whose step refuses sparse gradients is refused in one line.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import Optimizer

import tilework
from tilework.config.parallel import ParallelConfig
from tilework.errors import PlanError
from tilework.optim.own import OwnRowOptimizer
from tilework.testing import spawn

TOL = dict(rtol=1e-5, atol=1e-6)


# -- (a) the word language model, tied and sparse ------------------------------------------------

VOCAB, WIDTH, BPTT, BATCH, LM_STEPS, LM_LR, CLIP = 30, 8, 5, 4, 4, 0.5, 0.25


class WordLM(nn.Module):
    """pytorch/examples word_language_model's RNNModel (LSTM, --tied, sparse embeddings), with
    dropout 0: ranks' dropout masks are their own, as under DDP, which no one process equals."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.drop = nn.Dropout(0.0)
        self.encoder = nn.Embedding(VOCAB, WIDTH, sparse=True)
        self.rnn = nn.LSTM(WIDTH, WIDTH, 1)
        self.decoder = nn.Linear(WIDTH, VOCAB)
        self.decoder.weight = self.encoder.weight
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)

    def forward(self, input, hidden):
        output, hidden = self.rnn(self.drop(self.encoder(input)), hidden)
        decoded = self.decoder(self.drop(output)).view(-1, VOCAB)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return (weight.new_zeros(1, bsz, WIDTH), weight.new_zeros(1, bsz, WIDTH))


def _lm_batch(step, rank, world_size):
    """(BPTT, batch) token ids and targets; a rank takes its columns (the example's batchify
    puts sequences in columns)."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (BPTT + 1, BATCH), generator=g)
    cols = tokens.chunk(world_size, dim=1)[rank]
    return cols[:-1], cols[1:].reshape(-1)


def _train_lm(model, opt, rank, world_size):
    """The example's train(): hidden state carried (detached), clipped, updated by hand where
    there is no optimizer."""
    hidden, losses = model.init_hidden(BATCH // world_size), []
    for step in range(LM_STEPS):
        data, targets = _lm_batch(step, rank, world_size)
        hidden = tuple(h.detach() for h in hidden)
        model.zero_grad()
        output, hidden = model(data, hidden)
        loss = F.nll_loss(output, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        if opt is None:
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-LM_LR)
        else:
            opt.step()
        losses.append(loss.item())
    return losses


def _lm_variant(variant, rank, world_size, parallel):
    model = WordLM()
    opt = torch.optim.Adam(model.parameters(), lr=0.01) if variant == "adam" else None
    if parallel:
        tilework.parallelize(model, opt, log=False)
    losses = _train_lm(model, opt, rank, world_size)
    # A backward that uses the encoder alone: its gradient is sparse (no decoder term).
    model.zero_grad()
    model.encoder(_lm_batch(0, rank, world_size)[0]).pow(2).mean().backward()
    grad = model.encoder.weight.grad
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, grad


def _lm_ranks(rank, world_size):
    out = {v: _lm_variant(v, rank, world_size, parallel=True) for v in ("hand", "adam")}
    plan = tilework.plan(WordLM())
    return out, {p.name: (p.method, p.reason) for p in plan.params}


def test_pytorch_does_densify_a_tied_sparse_tables_gradient():
    """What the all-reduce path reproduces: the embedding's sparse part and the decoder's dense
    part of one backward sum to a dense .grad; a backward through the encoder alone leaves a
    sparse one."""
    model = WordLM()
    data, targets = _lm_batch(0, 0, 1)
    F.nll_loss(model(data, model.init_hidden(BATCH))[0], targets).backward()
    assert model.encoder.weight.grad.layout == torch.strided
    model.zero_grad()
    model.encoder(data).sum().backward()
    assert model.encoder.weight.grad.is_sparse


def test_tied_sparse_lm_plans_its_table_all_reduced_and_trains_as_one_process():
    results = spawn(_lm_ranks, 2, timeout=120)
    for variant in ("hand", "adam"):
        want_losses, want_state, want_grad = _lm_variant(variant, 0, 1, parallel=False)
        # Each rank's loss is over its half of the tokens; one process's is their mean.
        mean = [sum(out[variant][0][i] for out, _ in results) / 2 for i in range(LM_STEPS)]
        assert mean == pytest.approx(want_losses, rel=1e-5), variant
        for out, _ in results:
            _, state, grad = out[variant]
            assert state.keys() == want_state.keys()
            for key, value in want_state.items():
                torch.testing.assert_close(state[key], value, **TOL, msg=f"{variant} {key}")
            # The sparse gradient was all-reduced dense: the average of the ranks'.
            assert grad.layout == torch.strided
            torch.testing.assert_close(grad, want_grad.to_dense(), **TOL)
    placed = results[0][1]
    method, reason = placed["encoder.weight"]
    assert method == "allreduce" and "tied to decoder.weight" in reason and "dense" in reason
    assert "decoder.weight" not in placed   # one parameter, planned once


@pytest.mark.parametrize("config, setting", [
    (ParallelConfig(mode="ps"), "mode='ps'"),
    (ParallelConfig(overrides={"encoder.weight": "ps"}), "overrides={'encoder.weight': 'ps'}"),
])
def test_a_tied_table_forced_to_the_servers_is_refused_in_one_line(config, setting):
    with pytest.raises(PlanError) as e:
        tilework.plan(WordLM(), config)
    message = str(e.value)
    assert message.startswith("encoder.weight is tied to decoder.weight"), message
    assert setting in message and "\n" not in message
    assert message.endswith("overrides={'encoder.weight': 'allreduce'}"), message
    forced_off = ParallelConfig(mode="ps", overrides={"encoder.weight": "allreduce"})
    assert tilework.plan(WordLM(), forced_off).by_name()["encoder.weight"].method == "allreduce"


# -- (b) DLRM's row-wise optimizer on the servers ------------------------------------------------

ROWS, DIM, REC_BATCH, REC_STEPS, MORE_STEPS = 40, 4, 8, 5, 2


class RowWiseAdagrad(Optimizer):
    """DLRM's RWSAdagrad, reduced: a sparse gradient updates only its rows, with one
    accumulator per row (the mean of the row's squared gradient); a dense one is Adagrad's.
    State: an int "step", and "momentum" (rows,) or "sum" (the parameter's shape). Unlike
    DLRM's, state is made per parameter, so a fresh instance that loads a state keeps it."""

    def __init__(self, params, lr=1e-2, lr_decay=0.0, eps=1e-10):
        super().__init__(params, dict(lr=lr, lr_decay=lr_decay, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "step" not in state:
                    state["step"] = 0
                    if p.grad.is_sparse:
                        state["momentum"] = p.new_zeros(p.shape[0])
                    else:
                        state["sum"] = torch.zeros_like(p)
                state["step"] += 1
                clr = group["lr"] / (1 + (state["step"] - 1) * group["lr_decay"])
                if p.grad.is_sparse:
                    grad = p.grad.coalesce()
                    rows, values = grad.indices()[0], grad.values()
                    if values.numel():
                        state["momentum"].index_add_(0, rows, values.pow(2).mean(dim=1))
                        std = state["momentum"][rows].sqrt().add_(group["eps"])
                        p.index_add_(0, rows, values / std[:, None], alpha=-clr)
                else:
                    state["sum"].addcmul_(p.grad, p.grad)
                    p.addcdiv_(p.grad, state["sum"].sqrt().add_(group["eps"]), value=-clr)


class DenseOnly(Optimizer):
    """A user's optimizer whose step refuses sparse gradients, as torch's dense ones do."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    if p.grad.is_sparse:
                        raise RuntimeError("DenseOnly does not support sparse gradients")
                    p.add_(p.grad, alpha=-group["lr"])


class TinyRec(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.table = nn.Embedding(ROWS, DIM, sparse=True)
        self.bottom = nn.Linear(2, DIM)
        self.top = nn.Linear(DIM, 1)

    def forward(self, ids, x):
        return self.top(torch.relu(self.table(ids).sum(1) + self.bottom(x))).squeeze(1)


def _rec_batch(step, rank, world_size):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, ROWS, (REC_BATCH, 3), generator=g)
    x, y = torch.randn(REC_BATCH, 2, generator=g), torch.randn(REC_BATCH, generator=g)
    return [t.chunk(world_size)[rank] for t in (ids, x, y)]


def _train_rec(model, opt, steps, rank, world_size):
    losses = []
    for step in steps:
        ids, x, y = _rec_batch(step, rank, world_size)
        loss = F.mse_loss(model(ids, x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _new_rec():
    model = TinyRec()
    return model, RowWiseAdagrad(model.parameters(), lr=0.1, lr_decay=0.01)


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _rec_ranks(rank, world_size, path, mode):
    model, opt = _new_rec()
    tilework.parallelize(model, opt, mode=mode, log=False)
    engine = model._tilework_engine
    parts = [*engine.tables.values(), *engine.served.values()]
    served = len(parts) == (1 if mode == "hybrid" else 5) and all(
        isinstance(part.optimizer, OwnRowOptimizer) for part in parts)
    losses = _train_rec(model, opt, range(REC_STEPS), rank, world_size)
    plain, trained = copy.deepcopy(opt.state_dict()), _params(model)
    tilework.save(path, model, opt)
    resumed = {}
    # Back from tilework's checkpoint, and from the plain state dicts (as one process loads).
    for how in ("checkpoint", "plain"):
        model, opt = _new_rec()
        tilework.parallelize(model, opt, mode=mode, log=False)
        if how == "checkpoint":
            tilework.load(path, model, opt)
        else:
            model.load_state_dict(trained)
            opt.load_state_dict(copy.deepcopy(plain))   # torch's load keeps its tensors
        more = _train_rec(model, opt, range(REC_STEPS, REC_STEPS + MORE_STEPS), rank, world_size)
        resumed[how] = more, _params(model)
    return served, losses, trained, plain, resumed


@pytest.mark.parametrize("mode", ["hybrid", "ps"])   # the table served; every parameter served
def test_a_users_row_wise_optimizer_runs_on_the_servers_as_in_one_process(tmp_path, mode):
    """Dense parameters served (mode="ps") get dense gradients, as in one process: the class's
    dense branch, its state shaped like the parameter."""
    results = spawn(_rec_ranks, 2, args=(str(tmp_path / "state.pt"), mode), timeout=120)
    model, opt = _new_rec()
    want_losses = _train_rec(model, opt, range(REC_STEPS), 0, 1)
    # torch's state_dict holds the live state: copied before the training goes on.
    want_trained, want_plain = _params(model), copy.deepcopy(opt.state_dict())
    want_more = _train_rec(model, opt, range(REC_STEPS, REC_STEPS + MORE_STEPS), 0, 1)
    want_after = _params(model)

    assert all(r[0] for r in results), "the servers did not run the user's class"
    got = [sum(r[1][k] for r in results) / 2 for k in range(REC_STEPS)]
    assert got == pytest.approx(want_losses, rel=1e-5)
    for served, losses, trained, plain, resumed in results:
        for key, value in want_trained.items():
            torch.testing.assert_close(trained[key], value, **TOL, msg=key)
        # The plain optimizer's layout: the table's accumulator gathered to all its rows, its
        # int step kept; the dense parameters' state as torch keeps it.
        assert plain["param_groups"] == want_plain["param_groups"]
        assert plain["state"].keys() == want_plain["state"].keys()
        for index, want in want_plain["state"].items():
            assert plain["state"][index].keys() == want.keys()
            for key, value in want.items():
                if torch.is_tensor(value):
                    torch.testing.assert_close(plain["state"][index][key], value, **TOL)
                else:
                    assert plain["state"][index][key] == value and type(value) is int
        assert plain["state"][0]["momentum"].shape == (ROWS,)
        for how in ("checkpoint", "plain"):
            more, after = resumed[how]
            for key, value in want_after.items():
                torch.testing.assert_close(after[key], value, **TOL, msg=f"{how} {key}")
    for how in ("checkpoint", "plain"):
        got = [sum(r[4][how][0][k] for r in results) / 2 for k in range(MORE_STEPS)]
        assert got == pytest.approx(want_more, rel=1e-5), how


def test_a_users_optimizer_without_sparse_gradients_is_refused_in_one_line():
    model = TinyRec()
    with pytest.raises(PlanError) as e:
        tilework.parallelize(model, DenseOnly(model.parameters()), log=False)
    message = str(e.value)
    assert message.startswith("table.weight: DenseOnly is not supported on the parameter "
                              "server: its step refused a sparse gradient"), message
    assert "DenseOnly does not support sparse gradients" in message and "\n" not in message
    assert message.endswith("overrides={'table.weight': 'allreduce'})"), message
    # Nothing changed: the table is still the model's, and still in the optimizer.
    assert isinstance(model.table, nn.Embedding)
