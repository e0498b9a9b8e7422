"""The mesh search (tilework/planner/search.py): candidates, refusals with their reason, and how the
predicted step answers the links; pure, on meta-device models."""

from __future__ import annotations

import pytest
import torch

from tilework.cluster.topology import Cluster, Host, Link, Links
from tilework.config.parallel import ParallelConfig
from tilework.estimate.cost import seconds
from tilework.estimate.step_bytes import mesh_step_bytes
from tilework.models.gpt import TinyGPT
from tilework.parallel.pipeline import build, simulate
from tilework.planner.search import candidates, predict, search_mesh

BATCH, SEQ = 16, 64


def cluster(hosts: int, per_host: int, links: Links | None = None) -> Cluster:
    return Cluster([Host(f"h{i}", per_host) for i in range(hosts)], links=links or Links())


def gpt(heads: int = 8, layers: int = 4) -> TinyGPT:
    with torch.device("meta"):
        return TinyGPT(vocab=1024, dim=256, heads=heads, layers=layers, seq_len=SEQ)


def test_candidates_cover_every_split_with_tp_inside_a_host():
    got = {(c.tp, c.pp, c.cp) for c in candidates(8, 4, layers=4)}
    assert (8, 1, 1) in got            # whole hosts
    assert (2, 2, 2) in got and (1, 4, 2) in got
    assert all(pp <= 4 for _, pp, _ in got)
    assert not any(tp == 8 for tp, _, _ in {(c.tp, c.pp, c.cp) for c in candidates(8, 3, 4)})


