"""Cluster and job files: parsed into typed objects; every mistake named by file and key."""

import pytest

from tilework.cluster.topology import Cluster, Topology
from tilework.errors import ConfigError
from tilework.train.job import Job

GOOD = """
rendezvous = "node0:29400"
[[hosts]]
name = "node0"
address = "192.0.2.1"
procs = 2
[[hosts]]
name = "node1"
procs = 3
[links.inter]
bandwidth_gbps = 100.0
latency_us = 2.0
"""


def write(tmp_path, text, name="cluster.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_cluster_file_parses(tmp_path):
    c = Cluster.load(write(tmp_path, GOOD))
    assert [h.name for h in c.hosts] == ["node0", "node1"]
    assert c.world_size == 5
    assert c.rendezvous_endpoint == "192.0.2.1:29400"  # the host's address, not its name
    assert c.links.inter.bytes_per_s == 100e9 / 8
    assert c.links.intra.bandwidth_gbps == 100.0  # default
    assert c.topology().hosts == ((0, 1), (2, 3, 4))


@pytest.mark.parametrize("text, where, expected", [
    (GOOD.replace('procs = 3', 'procz = 3'), "hosts[1].procz", "unknown key"),
    (GOOD.replace('procs = 3', 'procs = "3"'), "hosts[1].procs", "expected an integer"),
    (GOOD.replace('procs = 3', 'procs = 0'), "hosts[1].procs", "at least 1 process"),
    (GOOD.replace('name = "node1"', 'name = "node0"'), "hosts[1].name", "duplicate host"),
    (GOOD.replace('"node0:29400"', '"node0"'), "rendezvous", "'host:port'"),
    (GOOD.replace('"node0:29400"', '"node7:29400"'), "rendezvous", "one of the hosts"),
    (GOOD.replace('latency_us = 2.0', 'latency_us = -1.0'), "links.inter.latency_us", ">= 0"),
    (GOOD.replace('[links.inter]', '[links.outer]'), "links.outer", "unknown key"),
    ("[[hosts]]\nprocs = 1\n", "hosts[0].name", "missing"),
    ("hosts = []\n", "hosts", "at least one"),
    ("hosts = [\n", "", "not valid TOML"),
    # found by tests/config/test_fuzz_inputs.py
    (GOOD.replace('latency_us = 2.0', 'latency_us = inf'), "links.inter.latency_us",
     "expected a finite number, got inf"),
    (GOOD.replace('bandwidth_gbps = 100.0', 'bandwidth_gbps = nan'), "links.inter.bandwidth_gbps",
     "expected a finite number, got nan"),
    (GOOD.replace('procs = 3', 'procs = 9223372036854775808'), "hosts[1].procs", "64-bit integer"),
    (GOOD.replace('procs = 3', 'procs = 4096'), "hosts[1].procs", "at most 1024"),
    (GOOD.replace('procs = 3', 'procs = ' + '9' * 5000), "", "not valid TOML"),
    (GOOD.replace('"node0:29400"', '"node0:\u00b2"'), "rendezvous", "'host:port'"),
    (GOOD.replace('procs = 3', '"procs\\n" = 3'), "hosts[1].procs\\n", "unknown key"),
    ("hosts = " + "[" * 10_000 + "]" * 10_000, "", "nested too deep"),
])
def test_bad_cluster_files_name_file_and_key(tmp_path, text, where, expected):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        Cluster.load(path)
    message = str(e.value)
    assert message.startswith(str(path)), message
    assert where in message and expected in message, message
    assert "\n" not in message


def test_missing_cluster_file(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        Cluster.load(tmp_path / "nope.toml")


@pytest.mark.parametrize("text, where", [
    ('workload = "gan"\n', "workload"),
    ('[train]\nsteps = 0\n', "train.steps"),
    ('[train]\nstpes = 10\n', "train.stpes"),
    ('[lm]\nvocab = 1.5\n', "lm.vocab"),
    ('[parallel]\nmode = "magic"\n', "parallel.mode"),
    ('[recommender]\ntable_sizes = []\n', "recommender.table_sizes"),
    ('[data]\nscaling = true\n', "data.scaling"),
    ('[train]\nlr = inf\n', "train.lr"),
    ('[parallel]\nbucket_mb = -inf\n', "parallel.bucket_mb"),
    ('[parallel]\nrecompute = "sometimes"\n', "parallel.recompute"),
    ('[parallel.recompute]\n"blocks.*" = "half"\n', "parallel.recompute"),
    ('[lm]\nzipf_alpha = nan\n', "lm.zipf_alpha"),
    ('[lm]\nvocab = 9223372036854775808\n', "lm.vocab"),
])
def test_bad_job_files(tmp_path, text, where):
    path = write(tmp_path, text, "job.toml")
    with pytest.raises(ConfigError) as e:
        Job.load(path)
    assert f"{path}: {where}" in str(e.value), str(e.value)


def test_non_finite_numbers_are_refused_by_name(tmp_path):
    """TOML has inf and nan; `bucket_mb = inf` used to crash the planner (int(inf)) later."""
    path = write(tmp_path, "[parallel]\nbucket_mb = inf\n", "job.toml")
    with pytest.raises(ConfigError) as e:
        Job.load(path)
    assert str(e.value) == f"{path}: parallel.bucket_mb: expected a finite number, got inf"


def test_job_defaults_and_fingerprint(tmp_path):
    job = Job.load(write(tmp_path, 'workload = "cnn"\n[cnn]\nwidth = 8\n', "job.toml"))
    assert job.cnn.width == 8 and job.train.steps == 200
    assert job.fingerprint()["cnn.width"] == 8


def test_topology_is_pure():
    t = Topology.from_sizes([2, 2, 1])
    assert t.hosts == ((0, 1), (2, 3), (4,))
    assert t.inter_host_groups() == [(0, 2, 4), (1, 3)]
    assert [t.host_of(r) for r in range(5)] == [0, 0, 1, 1, 2]
    assert t.local_rank(3) == 1
    assert Topology.from_host_ids(["a", "a", "b", "b"]) == Topology.uniform(2, 2)
    big = Topology.uniform(1000, 8)
    assert big.world_size == 8000 and len(big.inter_host_groups()) == 8
