"""Activation recompute (ParallelConfig(recompute=...)): chosen in the plan, applied by
runtime/recompute.py, verified by counting (FLOPs, ops, bytes), never by timing.

Measured on the benchmark GPT (2 layers, width 64, batch 16 x 32 tokens; docs/memory.md):
forward+backward FLOPs none 498.6 M, full 565.7 M (+ the blocks' forward, 100.7 M, less their
last matmuls' 33.6 M, which torch's early stop does not rerun), selective 498.6 M;
activations at the end of forward (MemTracker) none 5.50 MB, full 2.58 MB, selective 5.22 MB,
the estimate within 0.2% of each. The FLOP tests below use a smaller GPT, for speed."""

import copy
import json
import pickle
from collections import Counter
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import set_checkpoint_early_stop
from torch.utils.flop_counter import FlopCounterMode

import tilework
from tests.estimate.test_memory import _measure
from tests.parallel.data.test_equivalence import assert_same
from tilework import ParallelConfig
from tilework.bench.workloads import WORKLOADS
from tilework.errors import ConfigError, PlanError
from tilework.models import DLRM, SmallResNet, TinyGPT
from tilework.plans.analysis import recompute_units
from tilework.plans.plan import Plan
from tilework.runtime.changes import Changes
from tilework.runtime.recompute import SAVED_OPS, apply_recompute
from tilework.testing import spawn

VOCAB, SEQ, BATCH, STEPS = 50, 8, 8, 3


class Block(nn.Module):
    def __init__(self, dim, dropout=0.0):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return x + self.down(self.drop(F.gelu(self.up(self.norm(x)))))


class TableLM(nn.Module):
    """A sparse table (on the servers in hybrid mode) feeding two recomputed blocks: the
    blocks' input is the lookup's stand-in (parallel/rows/lookups.py)."""

    def __init__(self, dim=8, dropout=0.0):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim, sparse=True)
        self.blocks = nn.ModuleList(Block(dim, dropout) for _ in range(2))
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens, targets):
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).reshape(-1, VOCAB), targets.reshape(-1))


def make(kind, seed=0):
    torch.manual_seed(seed)
    return TinyGPT(VOCAB, 16, 2, 2, SEQ) if kind == "gpt" else TableLM()


def batch(step, rank=0, world_size=1):
    g = torch.Generator().manual_seed(step)
    t = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g).chunk(world_size)[rank]
    return t[:, :-1], t[:, 1:]


def optimizer(name, model):
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=0.01)
    return torch.optim.SGD(model.parameters(), lr=0.1)


def train(model, opt, rank=0, world_size=1, micro=1):
    """STEPS steps; `micro` > 1 accumulates micro-batches, all but the last under no_sync."""
    losses = []
    for step in range(STEPS):
        parts = [batch(step * micro + i, rank, world_size) for i in range(micro)]
        for i, (x, y) in enumerate(parts):
            last = i == micro - 1 or not hasattr(model, "no_sync")
            local = nullcontext() if last else model.no_sync()
            with local:
                loss = model(x, y)
                loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


CASES = [("gpt", "full", "sgd", 1), ("gpt", "selective", "sgd", 1), ("gpt", "none", "adam", 1),
         ("gpt", "full", "adam", 1), ("gpt", "selective", "adam", 1), ("table", "full", "sgd", 2),
         ("table", "selective", "sgd", 1)]


def _ranks(rank, world_size):
    out = []
    for kind, policy, opt_name, micro in CASES:
        model = make(kind)
        opt = optimizer(opt_name, model)
        tilework.parallelize(model, opt, recompute=policy, log=False)
        recomputed = [n for n, m in model.named_modules() if "forward" in vars(m)]
        losses = train(model, opt, rank, world_size, micro)
        state = tilework.state_dict(model, opt)["model"]
        out.append((state if rank == 0 else None, losses, recomputed))
    return out


def _key_biases(state: dict) -> dict:
    """The attention's key biases apart: their gradient is zero in exact arithmetic (softmax
    does not change when every score of a query moves by the same amount), so Adam turns the
    rounding noise of a reordered sum into full-size steps, with or without recompute."""
    rest, keys = dict(state), {}
    for name in [n for n in state if n.endswith("in_proj_bias")]:
        third = state[name].numel() // 3
        keys[name] = state[name][third:2 * third]
        rest[name] = torch.cat([state[name][:third], state[name][2 * third:]])
    return rest, keys