@pytest.mark.parametrize("config, reason", [
    (ParallelConfig(tp=4), "heads do not split over tp=4"),
    (ParallelConfig(pp=8), "does not divide the world of 4"),
    (ParallelConfig(pp=2, microbatches=3), "do not split into 3 microbatches"),
])
def test_refused_candidates_say_why(config, reason):
    found = predict(gpt(heads=2), config, cluster(1, 4), BATCH // 2, SEQ, 1e11)
    assert found.step_s is None and reason in found.why


def test_the_pipeline_part_is_the_simulators_replay():
    model, links = gpt(), Links()
    config = ParallelConfig(pp=2, microbatches=4)
    found = predict(model, config, cluster(1, 2), BATCH, SEQ, 1e11)
    sim = simulate(build("1f1b", 2, 4), found.parts["stage_forward_s"],
                   found.parts["stage_backward_s"], links.intra, BATCH // 4 * SEQ * 256 * 4)
    assert found.parts["pipeline"] == pytest.approx(sim.step_s)
    assert found.step_s == pytest.approx(sim.step_s)     # dp = 1: no all-reduce
    assert found.parts["bubble"] == pytest.approx(sim.bubble)


def test_dp_and_tp_times_are_their_counted_bytes_on_their_links():
    links = Links(intra=Link(50.0, 10.0), inter=Link(1.0, 100.0))
    model, config = gpt(), ParallelConfig(tp=2)
    found = predict(model, config, cluster(2, 2, links), BATCH // 2, SEQ, 1e11)
    sent = mesh_step_bytes(model, config, 4, 0, BATCH // 2, SEQ)
    assert found.parts["tp"] == pytest.approx(seconds(sent["tp"], links.intra, 2))
    assert found.parts["dp"] == pytest.approx(seconds(sent["allreduce"], links.inter, 2))
    assert found.parts["dp_between_hosts"] and not found.parts["pp_between_hosts"]


def test_a_slow_network_between_hosts_moves_the_choice_to_pipeline_across_them():
    """Megatron-LM's placement, found by the search: with fast links the step is data
    parallel (tp at most inside a host, no pipeline bubble); across a slow link only a
    pipeline's activations should cross it, the other split (tp, or cp, whose ranks each send
    half a sequence) staying inside each host."""
    model = gpt()
    fast = search_mesh(model, cluster(2, 2, Links(inter=Link(100.0, 5.0))), BATCH, SEQ, 1e11)
    slow = search_mesh(model, cluster(2, 2, Links(inter=Link(0.1, 500.0))), BATCH, SEQ, 1e11)
    assert fast[0].config.pp == 1 and fast[0].parts["dp_size"] >= 2
    best = slow[0]
    assert (best.config.pp, best.parts["dp_size"]) == (2, 1)
    assert best.parts["pp_between_hosts"] and not best.parts["dp_between_hosts"]
    assert best.config.tp * best.config.cp == 2       # the other split inside each host
    for found in (fast, slow):
        ordered = [c.step_s for c in found if c.step_s is not None]
        assert ordered == sorted(ordered)


def test_candidates_that_would_not_fit_are_refused_with_their_peak():
    """Paper 4's pruning: with 80% of memory_gb below what data parallelism holds (every rank
    the whole model, its gradients and Adam's two moments), only the splits fit."""
    from tilework.estimate.plan_memory import estimate_mesh_memory

    model = gpt()
    ids = torch.zeros(BATCH // 4, SEQ, dtype=torch.long)
    replicated = estimate_mesh_memory(model, ParallelConfig(), (ids, ids), 1, 0)
    tight = 0.9 * replicated.peak / 0.8 / 1e9     # memory_gb whose 80% misses dp's peak
    found = search_mesh(model, Cluster([Host("h", 4, memory_gb=tight)]), BATCH, SEQ, 1e11)
    dp4 = next(c for c in found if c.label.startswith("dp4"))
    assert dp4.step_s is None and "exceeds its budget" in dp4.why
    fits = [c for c in found if c.step_s is not None]
    assert fits and all(c.parts["peak_bytes"] <= 0.8 * tight * 1e9 for c in fits)
    assert all(c.config.tp * c.config.pp > 1 for c in fits)


def test_the_per_message_overhead_is_charged_on_every_exchange():
    """LogP's o (measured on busy CPU ranks by the pipeline bench): each tp all-reduce costs
    4 (tp - 1) message ends, each ring-attention shift 2, the pipeline's hops through the
    simulator."""
    from tilework.parallel.tensor import layout_for, plan_layout
    from tilework.parallel.tensor.cost import tp_step_calls

    model, o = gpt(), 1e-3
    for config in (ParallelConfig(tp=2), ParallelConfig(cp=2), ParallelConfig(pp=2)):
        plain = predict(model, config, cluster(1, 2), BATCH, SEQ, 1e11)
        charged = predict(model, config, cluster(1, 2), BATCH, SEQ, 1e11, message_overhead_s=o)
        assert charged.step_s > plain.step_s
    tp = ParallelConfig(tp=2)
    reduces, gathers = tp_step_calls(plan_layout(model, layout_for(model), 2))
    # 4 blocks x (2 per attention + 2 per MLP), the embedding 1, the head 1 and its loss 2
    assert gathers == 0 and reduces == 4 * 4 + 1 + 3
    gap = (predict(model, tp, cluster(1, 2), BATCH, SEQ, 1e11, message_overhead_s=o).parts["tp"]
           - predict(model, tp, cluster(1, 2), BATCH, SEQ, 1e11).parts["tp"])
    assert gap == pytest.approx(o * 4 * reduces)
    cp = ParallelConfig(cp=2)
    gap = (predict(model, cp, cluster(1, 2), BATCH, SEQ, 1e11, message_overhead_s=o).parts["cp"]
           - predict(model, cp, cluster(1, 2), BATCH, SEQ, 1e11).parts["cp"])
    assert gap == pytest.approx(o * 2 * 4 * (3 * 2 - 2))   # 4 layers


def test_candidates_sharing_the_models_facts_are_priced_as_alone():
    """The search works out the model's stage cuts, layouts and shapes once for all its
    candidates (estimate/model_facts.py): each candidate's predicted step and parts are what
    pricing it alone gives, whichever candidates came before it, curve and recompute
    included, on hosts alike and unlike."""
    from tilework.cluster.matmul_curve import MatmulCurve
    from tilework.estimate.model_facts import ModelFacts

    model, where = gpt(), cluster(2, 4, Links(inter=Link(1.0, 50.0)))
    curve = MatmulCurve((64, 512), (((2e10, 3e10), (3e10, 5e10)), ((4e10, 6e10), (6e10, 8e10))))
    configs = [ParallelConfig(pp=2, microbatches=4), ParallelConfig(tp=2, pp=2, microbatches=2),
               ParallelConfig(cp=2, tp=2, recompute="full"),
               ParallelConfig(pp=4, microbatches=8, zero=3), ParallelConfig(tp=4, zero=3),
               ParallelConfig(tp=4, pp=2, microbatches=2),   # a stage per host: cut by speed
               ParallelConfig(pp=2, microbatches=4, schedule="interleaved", recompute="full")]
    uneven = Cluster([Host("fast", 4), Host("slow", 4, speed=0.5)], links=where.links)
    shared = ModelFacts(model)
    for rate, where in ((1e11, where), (curve, where), (1e11, uneven)):
        for config in configs + configs[::-1]:
            alone = predict(model, config, where, BATCH, SEQ, rate)
            together = predict(model, config, where, BATCH, SEQ, rate, facts=shared)
            assert alone.step_s is not None, alone.why
            assert (together.step_s, together.parts) == (alone.step_s, alone.parts), config
