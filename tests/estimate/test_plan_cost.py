"""`estimate(plan, cluster)`: one step of any Plan from the estimates that exist, read from the
plan (pure: the meta device, no process group)."""

from __future__ import annotations

import pytest
import torch

import tilework
from tilework.cluster.topology import Cluster, Host, Link, Links
from tilework.estimate import estimate_memory
from tilework.estimate.plan_cost import estimate
from tilework.estimate.plan_memory import estimate_every_rank
from tilework.estimate.step import predict
from tilework.models.gpt import TinyGPT
from tilework.models.recommender import DLRM
from tilework.plans.plan import config_of

CLUSTER = Cluster(hosts=[Host("a", 4), Host("b", 4)],
                  links=Links(inter=Link(bandwidth_gbps=10.0, latency_us=50.0)))


def meta_gpt() -> TinyGPT:
    with torch.device("meta"):
        return TinyGPT(vocab=64, dim=32, heads=4, layers=4, seq_len=16)


MESH_CONFIGS = [dict(tp=2), dict(pp=2, microbatches=4), dict(cp=2),
                dict(tp=2, pp=2, zero=1, microbatches=4),
                dict(pp=2, microbatches=4, schedule="interleaved", stages_per_rank=2),
                dict(tp=2, sequence_parallel=True, recompute="full"),
                dict(tp=2, zero=3, zero_scope="host")]


@pytest.mark.parametrize("options", MESH_CONFIGS)
def test_a_mesh_plan_says_the_configuration_it_runs_under(options):
    """config_of(plan) plans to the same plan: everything the estimates read is in the Plan."""
    model = meta_gpt()
    plan = tilework.plan(model, tilework.ParallelConfig(**options), CLUSTER)
    assert tilework.plan(model, config_of(plan), CLUSTER) == plan


def test_a_mesh_plans_estimate_is_its_parts():
    model, config = meta_gpt(), tilework.ParallelConfig(tp=2, pp=2, zero=1, microbatches=4)
    plan = tilework.plan(model, config, CLUSTER)
    tokens = torch.zeros(8, 16, dtype=torch.long)
    cost = estimate(plan, CLUSTER, model, (tokens, tokens), flops=1e10, replica_batch=8, seq=16)
    assert cost.memory == tuple(estimate_every_rank(model, config, (tokens, tokens), 8,
                                                    cluster=CLUSTER))
    assert cost.memory[3] == estimate_memory(model, config, (tokens, tokens), CLUSTER, rank=3)
    step = predict(model, config, CLUSTER, 8, 16, 1e10)
    assert cost.step_s == step.step_s and cost.compute_s == step.parts["compute"]
    assert cost.comm_s == sum(step.parts[a] for a in ("tp", "cp", "dp"))


def test_a_data_parallel_plans_estimate_is_the_reports_and_the_memory_estimates():
    from tilework.config.files import from_dict
    from tilework.estimate.memory import estimate_per_rank
    from tilework.plans.analysis import analyze
    from tilework.report.job import report
    from tilework.train.job import Job
    from tilework.train.planning import example_batch, job_plan, meta_model, table_traffic

    job = from_dict(Job, {"workload": "recommender",
                          "recommender": {"table_sizes": [5000, 800], "sparse": True}})
    cluster = Cluster(hosts=[Host("a", 2), Host("b", 2)])
    plan, model = job_plan(job, cluster), meta_model(job)
    traffic = table_traffic(job, analyze(model), cluster)
    inputs = example_batch(job, cluster)
    cost = estimate(plan, cluster, model, inputs, traffic=traffic)
    assert cost.comm_s == report(job, cluster)["step_comm_seconds"]["hybrid"]
    assert cost.memory == tuple(estimate_per_rank(model, plan, inputs))
    assert cost.step_s is None and cost.compute_s is None   # no compute model on dp yet
    assert [e.name for e in cost.entries] == [p.name for p in plan.params]


def test_a_plan_for_another_world_is_refused():
    with torch.device("meta"):
        model = DLRM([100, 50])
    plan = tilework.plan(model, tilework.ParallelConfig(), Cluster(hosts=[Host("a", 2)]))
    with pytest.raises(tilework.errors.PlanError, match="2 ranks, the cluster has 8"):
        estimate(plan, CLUSTER)


