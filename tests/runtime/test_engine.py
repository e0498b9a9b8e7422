"""The engine on real gloo ranks: sharding, bad input, checkpoints, accumulation, accounting."""

import io

import pytest
import torch
from torch import nn

import tilework
from tilework.checkpoint import file as checkpoint
from tilework.comm.wire import CHECK_WORDS
from tilework.errors import CheckpointError, PlanError
from tilework.testing import RankFailed, spawn


class Tiny(nn.Module):
    def __init__(self, rows=1000, dim=4, extra=False):
        super().__init__()
        torch.manual_seed(0)
        self.table = nn.Embedding(rows, dim, sparse=True)
        self.conv = nn.Conv1d(dim, dim, 1)
        self.head = nn.Linear(dim, 1)
        self.unused = nn.Linear(dim, 1) if extra else None

    def forward(self, ids):
        x = self.conv(self.table(ids).transpose(1, 2)).mean(2)
        return self.head(x).pow(2).mean()


def batch(step, rank=0, world_size=1, per_rank=None, rows=1000):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, rows, (8, 5), generator=g)
    return ids.chunk(world_size)[rank] if per_rank is None else ids


def _sharded(rank, world_size, partitions):
    model = Tiny()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    tilework.parallelize(model, opt, partitions=partitions, log=False)
    params = dict(model.named_parameters())
    table = model._tilework_engine.tables["table.weight"]
    return ("table.weight" in params, type(model.table).__name__, table.shard.shape[0],
            table.shard_bytes())


@pytest.mark.parametrize("world_size, partitions", [(2, None), (4, None), (4, 2), (2, 8)])
def test_table_is_really_sharded(world_size, partitions):
    results = spawn(_sharded, world_size, args=(partitions,))
    parts = partitions or world_size
    for rank, (still_param, kind, rows, nbytes) in enumerate(results):
        assert not still_param and kind == "ShardedEmbedding"
        served = sum(1 for p in range(parts) if p % world_size == rank)
        assert rows == served * 1000 // parts
        assert nbytes == rows * 4 * 4 * 3   # fp32 rows + Adam's two moments, no more
    assert sum(r[2] for r in results) == 1000


def _forced_conv(rank, world_size):
    model = Tiny()
    tilework.parallelize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                         overrides={"conv.weight": "ps"}, log=False)


def test_forcing_a_conv_weight_onto_the_server_is_refused():
    with pytest.raises(RankFailed, match=r"conv.weight \(shape \(4, 4, 1\)\) is not an embedding"):
        spawn(_forced_conv, 2)


def _mismatched(rank, world_size):
    model = Tiny(dim=4 if rank == 0 else 6)
    tilework.parallelize(model, torch.optim.SGD(model.parameters(), lr=0.1), log=False)


def test_models_that_differ_across_ranks_are_named():
    with pytest.raises(RankFailed, match=r"parameter conv.bias is shape \(4,\) .* on rank 0 but "
                                         r"shape \(6,\) .* on rank 1"):
        spawn(_mismatched, 2)


def _plans_that_differ(rank, world_size):
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # Each rank plans on its own and places the table its own way (as ranks planning from
    # their own measured density could): they would meet in different collectives.
    plan = tilework.plan(model, tilework.ParallelConfig(
        overrides={"table.weight": "ps" if rank == 0 else "allreduce"}),
        topology=tilework.Topology.from_sizes([world_size]))
    tilework.parallelize(model, opt, plan=plan, log=False)


def _plans_worded_apart(rank, world_size):
    import dataclasses

    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = tilework.plan(model, tilework.ParallelConfig(overrides={"table.weight": "ps"}),
                         topology=tilework.Topology.from_sizes([world_size]))
    # What only the reader sees, and each host's own offload directory, may differ.
    plan = dataclasses.replace(plan, offload_dir=f"/tmp/host{rank}", params=tuple(
        dataclasses.replace(p, reason=f"measured on rank {rank}") for p in plan.params))
    tilework.parallelize(model, opt, plan=plan, log=False)
    model(batch(0, rank, world_size)).backward()
    opt.step()
    return model._tilework_engine.plan.by_name()["table.weight"].method


