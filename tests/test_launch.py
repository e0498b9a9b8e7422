"""`tilework run`: real worker processes started by PyTorch's elastic launcher."""

import json
import subprocess
import sys
import textwrap

import pytest

from tilework.cluster import Cluster, Host
from tilework.errors import ConfigError, UserError
from tilework.launch import cluster_spec, local_spec

SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as dist
    from tilework.comm import build_groups, exit_worker, init_from_env
    groups = build_groups(init_from_env())
    t = torch.tensor([float(groups.rank + 1)])
    dist.all_reduce(t, group=groups.world)
    out = {"rank": groups.rank, "world": groups.world_size, "sum": t.item(),
           "local_rank": int(os.environ["LOCAL_RANK"]), "argv": sys.argv[1:]}
    open(os.path.join(sys.argv[1], f"rank{groups.rank}.json"), "w").write(json.dumps(out))
    exit_worker(3 if "--fail" in sys.argv and groups.rank == 1 else 0)
""")


def tilework(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "tilework", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_run_two_local_processes_all_reduce(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    r = tilework("run", "-n", "2", str(script), str(tmp_path), "--flag", "x")
    assert r.returncode == 0, r.stderr
    results = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    assert [x["sum"] for x in results] == [3.0, 3.0]
    assert [x["local_rank"] for x in results] == [0, 1]
    assert all(x["world"] == 2 and x["argv"] == [str(tmp_path), "--flag", "x"] for x in results)


def test_run_two_hosts_from_one_cluster_file(tmp_path):
    """Two "hosts" on loopback, each running the same command with its own --host."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "cluster.toml").write_text(textwrap.dedent(f"""
        rendezvous = "a:{port}"
        [[hosts]]
        name = "a"
        address = "127.0.0.1"
        procs = 1
        [[hosts]]
        name = "b"
        address = "127.0.0.1"
        procs = 2
    """))
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "tilework", "run", "--hosts", str(tmp_path / "cluster.toml"),
           "--run-id", "two-hosts"]
    procs = [subprocess.Popen([*cmd, "--host", h, str(script), str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for h in ("a", "b")]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    results = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(3)]
    assert [x["sum"] for x in results] == [6.0] * 3 and all(x["world"] == 3 for x in results)
    assert sorted(x["local_rank"] for x in results) == [0, 0, 1]


def test_run_names_the_failed_rank(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    r = tilework("run", "-n", "2", str(script), str(tmp_path), "--fail")
    assert r.returncode == 1
    assert r.stderr.strip() == "tilework run: rank 1 failed (exit code 3)"


@pytest.mark.parametrize("args, expected", [
    (["run", "-n", "0", "x.py"], "expected 1 to 1024 processes, got 0"),
    (["run", "-n", "99999999999999999999", "x.py"], "expected 1 to 1024 processes"),
    (["run", "-n", "2", "missing.py"], "missing.py: script not found"),
    (["run", "--hosts", "missing.toml", "x.py"], "file not found"),
    (["train", "nope.toml"], "nope.toml: file not found"),
    (["bogus"], "invalid choice"),
    (["demo", "--steps", "0"], "--steps: expected at least 1"),
    # found by tests/test_fuzz_inputs.py
    (["run", "-n", "2", "x" * 5000], "script not found"),  # not OSError: file name too long
    (["run", "--hosts", "", "x.py"], ".: not a file"),  # not local_spec(None)
    (["plan", "--job", "a\nb.toml", "--cluster", "c.toml"], "a\\nb.toml: file not found"),
])
def test_user_errors_are_one_line_exit_2(tmp_path, args, expected):
    (tmp_path / "x.py").write_text("")
    r = subprocess.run([sys.executable, "-m", "tilework", *args], capture_output=True, text=True,
                       cwd=tmp_path, timeout=60)
    assert r.returncode == 2, r.stderr
    assert expected in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_cluster_spec_for_each_host():
    cluster = Cluster(hosts=[Host("a", 2, "192.0.2.1"), Host("b", 4, "192.0.2.2")],
                      rendezvous="a:29400")
    a, b = cluster_spec(cluster, "a"), cluster_spec(cluster, "192.0.2.2")
    assert (a.nnodes, a.nproc_per_node, a.is_rendezvous_host) == (2, 2, True)
    assert (b.nnodes, b.nproc_per_node, b.is_rendezvous_host) == (2, 4, False)
    assert a.rdzv_endpoint == b.rdzv_endpoint == "192.0.2.1:29400"
    assert b.local_addr == "192.0.2.2"
    with pytest.raises(ConfigError, match="'c' is not in the cluster file"):
        cluster_spec(cluster, "c")
    with pytest.raises(UserError):
        local_spec(2, max_restarts=-1)
