"""The search's table placements: beside each table placed by its own cost, every table placed
alike by each method (planner/search.with_table_methods), priced as the forced plan is."""

from __future__ import annotations

import dataclasses

import torch

import tilework
from tilework import ParallelConfig
from tilework.bench.workloads import WORKLOADS
from tilework.cluster.topology import Cluster, Host, Link, Links
from tilework.estimate.plan_cost import estimate
from tilework.planner.search import Space, label, options_of, search
from tilework.plans.plan import config_of

RECOMMENDER = WORKLOADS["recommender"]   # tables of 200,000, 50,000 and 1,000 rows, Zipf ids
ONLY_PLACEMENTS = Space(zero=(0,), zero_scopes=(), recompute=("none",), offload=())


def _meta():
    with torch.device("meta"):
        return RECOMMENDER.make(True)


def _cluster(latency_us: float) -> Cluster:
    return Cluster([Host("a", 1), Host("b", 1)],
                   links=Links(intra=Link(10, latency_us), inter=Link(1, latency_us)))


def _search(model, cluster, optimizer="sgd", base=None):
    return search(model, cluster, RECOMMENDER.batch(0, 0, 2), 1e10, optimizer,
                  base=base or ParallelConfig(), space=ONLY_PLACEMENTS,
                  traffic=RECOMMENDER.traffic(cluster.topology()))


def test_tables_of_one_method_share_their_meetings_which_a_choice_table_by_table_misses():
    """Alone, the 1,000-row table is cheaper all-reduced (64 KB in the dense bucket) than on
    the servers (three messages a peer at 1 ms each); with the other two tables already on
    the servers it adds only its rows to their exchange. The search sees the joint plan."""
    model, cluster = _meta(), _cluster(1000)
    found = {label(c): c for c in _search(model, cluster)}
    by_cost, together = found["dp2"], found["dp2, tables on the servers"]
    methods = {p.name: p.method for p in by_cost.parts["plan"].params if p.is_table}
    assert methods == {"tables.0.weight": "ps", "tables.1.weight": "ps",
                       "tables.2.weight": "allreduce"}
    assert all(p.method == "ps" for p in together.parts["plan"].params if p.is_table)
    assert together.step_s < by_cost.step_s
    assert label(_search(model, cluster)[0]) == "dp2, tables on the servers"
    # Each variant is priced as the plan it forces: estimate() of that plan.
    inputs = RECOMMENDER.batch(0, 0, 2)
    traffic = RECOMMENDER.traffic(cluster.topology())
    for c in found.values():
        forced = tilework.plan(model, c.config, cluster, traffic=traffic)
        assert estimate(forced, cluster, model, inputs, traffic=traffic, optimizer="sgd",
                        flops=1e10, with_memory=False).step_s == c.step_s, label(c)


def test_a_variant_that_places_every_table_as_the_cost_does_is_listed_once():
    """No two candidates run the same plan: where each table's own cost already puts every
    table on one method, the variant of that method is not listed again."""
    model, dropped = _meta(), 0
    for latency in (1, 50, 1000):
        found = _search(model, _cluster(latency))
        plans = [tuple((p.name, p.method, p.partitions) for p in c.parts["plan"].params)
                 for c in found]
        assert len(plans) == len(set(plans)), latency
        by_cost = next(c for c in found if label(c) == "dp2")
        if all(p.method == "ps" for p in by_cost.parts["plan"].params if p.is_table):
            assert "dp2, tables on the servers" not in {label(c) for c in found}
            dropped += 1
    assert dropped   # at 1 us a message every table's own cost sends it to the servers


def test_the_servers_are_offered_only_for_an_optimizer_they_can_run():
    """A live optimizer's settings decide: SGD with momentum has no row-wise rule on the
    servers, so no candidate puts the tables there by the search's hand."""
    torch.manual_seed(0)
    model = RECOMMENDER.make(True)
    cluster = _cluster(1000)
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    momentum = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert "dp2, tables on the servers" in {label(c) for c in _search(model, cluster, plain)}
    assert "dp2, tables on the servers" not in {
        label(c) for c in _search(model, cluster, momentum)}


def test_tables_the_user_placed_stay_where_they_are():
    model, cluster = _meta(), _cluster(1000)
    base = ParallelConfig(overrides={"tables.2.weight": "allreduce"})
    found = _search(model, cluster, base=base)
    for c in found:
        assert c.config.overrides["tables.2.weight"] == "allreduce", label(c)
    # The user's override is not a variant: every candidate's label stays its own.
    labels = [label(c) for c in found]
    assert "dp2" in labels and len(labels) == len(set(labels))


def test_a_variant_runs_as_the_search_priced_it():
    """options_of gives the variant's overrides back to parallelize, and the plan it makes says
    so (config_of reads them back)."""
    model, cluster = _meta(), _cluster(1000)
    chosen = next(c for c in _search(model, cluster) if label(c) == "dp2, tables all-gathered")
    options = options_of(chosen.config)
    assert options["overrides"] == {f"tables.{i}.weight": "allgather" for i in range(3)}
    again = dataclasses.replace(ParallelConfig(), **options)
    traffic = RECOMMENDER.traffic(cluster.topology())
    plan = tilework.plan(model, again, cluster, traffic=traffic)
    assert config_of(plan).overrides == options["overrides"]
    assert {p.reason for p in plan.params if p.is_table} == {"set in overrides"}


def test_trials_take_the_fastest_of_each_placement_before_a_second_of_any():
    """A trial settles what the model prices close between families (here the tables'
    placements), not a plan against its own ZeRO or recompute variant."""
    from tilework.planner.search import trial_candidates

    model, cluster = _meta(), _cluster(1000)
    found = search(model, cluster, RECOMMENDER.batch(0, 0, 2), 1e10, "sgd",
                   space=Space(zero_scopes=(), offload=()),
                   traffic=RECOMMENDER.traffic(cluster.topology()), every=True)
    families = {c.config.overrides and frozenset(c.config.overrides.items()) for c in found}
    assert len(families) == 4   # by cost, and all-gathered, on the servers, all-reduced alike
    picked = trial_candidates(found, 4)
    assert len({c.config.overrides and frozenset(c.config.overrides.items())
                for c in picked}) == 4
    fits = [c for c in found if c.step_s is not None and "peak_bytes" in c.parts]
    assert picked[0] is fits[0]
    assert [c.step_s for c in picked] == sorted(c.step_s for c in picked)
    every = trial_candidates(found, len(fits) + 3)   # asked for more: every fit, once
    assert len(every) == len(fits) and {id(c) for c in every} == {id(c) for c in fits}
