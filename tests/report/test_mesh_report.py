"""`tilework plan` for a tp/pp/cp job (tilework/report/job.py, printed by report/tables.py): the
mesh and its groups, the stages as split_stages cuts them, the schedule's own printout, the
simulator's step and bubble, and every rank's bytes per axis equal to mesh_step_bytes. Pure: no
process group."""

from __future__ import annotations

import json

import pytest
import torch

from tilework.cli import main
from tilework.cluster.topology import Cluster, Host, Link, Links
from tilework.config.parallel import ParallelConfig
from tilework.errors import PlanError
from tilework.estimate.step_bytes import mesh_step_bytes
from tilework.parallel.pipeline import build, simulate, split_stages
from tilework.report.job import report
from tilework.report.tables import format_report
from tilework.train.job import DataJob, GPTJob, Job
from tilework.train.planning import meta_model

FLOPS = 10e9
JOB_TOML = """workload = "gpt"
[gpt]
vocab = 64
dim = 16
heads = 4
layers = 4
seq_len = 8
[data]
batch_size = 8
[parallel]
tp = 2
pp = 2
microbatches = 4
"""


def gpt_job(batch=8, **parallel) -> Job:
    return Job(workload="gpt", gpt=GPTJob(vocab=64, dim=16, heads=4, layers=4, seq_len=8),
               data=DataJob(batch_size=batch), parallel=ParallelConfig(**parallel))


def test_pp2_x_tp2_report_holds_the_mesh_stages_schedule_and_bytes():
    job = gpt_job(tp=2, pp=2, microbatches=4)
    out = report(job, Cluster.local(4), FLOPS)
    assert out["mesh"]["axes"] == {"dp": 1, "pp": 2, "cp": 1, "tp": 2}
    assert out["mesh"]["groups"]["tp"] == [(0, 1), (2, 3)]
    assert out["mesh"]["groups"]["pp"] == [(0, 2), (1, 3)]
    schedule = build("1f1b", 2, 4)
    assert out["schedule"]["text"] == schedule.format()
    stages = split_stages(meta_model(job), 2)
    assert [s["blocks"] for s in out["stages"]] == \
        [[s.index_range.start, s.index_range.stop] for s in stages]
    assert out["stages"][0]["holds"][:2] == ["tokens", "positions"]
    assert out["stages"][-1]["holds"][-2:] == ["norm", "head"]
    assert sum(s["cost_share"] for s in out["stages"]) == pytest.approx(1.0)
    model = meta_model(job)
    for b in out["bytes_per_rank"]:
        assert {k: v for k, v in b.items() if k != "rank"} == \
            mesh_step_bytes(model, job.parallel, 4, b["rank"], batch=8, seq=8)
    # The step is the simulator's on the stages' compute (no dp: nothing to all-reduce).
    sim = simulate(schedule, [s["forward_s"] for s in out["stages"]],
                   link=Cluster.local(4).links.intra, activation_bytes=2 * 8 * 16 * 4)
    assert (out["pipeline_step_s"], out["bubble"]) == (sim.step_s, sim.bubble)
    assert out["predicted_step_s"] == sim.step_s and out["dp_allreduce_s"] == 0.0
    json.dumps(out)   # --json prints it


def test_stage_compute_is_its_blocks_flops_over_tp():
    """2 FLOPs per matmul weight and bias per token, and causal attention (half the scores);
    the stage's time per microbatch adds its share of tp's exchanges (mesh_search.predict)."""
    job = gpt_job(tp=2, pp=2, microbatches=4)
    out = report(job, Cluster.local(4), FLOPS)
    dim, seq, micro = 16, 8, 2
    block = 2 * (3 * dim * dim + 3 * dim + dim * dim + dim + 2 * 4 * dim * dim + 4 * dim + dim
                 + 4 * dim) * micro * seq + 2 * micro * seq * seq * dim
    first = out["stages"][0]
    blocks = first["blocks"][1] - first["blocks"][0]
    assert first["forward_flops"] == pytest.approx(blocks * block / 2)
    assert first["forward_s"] > first["forward_flops"] / FLOPS          # tp's exchanges
    assert out["tp_s"] > 0


def test_printed_report_shows_groups_stages_schedule_and_bytes():
    job = gpt_job(tp=2, pp=2, microbatches=4)
    out = report(job, Cluster.local(4), FLOPS)
    text = format_report(out, "job.toml on 4 ranks")
    assert "mesh dp=1 x pp=2 x cp=1 x tp=2" in text
    assert "tp groups: (0, 1) (2, 3)" in text and "pp groups: (0, 2) (1, 3)" in text
    assert "dp groups: none (size 1)" in text
    first = out["stages"][0]
    assert f"stage 0 on pp rank 0: tokens, positions, blocks 0-{first['blocks'][1] - 1}" in text
    assert build("1f1b", 2, 4).format().splitlines()[-1] in text
    assert f"bubble {out['bubble']:.3f}" in text
    assert "ranks 0, 1: tp " in text and "ranks 2, 3: tp " in text


def test_dp_across_hosts_times_the_all_reduce_on_the_inter_host_link():
    links = Links(intra=Link(100.0, 5.0), inter=Link(1.0, 100.0))
    cluster = Cluster(hosts=[Host("a", 2), Host("b", 2)], links=links)
    out = report(gpt_job(tp=2), cluster, FLOPS)
    assert out["mesh"]["groups"]["tp"] == [(0, 1), (2, 3)]      # tp inside each host
    assert out["mesh"]["groups"]["dp"] == [(0, 2), (1, 3)]
    sent = out["bytes_per_rank"][0]["allreduce"]
    assert out["dp_allreduce_s"] == pytest.approx(sent / links.inter.bytes_per_s
                                                  + 2 * links.inter.latency_s)
    assert out["stages"][0]["holds"] == ["tokens", "positions", "blocks 0-3", "norm", "head"]