def test_two_ranks_with_recompute_train_as_one_process_without():
    results = spawn(_ranks, 2, timeout=180)
    for i, (kind, policy, opt_name, micro) in enumerate(CASES):
        model = make(kind)
        ref_losses = train(model, optimizer(opt_name, model), micro=micro)
        state, losses, recomputed = results[0][i]
        units = recompute_units(make(kind)) if policy != "none" else []
        assert recomputed == units, (kind, recomputed)
        if opt_name == "sgd":
            assert_same(state, model.state_dict(), opt_name)
        else:   # two ranks' key biases, as two ranks without recompute have them
            ref, keys = _key_biases(model.state_dict())
            ours, our_keys = _key_biases(state)
            assert_same(ours, ref, opt_name)
            without = _key_biases(results[0][CASES.index(("gpt", "none", "adam", 1))][0])[1]
            for name in keys:
                torch.testing.assert_close(our_keys[name], without[name], rtol=1e-6, atol=1e-7)
        mean = [(a + b) / 2 for a, b in zip(losses, results[1][i][1])]
        assert mean == pytest.approx(ref_losses, rel=1e-5), (kind, policy, opt_name)


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_one_process_with_dropout_is_bit_equal_to_no_recompute(policy):
    """The recompute restores the RNG state: dropout draws the same masks twice."""
    def run(recompute):
        torch.manual_seed(0)
        model = TableLM(dropout=0.3)
        opt = torch.optim.Adam([p for n, p in model.named_parameters() if n != "emb.weight"])
        if recompute != "none":
            apply_recompute(model, tilework.plan(model, ParallelConfig(recompute=recompute))
                            .recompute, Changes())
        grads = []
        for step in range(2):
            model(*batch(step)).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            opt.step()
            opt.zero_grad()
        return grads, [p.detach().clone() for p in model.parameters()]

    plain, recomputed = run("none"), run(policy)
    for a, b in zip(plain[0] + [plain[1]], recomputed[0] + [recomputed[1]]):
        assert all(torch.equal(x.to_dense(), y.to_dense()) for x, y in zip(a, b))


class Ops(TorchDispatchMode):
    """How many times each aten op runs."""

    def __init__(self):
        super().__init__()
        self.count = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count[func.overloadpacket] += 1
        return func(*args, **(kwargs or {}))


def _step_counts(policy, early_stop=True):
    model = make("gpt")
    if policy != "none":
        apply_recompute(model, tilework.plan(model, ParallelConfig(recompute=policy)).recompute,
                        Changes())
    with FlopCounterMode(display=False) as flops, Ops() as ops, \
            set_checkpoint_early_stop(early_stop):
        model(*batch(0)).backward()
    return flops.get_total_flops(), ops.count


def _blocks_forward():
    """The blocks' forward alone, on the inputs they get in the model: FLOPs and op counts,
    and the FLOPs of each block's last matmul (linear2)."""
    model = make("gpt")
    blocks = [model.get_submodule(n) for n in recompute_units(model)]
    calls, last = [], []
    handles = [b.register_forward_pre_hook(lambda m, a, k: calls.append((m, a, k)),
                                           with_kwargs=True) for b in blocks]
    handles += [b.linear2.register_forward_pre_hook(lambda m, a: last.append((m, a)))
                for b in blocks]
    model(*batch(0))
    for h in handles:
        h.remove()
    with torch.no_grad(), FlopCounterMode(display=False) as flops, Ops() as ops:
        for block, args, kwargs in calls:
            block(*args, **kwargs)
    with torch.no_grad(), FlopCounterMode(display=False) as tail:
        for linear, args in last:
            linear(*args)
    return flops.get_total_flops(), ops.count, tail.get_total_flops()


def test_full_recompute_adds_exactly_the_blocks_forward_flops():
    plain, _ = _step_counts("none")
    forward, _, last_matmul = _blocks_forward()
    assert _step_counts("full", early_stop=False)[0] == plain + forward
    # torch's default early stop ends the recompute once every tensor backward needs is
    # rebuilt: each block's last matmul saves its inputs before its kernel runs, so it is
    # not recomputed.
    assert _step_counts("full")[0] == plain + forward - last_matmul
    assert last_matmul > 0


