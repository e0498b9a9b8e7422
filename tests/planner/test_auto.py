"""plan="auto": the search over every dimension chooses right where the numbers force the
answer, each role of it works alone, and a program parallelized with plan="auto" trains as one
process does."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import tilework
from tilework import ParallelConfig
from tilework.cluster.topology import Cluster, Host, Link, Links
from tilework.estimate import estimate_memory
from tilework.models.gpt import TinyGPT
from tilework.planner.search import (
    Space,
    auto,
    choose,
    configs,
    label,
    options_of,
    price,
    search,
)

RATE = 1e10   # FLOP/s per rank: the same for every candidate, so only the plans differ


def gpt(layers: int = 4, dim: int = 64, vocab: int = 512) -> TinyGPT:
    with torch.device("meta"):
        return TinyGPT(vocab=vocab, dim=dim, heads=4, layers=layers, seq_len=16)


def tokens(batch: int = 2, seq: int = 16):
    ids = torch.zeros(batch, seq, dtype=torch.long)
    return ids, ids


def test_enumerate_covers_the_space_and_keeps_the_rest_of_the_config():
    cluster = Cluster([Host("a", 2), Host("b", 2)])
    found = configs(ParallelConfig(bucket_mb=5.0), Space(), cluster, layers=4)
    # ZeRO 0, or 1-3 over the world or each host, 3 with its shards offloaded or not;
    # recompute none, selective or full
    assert len(found) == (1 + 2 * 2 + 2 * 2) * 3
    assert all(c.bucket_mb == 5.0 and c.tp == c.pp == c.cp == 1 for c in found)
    assert {(c.zero, c.offload) for c in found} == {(0, "none"), (1, "none"), (2, "none"),
                                                    (3, "none"), (3, "all")}
    assert {c.recompute for c in found} == {"none", "selective", "full"}
    assert {(c.zero, c.zero_scope) for c in found} >= {(0, "world"), (3, "host"), (1, "world")}
    one_host = configs(ParallelConfig(), Space(), Cluster([Host("a", 4)]), layers=4)
    assert {c.zero_scope for c in one_host} == {"world"}   # a host scope is the world there
    piped = configs(ParallelConfig(), Space(axes=("pp",), zero=(), recompute=()), cluster,
                    layers=4)
    assert {(c.pp, c.microbatches) for c in piped} == {(1, None), (2, 2), (2, 4), (2, 8),
                                                        (4, 4), (4, 8), (4, 16)}


def test_a_tiny_model_stays_plain_data_parallel():
    """Nothing to save: ZeRO-3 and recompute only cost, ZeRO-1 and 2 tie with plain data
    parallelism in the step and the simpler plan wins."""
    choice = auto(gpt(), ParallelConfig(plan="auto"), Cluster([Host("a", 2), Host("b", 2)]),
                  tokens(), RATE)
    chosen = choice.chosen.config
    assert (chosen.zero, chosen.recompute, chosen.tp, chosen.pp, chosen.cp) == \
        (0, "none", 1, 1, 1)
    assert choice.runner_up is not None and "runner-up" in choice.why()


def _peak(config: ParallelConfig, model, inputs, cluster) -> float:
    return max(estimate_memory(model, config, inputs, cluster, rank=r).peak
               for r in range(cluster.world_size))


def test_a_model_too_large_for_a_rank_gets_zero_3():
    """Memory between ZeRO-3's peak and ZeRO-2's: every lower stage is refused by its peak,
    ZeRO-3 is chosen (paper 4's pruning: 80% of the memory is the budget)."""
    model, inputs = gpt(layers=4, dim=256, vocab=4096), tokens(batch=1)
    cluster = Cluster([Host("a", 4)])
    stage2, stage3 = (_peak(ParallelConfig(zero=z), model, inputs, cluster) for z in (2, 3))
    assert stage3 < stage2
    memory_gb = (stage3 + stage2) / 2 / 0.8 / 1e9
    tight = Cluster([Host("a", 4, memory_gb=memory_gb)])
    found = search(model, tight, inputs, RATE, space=Space(recompute=("none",)), every=True)
    chosen = choose(found).chosen
    assert chosen.config.zero == 3
    for c in found:
        if c.config.zero < 3:
            assert c.step_s is None and "exceeds its budget" in c.why, label(c)


def test_a_host_with_less_memory_gets_the_smaller_pipeline_stage():
    """pp=2 over two hosts of one speed, one with the memory for less than half the model: the
    even cut (the default, by speed) is refused by that rank's peak, the cut by memory
    (stage_weights, the hosts' memory_gb) gives it fewer blocks and is chosen. Hosts of equal
    memory get no such candidate."""
    model, inputs = gpt(layers=8, dim=256), tokens(batch=8)
    config = ParallelConfig(plan="auto", pp=2, microbatches=4)
    roomy = Cluster([Host("a", 1, memory_gb=100.0), Host("b", 1, memory_gb=100.0)])
    even = max(estimate_memory(model, ParallelConfig(pp=2, microbatches=4), inputs, roomy,
                               rank=r).peak for r in range(2))
    small = 0.6 * even / 0.8 / 1e9   # a budget of 60% of the even cut's larger peak
    tight = Cluster([Host("a", 1, memory_gb=100.0), Host("b", 1, memory_gb=small)])
    space = Space(zero=(0,), recompute=("none",), offload=())
    found = search(model, tight, inputs, RATE, base=config, space=space, every=True)
    chosen = choose(found).chosen
    assert chosen.config.stage_weights == [100.0, small], label(chosen)
    assert "stages by memory" in label(chosen)
    assert chosen.parts["plan"].parallel.stages[1][1] - chosen.parts["plan"].parallel.stages[1][0] \
        < 4
    by_speed = [c for c in found if c.config.stage_weights is None]
    assert by_speed and all(c.step_s is None and "exceeds its budget" in c.why
                            for c in by_speed), [label(c) for c in by_speed]
    alike = search(model, roomy, inputs, RATE, base=config, space=space)
    assert all(c.config.stage_weights is None for c in alike)


class _Wide(nn.Module):
    """Parameters and their Adam state dominate: sixteen wide layers on a batch of two."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(512, 512) for _ in range(16))

    def forward(self, x, y):
        for layer in self.layers:
            x = layer(x).relu()
        return nn.functional.mse_loss(x, y)


def _chunked_by_memory(found, small: float):
    """The chosen candidate of `found`, checked to cut ZeRO's chunks 3:1 by the hosts' memory
    where every even cut was refused by the small host's budget."""
    chosen = choose(found).chosen
    assert chosen.config.zero_weights == [3 * small, small], label(chosen)
    big = max(chosen.parts["plan"].params, key=lambda p: p.numel)
    assert big.zero_chunks[0] == 3 * big.zero_chunks[1]
    evenly = [c for c in found if c.config.zero_weights is None]
    assert evenly and all(c.step_s is None and "exceeds its budget" in c.why
                          for c in evenly), [label(c) for c in evenly]
    return chosen


def test_a_host_with_less_memory_keeps_fewer_zero_chunks():
    """ZeRO-3 over two hosts of one speed, one with the memory for 75% of the even cut's peak
    and the other three times that: every even cut is refused by the small rank's budget, the
    chunks by memory (zero_weights, the hosts' memory_gb) give it a quarter and are chosen
    (the large rank's peak grows by more than the small one's falls: every chunk crosses
    padded to the largest). Equal memories get no such candidate."""
    with torch.device("meta"):
        model = _Wide()
    inputs = (torch.zeros(2, 512), torch.zeros(2, 512))
    config = ParallelConfig(plan="auto", zero=3)
    space = Space(zero=(3,), recompute=("none",), offload=(), tables=())
    roomy = Cluster([Host("a", 1, memory_gb=100.0), Host("b", 1, memory_gb=100.0)])
    even = max(estimate_memory(model, ParallelConfig(zero=3), inputs, roomy, rank=r).peak
               for r in range(2))
    small = 0.75 * even / 0.8 / 1e9
    tight = Cluster([Host("a", 1, memory_gb=3 * small), Host("b", 1, memory_gb=small)])
    found = search(model, tight, inputs, RATE, base=config, space=space, every=True)
    chosen = _chunked_by_memory(found, small)
    assert "chunks by memory" in label(chosen)
    alike = search(model, roomy, inputs, RATE, base=config, space=space)
    assert all(c.config.zero_weights is None for c in alike)
    assert options_of(chosen.config)["zero_weights"] == [3 * small, small]


@pytest.mark.parametrize("options, expected", [
    ({"pp": 2, "stage_weights": [1]}, "one weight per pipeline rank (pp=2), got 1"),
    ({"pp": 2, "stage_weights": [1, 0]}, "a list of positive weights, one per pipeline rank"),
    ({"pp": 2, "stage_weights": "1,2"}, "a list of positive weights"),
    ({"plan": "auto", "pp": "auto", "stage_weights": [1, 2]}, "no weights with pp='auto'"),
])
def test_stage_weights_are_refused_by_name(options, expected):
    with pytest.raises(tilework.errors.ConfigError, match="stage_weights") as refused:
        ParallelConfig(**options)
    assert expected in str(refused.value)
    assert ParallelConfig(pp=2, stage_weights=(3, 1)).stage_weights == [3.0, 1.0]


def _chosen_between(model, inputs, fits: float, misses: float) -> ParallelConfig:
    """plan="auto" on 2 ranks whose budget (80% of their memory) lies between two peaks."""
    budget = Cluster([Host("a", 2, memory_gb=(fits + misses) / 2 / 0.8 / 1e9)])
    return auto(model, ParallelConfig(plan="auto"), budget, inputs, RATE).chosen.config


def test_recompute_is_chosen_when_only_it_fits():
    """Activations dominate (a long batch, few parameters): only recompute fits."""
    model, inputs = gpt(layers=4, dim=64, vocab=256), tokens(batch=64)
    cluster = Cluster([Host("a", 2)])
    plain = _peak(ParallelConfig(zero=3), model, inputs, cluster)
    full = _peak(ParallelConfig(zero=0, recompute="full"), model, inputs, cluster)
    assert full < plain
    assert _chosen_between(model, inputs, full, plain).recompute == "full"


def test_selective_recompute_is_chosen_where_it_fits_and_costs_less_than_full():
    """Between selective's peak and no recompute's: selective, which recomputes no matmul, is
    chosen over full, which fits too but runs every block's forward again."""
    model, inputs = gpt(layers=4, dim=64, vocab=256), tokens(batch=64)
    cluster = Cluster([Host("a", 2)])
    none = _peak(ParallelConfig(zero=3), model, inputs, cluster)
    selective = _peak(ParallelConfig(zero=3, recompute="selective"), model, inputs, cluster)
    assert selective < none
    assert _chosen_between(model, inputs, selective, none).recompute == "selective"


def test_offload_is_chosen_when_only_it_fits():
    """Parameters and AdamW's state dominate: below ZeRO-3's peak, only ZeRO-3 with its
    shards in host files (offload="all") fits."""
    model, inputs = gpt(layers=4, dim=256, vocab=4096), tokens(batch=2)
    cluster = Cluster([Host("a", 2)])
    zero3 = min(_peak(ParallelConfig(zero=3, recompute=r), model, inputs, cluster)
                for r in ("none", "selective", "full"))
    offloaded = _peak(ParallelConfig(zero=3, offload="all"), model, inputs, cluster)
    assert offloaded < zero3
    chosen = _chosen_between(model, inputs, offloaded, zero3)
    assert (chosen.zero, chosen.offload) == (3, "all")


def test_options_of_a_candidate_give_back_what_the_search_varied():
    """The benchmarks run each candidate through parallelize(**options_of(config)): every
    field the search varies must survive (offload was once dropped, so the benchmarks ran
    ZeRO-3 without it)."""
    from tilework.planner.search import options_of, with_shares

    space = Space(axes=("tp", "pp", "cp"), schedules=("1f1b", "gpipe"))
    varied = ("tp", "pp", "cp", "zero", "zero_scope", "offload", "recompute", "microbatches",
              "schedule", "batch_shares")
    uneven = Cluster([Host("a", 2, speed=2.0), Host("b", 2)])
    found = with_shares(configs(ParallelConfig(), space, uneven, layers=4), uneven, tokens())
    assert any(c.batch_shares for c in found)
    for config in found:
        again = ParallelConfig(**options_of(config))
        for field in varied:
            if field != "schedule" or config.pp > 1:
                assert getattr(again, field) == getattr(config, field), (field, config)


def test_a_slow_link_between_hosts_puts_the_pipeline_across_them_and_tp_inside():
    """With pp opted in (pp="auto"): across a slow link only a pipeline's activations should
    cross it, tp staying inside each host; with fast links the step stays data parallel."""
    model, inputs = gpt(layers=4, dim=64), tokens(batch=4)
    config = ParallelConfig(plan="auto", tp="auto", pp="auto")
    fast = auto(model, config, Cluster([Host("a", 2), Host("b", 2)],
                                       links=Links(inter=Link(100.0, 5.0))), inputs, 1e11)
    slow = auto(model, config, Cluster([Host("a", 2), Host("b", 2)],
                                       links=Links(inter=Link(0.1, 500.0))), inputs, 1e11)
    assert fast.chosen.config.pp == 1
    best = slow.chosen
    assert (best.config.pp, best.config.tp) == (2, 2)
    assert best.parts["pp_between_hosts"] and not best.parts["dp_between_hosts"]


def test_a_sparse_table_goes_to_the_servers():
    """A large embedding whose gradient touches few rows: the chosen plan serves it."""
    from tilework.estimate.cost import TableTraffic
    from tilework.models.recommender import DLRM

    with torch.device("meta"):
        model = DLRM([200_000, 50], embed_dim=16, sparse=True)
    cluster = Cluster([Host("a", 2), Host("b", 2)], links=Links(inter=Link(1.0, 50.0)))
    inputs = (torch.zeros(8, 8), torch.zeros(8, 2, dtype=torch.long), torch.zeros(8))
    topology = cluster.topology()
    traffic = {"tables.0.weight": TableTraffic.zipf(200_000, 8, topology),
               "tables.1.weight": TableTraffic.zipf(50, 8, topology)}
    choice = auto(model, ParallelConfig(plan="auto"), cluster, inputs, RATE, traffic=traffic)
    placed = {p.name: p.method for p in choice.chosen.parts["plan"].params}
    assert placed["tables.0.weight"] == "ps"


def test_with_every_parameter_on_the_servers_zero_is_no_candidate():
    """mode="ps" leaves ZeRO nothing to shard: its stages would be copies of plain dp (and
    ZeRO-3 with offload made a plan whose configuration could not be built: the search
    raised instead of ranking)."""
    from tilework.models.recommender import DLRM

    with torch.device("meta"):
        model = DLRM([1000, 50], embed_dim=16, sparse=True)
    inputs = (torch.zeros(8, 8), torch.zeros(8, 2, dtype=torch.long), torch.zeros(8))
    cluster = Cluster([Host("a", 2)])
    found = search(model, cluster, inputs, RATE, base=ParallelConfig(mode="ps"), every=True)
    assert {c.config.zero for c in found} == {0}
    assert all(c.step_s is not None for c in found)
    assert {p.method for p in found[0].parts["plan"].params} == {"ps"}
    # A mesh candidate runs hybrid (its dense parameters all-reduced): ZeRO stays a candidate.
    meshed = configs(ParallelConfig(mode="ps"), Space(axes=("tp",)), Cluster([Host("a", 4)]),
                     layers=4)
    assert {c.zero for c in meshed if c.tp == 2} == {0, 1, 2, 3}
    assert {c.zero for c in meshed if c.tp == 1} == {0}


def test_price_refuses_what_cannot_run_and_says_why():
    model, inputs = gpt(layers=2), tokens(batch=2)
    cluster = Cluster([Host("a", 4)])
    three = price(model, ParallelConfig(pp=4, microbatches=4), cluster, inputs, RATE)
    assert three.step_s is None and three.why
    odd = price(model, ParallelConfig(pp=2, microbatches=3), cluster, inputs, RATE)
    assert odd.step_s is None and "microbatches" in odd.why


def test_plan_auto_needs_example_inputs_said_in_one_line():
    model = nn.Linear(4, 4)
    with pytest.raises(tilework.errors.PlanError, match="example_inputs"):
        tilework.parallelize(model, torch.optim.SGD(model.parameters(), 0.1), plan="auto",
                             log=False)


def test_auto_axes_need_plan_auto():
    with pytest.raises(Exception, match="plan='auto'"):
        ParallelConfig(tp="auto")
    c = ParallelConfig(plan="auto", pp="auto")
    assert (c.pp, c.auto_axes) == (1, ["pp"])
    assert dataclasses.replace(c, zero=1).auto_axes == ["pp"]


# -- live: 2 gloo ranks ----------------------------------------------------------------------

BATCH, SEQ, VOCAB = 4, 8, 64


def _model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab=VOCAB, dim=32, heads=4, layers=2, seq_len=SEQ)


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g) for _ in range(3)]


