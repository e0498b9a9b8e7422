"""What the runtime runs around the model (estimate/runtime_ops.py), recorded on the meta device,
against what it runs on 2 real gloo ranks: for ZeRO 0-3 and SGD/Adam, the copies, sums and
updates of a real step that its model's own forward and backward do not make are exactly the
recorded ones (every call of more than a few elements, by op, shapes and dtypes; views
aside)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import tilework
from tilework.estimate.ops import OpCall, TensorSpec, _Recorder
from tilework.estimate.runtime_ops import runtime_calls
from tilework.models.gpt import TinyGPT
from tilework.plans.analysis import owning_units
from tilework.testing import spawn

SEQ, VOCAB, BATCH = 8, 50, 4
BUCKET_BYTES = 4096   # several buckets on this tiny model
# The runtime's own bookkeeping (the input checks' words, the loss, scalars) is a few elements
# a call; what it copies of the parameters is what the model is measured by.
LARGE = 64


def new_model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab=VOCAB, dim=16, heads=2, layers=2, seq_len=SEQ)


def new_optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    return torch.optim.Adam(params, lr=0.01)


def _elements(call: OpCall) -> int:
    def count(spec):
        if isinstance(spec, TensorSpec):
            n = 1
            for d in spec.shape:
                n *= d
            return n
        if isinstance(spec, tuple):
            return max((count(s) for s in spec), default=0)
        return 0
    return max((count(a) for a in call.args), default=0)


# Views: they move nothing (how often the runtime takes `.data` or a slice is its business).
VIEWS = {"aten::view.default", "aten::_unsafe_view.default", "aten::slice.Tensor",
         "aten::detach.default", "aten::split_with_sizes.default", "aten::alias.default"}


def large(calls: Counter) -> Counter:
    """The calls of more than a few elements but views, by op and tensor shapes (scalars, such
    as the learning rate, do not change what a call costs)."""
    out = Counter()
    for c, n in calls.items():
        if _elements(c) > LARGE and c.op not in VIEWS:
            out[c.op, tuple(a for a in c.args if isinstance(a, (TensorSpec, tuple)))] += n
    return out


def _real_step(rank, world_size, zero, optimizer, hosts=1):
    import torch.distributed as dist

    from tilework.cluster.topology import Topology
    from tilework.comm import build_groups

    model = new_model()
    opt = new_optimizer(optimizer, model.parameters())
    groups = build_groups(dist.group.WORLD, Topology.uniform(hosts, world_size // hosts))
    tilework.parallelize(model, opt, zero=zero, bucket_mb=BUCKET_BYTES / 2**20, log=False,
                         groups=groups, zero_scope="host" if hosts > 1 else "world")
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(rank))

    def step():
        model(tokens, tokens).backward()
        opt.step()
        opt.zero_grad()

    step()   # the optimizer's state is made at the first step: the model is of the next ones
    calls = Counter()
    with _Recorder(calls, Counter(), "step", ["none"]):
        step()
    return calls


def _model_step() -> Counter:
    """The model's own forward and backward, recorded on real tensors in one process (a meta
    recording takes another attention kernel than the CPU's)."""
    model = new_model()
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    calls = Counter()
    with _Recorder(calls, Counter(), "step", ["none"]):
        model(tokens, tokens).backward()
    return calls


@pytest.mark.parametrize("zero,optimizer,hosts", [(0, "sgd", 1), (1, "sgd", 1), (2, "adam", 1),
                                                  (3, "sgd", 1), (2, "sgd", 2)])
