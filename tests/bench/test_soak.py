"""bench/soak.py: how a run ended is read right, and a native crash leaves its core and a
backtrace of every thread (a real segfault, in a child run, with core dumps on)."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest


def _soak():
    path = Path(__file__).resolve().parents[2] / "bench" / "soak.py"
    spec = importlib.util.spec_from_file_location("soak_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_outcomes_are_told_apart():
    soak = _soak()
    assert soak.classify(0, "1 passed") == "passed"
    assert soak.classify(1, "AssertionError: losses differ") == "failed"
    assert soak.classify(-6, "") == "crashed"
    assert soak.classify(1, "terminate called without an active exception") == "crashed"
    assert soak.classify(1, "malloc(): unaligned tcache chunk detected") == "crashed"
    assert soak.classify(None, "") == "timeout"


@pytest.mark.skipif(shutil.which("gdb") is None, reason="gdb is not installed")
def test_a_crash_leaves_its_core_and_a_backtrace(tmp_path):
    if Path("/proc/sys/kernel/core_pattern").read_text().strip() != "core":
        pytest.skip("core_pattern is not 'core' (cores go elsewhere on this machine)")
    crash = tmp_path / "test_crash.py"
    crash.write_text("import ctypes\n\ndef test_crash():\n    ctypes.string_at(0)\n")
    soak = _soak()
    result = soak.run_once(0, str(crash), tmp_path / "out", timeout=120)
    assert result["outcome"] == "crashed" and result["cores"], result
    backtrace = (tmp_path / "out" / "run-000.bt").read_text()
    assert "SIGSEGV" in backtrace and "string_at" in backtrace
