"""ZeRO stages 1-3 (parallel/data/zero.py, parallel/data/zero3.py) train the model one process
trains.

The reference GPT (two transformer blocks, so stage 3 has two block units and the model's own)
trains 3 steps on 2 or 4 real gloo ranks, each on its share of a global batch of 8 sequences,
and as one plain process on the whole batch. Tolerances, relative to each tensor's largest
magnitude: SGD 1e-5, Adam/AdamW 1e-4 (the ranks' sums reorder the reference's; Adam divides by a
running norm). Optimizer state is compared as `optimizer.state_dict()` gives it: the plain
optimizer's layout, whatever the stage. With a server table (the token embedding on the
parameter server, hybrid with sharded dense state) SGD only: the servers apply Adam lazily to
the rows looked up, which a dense reference does not.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import tilework
from tilework import ParallelConfig
from tilework.checkpoint import file as checkpoint
from tilework.errors import ConfigError, PlanError
from tilework.models.gpt import TinyGPT
from tilework.testing import spawn

STEPS, GLOBAL_BATCH, SEQ, VOCAB = 3, 8, 8, 50
TOLERANCE = {"sgd": 1e-5, "adamw": 1e-4, "adam": 1e-4}


def new_model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab=VOCAB, dim=16, heads=2, layers=2, seq_len=SEQ)


def new_optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    # eps 1e-4, not 1e-8: the attention's key bias has a gradient that is zero in exact
    # arithmetic (softmax ignores a constant added to every key), and with a tiny eps Adam
    # turns its rounding noise into lr-sized steps that depend on the order of the sums.
    if name == "adamw":
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1, eps=1e-4)
    return torch.optim.Adam(params, lr=0.01, eps=1e-4)


def batch(step: int, rank: int = 0, world_size: int = 1):
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    per = GLOBAL_BATCH // world_size
    part = tokens[rank * per:(rank + 1) * per]
    return part[:, :-1], part[:, 1:]


def train(model, opt, steps, rank=0, world_size=1):
    losses = []
    for step in steps:
        loss = model(*batch(step, rank, world_size))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def reference(optimizer: str, steps=range(STEPS)):
    model = new_model()
    opt = new_optimizer(optimizer, model.parameters())
    losses = train(model, opt, steps)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses, opt.state_dict()


def _rank(rank, world_size, zero, optimizer, options):
    from tilework.cluster.topology import Topology
    from tilework.comm import build_groups

    model = new_model()
    opt = new_optimizer(optimizer, model.parameters())
    options = dict(options)
    hosts = options.pop("hosts", 1)   # emulated: ranks split into equal hosts
    groups = build_groups(dist.group.WORLD, Topology.uniform(hosts, world_size // hosts))
    tilework.parallelize(model, opt, zero=zero, log=False, groups=groups, **options)
    losses = train(model, opt, range(STEPS), rank, world_size)
    held = {n: p.untyped_storage().nbytes() for n, p in model.named_parameters()}
    engine = model._tilework_engine
    owned = {s.name: s.shard.numel() for s in engine.zero.shards}
    opt_state = opt.state_dict()   # a collective: the shards' state gathered whole
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    stats = tilework.stats(model)["last_step"]
    model(*batch(STEPS, rank, world_size)).backward()   # what a shard's gradient holds on to
    # each storage once: a bucket's summed row is shared by the shards that fill it
    storages = {s.shard.grad.untyped_storage().data_ptr(): s.shard.grad.untyped_storage().nbytes()
                for s in engine.zero.shards if s.stage >= 2 and s.shard.grad is not None}
    grads = {"held": sum(storages.values()),
             "owned": sum(4 * s.shard.numel() for s in engine.zero.shards if s.stage >= 2)}
    return {"losses": losses, "state": state, "opt": opt_state, "held": held, "owned": owned,
            "grads": grads, "stats": stats}


def close(what, got, expected, tol):
    assert tuple(got.shape) == tuple(expected.shape), f"{what}: shape {tuple(got.shape)}"
    scale = expected.abs().max().item() + 1e-12
    worst = (got.double() - expected.double()).abs().max().item() / scale
    assert worst <= tol, f"{what}: relative difference {worst:.2e} > {tol:.0e}"


def check_against_reference(results, optimizer, check_state=True):
    state, losses, opt_state = reference(optimizer)
    tol = TOLERANCE[optimizer]
    for rank, r in enumerate(results):
        assert set(r["state"]) == set(state)
        for k, v in state.items():
            close(f"rank {rank}: {k}", r["state"][k], v, tol)
        mean = [sum(x) / len(x) for x in zip(*(r["losses"] for r in results))]
        close("losses", torch.tensor(mean), torch.tensor(losses), tol)
        if check_state:
            got = r["opt"]
            assert got["param_groups"][0]["params"] == opt_state["param_groups"][0]["params"]
            assert set(got["state"]) == set(opt_state["state"])
            for i, s in opt_state["state"].items():
                for key, value in s.items():
                    close(f"rank {rank}: optimizer {key} of #{i}", got["state"][i][key], value, tol)


CASES = [(1, 2, "adamw", {}), (2, 2, "adamw", {}), (3, 2, "adamw", {}), (2, 4, "sgd", {}),
         (3, 4, "adam", {}),
         (2, 2, "sgd", {"overrides": {"tokens.weight": "ps"}}),
         (3, 4, "sgd", {"overrides": {"tokens.weight": "ps"}}),
         (3, 2, "adamw", {"recompute": "full"}),
         (1, 4, "adamw", {"zero_scope": "host", "hosts": 2}),
         (2, 4, "adamw", {"zero_scope": "host", "hosts": 2}),
         (3, 4, "sgd", {"zero_scope": "host", "hosts": 2, "overrides": {"tokens.weight": "ps"}}),
         # chunks by weight (ranks of different memory): uneven shards, padded on the wire
         (1, 2, "adamw", {"zero_weights": [3, 1]}),
         (2, 4, "adam", {"zero_weights": [4, 1, 2, 1]}),
         (3, 4, "adamw", {"zero_weights": [1, 3, 1, 2]}),
         (3, 2, "sgd", {"zero_weights": [1, 2], "overrides": {"tokens.weight": "ps"}})]


@pytest.mark.parametrize("zero, world_size, optimizer, options", CASES,
                         ids=[f"zero{z}-{w}ranks-{o}-{'+'.join(opts) or 'dense'}"
                              for z, w, o, opts in CASES])
def test_trains_as_one_process(zero, world_size, optimizer, options):
    results = spawn(_rank, world_size, args=(zero, optimizer, options), timeout=120)
    # With a server table its optimizer state lives on the servers, in tilework's row layout.
    check_against_reference(results, optimizer, check_state="overrides" not in options)
    weights = options.get("zero_weights")
    if weights:   # each rank keeps its weight's share of every parameter, to an element
        for name, numel in ((n, p.numel()) for n, p in new_model().named_parameters()):
            got = [r["owned"][name] for r in results if name in r["owned"]]
            if got:
                assert sum(got) == numel
                for w, n in zip(weights, got):
                    assert abs(n - numel * w / sum(weights)) < 1, (name, got)
        for r in results:   # and its gradients no more (not views of the padded bucket)
            assert r["grads"]["held"] == r["grads"]["owned"], r["grads"]
    if zero == 3:   # between steps a rank holds no full value: only its shards
        for r in results:
            held = {n: b for n, b in r["held"].items() if b and n != "tokens.weight"}
            assert held == {}, f"full values held between steps: {sorted(held)}"


def _save_then_resume(rank, world_size, zero, path, steps, options=None):
    model = new_model()
    opt = new_optimizer("adam", model.parameters())
    tilework.parallelize(model, opt, zero=zero, log=False, **(options or {}))
    if steps.start > 0:
        tilework.load(path, model, opt)
    losses = train(model, opt, steps, rank, world_size)
    tilework.save(path, model, opt)
    return losses


@pytest.mark.parametrize("first, then", [
    ((2, 3, None), (4, 1, None)),
    # uneven chunks to even ones and back: the checkpoint is the one-process layout
    ((2, 3, {"zero_weights": [1, 3]}), (4, 2, {"zero_weights": [2, 1, 1, 3]}))],
    ids=["even", "uneven"])
def test_checkpoint_moves_between_world_sizes_and_stages(tmp_path, first, then):
    """Saved at 2 ranks under stage 3, resumed at 4 under stage 1 (2, with other weights):
    as one process."""
    path = str(tmp_path / "ckpt.pt")
    spawn(_save_then_resume, first[0], args=(first[1], path, range(0, 2), first[2]),
          timeout=120)
    spawn(_save_then_resume, then[0], args=(then[1], path, range(2, STEPS), then[2]),
          timeout=120)
    state, _, opt_state = reference("adam")
    saved = checkpoint.load(path)["state"]
    for k, v in state.items():
        close(k, saved["model"][k], v, TOLERANCE["adam"])
    plain = new_model()
    plain.load_state_dict(saved["model"])   # single-device layout: a plain model loads it


def _unparallelize(rank, world_size):
    model = new_model()
    opt = new_optimizer("adam", model.parameters())
    tilework.parallelize(model, opt, zero=3, log=False)
    train(model, opt, range(2), rank, world_size)
    tilework.unparallelize(model, opt)
    # A plain model and optimizer again: one more step alone on every rank, on the whole batch.
    train(model, opt, range(2, 3))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_unparallelize_after_stage_3_gives_back_the_plain_model():
    results = spawn(_unparallelize, 2, timeout=120)
    state, _, _ = reference("adam")
    for k, v in state.items():
        for r in results:
            close(k, r[k], v, TOLERANCE["adam"])


def test_counted_bytes_by_stage():
    """What one step sends per rank, by stage, on 2 ranks: stage 1 adds an all-gather to DDP's
    all-reduce; 2 is DDP's bytes (a reduce-scatter and an all-gather); 3 adds a gather per
    block unit (the counters equal the cost model exactly: tests/estimate/test_cost.py). And
    ZeRO's collectives are the ones the cost model prices, one per bucket or unit
    (estimate/cost.zero_exchanges), with their bytes."""
    from tilework.cluster.topology import Topology
    from tilework.comm.wire import REDUCE_SCATTER, all_gather_bytes
    from tilework.estimate.cost import zero_exchanges

    sent = {}
    # The last: buckets of 2 KB, so stage 2's exchanges take several.
    for zero, bucket_mb in ((0, 25.0), (1, 25.0), (2, 25.0), (3, 25.0), (2, 2 / 1024)):
        results = spawn(_rank, 2, args=(zero, "sgd", {"check_inputs": False,
                                                      "bucket_mb": bucket_mb}), timeout=120)
        if bucket_mb == 25.0:
            sent[zero] = sum(t["sent"] for m, t in results[0]["stats"].items()
                             if m in ("allreduce", "zero"))
        plan = tilework.plan(new_model(), ParallelConfig(zero=zero, bucket_mb=bucket_mb),
                             topology=Topology.from_sizes([2]))
        priced = zero_exchanges(list(plan.of("allreduce")), 2, 1, plan.bucket_bytes)
        counted = results[0]["stats"].get("zero", {"calls": 0, "sent": 0})
        assert counted["calls"] == sum(times for _, _, times in priced), (zero, priced)
        assert counted["sent"] == sum(
            times * (REDUCE_SCATTER.sent(chunk * 2, 2) if kind == "reduce_scatter"
                     else all_gather_bytes(chunk, 2)) for kind, chunk, times in priced), zero
    params = sum(p.numel() * 4 for p in new_model().parameters())
    assert sent[0] == params   # ring all-reduce on 2 ranks: 2 (n-1)/n = 1x the bytes
    assert sent[0] < sent[1] <= 1.5 * sent[0] + 64
    assert sent[0] <= sent[2] <= sent[0] + 64   # padding to 2 chunks: a few bytes at most
    assert sent[2] < sent[3] < 1.5 * sent[2] + 64


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_uneven_chunks_send_what_the_cost_model_prices_and_keep_what_memory_says(zero):
    """Chunks by weight 3:1 on 2 ranks: the counted bytes equal the cost model's (every chunk
    padded to the largest on the wire: 1.5x the even cut's reduce-scatter and gathers), and
    the memory estimate gives the lighter rank its quarter of the shards and their state."""
    from tilework.cluster.topology import Topology
    from tilework.comm.wire import REDUCE_SCATTER, all_gather_bytes
    from tilework.estimate.cost import zero_exchanges
    from tilework.estimate.memory import estimate_per_rank

    options = {"check_inputs": False, "zero_weights": [3, 1]}
    results = spawn(_rank, 2, args=(zero, "adam", options), timeout=120)
    topology = Topology.from_sizes([2])
    plan = tilework.plan(new_model(), ParallelConfig(zero=zero, zero_weights=[3, 1]),
                         topology=topology)
    even = tilework.plan(new_model(), ParallelConfig(zero=zero), topology=topology)
    from tilework.plans.plan import Plan, config_of

    # The configuration the plan says it runs under plans it again, and plan.json reads back.
    assert tilework.plan(new_model(), config_of(plan), topology=topology) == plan
    assert Plan.from_dict(plan.as_dict()) == plan

    def sent(priced):
        return sum(times * (REDUCE_SCATTER.sent(chunk * 2, 2) if kind == "reduce_scatter"
                            else all_gather_bytes(chunk, 2)) for kind, chunk, times in priced)

    priced = zero_exchanges(list(plan.of("allreduce")), 2, 1, plan.bucket_bytes)
    for r in results:
        assert r["stats"]["zero"]["calls"] == sum(times for _, _, times in priced)
        assert r["stats"]["zero"]["sent"] == sent(priced)
    assert sent(priced) > 1.4 * sent(zero_exchanges(list(even.of("allreduce")), 2, 1,
                                                    even.bucket_bytes))
    model = new_model()
    inputs = batch(0, 0, 2)
    heavy, light = estimate_per_rank(model, plan, inputs, "adam")
    alike = estimate_per_rank(model, even, inputs, "adam")[0]
    params = sum(p.numel() * 4 for p in model.parameters())
    count = len(list(model.parameters()))
    # Adam: two moments of its share, a step counter per parameter, each share to an element
    for got, share in ((heavy, 3 / 4), (light, 1 / 4)):
        assert abs(got.optimizer_state - 2 * params * share - 4 * count) <= 2 * 4 * count
    assert heavy.optimizer_state > alike.optimizer_state > light.optimizer_state


def test_bad_settings_are_named():
    with pytest.raises(ConfigError, match="zero: expected a ZeRO stage 0, 1, 2 or 3, got 4"):
        ParallelConfig(zero=4)
    with pytest.raises(ConfigError, match="offload: expected a ZeRO stage to offload from"):
        ParallelConfig(offload="optimizer")
    with pytest.raises(ConfigError, match="zero_weights: expected weights for ZeRO's chunks"):
        ParallelConfig(zero_weights=[1, 2])
    with pytest.raises(ConfigError, match="zero_weights: expected weights .* zero_scope='host'"):
        ParallelConfig(zero=2, zero_scope="host", zero_weights=[1, 2])
    with pytest.raises(ConfigError, match="zero_weights: expected a list of positive weights"):
        ParallelConfig(zero=2, zero_weights=[1, 0])
    with pytest.raises(ConfigError, match=r"zero_weights: one weight per rank \(1\), got 2"):
        tilework.plan(new_model(), ParallelConfig(zero=2, zero_weights=[1, 2]))
    model = new_model()
    with pytest.raises(PlanError, match="pass the optimizer"):
        tilework.parallelize(model, None, zero=2, log=False)
    model = new_model()
    lbfgs = torch.optim.LBFGS(model.parameters())
    with pytest.raises(PlanError, match="LBFGS"):
        tilework.parallelize(model, lbfgs, zero=1, log=False)


def _offloaded(rank, world_size, zero, offload, directory):
    import os

    model = new_model()
    opt = new_optimizer("adamw", model.parameters())
    tilework.parallelize(model, opt, zero=zero, offload=offload, offload_dir=directory,
                         log=False)
    losses = train(model, opt, range(STEPS), rank, world_size)
    engine = model._tilework_engine
    mapped = {f"{s.name}.{k}": _file_backed(v) for s in engine.zero.shards
              for k, v in opt.state[s.shard].items() if k != "step"}
    shards = {s.name: _file_backed(s.shard) for s in engine.zero.shards}
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "losses": losses, "opt": opt.state_dict(), "mapped": mapped, "shards": shards,
            "left": os.listdir(directory)}


def _file_backed(t: torch.Tensor) -> bool:
    """Whether `t`'s memory is a mapping of a (deleted) file, as /proc/self/maps lists it."""
    address = t.untyped_storage().data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, *rest = line.split()
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= address < hi:
                return "tilework-offload" in line
    return False