def test_the_runtime_runs_the_recorded_calls_around_the_model(zero, optimizer, hosts):
    """hosts=2: ZeRO over each host of one rank (zero_scope="host"), the chunks summed across
    hosts: it shards over one rank, and still packs, divides and writes back."""
    real = spawn(_real_step, 2, args=(zero, optimizer, hosts))[0]
    around = large(real) - large(_model_step())
    params = tuple(TensorSpec(tuple(p.shape), "float32") for p in new_model().parameters())
    units = tuple(owning_units(new_model()).values())
    predicted = large(runtime_calls(params, zero, 2 // hosts, 2, BUCKET_BYTES, optimizer,
                                    units=units))
    assert {k: (around[k], predicted[k]) for k in around | predicted
            if around[k] != predicted[k]} == {}


def test_zero_copies_more_than_the_plain_buckets_and_steps_less():
    """Counted: stage 2 packs every gradient rank-major and writes every gathered value back,
    where plain data parallelism copies each gradient once into its bucket; its update runs
    on half the elements at 2 ranks."""
    params = tuple(TensorSpec(tuple(p.shape), "float32") for p in new_model().parameters())
    numel = sum(p.numel() for p in new_model().parameters())

    def moved(calls, op):   # the elements of each call's first argument (all of a list)
        def numel(spec):
            if isinstance(spec, tuple) and not isinstance(spec, TensorSpec):
                return sum(numel(x) for x in spec)
            return _elements(OpCall(op, (spec,), ()))
        return sum(n * numel(c.args[0]) for c, n in calls.items() if c.op == op)

    plain = runtime_calls(params, 0, 2, 2, 2**30, "sgd")
    sharded = runtime_calls(params, 2, 2, 2, 2**30, "sgd")
    assert moved(plain, "aten::cat.out") == numel           # one bucket, every gradient once
    assert moved(sharded, "aten::copy_.default") >= numel   # every value written back
    assert moved(sharded, "aten::add_.Tensor") * 2 <= moved(plain, "aten::add_.Tensor") + 2


def _recommender():
    from tilework.models.recommender import DLRM

    torch.manual_seed(0)
    return DLRM([500, 300], dense_features=8, embed_dim=16, sparse=True)


def _recommender_inputs(rank: int = 0):
    g = torch.Generator().manual_seed(rank)
    return (torch.randn(BATCH, 8, generator=g), torch.randint(0, 300, (BATCH, 2), generator=g),
            torch.randint(0, 2, (BATCH,), generator=g).float())


def _real_all_reduced_tables(rank, world_size, zero):
    model = _recommender()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tilework.parallelize(model, opt, mode="allreduce", bucket_mb=BUCKET_BYTES / 2**20,
                         log=False, zero=zero)
    inputs = _recommender_inputs(rank)

    def step():
        model(*inputs).backward()
        opt.step()
        opt.zero_grad()

    step()
    calls = Counter()
    with _Recorder(calls, Counter(), "step", ["none"]):
        step()
    return calls


@pytest.mark.parametrize("zero", [0, 2])
def test_sparse_gradients_all_reduced_are_made_dense_as_recorded(zero):
    """Tables with sparse gradients, all-reduced (mode="allreduce"): the runtime makes each
    gradient dense in its bucket (ZeRO-2: as it packs it), which the recorded calls do too,
    from the recording's sparse gradient specs (the touched rows), where they used to take it
    dense already."""
    from tilework.estimate.ops import record

    real = spawn(_real_all_reduced_tables, 2, args=(zero,))[0]
    model, own = _recommender(), Counter()
    with _Recorder(own, Counter(), "step", ["none"]):
        model(*_recommender_inputs()).backward()
    around = large(real) - large(own)
    with torch.device("meta"):
        meta = _recommender()
    specs = record(meta, tuple(x.to("meta") for x in _recommender_inputs())).params
    assert [s.sparse_dims for s in specs[:2]] == [1, 1] and specs[0].nnz == BATCH
    predicted = large(runtime_calls(specs, zero, 2, 2, BUCKET_BYTES, "sgd"))
    assert any(op == "aten::_to_dense.default" for op, _ in predicted)
    assert {k: (around[k], predicted[k]) for k in around | predicted
            if around[k] != predicted[k]} == {}
