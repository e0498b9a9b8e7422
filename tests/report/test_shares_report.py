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