def test_mesh_plan_refuses_what_cannot_run():
    with pytest.raises(PlanError, match="does not divide the world of 6"):
        report(gpt_job(tp=2, pp=2), Cluster.local(6), FLOPS)
    with pytest.raises(PlanError, match="do not split into 3 equal microbatches"):
        report(gpt_job(pp=2, microbatches=3), Cluster.local(2), FLOPS)
    with pytest.raises(PlanError, match="--gflops"):
        report(gpt_job(pp=2), Cluster.local(2))


def test_cli_prints_the_mesh_plan_and_its_json(tmp_path, capsys):
    path = tmp_path / "job.toml"
    path.write_text(JOB_TOML)
    args = ["plan", "--job", str(path), "--world-size", "4", "--gflops", "10"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "tp groups: (0, 1) (2, 3)" in text and "1f1b: pp=2 stages=2 m=4" in text
    assert main([*args, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    expected = json.loads(json.dumps(report(Job.load(path), Cluster.local(4), 10e9,
                                            "--gflops")))
    assert printed == expected
    assert main(["plan", "--job", str(path), "--world-size", "0"]) == 2
    assert "--world-size: expected at least 1 process per host, got 0" in capsys.readouterr().err


def test_memory_per_rank_is_the_estimate_with_its_budget():
    import torch

    from tilework.estimate.plan_memory import estimate_mesh_memory
    from tilework.train.planning import meta_model

    job = gpt_job(tp=2, pp=2, microbatches=4)
    cluster = Cluster([Host("a", 2, memory_gb=1e-5), Host("b", 2, memory_gb=1.0)])
    out = report(job, cluster, FLOPS)
    ids = torch.zeros(out["batch_per_replica"], job.gpt.seq_len, dtype=torch.long)
    for m in out["memory"]:
        e = estimate_mesh_memory(meta_model(job), job.parallel, (ids, ids), 4, m["rank"],
                                 job.train.optimizer, cluster)
        assert m["peak"] == e.peak and m["parameters"] == e.parameters
    # Host a's ranks (0, 1) get 80% of 10 kB: over; host b's fit.
    assert [m["over_budget"] for m in out["memory"]] == [True, True, False, False]
    assert out["memory"][2]["budget"] == pytest.approx(0.8e9)
    text = format_report(out, "job")
    assert "OVER its budget" in text and "estimated memory per rank" in text


def test_cli_search_ranks_the_meshes_and_prunes_what_does_not_fit(tmp_path, capsys):
    job = tmp_path / "job.toml"
    job.write_text('workload = "gpt"\n[gpt]\nvocab = 64\ndim = 16\nheads = 2\nlayers = 2\n'
                   'seq_len = 8\n[data]\nbatch_size = 8\n')
    cluster = tmp_path / "cluster.toml"
    cluster.write_text('[[hosts]]\nname = "a"\nprocs = 2\nmemory_gb = 1.0\n')
    assert main(["plan", "--job", str(job), "--cluster", str(cluster), "--search",
                 "--gflops", "10", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    labels = [c["mesh"] for c in out["candidates"]]
    assert set(labels) == {"dp2 x pp1 x cp1 x tp1", "dp1 x pp1 x cp1 x tp2",
                           "dp1 x pp1 x cp2 x tp1", "dp1 x pp2 x cp1 x tp1"}
    steps = [c["predicted_step_s"] for c in out["candidates"]]
    assert all(s is not None for s in steps) and steps == sorted(steps)
    assert main(["plan", "--job", str(job), "--world-size", "2", "--search",
                 "--gflops", "10"]) == 0
    assert "fastest first" in capsys.readouterr().out
    assert main(["plan", "--job", str(job), "--cluster", str(cluster), "--search",
                 "--gflops", "10", "--message-overhead-ms", "0.7", "--json"]) == 0
    charged = json.loads(capsys.readouterr().out)["candidates"]
    by_mesh = {c["mesh"]: c["predicted_step_s"] for c in out["candidates"]}
    assert all(c["predicted_step_s"] > by_mesh[c["mesh"]] for c in charged)


def test_the_report_and_the_estimate_cut_the_stages_as_the_plan_does():
    """stage_weights (and, without them, the hosts' speeds) cut the report's stages and the
    estimate of a made plan as the plan cuts them, not evenly: the blocks the report shows are
    the plan's, and estimate(plan) prices the step predict(config) prices."""
    from tilework.estimate.plan_cost import estimate
    from tilework.estimate.step import predict
    from tilework.train.planning import job_plan

    cluster = Cluster([Host("a", 1), Host("b", 1)])
    uneven = Cluster([Host("a", 1, speed=3.0), Host("b", 1, speed=1.0)])
    for job, where in ((gpt_job(pp=2, microbatches=4, stage_weights=[1, 3]), cluster),
                       (gpt_job(pp=2, microbatches=4), uneven)):
        plan = job_plan(job, where)
        cut = [list(blocks) for blocks in plan.parallel.stages]
        assert cut != [[0, 2], [2, 4]]   # not the even cut
        out = report(job, where, FLOPS)
        assert [s["blocks"] for s in out["stages"]] == cut
        model = meta_model(job)
        priced = predict(model, job.parallel, where, 8, 8, FLOPS)
        assert estimate(plan, where, model, (torch.zeros(8, 8, dtype=torch.long),) * 2,
                        flops=FLOPS).step_s == pytest.approx(priced.step_s)
