"""Smoke test of the benchmark harness: one host, one step of every system (no timing checked)."""

import pytest

from tilework.bench.suite import Setting, ratios, run_one
from tilework.bench.worker import SYSTEMS, TORCHREC_SYSTEMS


def test_every_system_runs_one_step_on_one_host():
    from concurrent.futures import ThreadPoolExecutor

    systems = [s for s in SYSTEMS
               if s not in TORCHREC_SYSTEMS]  # those: tests/bench/test_torchrec_peer.py
    # Two at a time: each is one single-threaded process, most of it importing torch.
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda s: run_one("cnn", s, Setting("1 host", 1, None), steps=1,
                                                  warmup=0, timeout=120), systems))
    assert [r["system"] for r in results] == systems
    assert all(r["throughput"] > 0 and r["bytes_per_step"] == 0 for r in results)
    assert ratios(results)[0]["vs_ddp"] == pytest.approx(1.0)


def test_two_loopback_ranks_count_bytes():
    r = run_one("lm100k", "hybrid", Setting("loopback", 2, None), steps=1, warmup=0, timeout=120)
    assert r["world_size"] == 2 and r["bytes_per_step"] > 0


def test_hosts_of_different_speeds_run_in_quotas_with_the_batch_shared_by_speed():
    """`tilework bench --speeds 1 0.5`: each host's rank in a CPU quota of its own, and
    hybrid-shares feeding each rank the share `tilework train` gives those speeds."""
    import os

    from tilework.bench.cgroup import CpuQuota
    from tilework.bench.suite import shares_for

    if os.geteuid() != 0:
        pytest.skip("CPU quotas need root (cgroups)")
    try:
        CpuQuota(0.5, name="probe").remove()
    except OSError as e:
        pytest.skip(f"no cpu cgroup here: {e}")
    assert shares_for("cnn", (1, 0.5)) == (22, 10)   # 32 samples at 2:1: both ranks 22 units
    r = run_one("cnn", "hybrid-shares", Setting("quotas", 2, None, speeds=(1, 0.5)), steps=1,
                warmup=0, timeout=120)
    assert r["batch_shares"] == [22, 10] and r["throughput"] > 0 and r["bytes_per_step"] > 0


def test_bench_refuses_speeds_for_fewer_than_two_hosts(capsys):
    from tilework.cli import main

    assert main(["bench", "--speeds", "1"]) == 2
    assert "--speeds: expected a positive number of cores for each of at least 2 hosts" in \
        capsys.readouterr().err


def test_a_failed_rank_stops_the_others_at_once_and_is_named():
    import sys
    import time

    from tilework.bench.suite import launch_ranks

    quick = [sys.executable, "-c", "import sys; print('bad input'); sys.exit(3)"]
    slow = [sys.executable, "-c", "import time; time.sleep(60)"]
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 failed \(exit code 3\):\nbad input"):
        launch_ranks([slow, quick], [{}, {}], timeout=120)
    # A rank left running after another finished cleanly is stopped after the grace.
    done = [sys.executable, "-c", "pass"]
    with pytest.raises(RuntimeError, match="rank 0 still running 1 s after another rank"):
        launch_ranks([slow, done], [{}, {}], timeout=120, grace=1)
    assert time.monotonic() - start < 30
