"""Pipeline schedules as data (tilework/pipeline): the builders give valid schedules, the
validator names the first bad action, the simulator's bubble is the textbook one with free
links, and the runtime executing a schedule trains the GPT as one process does, sending exactly
the bytes the simulator counts."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tilework.cluster import Link
from tilework.pipeline.schedule import (Action, Schedule, build, gpipe, in_flight,
                                        interleaved_1f1b, one_f_one_b, split_backward, validate)
from tilework.pipeline.simulate import p2p_bytes, simulate

pp_m = st.integers(1, 6).flatmap(lambda p: st.tuples(st.just(p), st.integers(1, 12)))


def every_schedule(pp: int, m: int) -> list[Schedule]:
    out = [gpipe(pp, m), one_f_one_b(pp, m), split_backward(one_f_one_b(pp, m))]
    return out + [interleaved_1f1b(pp, m, v) for v in (2, 3) if m % pp == 0]


@given(pp_m)
def test_every_builder_gives_a_valid_schedule_whose_text_round_trips(args):
    pp, m = args
    for s in every_schedule(pp, m):
        validate(s)
        assert Schedule.from_text(s.as_text(), pp, s.stages, m, s.name) == s
        assert all(s.rank_of(a.stage) == r for r, acts in enumerate(s.ranks) for a in acts)


@given(pp_m, st.sampled_from([1.0, 0.5, 2.0]))
def test_free_links_give_the_textbook_bubble(args, f):
    """GPipe and 1F1B idle (p-1)/(m+p-1) of the step with equal stages (any backward/forward
    ratio); interleaving v chunks divides the bubble time by v (Narayanan et al. 2021, eq. 2)."""
    pp, m = args
    textbook = (pp - 1) / (m + pp - 1)
    for s in (gpipe(pp, m), one_f_one_b(pp, m)):
        assert simulate(s, [f] * pp).bubble == pytest.approx(textbook, abs=1e-12)
    if m % pp == 0:
        for v in (2, 3):
            sim = simulate(interleaved_1f1b(pp, m, v), [f / v] * (pp * v))
            assert sim.bubble == pytest.approx((pp - 1) / v / (m + (pp - 1) / v), abs=1e-12)


@given(pp_m)
def test_1f1b_holds_fewer_microbatches_than_gpipe(args):
    pp, m = args
    assert in_flight(gpipe(pp, m)) == [m] * pp
    assert in_flight(one_f_one_b(pp, m)) == [min(pp - r, m) for r in range(pp)]


def test_the_printer_draws_ranks_by_time_with_idle_slots():
    text = str(one_f_one_b(2, 3))
    assert text.splitlines()[2:] == ["rank 0 0F0 0F1   . 0B0 0F2 0B1   . 0B2",
                                     "rank 1   . 1F0 1B0 1F1 1B1 1F2 1B2   ."]


@pytest.mark.parametrize("text, message", [
    ("0F0 0F1 0B0 0B1\n1F0 1B0 1F1", "no B for stage 1, microbatch 1"),
    ("0F0 0F0 0B0\n1F0 1B0", "0F0 appears twice"),
    ("0F0 1F0 0B0\n1B0", "1F0 is on rank 0, but stage 1 lives on rank 1"),
    ("0B0 0F0\n1F0 1B0", r"0B0 on rank 0 \(position 0\) comes before 0F0"),
    ("0F0 0B0 0W0 0W0\n1F0 1B0", "0W0 appears twice"),
    ("0F0 0W0 0B0\n1F0 1B0", r"0W0 on rank 0 \(position 1\) comes before 0B0"),
    ("0F0 0B0 0F1 0B1\n1F1 1B1 1F0 1B0",
     "deadlocks: rank 0 waits at 0B0 for 1B0 \\(rank 1\\); rank 1 waits at 1F1 for 0F1"),
    ("0F0 0B0\n1F0 1B0 1F2", "1F2 on rank 1: outside 2 stages x 1 microbatches"),
])
def test_the_validator_names_the_first_bad_action(text, message):
    s = Schedule.from_text(text, 2, 2, 1 if "F2" in text else None)
    with pytest.raises(ValueError, match=message):
        validate(s)


def test_interleaved_stages_are_on_rank_s_mod_pp_and_bad_arguments_are_named():
    s = build("interleaved", 2, 4, v=2)
    assert s.stages == 4 and s.stages_of(1) == [1, 3]
    assert str(s.ranks[0][0]) == "0F0" and Action.parse("3B2") == Action(3, "B", 2)
    with pytest.raises(ValueError, match="multiple of pp"):
        interleaved_1f1b(4, 6, 2)
    with pytest.raises(ValueError, match="unknown schedule 'zb'"):
        build("zb", 2, 4)
    with pytest.raises(ValueError, match="not an action"):
        Action.parse("0X1")


def test_links_delay_each_hop_between_ranks_and_bytes_are_counted_per_boundary():
    link = Link(bandwidth_gbps=8.0, latency_us=100.0)   # 1 GB/s: 1 MB takes 1 ms + 0.1 ms
    nbytes = 1_000_000
    sim = simulate(gpipe(2, 1), [1e-3, 1e-3], link=link, activation_bytes=nbytes)
    # F0, hop, F1, B1 (2 ms), hop, B0 (2 ms)
    assert sim.step_s == pytest.approx(1e-3 + 1.1e-3 + 1e-3 + 2e-3 + 1.1e-3 + 2e-3)
    assert sim.sent_bytes == (nbytes, nbytes)
    # interleaved: every F but the last stage's and every B but stage 0's crosses ranks
    s = interleaved_1f1b(2, 4, 2)
    assert p2p_bytes(s, 10) == [(3 * 4 + 3 * 4) * 10 // 2] * 2
