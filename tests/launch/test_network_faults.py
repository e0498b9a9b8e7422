"""Network faults on emulated hosts: one host's link cut for longer than `--timeout` (the run
fails in time with one-line messages; with `--max-restarts` it re-forms once the link is back and
resumes from the last checkpoint), and a blip shorter than the timeout, which the run rides out.

Each host is a network namespace (tilework.bench.netns) running `python -m tilework train --hosts`
as a real host would; the cut is host 1's veth set down, which also takes the carrier off its
switch port: nothing is closed or reset, the peers just go silent. Needs root and iproute2.
"""

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from tests.bench.test_netns import needs_netns, no_leftovers  # noqa: F401 - a fixture, used by name
from tests.launch.test_faults import JOB
from tilework.bench.netns import (
    EmulatedCluster,
    LinkShape,
    emulated_cluster,
    host_layout,
    link_commands,
)
from tilework.checkpoint import file as checkpoint
from tilework.launch import launcher as launch
from tilework.launch.faults import LOST_PEER_EXIT, worker_failure

ROOT = Path(__file__).resolve().parents[2]
RDZV_PORT = 29500  # free: nothing else runs in the namespaces a test has just made
# How long after its collectives time out a host's command may take to exit: the agent notices
# its failed workers (0.5 s monitor interval), gives the rendezvous host up to SHUTDOWN_WAIT_S
# on the way out (host 1 cannot reach it), and the processes exit; measured about 1 s besides
# that wait, on this 2-core machine.
EXIT_SLACK_S = launch.SHUTDOWN_WAIT_S + 8


def test_link_commands_take_a_host_link_down_and_up():
    h = host_layout(2, "p")[1]
    assert link_commands(h, up=False) == [["ip", "-n", "ph1", "link", "set", "veth1", "down"]]
    assert link_commands(h, up=True) == [["ip", "-n", "ph1", "link", "set", "veth1", "up"]]


def test_a_collective_closed_by_another_ones_timeout_is_a_lost_peer():
    failure = worker_failure(RuntimeError("[../gloo/transport/tcp/pair.cc:98] Application "
                                          "timeout caused pair closure"), rank=0, timeout_s=6)
    assert failure.exit_code == LOST_PEER_EXIT and not failure.traceback
    assert failure.line == ("rank 0: lost contact with its peers (collective timeout 6 s): "
                            "Application timeout caused pair closure")


class _Unreachable:
    """A rendezvous handler whose host cannot be reached: every store call blocks."""

    def __init__(self):
        self.release = threading.Event()

    def num_nodes_waiting(self):
        raise AssertionError("asked the rendezvous host while its workers look healthy")

    def shutdown(self):
        self.release.wait(60)
        return True


def test_the_rendezvous_never_waits_long_on_an_unreachable_host(monkeypatch, capsys):
    monkeypatch.setattr(launch, "SHUTDOWN_WAIT_S", 0.2)
    inner = _Unreachable()
    handler = launch._FixedSizeRendezvous(inner, "192.0.2.10:29500")
    try:
        assert handler.num_nodes_waiting() == 0
        start = time.monotonic()
        assert handler.shutdown() is False
        assert time.monotonic() - start < 5
        assert "rendezvous host 192.0.2.10:29500 did not answer within 0.2 s" in \
            capsys.readouterr().err
    finally:
        inner.release.set()