def test_selective_recompute_recounts_the_cheap_ops_and_no_matmul():
    plain_flops, plain = _step_counts("none")
    flops, selective = _step_counts("selective")
    _, forward, _ = _blocks_forward()
    assert flops == plain_flops
    for op in SAVED_OPS:
        assert selective[op] == plain[op], op
    cheap = [torch.ops.aten.native_layer_norm, torch.ops.aten.relu]
    for op in cheap:
        assert forward[op] > 0 and selective[op] == plain[op] + forward[op], op


def test_activations_measured_by_memtracker_and_estimated():
    w = WORKLOADS["gpt"]
    inputs = w.batch(0, 0, 1)
    measured, estimated = {}, {}
    for policy in ("none", "full", "selective"):
        torch.manual_seed(0)
        model = w.make(False)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        config = ParallelConfig(recompute=policy)
        estimated[policy] = tilework.estimate_memory(model, config, inputs, optimizer=opt)
        apply_recompute(model, tilework.plan(model, config).recompute, Changes())
        measured[policy] = _measure(model, opt, inputs)
    assert measured["full"]["activations"] < measured["selective"]["activations"] \
        < measured["none"]["activations"]
    for policy in ("none", "full", "selective"):
        ratio = estimated[policy].activations / measured[policy]["activations"]
        assert 0.98 <= ratio <= 1.02, (policy, ratio)
        assert 0.95 <= estimated[policy].peak / measured[policy]["peak"] <= 1.05, policy
    assert estimated["none"].recompute == 0 < estimated["full"].recompute


def test_unparallelize_restores_the_forwards_and_the_model_trains_on_identically():
    model, plain = make("gpt"), make("gpt")
    opt, plain_opt = optimizer("adam", model), optimizer("adam", plain)
    tilework.parallelize(model, opt, recompute="full", log=False)
    units = [model.get_submodule(n) for n in recompute_units(model)]
    assert all("forward" in vars(u) for u in units)
    assert any("forward under activation recompute (full)" in line
               for line in model._tilework_engine.changes.listing())
    twin = pickle.loads(pickle.dumps(copy.deepcopy(model.blocks)))   # a plain stack
    assert all(vars(u)["forward"].__func__ is type(u).forward for u in twin.layers)
    train(model, opt)
    tilework.unparallelize(model, opt)
    assert not any("forward" in vars(u) for u in units)
    train(model, opt)
    train(plain, plain_opt)
    train(plain, plain_opt)
    for (name, a), b in zip(model.state_dict().items(), plain.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)


def test_the_plan_names_the_modules_and_round_trips():
    assert recompute_units(make("gpt")) == ["blocks.layers.0", "blocks.layers.1"]
    assert recompute_units(DLRM([30, 40, 7], 3, 4)) == ["bottom", "top"]   # no stack: children
    assert recompute_units(SmallResNet(10, 4, 2)) == ["blocks.0", "blocks.1"]
    config = ParallelConfig(recompute={"blocks.layers.*": "selective", "head": "full"})
    plan = tilework.plan(make("gpt"), config)
    assert plan.recompute == (("blocks.layers.0", "selective"), ("blocks.layers.1", "selective"),
                              ("head", "full"))
    assert plan.recompute_line() == \
        "recompute: selective on blocks.layers.0, blocks.layers.1; full on head"
    assert Plan.from_dict(json.loads(json.dumps(plan.as_dict()))) == plan
    assert plan.diff(tilework.plan(make("gpt"))) == [
        "recompute.blocks.layers.0: 'selective' -> 'none'",
        "recompute.blocks.layers.1: 'selective' -> 'none'", "recompute.head: 'full' -> 'none'"]


def test_bad_settings_are_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match="recompute: expected 'none', 'full', 'selective'"):
        ParallelConfig(recompute="sometimes")
    with pytest.raises(ConfigError, match="recompute.blocks: expected 'full' or 'selective'"):
        ParallelConfig(recompute={"blocks": "half"})
    with pytest.raises(PlanError, match=r"recompute: pattern 'nothing\.\*' matches no module"):
        tilework.plan(make("gpt"), ParallelConfig(recompute={"nothing.*": "full"}))
    table_inside = nn.Sequential(nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 4)))
    with pytest.raises(PlanError, match=r"module '0' \(full\) holds the server table 0\.0\.weight"):
        tilework.plan(table_inside, ParallelConfig(recompute={"0": "full"}))
    from tilework.train.job import Job

    (tmp_path / "job.toml").write_text('[parallel.recompute]\n"blocks.*" = "selective"\n')
    assert Job.load(tmp_path / "job.toml").parallel.recompute == {"blocks.*": "selective"}
