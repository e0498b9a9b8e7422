"""`tilework run`: real worker processes started by PyTorch's elastic launcher."""

import json
import subprocess
import sys
import textwrap

import pytest

from tilework import cli
from tilework.cluster.topology import Cluster, Host
from tilework.errors import ConfigError, UserError
from tilework.launch.launcher import cluster_spec, local_spec

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
    # found by tests/config/test_fuzz_inputs.py
    (["run", "-n", "2", "x" * 5000], "script not found"),  # not OSError: file name too long
    (["run", "--hosts", "", "x.py"], ".: not a file"),  # not local_spec(None)
    (["plan", "--job", "a\nb.toml", "--cluster", "c.toml"], "a\\nb.toml: file not found"),
])
def test_user_errors_are_one_line_exit_2(tmp_path, monkeypatch, capsys, args, expected):
    # In this process (cli.main as `python -m tilework` calls it): a fresh interpreter per case
    # cost 3 s each; the entry point itself is run for real just below.
    (tmp_path / "x.py").write_text("")
    monkeypatch.chdir(tmp_path)
    try:
        code = cli.main(args)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert expected in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


def test_a_user_error_through_the_real_entry_point_is_one_line_exit_2(tmp_path):
    r = subprocess.run([sys.executable, "-m", "tilework", "run", "-n", "2", "missing.py"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == "tilework: error: missing.py: script not found", r.stderr


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


# -- scripts under `tilework run` fail as `tilework train`'s workers do (tilework/launch/script.py)

def _run_script(tmp_path, text, *args):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(text))
    return tilework("run", "-n", "2", str(script), *args)


def _lines_but_rank_0_stopped(stderr):
    """stderr's lines, less the one that says rank 0 was stopped: the launcher stops a rank still
    running when another fails, which a slow start of rank 0 can make happen."""
    return [line for line in stderr.splitlines() if line != "tilework run: rank 0 stopped with it"]


def test_a_script_that_raises_on_one_rank_is_one_traceback_and_one_line(tmp_path):
    r = _run_script(tmp_path, """
        import torch.distributed as dist
        dist.init_process_group("gloo")
        def fail():
            raise ValueError("boom on rank 1")
        if dist.get_rank() == 1:
            fail()
        dist.barrier()  # rank 0 loses its peer here: one line, no traceback
    """)
    assert r.returncode == 1, r.stderr
    lines = r.stderr.splitlines()
    assert "tilework run: rank 1 failed (exit code 1): ValueError: boom on rank 1" in lines, \
        r.stderr
    assert "tilework: error: rank 1: ValueError: boom on rank 1" in lines, r.stderr
    assert r.stderr.count("Traceback (most recent call last)") == 1, r.stderr
    # The traceback starts at the script, as python's would: no runner or runpy frames.
    first_frame = lines[lines.index("Traceback (most recent call last):") + 1]
    assert first_frame.startswith(f'  File "{tmp_path / "job.py"}", line 7'), r.stderr


def test_a_script_raising_a_user_error_is_one_line_without_traceback(tmp_path):
    r = _run_script(tmp_path, """
        import os
        from tilework.errors import ConfigError
        if os.environ["RANK"] == "1":
            raise ConfigError("job.toml", "lr: expected a number")
    """)
    assert r.returncode == 1, r.stderr
    assert _lines_but_rank_0_stopped(r.stderr) == [
        "tilework: error: rank 1: job.toml: lr: expected a number",
        "tilework run: rank 1 failed (exit code 2): job.toml: lr: expected a number"], r.stderr


def test_a_refusal_of_the_users_model_is_its_line_without_traceback(tmp_path):
    """tilework's refusals are UserErrors (PlanError, a ValueError too): a layout naming no
    module prints no traceback on any rank, only its line."""
    r = _run_script(tmp_path, """
        import torch, tilework
        from torch import nn
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        tilework.parallelize(model, opt, tp=2, layout={"nope": "colwise"})
    """)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert ("tilework run: ranks 0, 1 failed (exit code 2): layout pattern 'nope' matches no "
            "module of Sequential") in r.stderr.splitlines(), r.stderr


def test_a_scripts_sys_exit_passes_through_and_its_exit_handlers_run(tmp_path):
    r = _run_script(tmp_path, """
        import atexit, pathlib, sys, time
        import torch.distributed as dist
        dist.init_process_group("gloo")  # open at exit: the runner leaves as exit_worker does
        rank = dist.get_rank()
        atexit.register(lambda: pathlib.Path(sys.argv[1], f"atexit{rank}").touch())
        dist.barrier()
        if rank == 1:
            # After rank 0 has left: else the launcher may stop it before its exit handlers run.
            deadline = time.monotonic() + 60
            while not pathlib.Path(sys.argv[1], "atexit0").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            sys.exit(3)
    """, str(tmp_path))
    assert r.returncode == 1
    assert _lines_but_rank_0_stopped(r.stderr) == ["tilework run: rank 1 failed (exit code 3)"], \
        r.stderr
    assert (tmp_path / "atexit0").exists() and (tmp_path / "atexit1").exists()


def test_a_script_sees_name_argv_and_path_as_under_python(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "helper.py").write_text("VALUE = 42\n")  # importable: sys.path[0]
    (tmp_path / "sub" / "job.py").write_text(textwrap.dedent("""
        import json, os, sys
        import helper
        out = {"name": __name__, "argv": sys.argv, "path0": sys.path[0], "helper": helper.VALUE}
        open(f"seen-{os.environ.get('RANK', 'python')}.json", "w").write(json.dumps(out))
    """))
    args = ["sub/job.py", "a b", "--flag", "-n", "3"]
    plain = subprocess.run([sys.executable, *args], cwd=tmp_path, capture_output=True, text=True,
                           timeout=60)
    assert plain.returncode == 0, plain.stderr
    r = subprocess.run([sys.executable, "-m", "tilework", "run", "-n", "2", *args], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    want = json.loads((tmp_path / "seen-python.json").read_text())
    assert want["argv"] == args and want["name"] == "__main__" and want["helper"] == 42
    for rank in (0, 1):
        assert json.loads((tmp_path / f"seen-{rank}.json").read_text()) == want