class ClusterRun:
    """`tilework train` on every emulated host, output to files (a chatty run never blocks on a
    full pipe); each command leads its own process group, so its workers die with it."""

    def __init__(self, cluster: EmulatedCluster, tmp_path: Path, steps: int, procs: int,
                 timeout_s: float, max_restarts: int = 0):
        self.out_dir = tmp_path / "out"
        job = tmp_path / "job.toml"
        job.write_text(JOB.format(steps=steps, out=self.out_dir))
        hosts = tmp_path / "cluster.toml"
        hosts.write_text(f'rendezvous = "{cluster.hosts[0].address}:{RDZV_PORT}"\n' + "".join(
            f'[[hosts]]\nname = "h{i}"\naddress = "{h.address}"\nprocs = {procs}\n'
            for i, h in enumerate(cluster.hosts)))
        run_id = uuid.uuid4().hex[:12]
        self.logs = [(tmp_path / f"h{i}.out", tmp_path / f"h{i}.err")
                     for i in range(len(cluster.hosts))]
        self.procs: list[subprocess.Popen] = []
        self.exited_at: list[float | None] = [None] * len(cluster.hosts)
        for i, (out_path, err_path) in enumerate(self.logs):
            env = {"GLOO_SOCKET_IFNAME": cluster.gloo_env(i)["GLOO_SOCKET_IFNAME"],
                   "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
            argv = [sys.executable, "-m", "tilework", "train", str(job), "--hosts", str(hosts),
                    "--host", f"h{i}", "--run-id", run_id, "--timeout", f"{timeout_s:g}",
                    "--max-restarts", str(max_restarts)]
            with out_path.open("w") as out, err_path.open("w") as err:
                self.procs.append(subprocess.Popen(cluster.command(i, argv, env), stdout=out,
                                                   stderr=err, cwd=ROOT, start_new_session=True))

    def out(self, i: int) -> str:
        return self.logs[i][0].read_text()

    def err(self, i: int) -> str:
        return self.logs[i][1].read_text()

    def _poll(self) -> None:
        for i, p in enumerate(self.procs):
            if self.exited_at[i] is None and p.poll() is not None:
                self.exited_at[i] = time.monotonic()

    def wait_until(self, ready, what: str, within_s: float, while_running: bool = True) -> float:
        deadline = time.monotonic() + within_s
        while not ready():
            self._poll()
            if while_running and any(t is not None for t in self.exited_at):
                pytest.fail(f"a host stopped before {what}:\n" + self.report())
            if time.monotonic() > deadline:
                pytest.fail(f"no {what} within {within_s:g} s:\n" + self.report())
            time.sleep(0.05)
        return time.monotonic()

    def wait_for_first_checkpoint(self) -> float:
        return self.wait_until((self.out_dir / "checkpoints" / "latest").exists,
                               "first checkpoint", 120)

    def wait_for_exits(self, within_s: float) -> list[float]:
        """When each host's command exited (monotonic), waiting at most `within_s`."""
        self.wait_until(lambda: self._poll() or all(t is not None for t in self.exited_at),
                        "exit of every host", within_s, while_running=False)
        return list(self.exited_at)

    @property
    def codes(self) -> list[int | None]:
        return [p.poll() for p in self.procs]

    def report(self) -> str:
        return "\n".join(f"--- h{i} (exit {p.poll()})\nstdout: {self.out(i)[-1500:]}\n"
                         f"stderr: {self.err(i)[-3000:]}" for i, p in enumerate(self.procs))

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait(timeout=30)


def assert_one_line_messages(err: str, only: bool = False) -> None:
    """No traceback; with `only`, nothing but tilework's lines and c10d's one-line warnings (on
    these hosts it cannot resolve its peers' names)."""
    assert "Traceback" not in err, err
    if only:
        odd = [line for line in err.splitlines() if line.strip()
               and not line.startswith(("tilework: error: ", "tilework run: "))
               and "The hostname of the client socket cannot be retrieved" not in line]
        assert not odd, err


@needs_netns
def test_a_link_cut_past_the_timeout_fails_both_hosts_in_time(tmp_path, no_leftovers):
    timeout_s = 6
    with emulated_cluster(2, LinkShape(None)) as cluster:
        # Two ranks per host: the host and cross-host groups must honour --timeout too.
        run = ClusterRun(cluster, tmp_path, steps=5000, procs=2, timeout_s=timeout_s)
        try:
            run.wait_for_first_checkpoint()
            cluster.set_link(1, up=False)
            cut = time.monotonic()
            # The link stays down: the hosts must give up on the timeout alone.
            exits = run.wait_for_exits(within_s=timeout_s + EXIT_SLACK_S + 30)
        finally:
            run.kill()
    took = [t - cut for t in exits]
    print(f"\nlink cut, --timeout {timeout_s} s: host 0 exited after {took[0]:.1f} s, "
          f"host 1 after {took[1]:.1f} s")
    assert run.codes == [1, 1], run.report()
    assert max(took) < timeout_s + EXIT_SLACK_S, run.report()
    for i, ranks in enumerate(["ranks 0, 1", "ranks 2, 3"]):
        err = run.err(i)
        assert_one_line_messages(err, only=True)
        assert f"lost contact with its peers (collective timeout {timeout_s} s)" in err, err
        assert f"tilework run: {ranks} lost contact with their peers" in err, err
        assert "tilework run: no rank failed on its own: a host or its network link went away" \
            in err, err
    assert "tilework run: the rendezvous host 192.0.2.10:29500 did not answer" in run.err(1)
    # The last checkpoint, written before the cut, is whole.
    assert checkpoint.load(checkpoint.latest(run.out_dir / "checkpoints"))["step"] >= 10


@needs_netns
def test_a_link_cut_past_the_timeout_is_resumed_from_once_the_link_returns(tmp_path,
                                                                            no_leftovers):
    timeout_s, down_s, steps = 6, 18, 300
    # down_s > timeout_s: the collectives on both sides time out while the link is down; and
    # > 15 s, the rendezvous's keep-alive expiry (3 beats of 5 s): host 0 drops host 1 from it,
    # so host 1 has to join again.
    with emulated_cluster(2, LinkShape(None)) as cluster:
        run = ClusterRun(cluster, tmp_path, steps=steps, procs=1, timeout_s=timeout_s,
                         max_restarts=2)
        try:
            run.wait_for_first_checkpoint()
            cluster.set_link(1, up=False)
            cut = time.monotonic()
            # Host 0 fails and restarts its side on its own, then waits for host 1.
            run.wait_until(lambda: "restart 1 of 2" in run.err(0), "restart on host 0",
                           timeout_s + EXIT_SLACK_S)
            failed_after = time.monotonic() - cut
            time.sleep(max(0.0, down_s - (time.monotonic() - cut)))
            cluster.set_link(1, up=True)
            up = time.monotonic()
            resumed = run.wait_until(lambda: "resumed from" in run.out(0), "resume", 90)
            exits = run.wait_for_exits(within_s=90)
        finally:
            run.kill()
    print(f"\nlink down {down_s} s, --timeout {timeout_s} s: host 0 restarted "
          f"{failed_after:.1f} s after the cut; resumed {resumed - up:.1f} s after the link "
          f"returned; finished {max(exits) - resumed:.1f} s later")
    assert run.codes == [0, 0], run.report()
    out = run.out(0)
    assert out.count("resumed from") == 1, out
    assert f"step {steps}/{steps}" in out, out
    for i in range(2):
        err = run.err(i)
        assert_one_line_messages(err)
        assert f"lost contact with its peers (collective timeout {timeout_s} s)" in err, err
        # One restart per outage, on each host: each host's workers see the same restart count,
        # so all resume (none starts afresh beside the others).
        assert "restarting them all (restart 1 of 2)" in err, err
        assert "restart 2 of 2" not in err, err
    assert checkpoint.load(checkpoint.latest(run.out_dir / "checkpoints"))["step"] == steps


@needs_netns
def test_a_blip_shorter_than_the_timeout_is_ridden_out(tmp_path, no_leftovers):
    timeout_s, blip_s, steps = 20, 2.5, 300
    with emulated_cluster(2, LinkShape(None)) as cluster:
        run = ClusterRun(cluster, tmp_path, steps=steps, procs=1, timeout_s=timeout_s)
        try:
            run.wait_for_first_checkpoint()
            cluster.set_link(1, up=False)
            time.sleep(blip_s)
            logged = run.out(0).count("\nstep ")
            cluster.set_link(1, up=True)
            up = time.monotonic()
            # The blip fell inside training: neither host had finished by its end.
            assert run.codes == [None, None] and f"step {steps}/" not in run.out(0), run.report()
            moved = run.wait_until(lambda: run.out(0).count("\nstep ") > logged,
                                   "step after the blip", timeout_s)
            exits = run.wait_for_exits(within_s=90)
        finally:
            run.kill()
    print(f"\n{blip_s} s blip, --timeout {timeout_s} s: steps again {moved - up:.1f} s after the "
          f"link returned, finished {max(exits) - up:.1f} s after it, no restart")
    assert run.codes == [0, 0], run.report()
    out = run.out(0)
    assert f"step {steps}/{steps}" in out and "resumed from" not in out, out
    for i in range(2):
        err = run.err(i)
        assert_one_line_messages(err)
        assert "lost contact" not in err and "restarting" not in err, err
    assert checkpoint.load(checkpoint.latest(run.out_dir / "checkpoints"))["step"] == steps
