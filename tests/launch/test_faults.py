"""Faults in real runs: a rank killed mid-training, a writer killed mid-checkpoint.

Every run here is `python -m tilework train` in a subprocess with real workers under the elastic
launcher; ranks are killed with SIGKILL, as the kernel's OOM killer or a lost host would.
"""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import torch

from tilework.checkpoint import file as checkpoint
from tilework.launch.faults import LOST_PEER_EXIT, summarize

JOB = """
workload = "lm"
[lm]
corpus = "zipf"
vocab = 500
embed_dim = 16
hidden = 16
seq_len = 8
zipf_tokens = 20000
num_sampled = 32
[data]
batch_size = 16
[train]
steps = {steps}
lr = 0.01
log_every = 10
checkpoint_every = 10
out_dir = "{out}"
"""


def _job(tmp_path: Path, name: str, steps: int = 60) -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(JOB.format(steps=steps, out=tmp_path / name))
    return path


class Run:
    """`tilework train JOB -n 4` in the background; output to files, so a chatty run can never
    block on a full pipe while the test waits."""

    def __init__(self, job: Path, *flags: str):
        self.marker = uuid.uuid4().hex  # inherited by the workers: finds them among all processes
        self.out, self.err = job.with_suffix(".out"), job.with_suffix(".err")
        with self.out.open("w") as out, self.err.open("w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tilework", "train", str(job), "-n", "4", *flags],
                stdout=out, stderr=err, env={**os.environ, "TILEWORK_TEST_RUN": self.marker})

    def wait(self, timeout: float) -> tuple[int, str, str]:
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        return code, self.out.read_text(), self.err.read_text()


def _worker_pid(marker: str, rank: int) -> int | None:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"TILEWORK_TEST_RUN={marker}".encode() in env and f"RANK={rank}".encode() in env:
            return int(entry.name)
    return None


def _kill_rank_after_first_checkpoint(run: Run, out: Path, rank: int = 2) -> float:
    deadline = time.monotonic() + 120
    while not (out / "checkpoints" / "latest").exists():
        assert run.proc.poll() is None, run.err.read_text()
        assert time.monotonic() < deadline, "no checkpoint within 120 s"
        time.sleep(0.05)
    pid = _worker_pid(run.marker, rank)
    assert pid is not None, "worker process not found"
    os.kill(pid, signal.SIGKILL)
    return time.monotonic()


def test_a_killed_rank_stops_the_others_and_is_named(tmp_path):
    run = Run(_job(tmp_path, "killed", steps=400))
    killed_at = _kill_rank_after_first_checkpoint(run, tmp_path / "killed")
    code, _, err = run.wait(timeout=90)
    stopped_after = time.monotonic() - killed_at
    assert stopped_after < 60, f"the others took {stopped_after:.0f} s to stop"
    assert code == 1, err
    assert "tilework run: rank 2 was killed by SIGKILL" in err, err
    # The others are named as consequences: lost contact where their collective failed first,
    # stopped with it where the agent's SIGTERM came first (a race either may win, seen in CI)
    consequences = re.findall(r"ranks? ([\d, ]+) (?:lost contact with|stopped with)", err)
    assert sorted(int(r) for line in consequences for r in line.split(", ")) == [0, 1, 3], err
    assert "Traceback" not in err, err
    # The last good checkpoint is whole.
    assert checkpoint.load(checkpoint.latest(tmp_path / "killed" / "checkpoints"))["step"] >= 10


def _final_state(out: Path, steps: int = 60) -> dict:
    blob = checkpoint.load(checkpoint.latest(out / "checkpoints"))
    assert blob["step"] == steps
    return blob["state"]


def test_restart_resumes_from_the_checkpoint_and_ends_as_an_uninterrupted_run(tmp_path):
    code, _, err = Run(_job(tmp_path, "reference")).wait(timeout=180)
    assert code == 0, err

    run = Run(_job(tmp_path, "restarted"), "--max-restarts", "1")
    _kill_rank_after_first_checkpoint(run, tmp_path / "restarted")
    code, out, err = run.wait(timeout=180)
    assert code == 0, err
    assert "restarting them all (restart 1 of 1)" in err, err
    assert "resumed from" in out, out

    want, got = _final_state(tmp_path / "reference"), _final_state(tmp_path / "restarted")
    for name, tensor in want["model"].items():
        # Same ops on the same data in the same order: bit-exact, not merely close.
        assert torch.equal(got["model"][name], tensor), name
    for name, rows in want["optimizer"]["rows"].items():
        for key, value in rows.items():
            assert torch.equal(torch.as_tensor(got["optimizer"]["rows"][name][key]),
                               torch.as_tensor(value)), (name, key)


WRITER = textwrap.dedent("""
    import os, sys, time, torch
    from tilework.checkpoint import file as checkpoint
    directory, kill_at = sys.argv[1], int(sys.argv[2])
    checkpoint.save(directory, 1, {"w": torch.full((1 << 20,), 1.0)}, {"f": 1})
    calls = 0
    real_fsync = os.fsync
    def fsync_then_wait(fd):
        # Park the writer at one point of the second save, so the SIGKILL lands exactly there.
        global calls
        calls += 1
        real_fsync(fd)
        if calls == kill_at:
            print("parked", flush=True)
            time.sleep(600)
    os.fsync = fsync_then_wait
    checkpoint.save(directory, 2, {"w": torch.full((1 << 20,), 2.0)}, {"f": 1})
""")


