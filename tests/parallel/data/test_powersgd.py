"""PowerSGD on the dense buckets (ParallelConfig(grad_compress="powersgd")) against PyTorch's
own: DDP with its powerSGD_hook, on the same two ranks, model and batches. Both factor the same
matrices from the same seeds, keep error feedback and warm start, and all-reduce plainly for the
first steps; on two ranks (a sum of two is the same in any order) the parameters agree bit for
bit, although the hook sums the plain gradients and the Ps in two all-reduces where tilework
sends them in one. The bytes counted are the cost model's."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel as DDP

import tilework
from tests.equivalence import LR, job
from tilework import ParallelConfig
from tilework.checkpoint import file as checkpoint_file
from tilework.cluster.topology import Topology
from tilework.comm.wire import low_rank_values, low_rank_view
from tilework.data import ShardedBatches
from tilework.errors import ConfigError
from tilework.estimate.cost import dense_sync_bytes
from tilework.planner import plan
from tilework.plans.plan import Plan
from tilework.testing import spawn
from tilework.train.workloads import build

BATCH, STEPS, START = 8, 6, 2


def trained(rank, world_size, system, powersgd_rank, accumulate=False):
    work = build(job("cnn"))
    opt = torch.optim.SGD(work.model.parameters(), lr=LR["sgd"])
    model = work.model
    if system == "ddp":
        model = DDP(work.model)
        state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=powersgd_rank,
                                   start_powerSGD_iter=START)
        model.register_comm_hook(state, psgd.powerSGD_hook)
    else:
        tilework.parallelize(model, opt, mode="allreduce", log=False, grad_compress="powersgd",
                             powersgd_rank=powersgd_rank, powersgd_start=START)
    sampler = ShardedBatches(len(work.train_set), BATCH, rank, world_size)
    losses = []
    for step in range(STEPS):
        if accumulate:   # a micro-batch under no_sync first: its gradient rides the next
            with model.no_sync():
                work.loss(model, work.train_set.collate(sampler.indices(STEPS + step)),
                          step).backward()
        loss = work.loss(model, work.train_set.collate(sampler.indices(step)), step)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    dist.barrier()
    stats = tilework.stats(model) if system != "ddp" else None
    return {k: v.detach().clone() for k, v in work.model.state_dict().items()}, losses, stats


def test_accumulated_gradients_are_compressed_as_ddps_powersgd_hook_does():
    """Micro-batches under no_sync leave local sums; the synchronised backward compresses
    the whole accumulated gradient, in DDP with the hook as here."""
    ours = spawn(trained, 2, args=("tilework", 2, True), timeout=180)
    theirs = spawn(trained, 2, args=("ddp", 2, True), timeout=180)
    for k, v in theirs[1][0].items():
        assert torch.equal(ours[1][0][k], v), k


@pytest.mark.parametrize("powersgd_rank", [1, 3])   # Gram-Schmidt, and QR above rank 2
def test_powersgd_buckets_train_as_ddps_powersgd_hook(powersgd_rank):
    ours = spawn(trained, 2, args=("tilework", powersgd_rank), timeout=180)
    theirs = spawn(trained, 2, args=("ddp", powersgd_rank), timeout=180)
    for r in range(2):   # every rank ends with the same model as torch's
        for k, v in theirs[r][0].items():
            assert torch.equal(ours[r][0][k], v), k
        assert ours[r][1] == theirs[r][1]
    # The bytes: START plain steps, then the factors (so neither side passed on plain
    # all-reduce), as the cost model counts them.
    model = build(job("cnn")).model
    shapes = [tuple(p.shape) for p in model.parameters()]
    nbytes = [p.numel() * p.element_size() for p in model.parameters()]
    factored = dense_sync_bytes(nbytes, 25 * 2**20, 2, grad_compress="powersgd", shapes=shapes,
                                powersgd_rank=powersgd_rank)
    assert ours[0][2]["total"]["allreduce"]["sent"] == \
        START * dense_sync_bytes(nbytes, 25 * 2**20, 2) + (STEPS - START) * factored
    assert factored < dense_sync_bytes(nbytes, 25 * 2**20, 2)


def test_which_gradients_powersgd_factors_and_what_it_sends():
    """torch's rule: a matrix (first dimension by the rest) whose rank-r factors take under
    half its values; the first all-reduce carries the rest and the Ps, the second the Qs."""
    assert low_rank_view((64, 256), 4) == (64, 256, 4)
    assert low_rank_view((8, 4, 3, 3), 1) == (8, 36, 1)
    assert low_rank_view((8, 4, 3, 3), 3) == (8, 36, 3)      # 264 < 288 values
    assert low_rank_view((4, 3, 3, 3), 3) is None            # 186 >= 108
    assert low_rank_view((256,), 1) is None and low_rank_view((), 1) is None
    assert low_rank_view((2, 2), 8) is None                  # the rank is capped by the shape
    assert low_rank_values([(64, 256), (256,), (64,)], 2) == (64 * 2 + 256 + 64, 256 * 2)
    assert low_rank_values([(256,)], 2) == (256, 0)


def test_a_plan_prices_powersgd_factors_and_says_so():
    model = build(job("lm")).model
    made = plan(model, ParallelConfig(mode="allreduce", grad_compress="powersgd",
                                      powersgd_rank=2, powersgd_start=10),
                topology=Topology.from_sizes([2]))
    assert (made.grad_compress, made.powersgd_rank, made.powersgd_start) == ("powersgd", 2, 10)
    entries = made.by_name()
    factored = [p for p in made.of("allreduce") if low_rank_view(p.shape, 2) is not None]
    assert factored and all("rank-2 factors" in p.reason for p in factored)
    bias = next(p for p in made.of("allreduce") if len(p.shape) == 1)
    assert "as it is" in bias.reason
    table = next(p for p in factored if p.shape == (400, 8))
    assert entries[table.name].predicted.bytes_sent == (400 + 8) * 2 * 4   # two ranks: 2(n-1)/n
    # The plan round-trips through plan.json, and its config is the one it came from.
    from tilework.plans.plan import config_of
    assert Plan.from_dict(made.as_dict()) == made
    assert (config_of(made).powersgd_rank, config_of(made).powersgd_start) == (2, 10)


def test_what_powersgd_refuses_in_one_line():
    for bad, field in (({"powersgd_rank": 0}, "powersgd_rank"),
                       ({"powersgd_rank": True}, "powersgd_rank"),
                       ({"powersgd_start": -1}, "powersgd_start")):
        with pytest.raises(ConfigError, match=f"{field}: expected"):
            ParallelConfig(grad_compress="powersgd", **bad)
    for bad in ({"zero": 2}, {"sync": "diloco"}, {"tp": 2}):
        with pytest.raises(ConfigError, match="grad_compress: expected 'none' with sync="):
            ParallelConfig(grad_compress="powersgd", **bad)


def resumed(rank, world_size, path, stop, steps, saved_at):
    """PowerSGD (rank 2, factors from step 2) with Adam: train to `stop` and save
    (tilework.save), or, when `stop` is None, load what was saved at `saved_at` and train to
    `steps`. Returns every rank's final parameters."""
    work = build(job("cnn"))
    opt = torch.optim.Adam(work.model.parameters(), lr=LR["adam"])
    tilework.parallelize(work.model, opt, mode="allreduce", log=False, grad_compress="powersgd",
                         powersgd_rank=2, powersgd_start=START)
    sampler = ShardedBatches(len(work.train_set), BATCH, rank, world_size)
    start = 0
    if stop is None:
        tilework.load(path, work.model, opt)
        start = saved_at
    for step in range(start, stop if stop is not None else steps):
        work.loss(work.model, work.train_set.collate(sampler.indices(step)), step).backward()
        opt.step()
        opt.zero_grad()
    if stop is not None:
        tilework.save(path, work.model, opt)
    return {k: v.detach().clone() for k, v in work.model.state_dict().items()}


