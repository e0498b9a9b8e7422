"""bench/zero_memory.py's measuring code, end to end on a tiny GPT at 2 ranks: one timed round of
one step and the MemTracker pass for DDP, FSDP2 and ZeRO 1-3, stage 3's resident-set pass, and
the table. Counts only, no timing: every system is in the table, they all train the same model,
and stage 3 and FSDP2 hold half of DDP's parameter bytes per rank.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tilework.bench.zero_peers import SYSTEMS, Shape

# Embeddings and head (the root unit) outweigh the layers, as in the benchmark's GPT.
TINY = Shape(dim=32, layers=2, vocab=4096, seq=16, batch=2)


def _bench():
    path = Path(__file__).resolve().parents[2] / "bench" / "zero_memory.py"
    spec = importlib.util.spec_from_file_location("zero_memory_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def measured():
    bench = _bench()
    # The resident set of one system only: each takes a world of fresh processes.
    result = bench.run(TINY, SYSTEMS, rounds=1, steps=1, ranks=2, rss_of=["zero3"])
    return bench, result


def test_every_system_is_measured_and_trains_the_same_model(measured):
    bench, result = measured
    rows = bench.table(result, bench.estimates(TINY, 2))
    assert [row.split(" | ")[0].lstrip("| ") for row in rows[2:]] == list(SYSTEMS)
    losses = result["losses"]
    for system in SYSTEMS:
        assert losses[system] == pytest.approx(losses["ddp"], rel=1e-5), system
        assert result["memory"][system]["peak"] > 0
        assert len(result["times"][system]) == 1
    assert result["memory"]["zero3"]["rss"] > 0 and result["memory"]["ddp"]["rss"] is None


def test_stage_3_and_fsdp2_hold_half_of_ddps_parameter_bytes(measured):
    _, result = measured
    memory = result["memory"]
    ddp = memory["ddp"]["parameters"]
    assert ddp == TINY.parameters() * 4
    for system in ("zero3", "fsdp2"):   # each rank's half, padded to an even split
        assert 0.5 <= memory[system]["parameters"] / ddp <= 0.51, system
    assert memory["zero1"]["parameters"] / ddp == pytest.approx(1.5, abs=0.01)   # + the shards
    assert memory["zero3"]["optimizer_state"] <= 0.51 * memory["ddp"]["optimizer_state"]
    assert memory["zero3"]["peak"] < memory["ddp"]["peak"]


@pytest.mark.xfail(strict=True, reason="by MemTracker stage 3 peaks above FSDP2's by its gloo "
                   "reduce-scatter's receive buffer (an all-to-all into a whole-bucket tensor "
                   "MemTracker counts; gloo's own reduce-scatter, which FSDP2 calls, allocates "
                   "where MemTracker does not look); by resident set the benchmark GPT is at "
                   "1.006x FSDP2's (docs/memory.md, 'ZeRO against DDP and FSDP2')")
def test_stage_3_peaks_within_5_percent_of_fsdp2(measured):
    _, result = measured
    memory = result["memory"]
    assert memory["zero3"]["peak"] <= 1.05 * memory["fsdp2"]["peak"]