@pytest.mark.parametrize("kill_at, survivor", [
    (1, 1.0),   # checkpoint data written, not yet renamed
    (2, 1.0),   # renamed into place, `latest` not yet updated
    (3, 1.0),   # new `latest` written to its temp file, not yet renamed
    (4, 2.0),   # everything in place
])
def test_a_writer_killed_mid_checkpoint_leaves_a_whole_one(tmp_path, kill_at, survivor):
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "ckpt"), str(kill_at)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "parked"
    proc.kill()
    proc.wait()
    found = checkpoint.latest(tmp_path / "ckpt")
    blob = checkpoint.load(found, {"f": 1})
    assert torch.all(blob["state"]["w"] == survivor)
    # The next save clears what the dead writer left behind.
    checkpoint.save(tmp_path / "ckpt", 3, {"w": torch.zeros(1)}, {"f": 1})
    assert not list((tmp_path / "ckpt").glob(".*.tmp"))


def test_summary_puts_the_cause_before_its_consequences():
    lines = summarize({0: (LOST_PEER_EXIT, "rank 0: lost contact with its peers: Connection reset"),
                       1: (-signal.SIGTERM, "Signal 15"),
                       2: (-signal.SIGKILL, "Signal 9 (SIGKILL) received by PID 7"),
                       3: (LOST_PEER_EXIT,
                           "rank 3: lost contact with its peers: Connection reset")})
    assert lines == ["rank 2 was killed by SIGKILL",
                     "ranks 0, 3 lost contact with their peers (Connection reset)",
                     "rank 1 stopped with it"]
    assert summarize({1: (2, "rank 1: lm.embedding: id 900 is out of range")}) == [
        "rank 1 failed (exit code 2): lm.embedding: id 900 is out of range"]
    only_lost = summarize({0: (LOST_PEER_EXIT, "rank 0: lost contact with its peers: Timed out")})
    assert "no rank failed on its own" in only_lost[-1]


def _blocked_frame(asker_path: str):
    """The frame of a thread blocked in torch.distributed.all_reduce that `asker_path`'s code
    called through tilework's counting wrapper (code compiled under those file names)."""
    import tilework
    from tilework.comm import guard

    root = Path(tilework.__file__).parent
    scope: dict = {"sys": sys}
    exec(compile("def all_reduce():\n    return sys._getframe()\n",
                 "/x/torch/distributed/distributed_c10d.py", "exec"), scope)
    exec(compile("def counted_all_reduce():\n    return all_reduce()\n",
                 str(root / "comm" / "counted.py"), "exec"), scope)
    exec(compile("def ask():\n    return counted_all_reduce()\n", asker_path, "exec"), scope)
    return guard.foreign_collective(scope["ask"]())


def test_a_model_parallel_layers_collective_is_computing_not_waiting_elsewhere():
    """A rank blocked in a tensor-parallel all-reduce inside its forward is computing its step
    (no verdict against it); one blocked in the script's own collective is waiting elsewhere."""
    import tilework

    root = Path(tilework.__file__).parent
    assert _blocked_frame(str(root / "tensor" / "regions.py")) is None
    assert _blocked_frame(str(root / "pipeline" / "comm.py")) is None
    assert _blocked_frame("/home/user/train.py").startswith(
        "torch.distributed.all_reduce called at")


LOCAL_SGD = """
[parallel]
mode = "allreduce"
sync = "diloco"
sync_every = 5
"""


def test_a_rank_killed_inside_an_outer_sync_resumes_bit_exact_from_the_last_checkpoint(tmp_path):
    """Local SGD meets only at its syncs. Rank 0 is stopped after the first checkpoint (step
    10), so the others run on to the next sync (step 15) and wait inside it; rank 2 is killed
    there, rank 0 let go. The restart resumes every rank from step 10 (the outer loop's anchors
    and momentum, every rank's own Adam state) and ends as the uninterrupted run, bit for bit."""
    def job(name):
        path = _job(tmp_path, name, steps=20)
        path.write_text(path.read_text() + LOCAL_SGD)
        return path

    code, _, err = Run(job("reference")).wait(timeout=180)
    assert code == 0, err
    run = Run(job("restarted"), "--max-restarts", "1")
    deadline = time.monotonic() + 120
    while not (tmp_path / "restarted" / "checkpoints" / "latest").exists():
        assert run.proc.poll() is None, run.err.read_text()
        assert time.monotonic() < deadline, "no checkpoint within 120 s"
        time.sleep(0.02)
    first = _worker_pid(run.marker, 0)
    os.kill(first, signal.SIGSTOP)
    try:
        time.sleep(4)   # five inner steps of a tiny model: the others are in the sync by now
        assert run.proc.poll() is None, run.err.read_text()
        os.kill(_worker_pid(run.marker, 2), signal.SIGKILL)
    finally:
        os.kill(first, signal.SIGCONT)
    code, out, err = run.wait(timeout=180)
    assert code == 0, err
    assert "restarting them all (restart 1 of 1)" in err, err
    assert "resumed from" in out, out
    want = _final_state(tmp_path / "reference", 20)
    got = _final_state(tmp_path / "restarted", 20)
    for name, tensor in want["model"].items():
        assert torch.equal(got["model"][name], tensor), name
    for name, momentum in want["outer"]["momentum"].items():
        assert torch.equal(got["outer"]["momentum"][name], momentum), name
