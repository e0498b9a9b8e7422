"""`tilework.parallelize` with tp, pp and cp (ParallelConfig(tp=, pp=, cp=, ...)): the reference
GPT trained on a dp x pp x cp x tp mesh equals one process, counted bytes per axis equal the
cost model's, and its checkpoint is one process's."""

from __future__ import annotations

import contextlib

import pytest
import torch

import tilework
from tests import tiny_gpt
from tilework.checkpoint import file as checkpoint
from tilework.errors import ConfigError, PlanError
from tilework.estimate.step_bytes import mesh_step_bytes
from tilework.models.gpt import TinyGPT
from tilework.parallel.tensor import GPT_LAYOUT, plan_layout
from tilework.parallel.tensor.cost import tp_step_calls
from tilework.testing import spawn

STEPS, GLOBAL_BATCH, SEQ, VOCAB = 3, 8, 8, 52
TOL = 1e-5   # SGD, relative to each tensor's largest magnitude: tp sums and the dp all-reduce
#              reorder additions (seen: below 2e-6)


def new_gpt(layers: int = 4, tied: bool = False) -> TinyGPT:
    torch.manual_seed(0)
    model = TinyGPT(vocab=VOCAB, dim=16, heads=4, layers=layers, seq_len=SEQ)
    if tied:   # GPT-2's and nanoGPT's weight tying: the head is the embedding
        model.head.weight = model.tokens.weight
    return model


def batch(step: int, part: int = 0, parts: int = 1):
    return tiny_gpt.gpt_batch(step, VOCAB, SEQ, GLOBAL_BATCH, part, parts)


def reference(clip: float | None = None, tied: bool = False, steps: int = STEPS):
    """One process's losses and state; with `clip`, torch's clip_grad_norm_ every step."""
    model = new_gpt(tied=tied)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, norms = [], []
    for step in range(steps):
        loss = model(*batch(step))
        loss.backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.clone() for k, v in model.state_dict().items()}, norms


def _train(rank, world_size, configs):
    """Each config in turn on the same world: losses as this rank saw them and the full state."""
    out = []
    for options in configs:
        options = dict(options)
        clip = options.pop("clip", None)
        plain_after = options.pop("unparallelize", False)
        model = new_gpt(tied=options.pop("tied", False))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = tilework.parallelize(model, opt, log=False, **options)
        dp_rank, dp = tilework.data_parallel_rank(model)
        losses, norms = [], []
        for step in range(STEPS):
            tokens, targets = batch(step, dp_rank, dp)
            if options.get("pp", 1) > 1:
                loss = model.step(tokens, targets)
            else:
                loss = model(tokens, targets)
                loss.backward()
            if clip is not None:
                norms.append(tilework.clip_grad_norm_(model, clip).item())
            opt.step()
            opt.zero_grad()
            losses.append(None if loss is None else loss.item())
        stats = tilework.stats(model)["last_step"]
        out.append((losses, tilework.state_dict(model, opt)["model"],
                    {k: v["sent"] for k, v in stats.items()}, norms,
                    model._tilework_engine.plan.recompute,
                    {k: v["calls"] for k, v in stats.items()}, _what_ran(model),
                    _trained_on_plain(model, opt) if plain_after else None))
    return out