def test_plans_worded_apart_but_placing_alike_are_one_plan():
    assert spawn(_plans_worded_apart, 2) == ["ps", "ps"]


def test_plans_that_differ_across_ranks_are_refused_naming_the_difference():
    with pytest.raises(RankFailed, match=r"the plan differs across ranks: rank 0 -> rank 1: "
                                         r"table.weight.method: 'ps' -> 'allreduce'"):
        spawn(_plans_that_differ, 2)


def _seeded_per_rank(rank, world_size):
    import warnings

    model = Tiny()
    with torch.no_grad():
        model.head.weight.add_(rank)  # as a script that seeds each rank differently
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        tilework.parallelize(model, torch.optim.SGD(model.parameters(), lr=0.1), log=False)
    return [str(w.message) for w in seen], model.head.weight.detach().clone()


def test_parameters_that_differ_across_ranks_are_warned_and_rank_0s_win():
    (warned, head0), (quiet, head1) = spawn(_seeded_per_rank, 2)
    assert len(warned) == 1 and "differ across ranks" in warned[0] and "head.weight" in warned[0]
    assert "table.weight" not in warned[0] and "conv.weight" not in warned[0]
    assert quiet == []  # said once, by rank 0
    assert torch.equal(head0, head1)


def _momentum(rank, world_size):
    model = Tiny()
    tilework.parallelize(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                         log=False)


def test_unsupported_optimizer_for_a_table_is_named():
    with pytest.raises(RankFailed, match="table.weight: SGD with momentum is not supported"):
        spawn(_momentum, 2)


def test_unsupported_optimizer_type_is_named():
    model = Tiny()
    with pytest.raises(PlanError, match="table.weight: RMSprop"):
        tilework.parallelize(model, torch.optim.RMSprop(model.parameters()), log=False)


def test_out_of_range_ids_name_the_table():
    model = Tiny()
    tilework.parallelize(model, torch.optim.SGD(model.parameters(), lr=0.1), log=False)
    with pytest.raises(IndexError,
                       match="table.weight: id 1000 is out of range for a table of 1000"):
        model(torch.tensor([[1, 1000]]))


def _train(model, opt, steps, rank, world_size, start=0):
    for step in range(start, start + steps):
        model(batch(step, rank, world_size)).backward()
        opt.step()
        opt.zero_grad()


def _checkpoint_roundtrip(rank, world_size, path, phase):
    model = Tiny()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    tilework.parallelize(model, opt, log=False)
    if phase == "first":
        _train(model, opt, 3, rank, world_size)
        tilework.save(path, model, opt)
        return None
    tilework.load(path, model, opt)
    _train(model, opt, 3, rank, world_size, start=3)
    state = tilework.state_dict(model, opt)["model"]
    return state if rank == 0 else None


def _uninterrupted(rank, world_size):
    model = Tiny()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    tilework.parallelize(model, opt, log=False)
    _train(model, opt, 6, rank, world_size)
    state = tilework.state_dict(model, opt)["model"]  # a collective: every rank calls it
    return state if rank == 0 else None


@pytest.mark.parametrize("first, second", [(2, 4), (4, 2)])
def test_resume_at_another_world_size_continues_identically(tmp_path, first, second):
    path = tmp_path / "state.pt"
    spawn(_checkpoint_roundtrip, first, args=(str(path), "first"))
    resumed = spawn(_checkpoint_roundtrip, second, args=(str(path), "second"))[0]
    straight = spawn(_uninterrupted, first)[0]
    for name, expected in straight.items():
        torch.testing.assert_close(resumed[name], expected, rtol=1e-5, atol=1e-6)


