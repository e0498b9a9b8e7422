"""ZeRO's exchanges priced at their links' measured factors (cluster/topology.Link), and ZeRO-3's
transfers beside the compute across hosts (estimate/step.dp_seconds). Pure."""

import pytest

from tilework.cluster.topology import Link, Topology
from tilework.comm.wire import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, all_gather_bytes
from tilework.estimate.cost import seconds, zero_sharded, zero_sync_bytes, zero_sync_seconds
from tilework.estimate.step import allreduce_seconds, dp_seconds
from tilework.plans.plan import ParamPlan

LINK = Link(bandwidth_gbps=1.0, latency_us=100.0)
SLOW_EXCHANGES = Link(1.0, 100.0, reduce_scatter_factor=2.0, all_gather_factor=1.5)


def entry(zero: int, numel: int = 1 << 20) -> ParamPlan:
    return ParamPlan("w", (numel,), "allreduce", zero=zero, unit="block" if zero == 3 else None)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_at_factors_of_one_the_exchanges_cost_their_bytes_on_the_link(zero):
    for n in (2, 4):
        sent, messages = zero_sync_bytes(entry(zero), n)
        assert zero_sync_seconds(entry(zero), n, LINK) == pytest.approx(
            seconds(sent, LINK, messages))


def test_each_exchange_takes_its_own_factor():
    n, p = 2, entry(2)
    chunk = p.numel * 4 // n
    gather = seconds(all_gather_bytes(chunk, n), LINK, ALL_GATHER.messages(n))
    scatter = seconds(REDUCE_SCATTER.sent(chunk * n, n), LINK, REDUCE_SCATTER.messages(n))
    assert zero_sync_seconds(p, n, SLOW_EXCHANGES) == pytest.approx(2.0 * scatter + 1.5 * gather)
    # ZeRO-1 all-reduces its gradient (the fit's own collective) and gathers once.
    ring = seconds(ALL_REDUCE.sent(p.nbytes, n), LINK, ALL_REDUCE.messages(n))
    assert zero_sync_seconds(entry(1), n, SLOW_EXCHANGES) == pytest.approx(ring + 1.5 * gather)
    # The plan's entry cost reads the topology's link the same way.
    assert zero_sharded(p, Topology.from_sizes([n]), _links(SLOW_EXCHANGES)).seconds == \
        pytest.approx(2.0 * scatter + 1.5 * gather)


def _links(link):
    from tilework.cluster.topology import Links

    return Links(intra=link, inter=link)


def test_the_step_models_dp_wait_follows_the_same_halves():
    sent, n = 8e6, 2
    ring = allreduce_seconds(sent, n, SLOW_EXCHANGES, 25.0)
    assert dp_seconds(sent, n, SLOW_EXCHANGES, 25.0, 0) == ring
    assert dp_seconds(sent, n, SLOW_EXCHANGES, 25.0, 1) == pytest.approx(ring * (1 + 1.5 / 2))
    assert dp_seconds(sent, n, SLOW_EXCHANGES, 25.0, 2) == pytest.approx(ring * (2 + 1.5) / 2)


def test_zero3_transfers_hide_behind_the_compute_only_across_hosts():
    sent, n, units = 8e6, 2, 5
    moved = sent / 2 / SLOW_EXCHANGES.bytes_per_s * (2.0 + 2 * 1.5)
    messages = units * (REDUCE_SCATTER.messages(n) + 2 * ALL_GATHER.messages(n)) \
        * SLOW_EXCHANGES.latency_s
    inside = dp_seconds(sent, n, SLOW_EXCHANGES, 25.0, 3, compute=10.0, units=units)
    assert inside == pytest.approx(moved + messages)
    # Across hosts beside a long compute: one unit's share of the transfers waits...
    hidden = dp_seconds(sent, n, SLOW_EXCHANGES, 25.0, 3, compute=10.0, units=units, beside=True)
    assert hidden == pytest.approx(moved / units + messages)
    # ...beside a short one, what the compute cannot cover.
    short = dp_seconds(sent, n, SLOW_EXCHANGES, 25.0, 3, compute=moved / 4, units=units,
                       beside=True)
    assert short == pytest.approx(moved * 3 / 4 + messages)