def test_local_sgd_is_priced_as_it_syncs_not_every_step():
    """estimate(plan) of a local-SGD plan: with H = 1 and nothing compressed it is the
    synchronous plan's all-reduce; over hosts at H = 20 in int4 it is the host's own
    all-reduce every step plus a twentieth of the int4 sync on the slow link; the step is the
    compute plus that."""
    from tilework.estimate.cost import outer_sync_wire, seconds

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    slow = Cluster(hosts=[Host("a", 2), Host("b", 2)],
                   links=Links(intra=Link(100.0, 5.0), inter=Link(0.1, 500.0)))
    inputs = (torch.randn(4, 64),)

    def priced(**sync):
        made = tilework.plan(model, tilework.ParallelConfig(mode="allreduce", **sync), slow)
        return estimate(made, slow, model, inputs, flops=1e9, with_memory=False)

    synchronous = priced()
    once = priced(sync="diloco", sync_every=1, outer_optimizer="sgd", outer_momentum=0.0)
    assert once.comm_s == pytest.approx(synchronous.comm_s)
    local = priced(sync="diloco", sync_every=20, outer_worker="host", outer_compress="int4")
    nbytes = [p.numel() * 4 for p in model.parameters()]
    wire = outer_sync_wire(nbytes, 25 * 2**20, 2, 2, "int4")
    inner = seconds(sum(nbytes), Link(100.0, 5.0), 2)   # a 2-rank ring sends the buffer once
    across = seconds(wire.across, Link(0.1, 500.0), wire.across_messages)
    within = seconds(wire.within, Link(100.0, 5.0), wire.within_messages)
    assert local.comm_s == pytest.approx(inner + (across + within) / 20)
    assert local.comm_s < synchronous.comm_s / 10
    assert local.step_s == pytest.approx(local.compute_s + local.comm_s)
    assert sum(e.bytes_sent for e in local.entries) == pytest.approx(
        sum(p.predicted.bytes_sent for p in tilework.plan(
            model, tilework.ParallelConfig(mode="allreduce", sync="diloco", sync_every=20,
                                           outer_worker="host", outer_compress="int4"),
            slow).of("allreduce")))


def test_a_layerwise_sync_is_priced_beside_the_inner_step_it_travels_with():
    """outer_schedule="layerwise": each group's sync runs beside one inner step, so the step
    waits only for what outlasts its compute: on a slow link, the groups' seconds beyond the
    compute over H; the same bytes as plain local SGD; hidden entirely where every group's
    sync is shorter than a step."""
    from tilework.estimate.cost import outer_step_seconds

    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 8))
    cluster = Cluster(hosts=[Host("a", 1), Host("b", 1)],
                      links=Links(inter=Link(0.1, 500.0)))
    inputs = (torch.randn(4, 256),)

    def made(**sync):
        return tilework.plan(model, tilework.ParallelConfig(mode="allreduce", sync="diloco",
                                                            sync_every=4, **sync), cluster)

    plain, layered = made(), made(outer_schedule="layerwise")
    entries, topo = layered.of("allreduce"), cluster.topology()
    bare = outer_step_seconds(entries, layered.outer, topo, cluster.links, layered.bucket_bytes)
    # The same bytes as plain local SGD's sync, in three meetings a period instead of one.
    assert bare == pytest.approx(outer_step_seconds(plain.of("allreduce"), plain.outer, topo,
                                                    cluster.links, plain.bucket_bytes)
                                 + 2 * 2 * 500e-6 / 4, rel=1e-3)
    fast = estimate(layered, cluster, model, inputs, flops=1e12, with_memory=False)
    slow = estimate(layered, cluster, model, inputs, flops=1e6, with_memory=False)
    assert fast.comm_s > 0.5 * bare   # a step of microseconds hides little
    assert slow.compute_s > 4 * bare and slow.comm_s == pytest.approx(0.0)   # all of it
    streamed = estimate(plain, cluster, model, inputs, flops=1e6, with_memory=False)
    assert streamed.comm_s == pytest.approx(bare - 2 * 2 * 500e-6 / 4, rel=1e-3)