def test_a_plain_model_loads_the_checkpoint(tmp_path):
    path = tmp_path / "state.pt"
    spawn(_checkpoint_roundtrip, 2, args=(str(path), "first"))
    plain = Tiny()
    # Read through tilework's checked reader (the file carries a length and digest header).
    blob = checkpoint.load(path)
    plain.load_state_dict(blob["state"]["model"])  # strict: exactly the single-device names
    assert plain.table.weight.shape == (1000, 4)
    assert not torch.equal(plain.table.weight, Tiny().table.weight)  # it was trained
    other = Tiny()
    tilework.load(path, other, None)  # the model alone, e.g. for inference
    assert torch.equal(other.table.weight, plain.table.weight)
    with pytest.raises(CheckpointError, match="optimizer state is in tilework's layout"):
        tilework.load(path, other, torch.optim.Adam(other.parameters()))


def _accumulate(rank, world_size, extra):
    model = Tiny(extra=extra)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tilework.parallelize(model, opt, log=False)
    for step in range(3):
        with model.no_sync():
            model(batch(2 * step, rank, world_size)).backward()
        model(batch(2 * step + 1, rank, world_size)).backward()
        opt.step()
        opt.zero_grad()
    state = tilework.state_dict(model, opt)["model"]  # a collective: every rank calls it
    return state if rank == 0 else None


