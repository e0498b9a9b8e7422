"""Bad input on one rank: a clear error naming the rank and the tensor, raised together on every
rank (nobody left waiting in a collective), with nothing updated."""

import subprocess
import sys

import pytest
import torch
from torch import nn

import tilework
from tilework.errors import IdOutOfRange, InputError
from tilework.launch.faults import PEER_FAULT_EXIT, worker_failure
from tilework.testing import RankFailed, spawn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.table = nn.Embedding(100, 4, sparse=True)
        self.words = nn.Embedding(10, 4)          # dense gradient: all-reduced
        self.head = nn.Linear(4, 1)

    def forward(self, ids, words=None):
        words = ids % 10 if words is None else words
        return self.head(self.table(ids).mean(1) + self.words(words).mean(1)).pow(2).mean()


def ids(rank, rows=4):
    return torch.arange(rows * 3).reshape(rows, 3) + rank


def _setup(check_inputs=True):
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tilework.parallelize(model, opt, log=False, check_inputs=check_inputs)
    return model, opt


def _snapshot(model):
    with torch.no_grad():
        return {n: t.clone() for n, t in tilework.state_dict(model, None)["model"].items()
                if t is not None}


def _bad_step(rank, world_size, kind):
    model, opt = _setup()
    before = _snapshot(model)
    x = ids(rank)
    try:
        if kind == "nan-loss":
            loss = model(x) * (float("nan") if rank == 1 else 1.0)
            # The model returned a finite loss: the NaN shows in the gradients.
            loss.backward()
        elif kind == "nan-output":
            model.head.bias.data.fill_(float("inf") if rank == 1 else 0.0)
            model(x).backward()
        elif kind == "nan-last-bucket":   # only a gradient the last bucket carries
            poison = model.words.weight.register_hook(
                lambda g: torch.full_like(g, float("nan")) if rank == 1 else g)
            model(x).backward()
            poison.remove()
        elif kind == "uneven":
            model(ids(rank, rows=3 if rank == 1 else 4)).backward()
        opt.step()
    except InputError as e:
        error = (str(e), e.ranks)
    else:
        error = None
    opt.zero_grad()
    model.head.bias.data.zero_()  # undo the "nan-output" fault before the sound step below
    untouched = all(torch.equal(t, before[n]) for n, t in _snapshot(model).items()
                    if n != "head.bias")
    # The group is still usable: the next, sound step goes through on every rank.
    model(ids(rank)).backward()
    opt.step()
    return error, untouched


def test_nan_gradient_on_one_rank_stops_every_rank_naming_it():
    results = spawn(_bad_step, 2, args=("nan-loss",))
    for error, untouched in results:
        message, culprits = error
        assert culprits == (1,)
        assert "rank 1: the gradient of" in message and "NaN or inf" in message, message
        assert "nothing was updated" in message
        assert untouched


def test_nan_only_in_the_bucket_that_carries_the_checks_stops_every_rank():
    """The checks' words ride the last bucket: they are taken after its own gradients are
    checked, so a NaN found there is in them (taken before, that rank alone exchanged its
    words again and the step hung)."""
    results = spawn(_bad_step, 2, args=("nan-last-bucket",), timeout=60)
    for error, untouched in results:
        assert error is not None
        message, culprits = error
        assert culprits == (1,) and "rank 1: the gradient of words.weight" in message, message
        assert untouched


def test_non_finite_loss_is_named_as_the_loss():
    results = spawn(_bad_step, 2, args=("nan-output",))
    message, culprits = results[0][0]
    assert culprits == (1,)
    assert "rank 1: the loss the model returned (inf)" in message, message


def test_batches_of_different_sizes_are_refused_before_anything_moves():
    results = spawn(_bad_step, 2, args=("uneven",))
    for error, untouched in results:
        message, culprits = error
        assert culprits == (1,)
        assert "model input 0 has a batch of 3 on rank 1 but 4 on rank 0" in message, message
        assert untouched


def _uneven_allowed(rank, world_size):
    model, opt = _setup(check_inputs=False)
    model(ids(rank, rows=3 if rank == 1 else 4)).backward()
    opt.step()
    return tilework.stats(model)["last_step"].get("check")


def test_uneven_batches_pass_when_checks_are_off():
    assert spawn(_uneven_allowed, 2) == [None, None]  # and no check bytes were sent


def _bad_id(rank, world_size, table):
    model, _ = _setup()
    x, words = ids(rank), ids(rank) % 10
    if rank == 1:
        (x if table == "table" else words)[0, 0] = 100 if table == "table" else 10
    model(x, words)


@pytest.mark.parametrize("table, id_", [("table", 100), ("words", 10)])
def test_out_of_range_ids_name_the_rank_and_table(table, id_):
    with pytest.raises(RankFailed) as failed:
        spawn(_bad_id, 2, args=(table,), timeout=30)
    assert failed.value.rank == 1
    assert f"rank 1: {table}.weight: id {id_} is out of range" in failed.value.detail


def test_one_process_refuses_a_nan_step_too():
    model, opt = _setup()
    (model(ids(0)) * float("nan")).backward()
    with pytest.raises(InputError, match="step 1: rank 0: the gradient of .* NaN or inf"):
        opt.step()
    with pytest.raises(IdOutOfRange):
        model(torch.tensor([[100]]))


def test_the_rank_at_fault_and_the_others_exit_differently():
    e = InputError("step 3: rank 1: the loss ... NaN", ranks=(1,))
    assert worker_failure(e, 1).exit_code == 2
    assert worker_failure(e, 0).exit_code == PEER_FAULT_EXIT


def test_a_diverging_run_ends_with_one_line_naming_the_step(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text(f"""
workload = "lm"
[lm]
corpus = "zipf"
vocab = 200
embed_dim = 8
hidden = 8
seq_len = 8
zipf_tokens = 5000
[data]
batch_size = 8
[train]
steps = 50
optimizer = "sgd"
lr = 3e38
out_dir = "{tmp_path / 'out'}"
""")
    r = subprocess.run([sys.executable, "-m", "tilework", "train", str(job), "-n", "2"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    assert "NaN or inf values" in r.stderr and "nothing was updated" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
