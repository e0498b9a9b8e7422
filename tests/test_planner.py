"""The planner and analysis are pure: no process group, any world size."""

import pytest
import torch
from torch import nn

from tilework.analysis import analyze, measure_density
from tilework.errors import PlanError
from tilework.models import DLRM, WordLM
from tilework.planner import make_plan


def test_hybrid_sends_sparse_tables_to_servers_and_the_rest_to_allreduce():
    plan = make_plan(analyze(WordLM(1000, num_sampled=16)), world_size=8)
    methods = {p.name: p.method for p in plan.params}
    assert methods["embedding.weight"] == methods["softmax_weight.weight"] == "ps"
    assert methods["rnn.weight_hh_l0"] == "allreduce"
    assert all(p.partitions == 8 for p in plan.of("ps"))


def test_dense_layout_tables_follow_their_measured_density():
    model = WordLM(1000, sparse=False)
    ids = torch.randint(0, 1000, (2, 9))
    density = measure_density(model, lambda m, b: m(b[:, :-1], b[:, 1:]), [ids, ids])
    assert density["embedding.weight"] <= 16 / 1000       # at most 16 distinct ids per batch
    assert density["softmax_weight.weight"] == 1.0        # full softmax touches every row
    plan = make_plan(analyze(model, density), world_size=2).by_name()
    assert plan["embedding.weight"].method == "ps"
    assert plan["softmax_weight.weight"].method == "allreduce"
    assert all(p.grad is None for p in model.parameters())  # measuring trained nothing


@pytest.mark.parametrize("mode", ["allreduce", "ps"])
def test_uniform_modes(mode):
    plan = make_plan(analyze(DLRM([100, 10])), world_size=4, mode=mode)
    assert {p.method for p in plan.params} == {mode}


def test_partitions_never_exceed_rows():
    plan = make_plan(analyze(DLRM([100, 3])), world_size=8).by_name()
    assert plan["tables.1.weight"].partitions == 3 and plan["tables.0.weight"].partitions == 8


def test_bad_overrides_are_named():
    infos = analyze(DLRM([100]))
    with pytest.raises(PlanError, match="no such trainable parameter"):
        make_plan(infos, 2, overrides={"tables.9.weight": "ps"})
    with pytest.raises(PlanError, match="bottom.0.weight .* is not an embedding table"):
        make_plan(infos, 2, overrides={"bottom.0.weight": "ps"})
    assert make_plan(infos, 2, mode="ps", overrides={"bottom.0.weight": "ps"})


def test_planning_a_huge_model_on_the_meta_device_is_instant():
    with torch.device("meta"):
        model = WordLM(793_471, embed_dim=512, hidden=2048, num_sampled=8192)
    plan = make_plan(analyze(model), world_size=48).by_name()
    assert plan["embedding.weight"].shape == (793_471, 512)
    assert plan["embedding.weight"].partitions == 48
