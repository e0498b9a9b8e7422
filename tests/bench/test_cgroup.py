"""The CPU quota cgroup (tilework/bench/cgroup.CpuQuota) that makes a rank as fast as a smaller
host: a process in a quarter-core group gets about a quarter of the CPU time it spins for.
Root only (cgroups); skipped with the reason elsewhere."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tilework.bench.cgroup import CpuQuota

SPIN = """
import os, time
start = time.monotonic()
while time.monotonic() - start < 1.0:
    pass
print(os.times().user + os.times().system)
"""


def _quota(cores: float) -> CpuQuota:
    if os.geteuid() != 0:
        pytest.skip("cgroups need root")
    try:
        return CpuQuota(cores, name="test")
    except OSError as e:
        pytest.skip(f"no cpu cgroup here: {e}")


def test_a_quarter_core_quota_gives_a_quarter_of_the_time():
    quota = _quota(0.25)
    try:
        done = subprocess.run([sys.executable, "-c", SPIN], capture_output=True, text=True,
                              preexec_fn=quota.join, timeout=30, check=True)
    finally:
        quota.remove()
    used = float(done.stdout)
    # One second of wall time spinning: a quarter of it on the CPU, give or take a period.
    assert 0.1 < used < 0.45, used