def _trained_on_plain(model, opt):
    """`unparallelize`, then UNPAR_STEPS more steps on the plain model and optimizer, on the
    whole batch as one process trains: its losses and state."""
    model, opt = tilework.unparallelize(model, opt)
    assert not hasattr(model, "_tilework_engine") and all(
        type(m).__module__.startswith("torch.") for m in model.modules() if m is not model)
    losses = []
    for step in range(STEPS, STEPS + UNPAR_STEPS):
        loss = model(*batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def _what_ran(model) -> dict:
    """The plan this rank's runtime was given, and what it did: the engine's plan, the layout
    it applied, the stages it cut, the shapes its part holds."""
    engine = model._tilework_engine
    found = engine.mesh
    stages = None if found.pipeline is None else [
        (s.index_range.start, s.index_range.stop) for s in found.pipeline.runner.stages.values()]
    with tilework.full_parameters(model):   # ZeRO-3's values are whole only here
        shapes = {n: tuple(p.shape) for n, p in engine.model.named_parameters()}
    return {"plan": found.plan, "engine_plan": engine.plan,
            "pp_rank": found.groups.coord("pp"),
            "layout": None if found.layout is None else tuple(
                (p.module, p.style) for p in found.layout.placements),
            "stages": stages,
            "shapes": shapes, "served": sorted([*engine.tables, *engine.served])}


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and (a - b).abs().max() <= TOL * max(b.abs().max(), 1e-30)


def _check(results, options, ref):
    ref_losses, ref_state, ref_norms = ref
    world = len(results)
    dp = world // (options.get("tp", 1) * options.get("pp", 1) * options.get("cp", 1))
    for rank, r in enumerate(results):
        assert len(r[3]) == len(ref_norms) and all(
            abs(a - b) <= TOL * b for a, b in zip(r[3], ref_norms)), (options, rank, r[3])
    # Bytes: the plain configurations (ZeRO's and the servers' are estimate/cost.py's, checked in
    # test_cost; recompute's second forward repeats its tp collectives, not modelled here).
    if not options.get("zero") and not options.get("overrides") and "clip" not in options \
            and "tied" not in options and "recompute" not in options:
        config = tilework.ParallelConfig(**options)
        for rank, r in enumerate(results):   # counted bytes per axis == the cost model's
            assert r[2] == mesh_step_bytes(new_gpt(), config, world, rank, GLOBAL_BATCH // dp,
                                           SEQ), (options, rank)
            if config.tp > 1 and config.pp == 1:   # and the calls a per-message cost counts
                layout = plan_layout(new_gpt(), GPT_LAYOUT, config.tp, config.sequence_parallel)
                assert r[5]["tp"] == sum(tp_step_calls(layout)), (options, rank)
    for rank, (losses, state, *_) in enumerate(results):
        assert set(state) == set(ref_state), f"rank {rank}: keys differ"
        bad = [k for k in ref_state if not _close(state[k], ref_state[k])]
        assert not bad, f"{options} rank {rank}: {bad}"
    # dp replicas' losses are their slices' means: their mean is the batch's.
    seen = [[r[0][s] for r in results if r[0][s] is not None] for s in range(STEPS)]
    for step, values in enumerate(seen):
        assert len(values) >= dp
        mean = sum(values) / len(values)
        assert abs(mean - ref_losses[step]) <= TOL * abs(ref_losses[step]), (options, step)


TWO = [{"cp": 2}, {"tp": 2}, {"tp": 2, "recompute": "full"},
       {"pp": 2, "microbatches": 4, "recompute": "full"}, {"tp": 2, "sequence_parallel": True},
       {"pp": 2, "microbatches": 4},
       {"pp": 2, "microbatches": 4, "schedule": "gpipe"},
       {"pp": 2, "microbatches": 4, "schedule": "interleaved"}]
# The embedding left whole by the layout and served by the parameter server over dp, while
# the blocks are split over tp: the combination the issue names.
SERVED_TOKENS = {"tp": 2, "layout": {k: v for k, v in GPT_LAYOUT.items() if k != "tokens"},
                 "overrides": {"tokens.weight": "ps"}}
FOUR = [{"cp": 2}, {"tp": 2, "sequence_parallel": True}, {"pp": 2, "microbatches": 2},
        {"tp": 2, "pp": 2, "microbatches": 2},
        {"tp": 2, "pp": 2, "microbatches": 2, "sequence_parallel": True},
        {"tp": 2, "zero": 1}, {"tp": 2, "zero": 3},
        SERVED_TOKENS,
        # ZeRO-3 on pipeline stages: each block gathered by its own forward as the stage
        # calls it (the whole model's units), the stage's ends as the part's own unit.
        {"pp": 2, "microbatches": 2, "zero": 3}, {"pp": 2, "microbatches": 2, "zero": 2}]
EIGHT = [{"tp": 2, "pp": 2, "microbatches": 2}]
# Context parallelism with the other axes: ring attention on tp's heads; on pipeline stages.
CP_MIXED = [{"cp": 2, "tp": 2}, {"cp": 2, "pp": 2, "microbatches": 2}]


# Trained on the mesh, then unparallelized and trained on as one process.
UNPAR_STEPS = 2
UNPAR_TWO = [{"tp": 2, "unparallelize": True},
             {"pp": 2, "microbatches": 4, "unparallelize": True}]
UNPAR_FOUR = [{"tp": 2, "unparallelize": True}]   # dp2 x tp2

CLIP = 0.5   # below the GPT's gradient norms (0.66-0.71): every step clips
CLIPPED_TWO = [{"tp": 2, "clip": CLIP}, {"pp": 2, "clip": CLIP},
               {"tp": 2, "sequence_parallel": True, "clip": CLIP}]
CLIPPED_FOUR = [{"tp": 2, "pp": 2, "clip": CLIP}, {"tp": 2, "zero": 2, "clip": CLIP},
                {"cp": 2, "zero": 3, "clip": CLIP}, dict(SERVED_TOKENS, clip=CLIP)]
TIED = [{"tp": 2, "tied": True}, {"tp": 2, "tied": True, "sequence_parallel": True},
        {"pp": 2, "tied": True, "microbatches": 4}]


@pytest.fixture(scope="module")
def ref():
    return reference()


# One world per size runs every configuration in turn (a world's start costs seconds on 2
# cores); each test reads its configurations' results.
@pytest.fixture(scope="module")
def two_ranks():
    configs = TWO + CLIPPED_TWO + TIED + UNPAR_TWO
    results = spawn(_train, 2, (configs,), timeout=400)
    return {i: [r[i] for r in results] for i in range(len(configs))}


@pytest.fixture(scope="module")
def four_ranks():
    configs = FOUR + CP_MIXED + CLIPPED_FOUR + UNPAR_FOUR
    results = spawn(_train, 4, (configs,), timeout=500)
    return {i: [r[i] for r in results] for i in range(len(configs))}


def test_two_ranks_cp_tp_or_pp_train_as_one_process(ref, two_ranks):
    for k, options in enumerate(TWO):
        _check(two_ranks[k], options, ref)
    first = [two_ranks[k][0] for k in range(len(TWO))]
    assert set(first[0][2]) == {"cp", "allreduce"}   # dp x cp average the gradients
    tp_only = first[1][2]
    assert tp_only.get("tp", 0) > 0 and "allreduce" not in tp_only   # dp = 1: no dp bytes
    assert first[2][2]["tp"] > tp_only["tp"]   # full recompute repeats the forward's
    assert first[5][2].get("pipeline", 0) > 0
    # Each pipeline rank recomputes the blocks its stage holds (4 blocks, 2 stages).
    assert [[name for name, _ in r[4]] for r in two_ranks[3]] == [
        ["blocks.layers.0", "blocks.layers.1"], ["blocks.layers.2", "blocks.layers.3"]]


def test_four_ranks_dp_with_cp_tp_and_pp_train_as_one_process(ref, four_ranks):
    for k, options in enumerate(FOUR):
        _check(four_ranks[k], options, ref)


def test_cp_with_tp_or_pp_trains_as_one_process(ref, four_ranks):
    for k, options in enumerate(CP_MIXED, start=len(FOUR)):
        _check(four_ranks[k], options, ref)
        assert {"cp", "tp" if "tp" in options else "pipeline"} <= set(four_ranks[k][0][2])


def test_clip_grad_norm_on_a_mesh_is_one_process_clip(two_ranks, four_ranks):
    """tilework.clip_grad_norm_ over tp shards, pipeline stages, ZeRO chunks and server rows:
    the norm and the clipped step of torch's clip_grad_norm_ in one process."""
    ref = reference(CLIP)
    assert min(ref[2]) > CLIP
    for k, options in enumerate(CLIPPED_TWO, start=len(TWO)):
        _check(two_ranks[k], options, ref)
    for k, options in enumerate(CLIPPED_FOUR, start=len(FOUR) + len(CP_MIXED)):
        _check(four_ranks[k], options, ref)


def test_tied_embedding_and_head_stay_one_parameter_under_tp_and_pp(two_ranks):
    """vocab_embedding and vocab_head split the tied weight alike: one shard per rank, as
    Megatron-LM ties them; the gradient is the sum of both uses, as in one process. Under pp
    the first and last stages' ranks each hold it and sum their gradients over the pipeline
    (Megatron-LM's embedding group), so both copies take one update."""
    for k, options in enumerate(TIED, start=len(TWO) + len(CLIPPED_TWO)):
        _check(two_ranks[k], options, reference(tied=True))


def _refused(run) -> str | None:
    try:
        run()
    except PlanError as e:
        return str(e)
    return None


def _mistakes(rank, world_size):
    """Each refusal in turn on one world: what the program did wrong, and the message."""
    out = {}

    def parallel(options, tied=False):
        model = new_gpt(tied=tied)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return tilework.parallelize(model, opt, log=False, **options)

    for options in ({"tp": 2}, {"pp": 2}, {"cp": 2}):
        # A loader sharding by the world's rank: the replica's ranks get different batches.
        model, _ = parallel(options)
        step = model.step if options.get("pp", 1) > 1 else model
        out[("batches", *options)] = _refused(lambda: step(*batch(0, rank, world_size)))
    for options in ({"tp": 2}, {"pp": 2}):
        # nanoGPT's clipping line on a mesh.
        model, _ = parallel(options)
        if "pp" in options:
            model.step(*batch(0))
        else:
            model(*batch(0)).backward()
        out[("torch clip", *options)] = _refused(
            lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    model, _ = parallel({"pp": 2})
    out["plain forward"] = _refused(lambda: model(*batch(0)))
    with torch.no_grad():
        out["no_grad step"] = _refused(lambda: model.step(*batch(0)))
    out["evaluate"] = model.evaluate(*batch(0))   # forward only: the loss on the last stage
    out["dropout"] = _dropout_replicas(rank)
    return out


def _dropout_replicas(rank):
    """nanoGPT's seeding (1337 + rank) with dropout on: tp ranks must still drop alike where
    they hold activations alike, or their replicated parameters drift apart."""
    model = new_gpt()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.2
    torch.manual_seed(1337 + rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = tilework.parallelize(model, opt, log=False, tp=2)
    dp_rank, dp = tilework.data_parallel_rank(model)
    for step in range(2):
        model(*batch(step, dp_rank, dp)).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in model.named_parameters() if "norm" in k}


@pytest.fixture(scope="module")
def mistakes():
    """At 4 ranks: data parallelism beside every model-parallel axis."""
    return spawn(_mistakes, 4, timeout=300)


@pytest.mark.parametrize("axis", ["tp", "pp", "cp"])
def test_ranks_of_a_replica_given_different_batches_are_refused(mistakes, axis):
    for m in mistakes:
        message = m[("batches", axis)] or ""
        assert "were given different batches" in message and "data_parallel_rank" in message


@pytest.mark.parametrize("axis", ["tp", "pp"])
def test_torch_clip_on_a_mesh_is_refused_with_the_fix(mistakes, axis):
    for m in mistakes:
        assert "tilework.clip_grad_norm_(model, max_norm)" in (m[("torch clip", axis)] or "")


def test_pipeline_model_refuses_a_plain_forward(mistakes):
    assert all("model.step(inputs, targets)" in (m["plain forward"] or "") for m in mistakes)


def test_a_pipeline_evaluates_forward_only(mistakes):
    assert all("model.evaluate(inputs, targets)" in (m["no_grad step"] or "") for m in mistakes)
    with torch.no_grad():
        expected = new_gpt()(*batch(0)).item()
    # pp2 x dp2: the last stage's ranks (1 and 3) hold the loss, the first stage's None.
    got = [m["evaluate"] for m in mistakes]
    assert got[0] is None and got[2] is None
    assert all(abs(x - expected) <= TOL * expected for x in (got[1], got[3]))


def test_dropout_under_tp_keeps_the_replicated_parameters_alike(mistakes):
    for a, b in ((0, 1), (2, 3)):                 # the tp pairs
        first, second = mistakes[a]["dropout"], mistakes[b]["dropout"]
        assert all(torch.equal(first[k], second[k]) for k in first), sorted(first)


def test_eight_ranks_dp2_pp2_tp2_train_as_one_process(ref):
    results = spawn(_train, 8, (EIGHT,), timeout=400)
    _check([r[0] for r in results], EIGHT[0], ref)
    sent = results[0][0][2]
    assert {"tp", "pipeline", "allreduce"} <= set(sent), sent


@pytest.mark.parametrize("options, message", [
    ({"tp": 0}, "tp"), ({"pp": 2, "schedule": "zigzag"}, "schedule"),
    ({"tp": 2, "mode": "ps"}, "mode"), ({"microbatches": 0}, "microbatches"),
])
def test_config_refuses_bad_mesh_fields(options, message):
    with pytest.raises(ConfigError, match=message):
        tilework.ParallelConfig(**options)


# SGD with momentum: its state travels through the checkpoint. (Not Adam: the attention's key
# bias has a gradient of exactly zero in exact arithmetic, and Adam turns the reordering's
# 1e-9 noise there into steps of lr's size.)
def new_optimizer(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _steps(model, opt, steps, dp_rank, dp, pipelined, first=0):
    for step in range(first, first + steps):
        tokens, targets = batch(step, dp_rank, dp)
        if pipelined:
            model.step(tokens, targets)
        else:
            model(tokens, targets).backward()
        opt.step()
        opt.zero_grad()


def _save_then_resume(rank, world_size, path, save_options, load_options):
    """2 steps at one mesh and saved, resumed for 1 step at another."""
    options = save_options if world_size == 4 else load_options
    model = new_gpt()
    opt = new_optimizer(model.parameters())
    model, opt = tilework.parallelize(model, opt, log=False, **options)
    mesh = model._tilework_engine.mesh
    dp, at = mesh.mesh.size_of("dp"), mesh.groups.coord("dp")
    pipelined = options.get("pp", 1) > 1
    if world_size == 4:
        _steps(model, opt, 2, at, dp, pipelined)
        tilework.save(path, model, opt)
        return None
    tilework.load(path, model, opt)
    _steps(model, opt, 1, at, dp, pipelined, first=2)
    return tilework.state_dict(model, opt)["model"]


def test_checkpoint_saved_at_one_mesh_resumes_at_another(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    save_options, load_options = {"tp": 2, "pp": 2, "microbatches": 2}, {"tp": 2}
    spawn(_save_then_resume, 4, (path, save_options, load_options), timeout=300)
    plain = checkpoint.load(path)["state"]["model"]
    assert set(plain) == set(new_gpt().state_dict())          # one process's keys and shapes
    resumed = spawn(_save_then_resume, 2, (path, save_options, load_options), timeout=300)
    model = new_gpt()
    opt = new_optimizer(model.parameters())
    for step in range(3):
        model(*batch(step)).backward()
        opt.step()
        opt.zero_grad()
    for key, value in model.state_dict().items():
        for state in resumed:
            assert (state[key] - value).abs().max() <= TOL * max(value.abs().max(), 1e-30), key


def _accumulated(rank, world_size, options):
    """Each optimizer step over two half batches, the first under no_sync (DDP's
    accumulation): the parameters after 2 steps."""
    model = new_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if options:
        model, opt = tilework.parallelize(model, opt, log=False, **options)
    dp_rank, dp = tilework.data_parallel_rank(model) if options else (0, 1)
    for step in range(2):
        tokens, targets = batch(step, dp_rank, dp)
        halves = list(zip(tokens.chunk(2), targets.chunk(2)))
        for k, half in enumerate(halves):
            context = model.no_sync() if k == 0 and options else contextlib.nullcontext()
            with context:
                if options.get("pp", 1) > 1:
                    model.step(*half)
                else:
                    model(*half).backward()
        opt.step()
        opt.zero_grad()
    return tilework.state_dict(model, opt)["model"] if options else model.state_dict()


@pytest.mark.parametrize("options", [{"pp": 2, "microbatches": 2}, {"tp": 2}])
def test_accumulation_with_no_sync_on_a_mesh_is_one_process_accumulation(options):
    mine = spawn(_accumulated, 4, (options,), timeout=240)
    ref = _accumulated(0, 1, {})
    for state in mine:
        assert all(_close(state[k], v) for k, v in ref.items())


def _runs_its_plan(results, options, world: int) -> None:
    """What ran on every rank is `tilework.plan` of a meta model under the same config, field
    by field: the plan, each rank's part of it (its engine's plan: placements over dp, ZeRO,
    the servers' partitions, recompute), the layout applied, the stages cut, the shapes held."""
    options = {k: v for k, v in options.items() if k not in ("clip", "tied")}
    with torch.device("meta"):
        meta = new_gpt()
    planned = tilework.plan(meta, tilework.ParallelConfig(**options),
                            topology=tilework.Topology.from_sizes([world]))
    for rank, r in enumerate(results):
        ran = r[6]
        assert ran["plan"] == planned, (options, rank, planned.diff(ran["plan"]))
        part = planned.part(ran["pp_rank"])
        assert ran["engine_plan"] == part, (options, rank, part.diff(ran["engine_plan"]))
        assert ran["layout"] == (planned.parallel.layout or None), (options, rank)
        if planned.parallel.stages:
            mine = [planned.parallel.stages[s] for s in range(len(planned.parallel.stages))
                    if s % planned.mesh.size_of("pp") == ran["pp_rank"]]
            assert ran["stages"] == mine, (options, rank)
        # A table on the servers is no parameter of the model any more: its rows are served.
        assert ran["shapes"] == {p.name: p.shape for p in part.params if p.method != "ps"}, \
            (options, rank)
        assert ran["served"] == sorted(p.name for p in part.params if p.method == "ps"), \
            (options, rank)


def test_the_plan_tilework_plan_returns_is_what_runs_on_every_axis(two_ranks, four_ranks):
    """tp, pp (three schedules), cp, ZeRO 1 and 3, recompute, and a table on the servers over
    dp beside tp: each run's plan equals the one made on the meta device beforehand."""
    for k, options in enumerate(TWO):
        _runs_its_plan(two_ranks[k], options, 2)
    for k, options in enumerate(FOUR + CP_MIXED):
        _runs_its_plan(four_ranks[k], options, 4)
    served = four_ranks[FOUR.index(SERVED_TOKENS)][0][6]["plan"].by_name()["tokens.weight"]
    assert (served.method, served.tp_split) == ("ps", "")


def test_unparallelize_on_a_mesh_leaves_the_plain_model_training_on_as_one_process(
        two_ranks, four_ranks):
    """tp2, pp2 and dp2 x tp2: after unparallelize every rank holds the plain model (torch's
    own modules, no tilework attribute) and optimizer, and trains on exactly as one process
    does after the same steps."""
    losses, state, _ = reference(steps=STEPS + UNPAR_STEPS)
    runs = [two_ranks[len(TWO + CLIPPED_TWO + TIED) + k] for k in range(len(UNPAR_TWO))] + \
        [four_ranks[len(FOUR + CP_MIXED + CLIPPED_FOUR)]]
    for options, results in zip(UNPAR_TWO + UNPAR_FOUR, runs):
        for rank, r in enumerate(results):
            plain_losses, plain_state = r[7]
            assert all(abs(a - b) <= TOL * abs(b)
                       for a, b in zip(plain_losses, losses[STEPS:])), (options, rank)
            bad = [k for k in state if not _close(plain_state[k], state[k])]
            assert not bad, (options, rank, bad)