def _accumulate_ref():
    model = Tiny(extra=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        model(batch(2 * step)).backward()
        model(batch(2 * step + 1)).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def test_no_sync_accumulation_and_unused_parameters_match_one_process():
    ref = _accumulate_ref()
    got = spawn(_accumulate, 2, args=(True,))[0]
    for name, expected in ref.items():
        torch.testing.assert_close(got[name], expected, rtol=1e-5, atol=1e-7)


def _bytes(rank, world_size, sparse_reduce):
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    tilework.parallelize(model, opt, sparse_reduce=sparse_reduce, log=False)
    before = tilework.state_dict(model, opt)["model"]
    _train(model, opt, 1, rank, world_size)
    after = tilework.state_dict(model, opt)["model"]
    delta = (after["table.weight"] - before["table.weight"]) if rank == 0 else None
    return tilework.stats(model), delta


def test_sum_versus_mean_and_byte_counts():
    mean = spawn(_bytes, 2, args=("mean",))
    total = spawn(_bytes, 2, args=("sum",))
    torch.testing.assert_close(total[0][1], 2 * mean[0][1])
    stats = mean[0][0]
    assert stats["last_step"]["ps"]["sent"] > 0 and stats["last_step"]["allreduce"]["sent"] > 0
    dense_params = 4 * 4 + 4 + 4 + 1      # conv weight and bias, head weight and bias, fp32
    carried = CHECK_WORDS                 # the input check rides the last bucket
    assert (stats["last_step"]["allreduce"]["sent"]
            == 2 * (2 - 1) * (dense_params + carried) * 4 // 2)
    assert stats["dense_allreduce_bytes_per_step"] == (1000 * 4 + dense_params) * 4


def _one_row_each(rank, world_size):
    model = Tiny(rows=4, dim=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    tilework.parallelize(model, opt, log=False)
    # Rows 0-1 live on rank 0, rows 2-3 on rank 1: each owner receives exactly one row.
    model(torch.tensor([[0]]) if rank == 0 else torch.tensor([[3]])).backward()
    opt.step()
    with torch.no_grad():
        return model.table.weight  # a gather: every rank takes part


def test_a_single_pushed_row_of_width_one_is_delivered():
    """Regression: one received row of an odd-width packet failed to unpack its id (seen at 4
    ranks on the LM's 500x1 softmax bias)."""
    got = spawn(_one_row_each, 2)[0]

    model = Tiny(rows=4, dim=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    (model(torch.tensor([[0]])) + model(torch.tensor([[3]]))).div(2).backward()
    opt.step()
    torch.testing.assert_close(got, model.table.weight.detach(), rtol=1e-6, atol=1e-7)


def _with_tensor(state, key, shape):
    model_state = dict(state["model"])
    model_state[key] = torch.zeros(shape)
    return {**state, "model": model_state}


@pytest.mark.parametrize("parallel", [True, False])
def test_a_mismatched_checkpoint_is_refused_and_nothing_is_loaded(parallel):
    source = Tiny()
    with torch.no_grad():
        for p in source.parameters():
            p.add_(1.0)  # every value differs from a fresh Tiny's
    src_opt = torch.optim.SGD(source.parameters(), lr=0.1)
    if parallel:
        tilework.parallelize(source, src_opt, log=False)
    good = tilework.state_dict(source, src_opt)

    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if parallel:
        tilework.parallelize(model, opt, log=False)
    before = {k: v.clone() for k, v in tilework.state_dict(model, opt)["model"].items()}
    # The table comes first in the model, the broken tensor last: nothing may be copied early.
    bad = _with_tensor(good, "head.weight", (3, 3))
    with pytest.raises(CheckpointError, match=r"head.weight has shape \(3, 3\) in the checkpoint, "
                                              r"\(1, 4\) in the model"):
        tilework.load_state_dict(model, opt, bad)
    missing = {**good, "model": {k: v for k, v in good["model"].items() if k != "conv.bias"}}
    with pytest.raises(CheckpointError, match="conv.bias is missing"):
        tilework.load_state_dict(model, opt, missing)
    after = tilework.state_dict(model, opt)["model"]
    assert all(torch.equal(after[k], v) for k, v in before.items())
    tilework.load_state_dict(model, opt, good)  # and the right one loads
    assert torch.equal(tilework.state_dict(model, opt)["model"]["table.weight"],
                       good["model"]["table.weight"])


def _optimizer_state_round_trip(rank, world_size, optimizer):
    make = {"adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
            "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05)}[optimizer]
    model = Tiny()
    opt = make(model.parameters())
    tilework.parallelize(model, opt, log=False)
    for step in range(2):
        model(batch(step, rank, world_size)).backward()
        opt.step()
        opt.zero_grad()
    # Every rank: gathers the table's rows. Through bytes, as a checkpoint file goes: torch's
    # load_state_dict would otherwise share the dense state tensors between the two optimizers.
    buffer = io.BytesIO()
    torch.save((opt.state_dict(), model.state_dict()), buffer)
    saved, model_saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    again = Tiny()
    again_opt = make(again.parameters())
    tilework.parallelize(again, again_opt, log=False)
    again.load_state_dict(model_saved)
    again_opt.load_state_dict(saved)         # a plain optimizer's layout, split again
    for m, o in ((model, opt), (again, again_opt)):
        for step in range(2, 4):
            m(batch(step, rank, world_size)).backward()
            o.step()
            o.zero_grad()
    return (saved, tilework.state_dict(model, opt)["model"],
            tilework.state_dict(again, again_opt)["model"])


@pytest.mark.parametrize("optimizer", ["adam", "adagrad"])
def test_optimizer_state_dict_is_the_plain_optimizers_and_resumes(optimizer):
    """optimizer.state_dict() of a parallelized optimizer loads into the plain optimizer built
    over model.parameters() (as a DDP one would), table rows included; loaded back into a
    parallelized one, training goes on exactly as without the round trip."""
    saved, straight, resumed = spawn(_optimizer_state_round_trip, 2, args=(optimizer,))[0]
    plain = Tiny()
    plain_opt = {"adam": torch.optim.Adam, "adagrad": torch.optim.Adagrad}[optimizer](
        plain.parameters())
    plain_opt.load_state_dict(saved)
    table = plain_opt.state[plain.table.weight]
    key = "exp_avg" if optimizer == "adam" else "sum"
    assert table[key].shape == plain.table.weight.shape and table[key].abs().sum() > 0
    assert float(table["step"]) == 2
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name