@pytest.mark.parametrize("zero, offload", [(2, "optimizer"), (3, "all")])
def test_offload_to_mapped_files_trains_as_one_process(zero, offload, tmp_path):
    """On a CPU host offloaded state lives in memory-mapped files (deleted once mapped): the
    same training, every state tensor (and with "all" every shard) file-backed, no file left."""
    results = spawn(_offloaded, 2, args=(zero, offload, str(tmp_path)), timeout=120)
    check_against_reference(results, "adamw")
    for r in results:
        assert r["mapped"] and all(r["mapped"].values()), r["mapped"]
        assert all(r["shards"].values()) == (offload == "all"), r["shards"]
        assert not r["left"], f"files left behind: {r['left']}"


def _torch_clip_under_zero(rank, world_size, zero):
    model = new_model()
    opt = new_optimizer("sgd", model.parameters())
    tilework.parallelize(model, opt, zero=zero, log=False)
    out = {}
    for step in range(2):   # two synchronised backwards: the stand-ins must not get in the way
        model(*batch(step, rank, world_size)).backward()
    try:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        out["torch_clip"] = None
    except PlanError as e:
        out["torch_clip"] = str(e)
    out["norm"] = float(tilework.clip_grad_norm_(model, 1e9))
    opt.step()
    opt.zero_grad()
    out["after_zero_grad"] = [n for n, p in model.named_parameters() if p.grad is not None]
    return out


