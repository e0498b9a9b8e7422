"""The planner and analysis are pure: no process group, any world size."""

import dataclasses

import pytest
import torch

from tilework.errors import PlanError
from tilework.models import DLRM, WordLM
from tilework.planner import make_plan
from tilework.plans.analysis import analyze, measure_density


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


def test_cost_search_sends_a_fully_touched_table_to_allreduce():
    from tilework.cluster.topology import Links, Topology
    from tilework.estimate.cost import TableTraffic

    topo = Topology.uniform(1, 4)
    infos = analyze(DLRM([1000, 100_000]))
    traffic = {"tables.0.weight": TableTraffic(1000, 1000, 1000),       # every row, every step
               "tables.1.weight": TableTraffic.zipf(100_000, 64, topo)}
    plan = make_plan(infos, 4, topology=topo, links=Links(), traffic=traffic).by_name()
    assert plan["tables.0.weight"].method == "allreduce"
    assert plan["tables.1.weight"].method == "ps" and plan["tables.1.weight"].partitions == 4
    assert "rows/step" in plan["tables.0.weight"].reason


def test_under_local_sgd_a_table_goes_on_the_outer_schedule_where_that_costs_less():
    """The servers meet every step; an all-reduced table under local SGD is a replica averaged
    every H steps with the dense parameters. On a slow link with a 50 ms round trip the
    servers win for synchronous training (a 12.8 MB all-reduce a step), the outer schedule
    once the table's share of a sync every 20 steps costs less than three meetings a step;
    the step estimate prices the plan as chosen."""
    from torch import nn

    import tilework
    from tilework.cluster.topology import Cluster, Host, Link, Links
    from tilework.estimate.cost import TableTraffic

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Embedding(100_000, 32, sparse=True)
            self.head = nn.Linear(32, 1)

    with torch.device("meta"):
        model = Model()
    far = Cluster(hosts=[Host("a", 1), Host("b", 1)],
                  links=Links(intra=Link(100.0, 5.0), inter=Link(0.1, 25_000.0)))
    traffic = {"table.weight": TableTraffic(500, 500, 1000)}

    def table(**sync):
        made = tilework.plan(model, tilework.ParallelConfig(**sync), far, traffic=traffic)
        return made.by_name()["table.weight"]

    assert table().method == "ps"
    outer = table(sync="diloco", sync_every=20)
    assert outer.method == "allreduce" and "on the outer schedule <= servers" in outer.reason
    assert outer.predicted.seconds < table().predicted.seconds
    # A short period on a fast link: the servers' few rows still cost less than the replica.
    near = Cluster(hosts=[Host("a", 1), Host("b", 1)],
                   links=Links(intra=Link(100.0, 5.0), inter=Link(10.0, 50.0)))
    made = tilework.plan(model, tilework.ParallelConfig(sync="diloco", sync_every=2), near,
                         traffic=traffic)
    assert made.by_name()["table.weight"].method == "ps"


def test_auto_row_map_spreads_a_frequency_sorted_table_by_cost():
    """Contiguous ranges of a Zipf table put most requested rows on partition 0's server; the
    planner costs both maps and hashes them. Without a traffic model it hashes too; an explicit
    row_map is kept; ids that hashing would crowd keep contiguous ranges."""
    from tilework.cluster.topology import Link, Links, Topology
    from tilework.estimate.cost import TableTraffic, ps_expected

    topo = Topology.uniform(4, 1)
    slow = Links(inter=Link(bandwidth_gbps=0.025, latency_us=100.0))   # bytes, not latency
    infos = analyze(WordLM(100_000, 16, 16, 1, sparse=True))
    traffic = {"embedding.weight": TableTraffic.zipf(100_000, 160, topo)}
    plan = make_plan(infos, 4, topology=topo, links=slow, traffic=traffic).by_name()
    chosen = plan["embedding.weight"]
    assert chosen.row_map == "hashed" and "hashed" in chosen.reason
    contiguous = dataclasses.replace(chosen, row_map="contiguous")
    slower = ps_expected(contiguous, traffic["embedding.weight"], topo, slow, True)
    assert chosen.predicted.seconds < 0.6 * slower.seconds
    assert make_plan(infos, 4).by_name()["embedding.weight"].row_map == "hashed"
    assert make_plan(infos, 4, row_map="contiguous").by_name()["embedding.weight"].row_map == \
        "contiguous"
    assert make_plan(infos, 4).by_name()["rnn.weight_ih_l0"].row_map == "contiguous"
    # Every id a multiple of 4: hashed rows would send them all to one server.
    strided = torch.arange(0, 100_000, 4)
    measured = TableTraffic(1000, 1000, 4000, measured=(100_000, tuple(strided.tolist()), 25))
    pick = make_plan(infos, 4, topology=topo, links=slow,
                     traffic={"embedding.weight": measured}).by_name()["embedding.weight"]
    assert pick.row_map == "contiguous"


