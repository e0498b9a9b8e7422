"""WorkerEnv: the environment read once, checked, and passed down; workers start through
tilework.launch.worker with a serialized spec, not by re-running the CLI."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tilework import cli
from tilework.cluster.worker_env import DEFAULT_TIMEOUT_S, EnvError, WorkerEnv
from tilework.errors import UserError
from tilework.launch import launcher as launch
from tilework.launch import worker
from tilework.train.job import Job

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
            "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_ERROR_FILE": "/tmp/err.json"}


def test_a_process_started_by_hand_is_one_rank_of_one():
    env = WorkerEnv.from_environ({"PATH": "/bin"})
    assert env == WorkerEnv()
    assert not env.launched and (env.rank, env.world_size, env.local_rank) == (0, 1, 0)
    assert env.collective_timeout_s == DEFAULT_TIMEOUT_S


def test_torchruns_variables_are_read():
    env = WorkerEnv.from_environ({**TORCHRUN, "TILEWORK_TIMEOUT_S": "12.5",
                                  "XDG_CACHE_HOME": "/cache"})
    assert env.launched
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 4, 1, 2)
    assert (env.group_rank, env.master_addr, env.master_port) == (1, "10.0.0.1", 29500)
    assert (env.restart_count, env.error_file) == (2, "/tmp/err.json")
    assert env.collective_timeout_s == 12.5
    assert env.cache_dir == Path("/cache/tilework")


def test_local_world_size_defaults_to_the_world():
    env = WorkerEnv.from_environ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"})
    assert env.local_world_size == 2


@pytest.mark.parametrize("name, value, expected", [
    ("RANK", "x", "RANK: expected an integer >= 0, got 'x'"),
    ("RANK", "-1", "RANK: expected an integer >= 0"),
    ("RANK", "4", "RANK: expected less than WORLD_SIZE (4), got '4'"),
    ("WORLD_SIZE", "0", "WORLD_SIZE: expected an integer >= 1, got '0'"),
    ("LOCAL_RANK", "2", "LOCAL_RANK: expected less than LOCAL_WORLD_SIZE (2), got '2'"),
    ("LOCAL_WORLD_SIZE", "two", "LOCAL_WORLD_SIZE: expected an integer >= 1"),
    ("GROUP_RANK", "node-a", "GROUP_RANK: expected an integer >= 0, got 'node-a'"),
    ("MASTER_PORT", "70000", "MASTER_PORT: expected a port number (1 to 65535)"),
    ("TILEWORK_TIMEOUT_S", "0", "TILEWORK_TIMEOUT_S: expected a positive number of seconds"),
    ("TILEWORK_TIMEOUT_S", "nan", "TILEWORK_TIMEOUT_S: expected a positive number"),
    ("TILEWORK_TIMEOUT_S", "inf", "TILEWORK_TIMEOUT_S: expected a positive number"),
    ("TORCHELASTIC_RESTART_COUNT", "1.5", "TORCHELASTIC_RESTART_COUNT: expected an integer"),
    ("RANK", "1\n2", "RANK: expected an integer >= 0, got '1\\n2'"),
])
def test_a_bad_value_is_one_line_naming_the_variable(name, value, expected):
    with pytest.raises(EnvError) as e:
        WorkerEnv.from_environ({**TORCHRUN, name: value})
    assert isinstance(e.value, UserError)
    assert str(e.value).startswith(f"environment variable {expected}")
    assert "\n" not in str(e.value)


def test_a_childs_environment_reads_back_as_the_same_rank():
    env = WorkerEnv.from_environ({**TORCHRUN, "TILEWORK_TIMEOUT_S": "7", "XDG_CACHE_HOME": "/c"})
    assert WorkerEnv.from_environ(env.to_environ()) == env
    child = WorkerEnv(launched=True, rank=1, world_size=2, local_rank=1, local_world_size=2,
                      master_addr="127.0.0.1", master_port=1234)
    assert WorkerEnv.from_environ(child.to_environ()) == child
    assert child.to_environ() == {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                                  "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                  "MASTER_PORT": "1234", "TORCHELASTIC_RESTART_COUNT": "0"}


def test_the_cli_reports_a_bad_environment_in_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "tilework", "train", "job.toml"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "RANK": "0", "WORLD_SIZE": "zero"})
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == ("tilework: error: environment variable WORLD_SIZE: expected an "
                                "integer >= 1, got 'zero'")


# -- workers start through tilework.launch.worker --------------------------------------------------

def test_train_launches_tilework_worker_with_the_checked_job(tmp_path, monkeypatch):
    job_file = Path(__file__).parents[2] / "docs" / "examples" / "demo-job.toml"
    started = []
    monkeypatch.setattr(launch, "run", lambda spec, args, verbose=False: started.append(args) or 0)
    assert cli.main(["train", str(job_file), "-n", "2", "--resume"]) == 0
    (args,) = started
    assert args[:3] == ["-m", "tilework.launch.worker", "train"] and len(args) == 4
    spec = json.loads(args[3])
    assert spec["resume"] is True and spec["cluster"] is None
    job, want = worker._job(spec, WorkerEnv(cache_home=str(tmp_path))), Job.load(job_file)
    assert want.cache_dir is None and job.cache_dir == str(tmp_path / "tilework")  # XDG's
    job.cache_dir = None
    assert job == want


def test_demo_launches_its_changed_job(monkeypatch):
    started = []
    monkeypatch.setattr(launch, "run", lambda spec, args, verbose=False: started.append(args) or 0)
    assert cli.main(["demo", "-n", "2", "--steps", "3", "--out-dir", "elsewhere"]) == 0
    (args,) = started
    assert args[:3] == ["-m", "tilework.launch.worker", "demo"]
    job = worker._job(json.loads(args[3]), WorkerEnv())
    assert (job.train.steps, job.train.out_dir) == (3, "elsewhere")


# -- only the entry points read the environment --------------------------------------------------

ROOT = Path(__file__).parents[2] / "tilework"
# Modules that touch os.environ, and why: what the environment is read into, or what a child
# inherits from it.
ENVIRON_TOUCHED = {
    "cluster/worker_env.py": "WorkerEnv.from_environ: the one reader",
    "launch/launcher.py": "the launcher sets what its workers inherit "
                          "(OMP_NUM_THREADS, the timeout, torch's C++ log level)",
    "bench/suite.py": "the benchmark composes its workers' environments",
    "testing.py": "a test child sets its own RANK, as a launcher would",
}
# Where WorkerEnv.from_environ() is called: the entry points, each once.
READERS = {
    ("cli.py", "main"), ("launch/worker.py", "main"), ("launch/script.py", "main"),
    ("cluster/calibrate.py", "main"),
    ("bench/worker.py", "main"), ("bench/comm_prediction.py", "main"),
    # A user's script calls these bare: they are its entry points into tilework. tilework's
    # own callers pass the WorkerEnv they read.
    ("api.py", "parallelize"), ("api.py", "plan"), ("api.py", "estimate_memory"),
    ("comm/groups.py", "init_from_env"),
    ("comm/groups.py", "build_groups"),
}


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text())


def test_only_the_listed_modules_touch_os_environ():
    touched = set()
    for name, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv"):
                touched.add(name)
            if isinstance(node, ast.ImportFrom) and node.module == "os" and \
                    any(a.name in ("environ", "getenv") for a in node.names):
                touched.add(name)
    assert touched == set(ENVIRON_TOUCHED)


def test_from_environ_is_called_only_by_entry_points():
    calls = set()
    for name, tree in _modules():
        for func in ast.walk(tree):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(func):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                        node.func.attr == "from_environ":
                    calls.add((name, func.name))
    assert calls == READERS
