"""One planning path: the plan `tilework train` runs is the plan `tilework plan` prints for the
same job and cluster file (issue 11), and `tilework.plan` is pure (meta device, no group)."""

import json
import socket
import subprocess
import sys
import textwrap

import torch

import tilework
from tilework.cluster.topology import Cluster
from tilework.config.parallel import ParallelConfig
from tilework.train.job import Job
from tilework.train.planning import meta_model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_plan_a_job_runs_is_the_plan_tilework_plan_prints(tmp_path):
    """Two hosts on loopback; a slow inter-host link, so the cost search splits the tables: the
    big one on the servers, the tiny ones all-reduced."""
    (tmp_path / "cluster.toml").write_text(textwrap.dedent(f"""
        rendezvous = "a:{_free_port()}"
        [[hosts]]
        name = "a"
        address = "127.0.0.1"
        [[hosts]]
        name = "b"
        address = "127.0.0.1"
        [links.inter]
        bandwidth_gbps = 1.0
        latency_us = 50.0
    """))
    (tmp_path / "job.toml").write_text(textwrap.dedent(f"""
        workload = "recommender"
        [recommender]
        samples = 512
        table_sizes = [20000, 40, 7]
        embed_dim = 8
        [data]
        batch_size = 64
        [train]
        steps = 2
        out_dir = "{tmp_path / 'out'}"
    """))
    cmd = [sys.executable, "-m", "tilework", "train", str(tmp_path / "job.toml"), "--hosts",
           str(tmp_path / "cluster.toml"), "--run-id", "one-plan"]
    procs = [subprocess.Popen([*cmd, "--host", h], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for h in ("a", "b")]
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    ran = json.loads((tmp_path / "out" / "plan.json").read_text())
    printed = subprocess.run([sys.executable, "-m", "tilework", "plan", "--job",
                              str(tmp_path / "job.toml"), "--cluster",
                              str(tmp_path / "cluster.toml"), "--json"],
                             capture_output=True, text=True, timeout=120)
    assert printed.returncode == 0, printed.stderr
    assert json.loads(printed.stdout)["plan"] == ran
    methods = {p["name"]: p["method"] for p in ran["params"]}
    assert methods["tables.0.weight"] == "ps" and methods["tables.2.weight"] == "allreduce"


def test_plan_is_pure_on_an_lm1b_sized_model():
    """Planning an LM1B-sized model touches no weights (the model stays on the meta device,
    nothing of its size is allocated) and no process group."""
    import tracemalloc

    job = Job.load("docs/examples/lm1b.toml")
    model = meta_model(job)
    cluster = Cluster.load("docs/examples/parallax-testbed.toml")
    tracemalloc.start()
    plan = tilework.plan(model, job.parallel, cluster)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert all(p.is_meta for p in model.parameters())
    assert peak < weights / 100, (peak, weights)   # counted, not timed
    assert plan.world_size == cluster.world_size
    assert not torch.distributed.is_initialized()
    assert {p.method for p in plan.params} == {"ps", "allreduce"}


def test_parallelize_takes_a_config_or_its_fields_not_both():
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        tilework.parallelize(model, opt, ParallelConfig(), mode="ps", log=False)
    except tilework.UserError as e:
        assert "not both" in str(e)
    else:
        raise AssertionError("config and keywords together were accepted")
    try:
        tilework.parallelize(model, opt, mdoe="ps", log=False)
    except tilework.UserError as e:
        assert "unknown option 'mdoe'" in str(e)
    else:
        raise AssertionError("a misspelt option was accepted")
