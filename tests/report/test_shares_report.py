"""`tilework plan` on a cluster whose hosts differ in speed: the batch shares it chooses (the
ones `tilework train` runs: train/planning.job_config), and the compute pace against the even
split and the additive ideal."""

from __future__ import annotations

from tilework.cli import main
from tilework.cluster.topology import Cluster, Host
from tilework.config.parallel import ParallelConfig
from tilework.report.job import report
from tilework.train.job import DataJob, GPTJob, Job

CLUSTER = """
[[hosts]]
name = "fast"
speed = 4.0
[[hosts]]
name = "slow"
speed = 1.0
"""


def gpt_job(**parallel) -> Job:
    return Job(workload="gpt", gpt=GPTJob(vocab=64, dim=16, heads=4, layers=2, seq_len=8),
               data=DataJob(batch_size=10), parallel=ParallelConfig(**parallel))


def test_the_report_gives_the_shares_and_the_pace_against_the_ideal():
    cluster = Cluster([Host("fast", 1, speed=4.0), Host("slow", 1, speed=1.0)])
    out = report(gpt_job(), cluster)
    assert out["plan"]["batch_shares"] == [8, 2]
    shares = out["shares"]
    assert shares["speeds"] == [4.0, 1.0] and shares["batch_shares"] == [8, 2]
    assert shares["pace"] == shares["ideal_pace"] == 2 / 5 and shares["even_pace"] == 1.0
    # A share the user gives is kept, and priced.
    given = report(gpt_job(batch_shares=[5, 5]), cluster)["shares"]
    assert given["batch_shares"] == [5, 5] and given["pace"] == 1.0


def test_equal_hosts_report_no_shares():
    assert "shares" not in report(gpt_job(), Cluster([Host("a", 1), Host("b", 1)]))


def test_cli_prints_the_shares(tmp_path, capsys):
    (tmp_path / "c.toml").write_text(CLUSTER)
    (tmp_path / "j.toml").write_text('workload = "gpt"\n[gpt]\nvocab = 64\ndim = 16\nheads = 4'
                                     '\nlayers = 2\nseq_len = 8\n[data]\nbatch_size = 10\n')
    assert main(["plan", "--job", str(tmp_path / "j.toml"), "--cluster",
                 str(tmp_path / "c.toml")]) == 0
    text = capsys.readouterr().out
    assert "batch shares: rank 0: 8 at speed 4, rank 1: 2 at speed 1" in text
    assert "100% of the ideal" in text


def test_a_host_with_less_memory_gets_a_share_that_fits():
    """Equal speeds, but host b's budget holds fewer samples than the even split gives it:
    `tilework plan` (and so `tilework train`) gives b what fits and a the rest, and every
    rank's estimated peak is within its budget, where b's was over it under the even split."""
    from tilework.estimate.memory import estimate_per_rank
    from tilework.estimate.plan_memory import share_caps, with_batch
    from tilework.train.planning import example_batch, job_plan, meta_model

    job = gpt_job()
    roomy = Cluster([Host("a", 1), Host("b", 1)])
    even = job_plan(job, roomy)
    model, inputs = meta_model(job), example_batch(job, roomy)
    assert share_caps(model, even, inputs, [None, None], 10) == [None, None]
    # A budget that holds 3 samples a step (the even split gives 5).
    peak = [estimate_per_rank(model, even, with_batch(inputs, n), "adam", [1])[0].peak
            for n in (3, 4)]
    budget = (peak[0] + peak[1]) / 2
    tight = Cluster([Host("a", 1, memory_gb=64.0), Host("b", 1, memory_gb=budget / 0.8 / 1e9)])
    out = report(job, tight)
    assert out["plan"]["batch_shares"] == [7, 3]
    assert not any(m["over_budget"] for m in out["memory"])
    assert report(gpt_job(batch_shares=[5, 5]), tight)["memory"][1]["over_budget"]


