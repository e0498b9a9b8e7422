"""The op-level compute model (estimate/ops.py, estimate/op_stages.py): what a step runs,
recorded on the meta device, priced at measured times. Pure apart from two small
measurements."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn

from tilework.cluster.topology import Cluster, Host
from tilework.config.parallel import ParallelConfig
from tilework.estimate.meta_forward import on_meta
from tilework.estimate.op_stages import stage_recordings
from tilework.estimate.ops import Collecting, OpCall, OpTimes, TensorSpec, measure, record
from tilework.estimate.step import predict
from tilework.models.gpt import TinyGPT

MM = torch.ops.aten.mm.default


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Sequential(nn.Linear(8, 16, bias=False), nn.GELU(),
                                   nn.Linear(16, 16, bias=False))
        self.second = nn.Linear(16, 1, bias=False)

    def forward(self, x):
        return self.second(self.first(x)).sum()


def ops_named(calls: Counter, name: str) -> int:
    return sum(n for c, n in calls.items() if c.op == f"aten::{name}")


def inputs():
    return (torch.empty(4, 8, device="meta"),)


def test_a_forward_and_its_backward_are_recorded_apart():
    got = record(on_meta(TwoLayers()), inputs())
    assert ops_named(got.forward, "mm.default") == 3
    # Backward: each later layer's input and weight gradients, the first's weight gradient
    # (its input needs none).
    assert ops_named(got.backward, "mm.default") == 5
    assert ops_named(got.forward, "gelu.default") == 1
    assert ops_named(got.backward, "gelu_backward.default") == 1
    assert set(region for _, region in got.regions) == {"none"}
    assert sum(got.regions.values()) == sum(got.forward.values()) + sum(got.backward.values())


def test_full_recompute_runs_the_module_again_in_backward_and_selective_keeps_the_matmul():
    plain = record(on_meta(TwoLayers()), inputs())
    full = record(on_meta(TwoLayers()), inputs(), [("first", "full")])
    selective = record(on_meta(TwoLayers()), inputs(), [("first", "selective")])
    # torch's checkpoint stops recomputing once backward has what it saved: the first matmul
    # and the GELU (the last matmul's output is needed by nothing).
    again = ops_named(full.backward, "mm.default") - ops_named(plain.backward, "mm.default")
    assert again == 1 and ops_named(full.backward, "gelu.default") == 1
    # Selective keeps the matmul's output: only GELU runs again.
    assert ops_named(selective.backward, "mm.default") == ops_named(plain.backward,
                                                                    "mm.default")
    assert ops_named(selective.backward, "gelu.default") == 1
    assert full.regions["backward", "full"] > 0 and full.regions["forward", "full"] > 0
    assert selective.regions["backward", "selective"] > 0


def test_recording_leaves_the_model_as_it_was():
    model = on_meta(TwoLayers())
    record(model, inputs(), [("first", "full")])
    assert "forward" not in model.first.__dict__


def test_the_price_is_calls_times_seconds_plus_the_framework_per_call():
    got = record(on_meta(TwoLayers()), inputs())
    each = {c: 1e-3 for c in got.calls()}
    times = OpTimes(each, 1.0, {"none": 1e-4})
    forward, backward = times.seconds(got)
    n_forward, n_backward = sum(got.forward.values()), sum(got.backward.values())
    assert forward == pytest.approx(n_forward * 1.1e-3)
    assert backward == pytest.approx(n_backward * 1.1e-3)
    assert sum(OpTimes(each, 2.0, {"none": 1e-4}).seconds(got)) == \
        pytest.approx(2 * (forward + backward))


def test_a_call_not_measured_is_priced_at_the_median_and_counted():
    a = OpCall("aten::mm.default", (TensorSpec((2, 2), "float32"),) * 2, ())
    b = OpCall("aten::mm.default", (TensorSpec((4, 4), "float32"),) * 2, ())
    c = OpCall("aten::mm.default", (TensorSpec((8, 8), "float32"),) * 2, ())
    times = OpTimes({a: 1.0, b: 3.0})
    assert times.priced(Counter({a: 1, c: 2})) == (1.0 + 2 * 2.0, 2)


def test_measure_times_real_calls_and_leaves_out_one_that_fails():
    ok = OpCall("aten::mm.default", (TensorSpec((32, 16), "float32"),
                                     TensorSpec((16, 8), "float32")), ())
    bad = OpCall("aten::mm.default", (TensorSpec((32, 16), "float32"),
                                      TensorSpec((3, 8), "float32")), ())
    got = measure([ok, bad], min_seconds=1e-4)
    assert set(got) == {ok} and got[ok] > 0


def test_a_sparse_gradient_is_recorded_and_measured_as_its_touched_rows():
    """An embedding with sparse=True hands its gradient to AccumulateGrad as a sparse tensor
    of the rows looked up: recorded as such and timed on a sparse tensor of as many entries,
    not on a dense table (the recommender's forward and backward came out 3.4x its measured
    time when a 200,000-row table's gradient was cloned dense)."""
    with torch.device("meta"):
        table = nn.Embedding(200_000, 16, sparse=True)
    ids = torch.zeros(128, dtype=torch.long, device="meta")
    found = record(table, (ids,), ())
    sparse = [a for c in found.backward for a in c.args
              if isinstance(a, TensorSpec) and a.sparse_dims]
    assert sparse and all(a == TensorSpec((200_000, 16), "float32", 1, 128) for a in sparse)
    assert found.params == (TensorSpec((200_000, 16), "float32", 1, 128),)
    # Reading the arriving gradient's spec is not one of the step's calls.
    assert not {"aten::_nnz.default", "aten::sparse_dim.default"} & {c.op for c in found.backward}
    from tilework.estimate.ops import _made

    made = _made(sparse[0], torch.device("cpu"))   # what `measure` times the call on
    assert made.layout == torch.sparse_coo and made.shape == (200_000, 16)
    assert made._nnz() == 128 and made._values().numel() == 128 * 16
    clone = OpCall("aten::clone.default", (sparse[0],), ())
    assert set(measure([clone], min_seconds=1e-4)) == {clone}


def test_collecting_gathers_what_it_is_asked_and_prices_nothing():
    asked = Collecting()
    got = record(on_meta(TwoLayers()), inputs())
    assert asked.seconds(got) == (0.0, 0.0)
    assert asked.asked == got.calls()


def gpt():
    torch.manual_seed(0)
    with torch.device("meta"):
        return TinyGPT(64, 16, 2, 4, 8)


def test_pipeline_stages_together_run_what_the_whole_model_runs():
    """The stages' recorded matmuls on one microbatch each, times the microbatches, are the
    whole model's on the whole batch: the cut neither loses nor adds a product."""
    model = gpt()
    whole = stage_recordings(model, ParallelConfig(), 8, 8)
    staged = stage_recordings(model, ParallelConfig(pp=2, microbatches=4), 8, 8)
    assert len(whole) == 1 and len(staged) == 2

    def flops(rec):
        return sum(2 * n * c.args[0].shape[0] * c.args[0].shape[1] * c.args[1].shape[1]
                   for part in (rec.forward, rec.backward) for c, n in part.items()
                   if c.op == "aten::mm.default")

    assert 4 * sum(flops(r) for r in staged) == flops(whole[0])


def test_the_mesh_step_priced_by_ops_charges_selective_recompute():
    """Where one rate prices selective recompute as free (it recomputes no matmul), the op
    model charges the ops it runs again: the wart of a runner-up 'chosen + selective' at the
    same step."""
    model = gpt()
    cluster = Cluster([Host("localhost", 2)])
    every_call = OpTimes({}, 1.0, {"none": 1e-5, "selective": 3e-5, "full": 1e-5})
    asked = Collecting()
    for recompute in ("none", "selective", "full"):
        predict(model, ParallelConfig(recompute=recompute), cluster, 8, 8, asked)
    times = OpTimes({c: 1e-4 for c in asked.asked}, 1.0, every_call.per_call)
    step = {r: predict(model, ParallelConfig(recompute=r), cluster, 8, 8, times).step_s
            for r in ("none", "selective", "full")}
    assert step["none"] < step["selective"]
    assert step["none"] < step["full"]
    by_rate = {r: predict(model, ParallelConfig(recompute=r), cluster, 8, 8, 1e9).step_s
               for r in ("none", "selective")}
    assert by_rate["none"] == by_rate["selective"]


@pytest.mark.parametrize("axis", ["tp", "cp"])
def test_the_recorded_exchanges_are_the_formula_s_and_recompute_adds_the_forward_s_again(axis):
    """The message ends counted on the shape-only exchanges equal tensor/cost's and ring
    attention's per-layer count; recompute runs the forward's exchanges a second time, which
    the formula leaves out."""
    from tilework.estimate.model_facts import ModelFacts
    from tilework.estimate.step import _message_ends

    model = gpt()
    plain = ParallelConfig(**{axis: 2})
    counted = stage_recordings(model, plain, 8, 8)[0].messages[axis]
    assert counted == _message_ends(ModelFacts(model), plain, None, None)[axis][0] > 0
    again = stage_recordings(model, ParallelConfig(**{axis: 2}, recompute="full"), 8,
                             8)[0].messages[axis]
    assert again > counted