@pytest.mark.parametrize("zero", [2, 3])
def test_torch_clipping_is_refused_in_one_line_where_gradients_are_sharded(zero):
    """nanoGPT's `torch.nn.utils.clip_grad_norm_(model.parameters(), c)` would clip nothing
    under stage 2/3 (the gradients are on the shards): it raises, naming the drop-in; the
    drop-in sees the whole gradient (two accumulated backwards, norm as one process's)."""
    model = new_model()
    for step in range(2):
        model(*batch(step)).backward()
    expected = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
    for r in spawn(_torch_clip_under_zero, 2, args=(zero,), timeout=120):
        assert r["torch_clip"] is not None and "tilework.clip_grad_norm_" in r["torch_clip"]
        assert r["norm"] == pytest.approx(expected, rel=1e-5)
        assert r["after_zero_grad"] == []


def _compiled(rank, world_size, zero):
    model = new_model()
    opt = new_optimizer("sgd", model.parameters())
    tilework.parallelize(model, opt, zero=zero, log=False)
    compiled = torch.compile(model, backend="aot_eager")
    losses = train(compiled, opt, range(2), rank, world_size)
    return {"losses": losses,
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def test_torch_compile_under_stage_3_trains_as_eager():
    results = spawn(_compiled, 2, args=(3,), timeout=300)
    state, losses, _ = reference("sgd", range(2))
    for k, v in state.items():
        close(k, results[0]["state"][k], v, TOLERANCE["sgd"])
    mean = [sum(x) / 2 for x in zip(*(r["losses"] for r in results))]
    close("losses", torch.tensor(mean), torch.tensor(losses), TOLERANCE["sgd"])


def _outside_forward(rank, world_size):
    model = new_model()
    opt = new_optimizer("sgd", model.parameters())
    tilework.parallelize(model, opt, zero=3, log=False)
    train(model, opt, range(1), rank, world_size)
    tokens = batch(5)[0]
    with torch.no_grad():   # the model's own unit's modules called directly, not forward
        out = model.head(model.norm(model.tokens(tokens)))
        with tilework.full_parameters(model):   # parameters read directly, no module called
            direct = model.norm(model.tokens(tokens)) @ model.head.weight.t() + model.head.bias
    held = {n for n, p in model.named_parameters() if p.untyped_storage().nbytes()}
    return out, direct, held


def test_stage_3_values_gathered_for_calls_outside_forward():
    """An evaluation method that calls the model's modules itself (a perplexity, a generate)
    finds the values of the model's own unit gathered, and they are freed again after; one
    that reads parameters directly does so inside tilework.full_parameters(model)."""
    model = new_model()
    opt = new_optimizer("sgd", model.parameters())
    train(model, opt, range(1))
    with torch.no_grad():
        expected = model.head(model.norm(model.tokens(batch(5)[0])))
    for out, direct, held in spawn(_outside_forward, 2, timeout=120):
        close("outside forward", out, expected, 1e-5)
        close("read directly in tilework.full_parameters", direct, expected, 1e-5)
        assert held == set(), held


def test_tilework_train_job_at_stage_3_with_offload_trains_as_stage_0(tmp_path):
    """A job file's `[parallel] zero = 3, offload = "optimizer"` under `tilework train -n 2`:
    the same losses, evaluation and final checkpoint as the replicated run (its evaluation
    reads parameters directly, so the trainer gathers them for it)."""
    import json
    import subprocess
    import sys

    finals = {}
    for name, parallel in [("replicated", ""), ("zero3", 'zero = 3\noffload = "optimizer"\n')]:
        out = tmp_path / name
        job = tmp_path / f"{name}.toml"
        job.write_text(f'workload = "lm"\n[lm]\ncorpus = "zipf"\nvocab = 400\nembed_dim = 8\n'
                       f'hidden = 8\nseq_len = 6\nzipf_tokens = 5000\nnum_sampled = 24\n'
                       f'[data]\nbatch_size = 8\n[train]\nsteps = 4\noptimizer = "adam"\n'
                       f'lr = 0.01\nlog_every = 2\ncheckpoint_every = 4\nout_dir = "{out}"\n'
                       f'[parallel]\n{parallel}')
        r = subprocess.run([sys.executable, "-m", "tilework", "train", str(job), "-n", "2"],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        finals[name] = ([row.get("loss", row.get("ppl")) for row in rows],
                        checkpoint.load(checkpoint.latest(out / "checkpoints"))["state"]["model"])
    (metrics, state), (metrics3, state3) = finals["replicated"], finals["zero3"]
    assert len(metrics) == len(metrics3) >= 3   # losses and evaluations
    assert metrics3 == pytest.approx(metrics, rel=1e-4)
    for k, v in state.items():
        close(k, state3[k], v, TOLERANCE["adam"])


def _clip_norm(rank, world_size, zero, options):
    from tilework.cluster.topology import Topology
    from tilework.comm import build_groups

    model = new_model()
    opt = new_optimizer("sgd", model.parameters())
    options = dict(options)
    hosts = options.pop("hosts", 1)
    groups = build_groups(dist.group.WORLD, Topology.uniform(hosts, world_size // hosts))
    norm_type = options.pop("norm_type", 2.0)
    tilework.parallelize(model, opt, zero=zero, log=False, groups=groups, **options)
    model(*batch(0, rank, world_size)).backward()
    return tilework.clip_grad_norm_(model, 1e9, norm_type=norm_type).item()


@pytest.mark.parametrize("zero, norm_type", [(2, 2.0), (3, float("inf"))])
def test_clip_norm_with_chunks_by_weight_is_one_process_norm(zero, norm_type):
    """Weights 1:40 leave rank 0 none of the 16-element parameters (an empty shard, whose inf
    norm torch refuses): the norm is still one process's, of either kind."""
    model = new_model()
    model(*batch(0)).backward()
    expected = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9, norm_type).item()
    got = spawn(_clip_norm, 2, args=(zero, {"zero_weights": [1, 40], "norm_type": norm_type}),
                timeout=120)
    assert all(abs(g - expected) <= 1e-5 * expected for g in got), (got, expected)


@pytest.mark.parametrize("zero", [2, 3])
def test_clip_norm_under_zero_in_each_host_is_one_process_norm(zero):
    """zero_scope="host": every host holds a whole copy of the chunks, so the chunks' norms are
    summed inside a host only (over all ranks they were counted once per host)."""
    model = new_model()
    model(*batch(0)).backward()
    expected = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item()
    got = spawn(_clip_norm, 4, args=(zero, {"zero_scope": "host", "hosts": 2}), timeout=120)
    assert all(abs(g - expected) <= 1e-5 * expected for g in got), (got, expected)


def _clip_norm_float64(rank, world_size, zero):
    model = new_model().double()
    opt = new_optimizer("sgd", model.parameters())
    tilework.parallelize(model, opt, zero=zero, log=False)
    model(*batch(0, rank, world_size)).backward()
    norm = tilework.clip_grad_norm_(model, 1e9)
    return norm.dtype, norm.item()


@pytest.mark.parametrize("zero", [0, 2, 3])
def test_clip_norm_of_a_float64_model_is_float64_at_every_stage(zero):
    """torch's norm has its gradients' dtype: a float64 model's is float64 (under stage 3 no
    gradient is dense on the rank, and the norm came back float32)."""
    model = new_model().double()
    model(*batch(0)).backward()
    expected = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    for dtype, value in spawn(_clip_norm_float64, 2, args=(zero,), timeout=120):
        assert dtype == torch.float64 == expected.dtype
        assert abs(value - expected.item()) <= 1e-12 * expected.item(), (value, expected.item())