def test_a_host_with_less_memory_serves_fewer_rows():
    """Hosts that differ in memory serve a server table's rows in proportion to it (the job
    giving no server_weights of its own): the plan maps the table's partitions 11 to 5 over
    memories 2:1, and the memory estimate holds each rank's own rows."""
    from tilework.train.planning import job_plan

    job = Job(workload="lm")
    cluster = Cluster([Host("a", 1, memory_gb=32.0), Host("b", 1, memory_gb=16.0)])
    (table,) = job_plan(job, cluster).of("ps")
    assert table.partitions == 16 and table.servers.count(0) == 11
    params = [m["parameters"] for m in report(job, cluster)["memory"]]
    row_bytes = table.shape[1] * 4
    rows = [len([r for r in range(table.shape[0]) if table.servers[r % 16] == k])
            for k in (0, 1)]   # hashed rows: row r in partition r % 16
    assert params[0] - params[1] == (rows[0] - rows[1]) * row_bytes
    # Equal memories, or a job's own weights, are left as they are.
    even = Cluster([Host("a", 1, memory_gb=16.0), Host("b", 1, memory_gb=16.0)])
    assert not job_plan(job, even).of("ps")[0].servers
    own = job_plan(Job(workload="lm", parallel=ParallelConfig(server_weights=[1, 1])), cluster)
    assert not own.of("ps")[0].servers


def test_a_host_with_less_memory_keeps_fewer_zero_chunks():
    """Hosts that differ in memory keep ZeRO's chunks (over the world) in proportion to it
    (the job giving no zero_weights of its own), and the report's memory follows: the smaller
    host's shards and optimizer state are a third of the model's, the larger's two thirds."""
    from tilework.train.planning import job_config, job_plan

    job = Job(workload="gpt", parallel=ParallelConfig(zero=3))
    cluster = Cluster([Host("a", 1, memory_gb=32.0), Host("b", 1, memory_gb=16.0)])
    assert job_config(job, cluster).zero_weights == [32.0, 16.0]
    plan = job_plan(job, cluster)
    big = max(plan.params, key=lambda p: p.numel)
    assert big.zero_chunks == (-(-2 * big.numel // 3), big.numel // 3)
    state = [m["optimizer_state"] for m in report(job, cluster)["memory"]]
    assert 1.9 < state[0] / state[1] < 2.1
    # Equal memories, a job's own weights, or ZeRO inside each host are left as they are.
    even = Cluster([Host("a", 1, memory_gb=16.0), Host("b", 1, memory_gb=16.0)])
    assert job_config(job, even).zero_weights is None
    own = Job(workload="gpt", parallel=ParallelConfig(zero=3, zero_weights=[1, 1]))
    assert not any(p.zero_chunks for p in job_plan(own, cluster).params)
    host = Job(workload="gpt", parallel=ParallelConfig(zero=3, zero_scope="host"))
    assert job_config(host, cluster).zero_weights is None


def test_a_homogeneous_cluster_runs_the_plan_it_ran_before_speeds_and_memories_existed():
    """Issue 27's paired homogeneous check, on the plan side: hosts that give equal `speed`
    and `memory_gb` get exactly the plan, the configuration and the predicted step of hosts
    that give neither (no shares, no uneven serving), for every workload."""
    from tilework.estimate.plan_cost import estimate
    from tilework.train.planning import job_config, job_plan

    plain = Cluster([Host("a", 2), Host("b", 2)])
    even = Cluster([Host("a", 2, memory_gb=16.0, speed=1.0),
                    Host("b", 2, memory_gb=16.0, speed=1.0)])
    for workload in ("gpt", "lm", "cnn", "recommender"):
        job = Job(workload=workload)
        assert job_config(job, even) == job_config(job, plain), workload
        made = job_plan(job, even)
        assert made == job_plan(job, plain), workload
        assert made.batch_shares is None and not any(p.servers for p in made.params)
        assert estimate(made, even).comm_s == estimate(job_plan(job, plain), plain).comm_s
