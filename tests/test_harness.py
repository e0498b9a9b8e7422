"""The spawn harness itself: results by rank, failures re-raised with rank and traceback, no
hangs."""

import time

import pytest
import torch
import torch.distributed as dist

from tilework.testing import RankFailed, spawn


def _all_reduce_rank(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_all_ranks_return(world_size):
    expected = float(sum(range(world_size)))
    assert spawn(_all_reduce_rank, world_size) == [expected] * world_size


def _rank_one_fails(rank, world_size):
    if rank == 1:
        raise ValueError("deliberate failure on rank 1")
    t = torch.ones(1)
    dist.all_reduce(t)  # never completes: rank 1 is gone; the harness must not wait for it


def test_failing_rank_is_reported_not_hung():
    start = time.monotonic()
    with pytest.raises(RankFailed) as e:
        spawn(_rank_one_fails, 2, timeout=60)
    assert e.value.rank == 1
    assert "deliberate failure on rank 1" in str(e.value) and "Traceback" in str(e.value)
    assert time.monotonic() - start < 30


def _sleeps(rank, world_size):
    time.sleep(60)


def test_timeout_kills_all_ranks():
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] did not finish within 3 s"):
        spawn(_sleeps, 2, timeout=3)


def _crashes(rank, world_size):
    import os

    if rank == 0:
        os._exit(7)
    time.sleep(60)


def test_rank_killed_without_reporting():
    with pytest.raises(RankFailed, match="exited with code 7"):
        spawn(_crashes, 2, timeout=30)


def _peer_left_on_the_guards_verdict(rank, world_size):
    import os
    import threading

    from tilework.comm import guard

    if rank == 0:
        time.sleep(60)
    # What rank 1 sees when the guard has its verdict and its peer, having read it, leaves
    # first: the collective fails in the main thread while the guard's thread is about to exit.
    guard.STOPPING.set()
    threading.Timer(0.5, os._exit, args=(guard.EXIT_CODE,)).start()
    raise RuntimeError("Connection closed by peer [127.0.0.1]:1")


def test_a_peer_lost_to_the_guards_verdict_reports_the_verdicts_exit_not_the_lost_peer():
    with pytest.raises(RankFailed, match="exited with code 2"):
        spawn(_peer_left_on_the_guards_verdict, 2, timeout=30)


def test_guard_watchers_end_before_the_interpreter_finalizes():
    """A watcher thread still inside a store call when CPython finalizes is ended with
    pthread_exit as it takes the GIL back, which aborts the process through pybind11's frames
    ("terminate called without an active exception"; bench/soak.py found it at exit of 8 of
    43 emulated-host runs). At exit every watcher is ended and joined first."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import datetime, atexit
        import torch.distributed as dist
        from tilework.comm import guard
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True,
                              timeout=datetime.timedelta(seconds=30))
        guards = [guard.CallGuard(store, 0, 2) for _ in range(3)]
        assert all(t.is_alive() for t in guard._watchers)
        guard._end_watchers()
        print("alive after exit handler:", any(t.is_alive() for t in guard._watchers))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "alive after exit handler: False" in r.stdout, r.stdout + r.stderr