def test_too_few_partitions_cost_more():
    from tilework.cluster.topology import Links, Topology
    from tilework.estimate.cost import TableTraffic, ps_expected
    from tilework.plans.plan import ParamPlan

    topo = Topology.uniform(8, 6)
    traffic = TableTraffic.zipf(800_000, 2560, topo)
    times = [ps_expected(ParamPlan("t", (800_000, 512), "ps", p, kind="sparse"), traffic, topo,
                         Links(), la).seconds for la in (True, False) for p in (1, 8, 48)]
    assert times[0] > times[1] > times[2] and times[3] > times[4] > times[5]


def test_planning_a_thousand_hosts_with_a_hundred_tables_costs_few_candidates(monkeypatch):
    """At 8,000 ranks, no process group: the search costs each table's partition candidates
    and splits, a number that does not grow with the ranks (a count, not a time: timed
    assertions fail on a loaded machine; about 0.5 s on an idle one here)."""
    from tilework.cluster.topology import Links, Topology
    from tilework.estimate.cost import TableTraffic
    from tilework.planner import partition_candidates
    from tilework.planner import tables as planner_module

    topo = Topology.uniform(1000, 8)
    with torch.device("meta"):
        model = DLRM([100_000 + 1000 * i for i in range(100)], embed_dim=64)
    calls = []
    costed = planner_module.ps_expected
    monkeypatch.setattr(planner_module, "ps_expected",
                        lambda *a, **k: calls.append(1) or costed(*a, **k))
    infos = analyze(model)
    traffic = {i.name: TableTraffic.zipf(i.shape[0], 512, topo) for i in infos if i.is_table}
    plan = make_plan(infos, topo.world_size, topology=topo, links=Links(), traffic=traffic)
    assert len(plan.of("ps")) == 100
    per_table = max(len(partition_candidates(topo.world_size, i.shape[0])) for i in infos)
    assert len(calls) <= 100 * per_table * 2   # each count with contiguous and hashed rows
    assert per_table <= 64   # candidates, not ranks


def test_tilework_plan_cli(tmp_path):
    import json
    import subprocess
    import sys

    root = __import__("pathlib").Path(__file__).parents[2] / "docs" / "examples"
    r = subprocess.run([sys.executable, "-m", "tilework", "plan", "--job", str(root / "lm1b.toml"),
                        "--cluster", str(root / "parallax-testbed.toml"), "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    methods = {p["name"]: p["method"] for p in out["params"]}
    assert methods["embedding.weight"] == "ps" and methods["rnn.weight_hh_l0"] == "allreduce"
    assert out["hybrid_speedup_over_allreduce"] > 1


LONG_NAME = "_orig_mod.blocks.0.attention.query_key_value.weight"


def _narrow_console():
    import io

    from rich.console import Console

    return Console(width=60, file=io.StringIO(), record=True)


def test_the_plan_printed_by_parallelize_never_cuts_a_name():
    from tilework.plans.plan import ParamPlan, Plan
    from tilework.report.tables import print_plan

    plan = Plan((ParamPlan(LONG_NAME, (3072, 1024), "allreduce", reason="dense parameter"),
                 ParamPlan("tables.[b]x", (50000, 16), "ps", 2, reason="sparse table")), 2)
    console = _narrow_console()
    print_plan(plan, console)
    text = console.export_text()
    assert LONG_NAME in text and "tables.[b]x" in text and "…" not in text, text
    assert "allreduce" in text and "partitions" in text, text  # the other columns are readable


def test_the_plan_printed_by_tilework_plan_never_cuts_a_name():
    from pathlib import Path

    from tilework.cluster.topology import Cluster
    from tilework.report.job import report
    from tilework.report.tables import print_report
    from tilework.train.job import Job

    examples = Path(__file__).parents[2] / "docs" / "examples"
    out = report(Job.load(examples / "demo-job.toml"), Cluster.load(examples / "demo-2hosts.toml"))
    out["params"][0]["name"] = LONG_NAME
    console = _narrow_console()
    print_report(out, "demo-job.toml on demo-2hosts.toml", console)
    text = console.export_text()
    assert LONG_NAME in text and "…" not in text, text
    assert "allreduce" in text and "partitions" in text, text