def test_each_served_or_gathered_table_adds_its_methods_measured_cost():
    """Under the op model a table on the servers or all-gathered adds its method's measured
    cost a step, a fixed part and a part per id this rank looks it up with
    (runtime/table_costs.py: the runtime's own work, which no recorded op holds);
    an all-reduced table adds none. `table_costs` measures both methods on one rank, no process
    group needed."""
    from tilework.estimate.ops import OpTimes
    from tilework.runtime.table_costs import table_costs

    with torch.device("meta"):
        model = DLRM([500, 300], dense_features=4, embed_dim=8)
    inputs = (torch.zeros(8, 4), torch.zeros(8, 2, dtype=torch.long), torch.zeros(8))
    cluster = Cluster(hosts=[Host("a", 2)])
    base = OpTimes({}, 2.0, {"none": 1e-6})
    costed = OpTimes({}, 2.0, {"none": 1e-6, "table ps": 1e-3, "table ps id": 1e-6,
                               "table allgather": 4e-4, "table allgather id": 2e-7})

    def step(method, rate):
        made = tilework.plan(model, tilework.ParallelConfig(
            overrides={"tables.0.weight": method, "tables.1.weight": method}), cluster)
        return estimate(made, cluster, model, inputs, flops=rate, with_memory=False).step_s

    # Each table is looked up with this rank's 8 samples x 1 id.
    for method, each in (("ps", 1e-3 + 8 * 1e-6), ("allgather", 4e-4 + 8 * 2e-7),
                         ("allreduce", 0.0)):
        # two tables, each at its method's cost (measured as a whole loop: not scaled)
        assert step(method, costed) - step(method, base) == pytest.approx(2 * each), method
    measured = table_costs(steps=3)
    assert set(measured) == {"table ps", "table ps id", "table allgather",
                             "table allgather id"}
    assert all(v >= 0 for v in measured.values())


def test_a_bucket_riding_the_servers_push_costs_its_bytes_and_no_meeting():
    """Where the one dense bucket rides the servers' push (wire.bucket_rides_push: it goes
    whole to every peer at the end of the push's all-to-all), the step holds no all-reduce of
    its own: priced as one, the recommender's servers at 4 emulated hosts came out 40% over
    their measured step. A table all-reduced beside them makes the bucket too large to ride,
    and its all-reduce's meetings come back."""
    from tilework.comm.wire import ALL_REDUCE
    from tilework.estimate.cost import dense_rides_push
    from tilework.estimate.plan_cost import dense_seconds

    with torch.device("meta"):
        model = DLRM([500, 3000], dense_features=4, embed_dim=8)
    slow = Link(bandwidth_gbps=1.0, latency_us=1000.0)
    cluster = Cluster(hosts=[Host(f"h{r}", 1) for r in range(4)],
                      links=Links(intra=slow, inter=slow))
    served = tilework.plan(model, tilework.ParallelConfig(
        overrides={"tables.0.weight": "ps", "tables.1.weight": "ps"}), cluster)
    assert dense_rides_push(served, cluster.topology())
    dense = sum(p.nbytes for p in served.of("allreduce"))
    assert dense_seconds(served, cluster) == pytest.approx(3 * dense / slow.bytes_per_s)
    reduced = tilework.plan(model, tilework.ParallelConfig(
        overrides={"tables.0.weight": "ps", "tables.1.weight": "allreduce"}), cluster)
    assert not dense_rides_push(reduced, cluster.topology())
    assert dense_seconds(reduced, cluster) > ALL_REDUCE.messages(4) * slow.latency_s
    # Hot heads' sums ride the bucket too (parallel/data/dense.py): 800 rows of 8 floats and
    # their flags make it too large to ride, so it is all-reduced again.
    import dataclasses

    headed = dataclasses.replace(served, params=tuple(
        dataclasses.replace(p, hot_rows=800) if p.name == "tables.1.weight" else p
        for p in served.params))
    assert not dense_rides_push(headed, cluster.topology())
    assert dense_seconds(headed, cluster) > ALL_REDUCE.messages(4) * slow.latency_s


def test_the_outer_sync_meetings_are_priced_by_each_collective_s_factor():
    """A compressed sync's exchange is an all-to-all and an all-gather: their meetings at the
    link's measured factors (gloo's all-to-all waits once for its n - 1 sends, its all-gather
    n - 1 times), as the servers' are; an uncompressed one is a ring all-reduce, at the fit."""
    from tilework.comm.wire import ALL_GATHER, ALL_TO_ALL
    from tilework.estimate.cost import outer_bucket_wire

    fit = Link(1.0, 1000.0)
    measured = Link(1.0, 1000.0, all_to_all_latency_factor=0.5, all_gather_latency_factor=2.0)
    wire = outer_bucket_wire(64 * 1024, 4, 1, "int8")
    assert wire.seconds(measured, fit) - wire.seconds(fit, fit) == pytest.approx(
        1e-3 * (ALL_TO_ALL.messages(4) * (0.5 - 1) + ALL_GATHER.messages(4) * (2.0 - 1)))
    plain = outer_bucket_wire(64 * 1024, 4, 1, "none")
    assert plain.seconds(measured, fit) == pytest.approx(plain.seconds(fit, fit))
    # Inside a worker the averaged slices are all-gathered: that factor, on the host's link.
    hosts = outer_bucket_wire(64 * 1024, 2, 2, "none")
    assert hosts.seconds(fit, measured) - hosts.seconds(fit, fit) == pytest.approx(
        1e-3 * ALL_GATHER.messages(2) * (2.0 - 1))
