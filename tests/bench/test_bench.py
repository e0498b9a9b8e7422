"""Smoke test of the benchmark harness: one host, one step of every system (no timing checked)."""

import pytest

from tilework.bench.suite import Setting, ratios, run_one
from tilework.bench.worker import SYSTEMS, TORCHREC_SYSTEMS


def test_every_system_runs_one_step_on_one_host():
    systems = [s for s in SYSTEMS
               if s not in TORCHREC_SYSTEMS]  # those: tests/bench/test_torchrec_peer.py
    results = [run_one("cnn", s, Setting("1 host", 1, None), steps=1, warmup=0, timeout=120)
               for s in systems]
    assert [r["system"] for r in results] == systems
    assert all(r["throughput"] > 0 and r["bytes_per_step"] == 0 for r in results)
    assert ratios(results)[0]["vs_ddp"] == pytest.approx(1.0)


def test_two_loopback_ranks_count_bytes():
    r = run_one("lm100k", "hybrid", Setting("loopback", 2, None), steps=1, warmup=0, timeout=120)
    assert r["world_size"] == 2 and r["bytes_per_step"] > 0