def test_a_powersgd_run_resumes_bit_for_bit(tmp_path):
    """The checkpoint holds the warm Qs, the seeds, the steps so far and each rank's error:
    saved after the factors started and resumed, the run equals one never stopped."""
    whole = spawn(resumed, 2, args=(str(tmp_path / "a.pt"), STEPS, STEPS, 0), timeout=180)
    spawn(resumed, 2, args=(str(tmp_path / "b.pt"), 4, STEPS, 0), timeout=180)
    again = spawn(resumed, 2, args=(str(tmp_path / "b.pt"), None, STEPS, 4), timeout=180)
    for r in range(2):
        for k, v in whole[r].items():
            assert torch.equal(again[r][k], v), k
    saved = checkpoint_file.load(tmp_path / "b.pt")["state"]   # weights-only, as tilework.load
    assert saved["grad_compress"]["kind"] == "powersgd"
    assert set(saved["grad_compress"]) >= {"steps", "qs", "errors", "rng_keys"}
    assert saved["grad_compress"]["steps"] == 4 and len(saved["grad_compress"]["errors"]) == 2


def test_a_saved_powersgd_state_that_does_not_fit_is_named():
    from tilework.parallel.data.powersgd import PowerSGD

    here = PowerSGD(2, 0, [[(64, 32), (64,)], [(8,)]])
    assert here.sizes == {0: (64 * 32 + 64, 32 * 2), 1: (8, 0)}
    saved = PowerSGD(2, 0, [[(64, 32), (64,)], [(8,)]])
    state = saved.state_dict() | {"qs": {"0": torch.zeros(64)}}
    assert here.misfit(state, {"0": torch.zeros(64 * 32 + 64), "1": torch.zeros(8)}) is None
    assert here.misfit(state, {"1": torch.zeros(9)}) == "PowerSGD's error of bucket 1"
    assert here.misfit(state | {"qs": {"0": torch.zeros(96)}}, None) == \
        "PowerSGD's factors of bucket 0"
    here.load_state_dict(state, None)   # seeds and steps carried across, exactly
    assert here.rng.randint(1_000_000_000) == saved.rng.randint(1_000_000_000)
    here.steps, here.errors[0] = 7, torch.ones(3)
    here.reset()   # a load without this state: as new, plain steps first
    assert (here.steps, here.errors, here.qs) == (0, {}, {})
    assert here.rng.randint(1_000_000_000) == PowerSGD(2, 0, []).rng.randint(1_000_000_000)