def _optimizer(model):
    # SGD: Adam would turn the float noise of gradients that are zero in exact arithmetic
    # (attention's key bias) into whole steps, in one process and in any parallel run alike.
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _one_process():
    model = _model()
    opt = _optimizer(model)
    losses = []
    for b in _batches():
        loss = model(b[:, :-1], b[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def _suite(rank, world_size):
    """plan='auto' under a memory budget plain data parallelism misses: ZeRO-3 is chosen."""
    model = _model()
    opt = _optimizer(model)
    half = BATCH // world_size
    batches = [b[rank * half:(rank + 1) * half] for b in _batches()]
    example = (batches[0][:, :-1], batches[0][:, 1:])
    plain = max(tilework.estimate_memory(model, ParallelConfig(), example, rank=r,
                                         optimizer=opt).peak
                for r in range(world_size))
    zero3 = max(tilework.estimate_memory(model, ParallelConfig(zero=3), example, rank=r,
                                         optimizer=opt).peak
                for r in range(world_size))
    gb = (plain + zero3) / 2 / 0.8 / 1e9   # 80% of it between ZeRO-3's peak and plain's
    model, opt = tilework.parallelize(model, opt, plan="auto", example_inputs=example,
                                      cluster=Cluster([Host("h", world_size, memory_gb=gb)]),
                                      log=False)
    losses = []
    for b in batches:
        loss = model(b[:, :-1], b[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    engine = model._tilework_engine
    mean = []
    for loss in losses:   # each rank's mean over its half: the global mean is their mean
        torch.distributed.all_reduce(loss)
        mean.append(loss.item() / world_size)
    fresh = _model()
    return {"zero": max((p.zero for p in engine.plan.params), default=0), "losses": mean,
            "state": {k: v.clone() for k, v in tilework.state_dict(model, opt)["model"].items()},
            "live_plan_world": tilework.plan(fresh, ParallelConfig(zero=1)).world_size,
            "live_estimate": tilework.estimate_memory(fresh, ParallelConfig(zero=1), example),
            "two_ranks_estimate": tilework.estimate_memory(
                fresh, ParallelConfig(zero=1), example, Cluster([Host("h", world_size)]),
                rank=rank)}


def test_plan_auto_chooses_zero3_under_a_tight_budget_and_trains_like_one_process(two_ranks):
    losses, params = _one_process()
    for got in two_ranks:
        assert got["zero"] == 3
        assert got["losses"] == pytest.approx(losses, rel=1e-5)
        for k, v in params.items():
            torch.testing.assert_close(got["state"][k], v, rtol=1e-5, atol=1e-6)


def test_tilework_plan_and_estimate_memory_inside_a_live_world_default_to_it(two_ranks):
    """Inside an initialised process group, tilework.plan plans for the live world and
    tilework.estimate_memory estimates this rank of it (not one rank alone, where ZeRO-1
    would shard nothing)."""
    for rank, got in enumerate(two_ranks):
        assert got["live_plan_world"] == 2
        assert got["live_estimate"] == got["two_ranks_estimate"]
        assert got["live_estimate"].rank == rank


def test_tilework_plan_auto_prints_the_choice_and_reports_its_plan():
    import json
    import subprocess
    import sys

    args = [sys.executable, "-m", "tilework", "plan", "--job", "docs/examples/gpt-mesh.toml",
            "--world-size", "4", "--auto", "--gflops", "10"]
    text = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    assert "plan='auto'" in text and "chose dp" in text and "runner-up" in text
    out = json.loads(subprocess.run([*args, "--json"], capture_output=True, text=True,
                                    check=True).stdout)
    chosen = out["auto"]["chosen"]
    # The job gives pp=2 and tp=2 (not "auto"): they stay; the report is the chosen plan's.
    assert "pp2" in chosen and "tp2" in chosen and out["auto"]["flops_per_s"] == 10e9
    assert out["plan"]["world_size"] == 4
    steps = [c["predicted_step_s"] for c in out["auto"]["candidates"]
             if c["predicted_step_s"] is not None]
    assert steps == sorted(steps)


def test_tilework_plan_auto_writes_the_job_as_chosen_for_tilework_train(tmp_path):
    """--write-job: the job with the chosen [parallel] settings, which `tilework train` reads
    back as the job the report showed (plan = "config": nothing is searched again)."""
    import json
    import subprocess
    import sys

    from tilework.train.job import Job

    out = tmp_path / "chosen.toml"
    args = [sys.executable, "-m", "tilework", "plan", "--job", "docs/examples/gpt-mesh.toml",
            "--world-size", "4", "--auto", "--gflops", "10", "--json"]
    found = json.loads(subprocess.run([*args, "--write-job", str(out)], capture_output=True,
                                      text=True, check=True).stdout)
    written, given = Job.load(out), Job.load("docs/examples/gpt-mesh.toml")
    assert written.parallel.plan == "config"
    assert (written.parallel.tp, written.parallel.pp) == (given.parallel.tp, given.parallel.pp)
    assert written.gpt == given.gpt and written.train == given.train
    again = json.loads(subprocess.run([sys.executable, "-m", "tilework", "plan", "--job",
                                       str(out), "--world-size", "4", "--gflops", "10",
                                       "--json"], capture_output=True, text=True,
                                      check=True).stdout)
    assert again["plan"] == found["plan"]
    refused = subprocess.run([sys.executable, "-m", "tilework", "plan", "--job", str(out),
                              "--world-size", "4", "--write-job", str(tmp_path / "x.toml")],
                             capture_output=True, text=True)
    assert refused.returncode != 0 and "--write-job: with --auto" in refused.stderr


def test_tilework_plan_trial_trains_the_closest_candidates_and_keeps_the_fastest(tmp_path):
    """--trial 2: the two fastest predicted candidates that fit each train a few steps on 2
    local ranks as `tilework train` would; the report keeps the fastest measured, and shows
    both predictions beside the measurements."""
    import json
    import subprocess
    import sys

    job = tmp_path / "job.toml"
    text = open("docs/examples/gpt-mesh.toml").read()
    text = text[:text.index("[parallel]")].replace("vocab = 8192", "vocab = 512") \
        .replace("dim = 128", "dim = 32").replace("batch_size = 16", "batch_size = 4")
    job.write_text(text + '[parallel]\nplan = "auto"\n')
    out = json.loads(subprocess.run(
        [sys.executable, "-m", "tilework", "plan", "--job", str(job), "--world-size", "2",
         "--auto", "--gflops", "10", "--trial", "2", "--trial-steps", "1", "--json"],
        capture_output=True, text=True, check=True).stdout)
    trials = out["auto"]["trials"]
    assert len(trials) == 2 and all(t["measured_step_s"] > 0 for t in trials)
    best = min(trials, key=lambda t: t["measured_step_s"])
    assert out["auto"]["chosen"] == best["plan"]
    assert trials[0]["predicted_step_s"] <= trials[1]["predicted_step_s"]


def test_tp_replicas_with_less_memory_keep_fewer_zero_chunks():
    """The same on a tp=2 mesh over two hosts of two ranks (a host one replica): ZeRO-3's
    chunks are cut over each dp group, one weight per replica (its ranks' least memory), so
    the small host's ranks keep a quarter of their tp shards' chunks; with memory for 92% of
    the even cut's peak the even cut is refused by their budget and the chunks by memory fit
    (under ZeRO-3 they save less than the shards' share: the gathered blocks and the padded
    buffers stay the largest chunk's; 13% of the small rank's peak here)."""
    model = gpt(layers=4, dim=256, vocab=8192)
    inputs = tokens()
    config = ParallelConfig(plan="auto", tp=2, zero=3)
    space = Space(zero=(3,), recompute=("none",), offload=(), tables=())
    roomy = Cluster([Host("a", 2, memory_gb=100.0), Host("b", 2, memory_gb=100.0)])
    even = max(estimate_memory(model, ParallelConfig(tp=2, zero=3), inputs, roomy,
                               rank=r).peak for r in range(4))
    small = 0.92 * even / 0.8 / 1e9
    tight = Cluster([Host("a", 2, memory_gb=3 * small), Host("b", 2, memory_gb=small)])
    found = search(model, tight, inputs, RATE, base=config, space=space, every=True)
    assert _chunked_by_memory(found, small).config.tp == 2


def test_hosts_of_different_speeds_get_batch_shares_by_speed():
    """Speeds 4 and 1: every candidate is also priced with the batch split 8 / 2 (the global
    batch: the example's 5 per rank, times 2): its ranks finish together at the additive ideal,
    2 / (4 + 1) of the even split's pace, which the slow rank sets; the shares win."""
    fast_slow = Cluster([Host("a", 1, speed=4.0), Host("b", 1, speed=1.0)])
    choice = auto(gpt(), ParallelConfig(plan="auto", batch_shares="auto"), fast_slow,
                  tokens(batch=5), RATE)
    assert choice.chosen.config.batch_shares == [8, 2]
    even = next(c for c in choice.candidates if c.config.batch_shares is None
                and (c.config.zero, c.config.recompute) == (choice.chosen.config.zero,
                                                             choice.chosen.config.recompute))
    assert choice.chosen.parts["compute"] == pytest.approx(even.parts["compute"] * 0.4)
    assert "shares 8/2" in label(choice.chosen)


def test_tp_replicas_on_hosts_of_different_speeds_get_shares_by_their_slowest_rank():
    """tp=2 inside each of two hosts of speeds 4 and 1: each host is one replica, so the
    candidates also split the batch 16 / 4 between the replicas (the example one rank's 5
    sequences, times the 4 ranks: the even split's global batch), and the shares win as they
    do without tp."""
    fast_slow = Cluster([Host("a", 2, speed=4.0), Host("b", 2, speed=1.0)])
    choice = auto(gpt(), ParallelConfig(plan="auto", tp=2, batch_shares="auto"), fast_slow,
                  tokens(batch=5), RATE, space=Space(zero=(0,), recompute=("none",),
                                                     offload=()))
    assert choice.chosen.config.tp == 2 and choice.chosen.config.batch_shares == [16, 4]
    assert choice.chosen.parts["plan"].rank_shares() == (16, 16, 4, 4)
    even = next(c for c in choice.candidates if c.config.batch_shares is None)
    assert choice.chosen.step_s < even.step_s


def test_pipeline_replicas_on_hosts_of_different_speeds_get_shares_in_whole_microbatches():
    """pp=2 inside each of two hosts of speeds 4 and 1 (a host one replica's pipeline, 4
    microbatches): the batch split 16 / 4 between the replicas (the even split's 20, cut in
    microbatches of the replica's, so each share a multiple of 4), priced at the slow
    replica's pace: its 4 samples at speed 1 against the even 10 at speed 1, 0.4 of the even
    split's pipeline; the shares win. The equivalence of such a split is
    tests/runtime/test_mesh_shares.py's."""
    fast_slow = Cluster([Host("a", 2, speed=4.0), Host("b", 2, speed=1.0)])
    choice = auto(gpt(), ParallelConfig(plan="auto", pp=2, microbatches=4, batch_shares="auto"),
                  fast_slow, tokens(batch=5), RATE,
                  space=Space(zero=(0,), recompute=("none",), offload=()))
    assert choice.chosen.config.pp == 2 and choice.chosen.config.batch_shares == [16, 4]
    assert choice.chosen.parts["plan"].rank_shares() == (16, 16, 4, 4)
    even = next(c for c in choice.candidates if c.config.batch_shares is None)
    assert choice.chosen.parts["pace"] == pytest.approx(0.4)
    assert choice.chosen.step_s < even.step_s


def test_equal_hosts_get_no_share_candidates_and_nor_does_a_loop_that_feeds_even_batches():
    """Shares change what each rank must feed: without batch_shares="auto" (the loop reads its
    count from tilework.batch_shares) the search keeps the even split, however the hosts
    differ."""
    choice = auto(gpt(), ParallelConfig(plan="auto", batch_shares="auto"),
                  Cluster([Host("a", 2)]), tokens(), RATE)
    assert all(c.config.batch_shares is None for c in choice.candidates)
    fast_slow = Cluster([Host("a", 1, speed=4.0), Host("b", 1, speed=1.0)])
    choice = auto(gpt(), ParallelConfig(plan="auto"), fast_slow, tokens(batch=5), RATE)
    assert all(c.config.batch_shares is None for c in choice.candidates)
    with pytest.raises(tilework.UserError, match="batch_shares.*needs plan='auto'"):
        ParallelConfig(batch_shares="auto")


def test_sync_auto_goes_local_only_where_the_wire_outweighs_the_extra_steps():
    """sync="auto": a slow link between hosts makes local SGD's step far shorter than twice
    less than the synchronous one (it pays the all-reduce once in H steps), so the search
    takes it over hosts; on fast links the synchronous step wins, as it must (local SGD needs
    about twice the steps to a loss)."""
    model, inputs = gpt(layers=2, dim=128, vocab=2000), tokens(batch=8)
    config = ParallelConfig(plan="auto", sync="auto", outer_worker="host",
                            outer_compress="int4")
    fast = auto(model, config, Cluster([Host("a", 2), Host("b", 2)],
                                       links=Links(inter=Link(100.0, 5.0))), inputs, RATE)
    assert fast.chosen.config.sync == "every_step", fast.why()
    slow = auto(model, config, Cluster([Host("a", 2), Host("b", 2)],
                                       links=Links(inter=Link(0.1, 500.0))), inputs, RATE)
    chosen = slow.chosen.config
    assert (chosen.sync, chosen.sync_every, chosen.outer_compress) == ("diloco", 40, "int4")
    assert "local SGD every 40 steps in int4" in slow.why()
    synchronous = next(c for c in slow.candidates if c.config.sync == "every_step"
                       and c.step_s is not None)
    assert slow.chosen.step_s * 2 < synchronous.step_s
    # DreamDDP's layer-wise schedule is offered beside it: the same bytes, each group's sync
    # beside an inner step, which the estimate credits, so it is taken on this link.
    assert chosen.outer_schedule == "layerwise" and "layer-wise" in slow.why()
    plain = next(c for c in slow.candidates if c.config.sync == "diloco"
                 and c.config.outer_schedule == "streaming"
                 and (c.config.zero, c.config.recompute) == (chosen.zero, chosen.recompute))
    assert slow.chosen.step_s < plain.step_s
    streamed = auto(model, dataclasses.replace(config, outer_fragments=2, sync_every=40), Cluster(
        [Host("a", 2), Host("b", 2)], links=Links(inter=Link(0.1, 500.0))), inputs, RATE)
    assert all(c.config.outer_schedule == "streaming" for c in streamed.candidates)
    with pytest.raises(tilework.errors.ConfigError, match="sync: expected 'auto' with plan"):
        ParallelConfig(sync="auto")


def test_a_search_keeps_the_users_grad_compress_and_skips_what_refuses_it():
    """grad_compress is built for plain data parallelism: the search's ZeRO candidates are
    not candidates then (they used to stop the search with the config's refusal)."""
    model, inputs = gpt(layers=2), tokens()
    found = auto(model, ParallelConfig(plan="auto", grad_compress="bf16"),
                 Cluster([Host("a", 2), Host("b", 2)]), inputs, RATE)
    assert all(c.config.zero == 0 and c.config.grad_compress == "bf16"
               for c in found.candidates)
    assert "grad_compress" in __import__("tilework.planner.search", fromlist=["x"]).options_of(
        found.chosen.config)


def test_grad_compress_auto_compresses_more_as_the_link_gets_slower_and_not_on_a_fast_one():
    """No compression on a fast link; bf16 buckets where the wire is half the step; PowerSGD's
    factors (30x fewer bytes here, weighed at twice the steps to a loss) where it is most."""
    model, inputs = gpt(layers=2, dim=128, vocab=2000), tokens(batch=8)
    config = ParallelConfig(plan="auto", grad_compress="auto")

    def chosen(gbit, latency_us):
        return auto(model, config, Cluster([Host("a", 2), Host("b", 2)],
                                           links=Links(inter=Link(gbit, latency_us))),
                    inputs, RATE)

    fast = chosen(100.0, 5.0)
    assert fast.chosen.config.grad_compress == "none", fast.why()
    assert {c.config.grad_compress for c in fast.candidates} == \
        {"none", "bf16", "powersgd", "topk"}
    middling = chosen(0.5, 100.0)
    assert middling.chosen.config.grad_compress == "bf16", middling.why()
    assert "bf16 buckets" in middling.why()
    slow = chosen(0.1, 500.0)
    assert slow.chosen.config.grad_compress == "powersgd", slow.why()
    assert "PowerSGD rank 1 (weighed at x2 steps to a loss)" in slow.why()
    assert options_of(slow.chosen.config)["powersgd_start"] == 1000
    with pytest.raises(tilework.errors.ConfigError, match="grad_compress: expected 'auto' with"):
        ParallelConfig(grad_compress="auto")


def _shares_live(rank, world_size, quota_paths):
    import os

    with open(f"{quota_paths[rank]}/cgroup.procs", "w") as f:
        f.write(str(os.getpid()))
    os.environ["GROUP_RANK"] = str(rank)   # each rank a host of its own, as torchrun says
    model = _model()
    batch = _batches()[0][:4]
    tilework.parallelize(model, torch.optim.SGD(model.parameters(), lr=0.1), plan="auto",
                         batch_shares="auto", example_inputs=(batch[:, :-1], batch[:, 1:]),
                         log=False)
    return tilework.batch_shares(model)


def test_a_live_plan_auto_measures_the_hosts_speeds_and_gives_the_slow_one_less():
    """No cluster file: plan='auto' with batch_shares='auto' times every host (a matmul rate,
    each rank at once) and the search prices shares by speed. Two ranks as two hosts, one in a
    quarter-core CPU cgroup: it is given the smaller share of the global batch of 8. Root
    only."""
    from tilework.testing import spawn_on_cpu_quotas

    shares = spawn_on_cpu_quotas(_shares_live, [1.0, 0.25], timeout=120)
    assert shares[0] == shares[1]
    assert sum(shares[0]) == 8 and shares[0][0] > shares[0][1] >= 1, shares[0]