def test_the_search_prices_each_zero_stage_of_a_mesh_candidate_apart():
    """The search's step cache shares a mesh candidate's step between configurations that
    cannot differ; ZeRO's stages do, once their exchanges have factors of their own."""
    import torch

    from tilework.cluster.topology import Cluster, Host, Links
    from tilework.config.parallel import ParallelConfig
    from tilework.models.gpt import TinyGPT
    from tilework.planner.search import price_step

    with torch.device("meta"):
        model = TinyGPT(vocab=64, dim=32, heads=2, layers=2, seq_len=8)
    ids = torch.zeros(2, 8, dtype=torch.long, device="meta")
    link = Link(1.0, 100.0, reduce_scatter_factor=1.8, all_gather_factor=1.5)
    cluster = Cluster([Host("a", 4)], links=Links(intra=link, inter=link))
    cache: dict = {}
    steps = [price_step(model, ParallelConfig(tp=2, zero=zero), cluster, (ids, ids), 1e10,
                        cache=cache).step_s for zero in (0, 1, 2)]
    assert None not in steps and len(set(steps)) == 3


def test_many_small_parameters_are_priced_per_bucket_not_per_parameter():
    """parallel/data/zero.py exchanges a bucket at a time: ten parameters of 1 KB in one bucket
    are one reduce-scatter and one all-gather of their chunks (a latency each), not ten of
    each (the recommender's dense part priced so came out 6-10 ms over its measured ZeRO
    step on loopback)."""
    from tilework.estimate.cost import zero_bucket_seconds, zero_exchanges

    n, small = 2, [ParamPlan(f"w{i}", (256,), "allreduce", zero=2) for i in range(10)]
    chunk = sum(p.numel * 4 // n for p in small)
    scatter = seconds(REDUCE_SCATTER.sent(chunk * n, n), SLOW_EXCHANGES,
                      REDUCE_SCATTER.messages(n))
    gather = seconds(all_gather_bytes(chunk, n), SLOW_EXCHANGES, ALL_GATHER.messages(n))
    bucketed = zero_bucket_seconds(small, n, SLOW_EXCHANGES, 1, 25 << 20)
    assert bucketed == pytest.approx(2.0 * scatter + 1.5 * gather)
    # Buckets fill by every rank's padded chunk, as parallel/data/zero.py fills them: two
    # parameters of 511 floats take 2 x 256 floats each at 2 ranks, a 2 KB bucket each.
    odd = [ParamPlan(f"o{i}", (511,), "allreduce", zero=2) for i in range(2)]
    assert [kind for kind, _, _ in zero_exchanges(odd, 2, 1, 2048)] == \
        ["reduce_scatter", "reduce_scatter", "all_gather", "all_gather"]
    alone = sum(zero_sync_seconds(p, n, SLOW_EXCHANGES) for p in small)
    assert alone - bucketed == pytest.approx(9 * (2.0 * REDUCE_SCATTER.messages(n)
                                                  + 1.5 * ALL_GATHER.messages(n))
                                             * SLOW_EXCHANGES.latency_s)


def test_ring_attention_s_shift_is_priced_at_its_measured_factor():
    """cp's blocks cross the link both ways at once (every rank sends to the next while it
    receives from the previous), which `tilework calibrate` times as "ring_shift": at a factor
    of 2 the step model's cp exchange takes its transfer time once more."""
    import torch

    from tilework.cluster.topology import Cluster, Host, Links
    from tilework.config.parallel import ParallelConfig
    from tilework.estimate.step import predict
    from tilework.models.gpt import TinyGPT

    with torch.device("meta"):
        model = TinyGPT(vocab=64, dim=32, heads=2, layers=2, seq_len=16)

    def cp_seconds(link):
        cluster = Cluster([Host("a", 2)], links=Links(intra=link, inter=link))
        found = predict(model, ParallelConfig(cp=2), cluster, 2, 16, 1e10)
        return found.parts["cp"], found.parts["bytes_per_rank"][0]["cp"]

    plain, sent = cp_seconds(LINK)
    shifted, _ = cp_seconds(Link(1.0, 100.0, ring_shift_factor=2.0))
    assert sent > 0 and shifted - plain == pytest.approx(sent / LINK.bytes_per_s)