def test_a_plan_file_with_a_bad_compressor_setting_is_refused():
    """plan.json is not a checked ParallelConfig: a rank of 0 would zero every factored
    gradient silently, so the Plan itself refuses it."""
    made = plan(build(job("cnn")).model, ParallelConfig(mode="allreduce", grad_compress="powersgd"),
                topology=Topology.from_sizes([2]))
    for bad, field in (({"powersgd_rank": 0}, "powersgd_rank"), ({"powersgd_rank": 2.0},
                       "powersgd_rank"), ({"topk_ratio": 0}, "topk_ratio"),
                       ({"grad_compress": "int8"}, "grad_compress")):
        with pytest.raises(ValueError, match=field):
            Plan.from_dict(made.as_dict() | bad)
    assert low_rank_view((64, 256), 0) is None


def test_the_memory_estimate_holds_the_compressors_buffers():
    """Each rank's error (a copy of every bucket), PowerSGD's sent copy; top-k's ranking copy
    and the gathered pairs."""
    from tilework.estimate.memory import zero_figures

    model = build(job("cnn")).model
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    figures = {}
    for kind in ("none", "powersgd", "topk"):
        made = plan(model, ParallelConfig(mode="allreduce", grad_compress=kind),
                    topology=Topology.from_sizes([4]))
        figures[kind] = zero_figures(made, 1, 0).buckets
    assert figures["none"] == nbytes
    assert figures["powersgd"] == 3 * nbytes
    assert figures["topk"] == 3 * nbytes + int(2 * 4 * 0.01 * nbytes)


def _program(rank, world_size, system, which, compress):
    """A user's loop on a model not written for tilework (nanoGPT's tied lm_head and fused
    q/k/v, or Hugging Face's Llama with tied embeddings): two micro-batches, the first under
    no_sync, gradients clipped, a state_dict checkpoint saved and loaded midway, rank 0
    evaluating. DDP with torch's PowerSGD hook, or tilework with `compress`."""
    from tests.real_models import NanoGPT, hf_llama, lm_batch

    torch.manual_seed(0)
    model = NanoGPT() if which == "nanogpt" else hf_llama(tied=True)

    def loss_of(m, x, y):
        if which == "nanogpt":
            return m(x, y)[1]
        return m(input_ids=x, labels=x).loss

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run = model
    if system == "ddp":
        run = DDP(model)
        state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                   start_powerSGD_iter=2)
        run.register_comm_hook(state, psgd.powerSGD_hook)
    else:
        tilework.parallelize(model, opt, mode="allreduce", log=False, grad_compress=compress,
                             powersgd_rank=2, powersgd_start=2, topk_ratio=0.2)
    losses, evals = [], []
    for step in range(6):
        x, y = lm_batch(2 * step, 64, 8, 8, rank, world_size)
        with run.no_sync():
            (loss_of(run, x, y) / 2).backward()
        x, y = lm_batch(2 * step + 1, 64, 8, 8, rank, world_size)
        loss = loss_of(run, x, y) / 2
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if step == 2:   # the model's own state_dict, saved and loaded back
            model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
        if rank == 0:
            with torch.no_grad():
                evals.append(loss_of(model, *lm_batch(99, 64, 8, 8)).item())
    dist.barrier()
    return losses, evals, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("which", ["nanogpt", "hf-llama"])
def test_a_users_program_on_models_not_written_for_us_trains_as_ddp_with_the_hook(which):
    """Tied weights, fused projections, clipping, accumulation, a state_dict round trip and
    evaluation on one rank: PowerSGD trains as DDP + powerSGD_hook; top-k runs the same loop
    on nanoGPT (no torch peer) within 1% of the uncompressed run's held-out losses."""
    from tests.real_models import have_transformers

    if which == "hf-llama" and not have_transformers():
        pytest.skip("transformers is not installed (the 'models' extra)")
    ours = spawn(_program, 2, args=("tilework", which, "powersgd"), timeout=240)
    theirs = spawn(_program, 2, args=("ddp", which, "powersgd"), timeout=240)
    for r in range(2):
        assert ours[r][0] == pytest.approx(theirs[r][0], rel=1e-5, abs=1e-6)
        for k, v in theirs[r][2].items():
            torch.testing.assert_close(ours[r][2][k], v, rtol=1e-5, atol=1e-6, msg=k)
    assert ours[0][1] == pytest.approx(theirs[0][1], rel=1e-5)
    if which != "nanogpt":   # once is enough (the suite's time)
        return
    topk = spawn(_program, 2, args=("tilework", which, "topk"), timeout=240)
    plain = spawn(_program, 2, args=("tilework", which, "none"), timeout=240)
    assert topk[0][1] == pytest.approx(plain[0][1], rel=1e-2)
    assert topk[0][2].keys() == plain[0][2].keys()
