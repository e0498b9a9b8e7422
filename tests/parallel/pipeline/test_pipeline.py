"""Pipeline schedules as data (tilework/pipeline): the builders give valid schedules, the
validator names the first bad action, the simulator's bubble is the textbook one with free
links, and the runtime executing a schedule trains the GPT as one process does, sending exactly
the bytes the simulator counts."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests import tiny_gpt
from tilework.cluster.topology import Link
from tilework.comm.counted import Traffic
from tilework.models.gpt import TinyGPT
from tilework.parallel.pipeline import megatron
from tilework.parallel.pipeline.megatron import TABLE1
from tilework.parallel.pipeline.runtime import PipelineRunner
from tilework.parallel.pipeline.schedule import (
    Action,
    Schedule,
    build,
    gpipe,
    in_flight,
    interleaved_1f1b,
    one_f_one_b,
    split_backward,
    validate,
)
from tilework.parallel.pipeline.simulate import messages, p2p_bytes, simulate
from tilework.parallel.pipeline.stages import balance, split_stages
from tilework.parallel.pipeline.timeline import draw
from tilework.testing import spawn

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


@given(pp_m, st.lists(st.floats(0.1, 2.0), min_size=6, max_size=6))
def test_ranks_sharing_processors_slow_down_only_when_more_compute_than_there_are(args, f):
    """Processor sharing: with a processor per rank the replay is the plain one; with one
    processor for all, the step is all the work done back to back."""
    pp, m = args
    s = one_f_one_b(pp, m)
    alone = simulate(s, f[:pp])
    assert simulate(s, f[:pp], processors=pp).timeline == alone.timeline
    assert simulate(s, f[:pp], processors=1).step_s == pytest.approx(3 * m * sum(f[:pp]))
    if pp > 2:
        assert alone.step_s <= simulate(s, f[:pp], processors=2).step_s + 1e-12


@pytest.mark.parametrize("pp, m, v", [(2, 4, 2), (4, 8, 2), (2, 8, 3), (4, 16, 4)])
def test_interleaved_orders_equal_torchs_schedule(pp, m, v):
    """torch.distributed.pipelining's ScheduleInterleaved1F1B computes the same per-rank orders
    (its private order builder, read without a process group; skipped if it moves). With m == pp
    the two differ: Megatron, which we follow, then runs every forward first."""
    from types import SimpleNamespace

    from torch.distributed.pipelining import schedules

    order = getattr(schedules.ScheduleInterleaved1F1B, "_calculate_single_rank_operations", None)
    if order is None:
        pytest.skip("torch's interleaved order builder moved")
    fake = SimpleNamespace(n_local_stages=v, pp_group_size=pp, _n_microbatches=m,
                           microbatches_per_round=pp)
    ours = interleaved_1f1b(pp, m, v)
    for r in range(pp):
        assert [str(a) for a in order(fake, r) if a is not None] == [str(a) for a in ours.ranks[r]]


def test_the_printer_draws_ranks_by_time_with_idle_slots():
    text = one_f_one_b(2, 3).format()
    assert text == str(one_f_one_b(2, 3))
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


def test_message_overhead_is_charged_to_the_sender_and_the_receiver():
    """LogP's o: each cross-rank message costs its sending action and its receiving action o
    before they compute; it delays the step and is not computing."""
    ms, o = 1e-3, 0.5e-3
    sim = simulate(gpipe(2, 1), [ms, ms], message_overhead_s=o)
    # 0F0 (sends): 1.5, 1F0 (receives): 1.5, 1B0 (sends): 2.5, 0B0 (receives): 2.5
    assert sim.step_s == pytest.approx(8e-3)
    assert sim.busy_s == pytest.approx((3e-3, 3e-3))
    assert sim.overhead_s == pytest.approx((2 * o, 2 * o))
    assert sim.bubble == pytest.approx(1 - 3 / 8)
    link = Link(bandwidth_gbps=8.0, latency_us=100.0)
    with_link = simulate(gpipe(2, 1), [ms, ms], link=link, activation_bytes=1_000_000,
                         message_overhead_s=o)
    assert with_link.step_s == pytest.approx(8e-3 + 2 * 1.1e-3)
    # one processor for both ranks: the step is all the work, overhead included; an action's
    # wall time (stretched while both ranks run) is its overhead's and its compute's
    shared = simulate(one_f_one_b(2, 2), [ms, ms], message_overhead_s=o, processors=1)
    assert shared.step_s == pytest.approx(12 * ms + 8 * o)
    walls = [sum(e - b for r, b, e, _ in shared.timeline if r == rank) for rank in (0, 1)]
    assert [b + v for b, v in zip(shared.busy_s, shared.overhead_s)] == pytest.approx(walls)
    assert simulate(gpipe(2, 1), [ms, ms], message_overhead_s=o, processors=1) == sim


@given(pp_m, st.floats(0.0, 1.0))
def test_message_overhead_counts_every_message_twice_and_zero_changes_nothing(args, o):
    pp, m = args
    for s in every_schedule(pp, m):
        sends = sum(p2p_bytes(s, 1))   # one byte a message: the messages sent
        assert sum(messages(s, a) for acts in s.ranks for a in acts) == 2 * sends
        plain = simulate(s, [1.0] * s.stages)
        assert simulate(s, [1.0] * s.stages, message_overhead_s=0.0) == plain
        for cores in (1, 2):
            zero = simulate(s, [1.0] * s.stages, processors=cores, message_overhead_s=0.0)
            assert zero == simulate(s, [1.0] * s.stages, processors=cores)
        one = simulate(s, [1.0] * s.stages, processors=1, message_overhead_s=o)
        assert one.step_s == pytest.approx(3 * m * s.stages + o * 2 * sends)


# -- the runtime: the GPT trained through each schedule equals one process --------------------

STEPS, BATCH, SEQ, VOCAB, DIM = 3, 8, 8, 50, 16


def new_gpt(layers: int = 4):
    torch.manual_seed(0)
    return TinyGPT(vocab=VOCAB, dim=DIM, heads=2, layers=layers, seq_len=SEQ)


def gpt_batch(step: int):
    return tiny_gpt.gpt_batch(step, VOCAB, SEQ, BATCH)


def one_process():
    model = new_gpt()
    losses = tiny_gpt.sgd_losses(model, gpt_batch, STEPS)
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def _train(rank, schedule):
    model = new_gpt()
    stages = split_stages(model, schedule.stages)
    runner = PipelineRunner({s: stages[s] for s in schedule.stages_of(rank)}, schedule)
    opt = torch.optim.SGD(runner.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        loss = runner.step(*gpt_batch(step))
        opt.step()
        opt.zero_grad()
        losses.append(None if loss is None else loss.item())
    mine = {id(p) for p in runner.parameters()}
    params = {k: v.detach().clone() for k, v in model.named_parameters() if id(v) in mine}
    traffic = runner.stats.last_step.get("pipeline", Traffic())
    return {"losses": losses, "params": params, "sent": traffic.sent,
            "received": traffic.received, "timeline": [str(a) for a, _, _ in runner.timeline]}


def _pipeline_rank(rank, world_size, schedules):
    """Every schedule in one world (a spawn costs seconds), and one refused construction."""
    out = {s.name: _train(rank, s) for s in schedules}
    try:
        PipelineRunner({}, schedules[0])
    except ValueError as e:
        out["refused"] = str(e)
    return out


PP2 = [gpipe(2, 4), one_f_one_b(2, 4), interleaved_1f1b(2, 4, 2), split_backward(one_f_one_b(2, 4))]
PP4 = [gpipe(4, 4), one_f_one_b(4, 4)]


@pytest.fixture(scope="module")
def reference():
    return one_process()


@pytest.fixture(scope="module")
def pipelines():
    return {2: spawn(_pipeline_rank, 2, args=(PP2,)), 4: spawn(_pipeline_rank, 4, args=(PP4,))}


@pytest.mark.parametrize("schedule", PP2 + PP4, ids=lambda s: f"{s.name}-pp{s.pp}")
def test_each_schedule_trains_the_gpt_as_one_process_does(schedule, reference, pipelines):
    """Forward (losses) and backward (parameters after 3 SGD steps) against one process on the
    whole batch, within 1e-5 relative: microbatches reorder the gradients' sums."""
    losses, params = reference
    out = [rank[schedule.name] for rank in pipelines[schedule.pp]]
    assert out[-1]["losses"] == pytest.approx(losses, rel=1e-5)
    assert all(o["losses"] == [None] * STEPS for o in out[:-1])
    got = {k: v for o in out for k, v in o["params"].items()}
    assert sorted(got) == sorted(params)
    for name, value in params.items():
        scale = value.abs().max().item()
        assert (got[name] - value).abs().max().item() <= 1e-5 * scale, name
    # the schedule is what ran, and its bytes are what the simulator counts
    assert [o["timeline"] for o in out] == [[str(a) for a in acts] for acts in schedule.ranks]
    expected = p2p_bytes(schedule, (BATCH // schedule.microbatches) * SEQ * DIM * 4)
    assert [o["sent"] for o in out] == expected == [o["received"] for o in out]


def test_one_rank_runs_every_stage_without_a_process_group(reference):
    """pp = 1 with two stages: the stages hand activations and gradients over in place."""
    losses, params = reference
    got = _train(0, interleaved_1f1b(1, 4, 2))
    assert got["losses"] == pytest.approx(losses, rel=1e-5) and got["sent"] == 0
    for name, value in params.items():
        assert (got["params"][name] - value).abs().max().item() <= 1e-5 * value.abs().max().item()


def test_a_rank_given_the_wrong_stages_is_told_which_it_runs(pipelines):
    assert pipelines[2][1]["refused"] == ("rank 1 runs stages [1] of this schedule, "
                                          "got modules for []")


def test_stages_are_balanced_by_cost_and_chain_to_the_models_own_loss():
    assert balance([1, 1, 1, 1], 2) == [range(0, 2), range(2, 4)]
    assert balance([1, 1, 1, 1], 2, last=2) == [range(0, 3), range(3, 4)]   # the head is heavy
    assert balance([5, 1, 1, 1, 1, 5], 3) == [range(0, 1), range(1, 5), range(5, 6)]
    with pytest.raises(ValueError, match="cannot cut 2 blocks into 3 stages"):
        balance([1, 1], 3)
    # Ranks that differ: a stage's time is its cost over its ranks' speed.
    assert balance([1] * 8, 2, speeds=[3, 1]) == [range(0, 6), range(6, 8)]
    assert balance([1] * 8, 2, speeds=[1, 3]) == [range(0, 2), range(2, 8)]
    assert balance([1] * 4, 2, last=2, speeds=[1, 1]) == balance([1] * 4, 2, last=2)
    with pytest.raises(ValueError, match="stage speeds: one positive speed per stage"):
        balance([1] * 4, 2, speeds=[1])
    model = new_gpt()
    tokens, targets = gpt_batch(0)
    x = tokens
    stages = split_stages(model, 3)
    for stage in stages[:-1]:
        x = stage(x)
    assert torch.equal(stages[-1](x, targets), model(tokens, targets))   # same arithmetic
    assert sum(len(s.index_range) for s in stages) == 4


def test_megatron_table1_rows_and_the_calibrated_simulator():
    """Table 1's rows reproduce their published aggregate PFLOP/s; the compute rate calibrated
    on the first row (no tensor or pipeline parallelism) predicts it exactly; a pipelined row
    has a bubble, interleaving shrinks it."""
    published = {1.7: 4.4, 39.1: 70.8, 1008.0: 502.0}
    for run in TABLE1:
        assert run.d * run.t * run.p == run.gpus
        if run.params_b in published:
            assert run.tflops * run.gpus / 1e3 == pytest.approx(published[run.params_b], rel=0.01)
    hw = megatron.calibrate(TABLE1[0], megatron.Hardware())
    assert megatron.predict(TABLE1[0], hw)["tflops"] == pytest.approx(TABLE1[0].tflops, rel=1e-6)
    row = TABLE1[4]   # 39.1B: t=8, p=2, d=32
    plain, inter = megatron.predict(row, hw), megatron.predict(row, hw, v=2)
    assert plain["m"] == 48 and 0 < inter["bubble"] < plain["bubble"]


def test_timelines_draw_as_a_png(tmp_path):
    sim = simulate(one_f_one_b(2, 3), [1e-3, 1e-3])
    path = draw({"simulated": sim.timeline}, tmp_path / "t.png", "1f1b")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
