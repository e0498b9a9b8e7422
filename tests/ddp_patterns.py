"""Single-device training-loop patterns, run unchanged by one plain process, by
DistributedDataParallel and by tilework's modes (used by tests/runtime/test_ddp_semantics.py).

`run_patterns(system, optimizer, names, rank, world_size)` builds a fresh tiny model per pattern
(a 40x4 sparse nn.Embedding, a 30x4 sparse nn.EmbeddingBag, two small Linear layers; same seed
everywhere), feeds this rank its contiguous slice of each global batch of GLOBAL_BATCH rows, and
returns {pattern: ("ok", result) | ("error", traceback)}. A pattern that raises is recorded and
the next one starts on a fresh model, so one missing feature does not hide the others. Checks
whose outcome could differ between ranks (a strict load on rank 0, say) are recorded as data,
never raised, so that no rank leaves a pattern while its peer is still inside a collective.

Systems: "plain" (one process, world size 1: the reference), "ddp"
(torch.nn.parallel.DistributedDataParallel over the default gloo group; it averages sparse
embedding gradients too), and tilework's "hybrid", "ps", "allreduce", the ZeRO stages and
"allgather" (tables synchronised as DDP does).
"""

from __future__ import annotations

import contextlib
import io
import traceback

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import tilework
from tilework import optim

TILEWORK = ("hybrid", "ps", "allreduce", "zero1", "zero2", "zero3", "allgather")
# tilework's systems as parallelize's options: the ZeRO ones are hybrid with sharded dense state;
# "allgather" synchronises the tables as DDP does (their touched rows all-gathered).
OPTIONS = {"hybrid": {"mode": "hybrid"}, "ps": {"mode": "ps"}, "allreduce": {"mode": "allreduce"},
           "zero1": {"zero": 1}, "zero2": {"zero": 2}, "zero3": {"zero": 3},
           "allgather": {"overrides": {"emb.weight": "allgather", "bag.weight": "allgather"}}}
GLOBAL_BATCH = 8
STEPS = 4
ACC_STEPS, K = 3, 3           # accumulation: 3 optimizer steps of K = 3 backward calls each
MAX_NORM = 0.3                # below every step's gradient norm (0.58-0.99): it really clips
CLIP_VALUE = 0.1              # below the largest gradient entry of every step (0.22-0.72)
LR = {"sgd": 0.1, "adagrad": 0.05, "adam": 0.01}
MANUAL_LR = 0.1
TABLES = ("emb.weight", "bag.weight")


class Tiny(nn.Module):
    def __init__(self, sparse: bool = True):
        super().__init__()
        self.emb = nn.Embedding(40, 4, sparse=sparse)
        self.bag = nn.EmbeddingBag(30, 4, mode="mean", sparse=sparse)
        self.fc1 = nn.Linear(8, 6)
        self.fc2 = nn.Linear(6, 1)

    def forward(self, ids, bags):
        h = torch.cat([self.emb(ids), self.bag(bags)], dim=1)
        return self.fc2(torch.tanh(self.fc1(h))).squeeze(1)


def new_model(seed: int = 0, sparse: bool = True) -> Tiny:
    torch.manual_seed(seed)
    return Tiny(sparse)


def global_batches(n: int = 16):
    """Global batches: ids from only 12 of the 40 rows (repeats within and across ranks, and
    rows never touched: what tells lazy from dense Adam); bags of 3 over 30 rows."""
    g = torch.Generator().manual_seed(1234)
    return [(torch.randint(0, 12, (GLOBAL_BATCH,), generator=g),
             torch.randint(0, 30, (GLOBAL_BATCH, 3), generator=g),
             torch.randn(GLOBAL_BATCH, generator=g))
            for _ in range(n)]


BATCHES = global_batches()


def loss_of(model, batch):
    ids, bags, y = batch
    return F.mse_loss(model(ids, bags), y)


# -- clipping as torch defines it, extended to sparse gradients (torch's own refuses them) ----
def _grads(params):
    out = []
    for p in params:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            p.grad = p.grad.coalesce()  # duplicate ids are one row of the gradient
        out.append(p.grad)
    return out


def clip_grad_norm_reference(params, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_'s formula (norm of per-tensor norms; coefficient
    max_norm / (total + 1e-6) clamped at 1), with a sparse gradient's norm that of its
    coalesced rows."""
    grads = _grads(params)
    norms = [torch.linalg.vector_norm(g._values() if g.is_sparse else g, norm_type) for g in grads]
    total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)
    return total


def clip_grad_value_reference(params, clip_value: float) -> None:
    for g in _grads(params):
        (g._values() if g.is_sparse else g).clamp_(-clip_value, clip_value)


def max_abs_grad(model) -> float:
    return max((g._values() if g.is_sparse else g).abs().max().item()
               for g in _grads(model.parameters()))


def _err(e: BaseException):
    return {"type": type(e).__name__, "user_error": isinstance(e, tilework.UserError),
            "message": str(e)}


def _clone(state):
    """A copy; a value that is not a tensor is kept as it is (the test names the key)."""
    return {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in state.items()}


class Run:
    """One system and optimizer on one rank."""

    def __init__(self, system: str, optimizer: str, rank: int, world_size: int,
                 sparse_tables: bool = True):
        self.system, self.optimizer = system, optimizer
        self.rank, self.world_size = rank, world_size
        self.sparse_tables = sparse_tables
        self.tilework = system in TILEWORK

    # -- set-up --------------------------------------------------------------------------------
    def make_optimizer(self, model):
        lr = LR[self.optimizer]
        if self.tilework and self.system != "allgather":
            # One torch optimizer: the servers apply its rule row-wise (lazy Adam). Tables
            # all-gathered stay replicated with sparse gradients, as under DDP.
            return {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad,
                    "adam": torch.optim.Adam}[self.optimizer](model.parameters(), lr=lr)
        return optim.for_model(model, self.optimizer, lr)  # SparseAdam for sparse tables

    def build(self, seed: int = 0, with_optimizer: bool = True):
        model = new_model(seed, self.sparse_tables)
        opt = self.make_optimizer(model) if with_optimizer else None
        if self.system == "plain":
            return model, opt
        if self.system == "ddp":
            return DDP(model), opt
        return tilework.parallelize(model, opt, log=False, **OPTIONS[self.system])

    def inner(self, model):
        return model.module if self.system == "ddp" else model

    def batch(self, i: int):
        per = GLOBAL_BATCH // self.world_size
        return tuple(t[self.rank * per:(self.rank + 1) * per] for t in BATCHES[i])

    def state(self, model, opt):
        """The whole model in single-device layout (tables included); a collective in tilework,
        whose tilework.state_dict completes the tables on rank 0 only: the tests read rank 0's."""
        if self.tilework and opt is not None:
            state = tilework.state_dict(model, opt)["model"]
            return _clone(state) if self.rank == 0 else None
        return _clone(self.inner(model).state_dict())

    def visible_grads(self, model):
        """Every parameter the model still has, with its gradient as the user sees it."""
        out = {}
        from tilework.parallel.data.shards import ShardedGradient

        for name, p in self.inner(model).named_parameters():
            if p.grad is not None and not isinstance(p.grad, ShardedGradient):
                g = p.grad.coalesce().to_dense() if p.grad.is_sparse else p.grad
                out[name] = g.detach().clone()
        return out

    # -- clipping: torch's rule everywhere (tilework's drop-ins for tilework) ----------------------
    def clip_norm(self, model, max_norm):
        if self.tilework:
            return tilework.clip_grad_norm_(model, max_norm)
        return clip_grad_norm_reference(model.parameters(), max_norm)

    def clip_value(self, model, clip_value):
        if self.tilework:
            return tilework.clip_grad_value_(model, clip_value)
        return clip_grad_value_reference(model.parameters(), clip_value)

    def sync_off(self, model, how: str):
        if how == "no_sync":
            return model.no_sync() if self.system != "plain" else contextlib.nullcontext()
        return _flag_off(model)


@contextlib.contextmanager
def _flag_off(model):
    """DDP's `require_backward_grad_sync = False`, set before the forward as DDP needs."""
    model.require_backward_grad_sync = False
    try:
        yield
    finally:
        model.require_backward_grad_sync = True


# -- the patterns ------------------------------------------------------------------------------
def p_loop(r: Run):
    model, opt = r.build()
    losses, grads = [], None
    for s in range(STEPS):
        loss = loss_of(model, r.batch(s))
        loss.backward()
        if s == 0:
            grads = r.visible_grads(model)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": r.state(model, opt), "grads": grads}


def _clip_loop(r: Run, clip):
    model, opt = r.build()
    losses, norms, before = [], [], []
    for s in range(STEPS):
        loss = loss_of(model, r.batch(s))
        loss.backward()
        if r.system == "plain":
            before.append(max_abs_grad(model))
        norm = clip(model)
        norms.append(None if norm is None else float(norm))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": r.state(model, opt), "norms": norms, "max_abs": before}


def p_clip_norm(r):
    return _clip_loop(r, lambda m: r.clip_norm(m, MAX_NORM))


def p_clip_value(r):
    return _clip_loop(r, lambda m: r.clip_value(m, CLIP_VALUE))


def p_clip_norm_dropin(r):  # tilework's drop-in on a DDP-wrapped module
    return _clip_loop(r, lambda m: tilework.clip_grad_norm_(m, MAX_NORM))


def p_clip_value_dropin(r):
    return _clip_loop(r, lambda m: tilework.clip_grad_value_(m, CLIP_VALUE))


def p_clip_norm_torch(r):  # mode "allreduce": nothing on the servers, torch's own clipping
    return _clip_loop(r, lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM))


def p_clip_value_torch(r):
    return _clip_loop(r, lambda m: torch.nn.utils.clip_grad_value_(m.parameters(), CLIP_VALUE))


def _accumulate(r: Run, how: str | None):
    model, opt = r.build()
    losses, local = [], None
    for s in range(ACC_STEPS):
        for k in range(K):
            quiet = how is not None and k < K - 1
            with r.sync_off(model, how) if quiet else contextlib.nullcontext():
                loss = loss_of(model, r.batch(s * K + k)) / K
                loss.backward()
            if s == 0 and k == 0:  # with sync off: this rank's own gradient, nothing averaged
                local = r.visible_grads(model)
            losses.append(loss.item() * K)
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "state": r.state(model, opt), "first_grads": local}


def p_accumulate(r):
    return _accumulate(r, None)


def p_accumulate_no_sync(r):
    return _accumulate(r, "no_sync")


def p_accumulate_flag(r):
    return _accumulate(r, "flag")


def _manual(r: Run, clip: bool):
    """The classic word-LM loop: no optimizer, model.zero_grad(), torch's clip, p.data.add_."""
    model, _ = r.build(with_optimizer=False)
    losses, norms = [], []
    for s in range(STEPS):
        model.zero_grad()
        loss = loss_of(model, r.batch(s))
        loss.backward()
        if clip:
            params = list(model.parameters())
            norm = (torch.nn.utils.clip_grad_norm_(params, MAX_NORM) if r.tilework
                    else clip_grad_norm_reference(params, MAX_NORM))
            norms.append(float(norm))
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-MANUAL_LR)
        losses.append(loss.item())
    return {"losses": losses, "state": _clone(r.inner(model).state_dict()), "norms": norms}


def p_manual(r):
    return _manual(r, clip=False)


def p_manual_clip(r):
    return _manual(r, clip=True)


def p_scheduler(r: Run):
    model, opt = r.build()
    opts = opt.optimizers if isinstance(opt, optim.MultiOptimizer) else [opt]
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in opts]
    losses, lrs = [], []
    for s in range(STEPS):
        loss = loss_of(model, r.batch(s))
        loss.backward()
        opt.step()
        opt.zero_grad()
        for sch in schedulers:
            sch.step()
        lrs.append(opts[0].param_groups[0]["lr"])
        losses.append(loss.item())
    return {"losses": losses, "state": r.state(model, opt), "lrs": lrs}


def p_state_dict(r: Run):
    """Train 2 steps; model.state_dict() (every rank); load it into a plain model (strict) and,
    on every rank, into a fresh parallelized model of another seed; train 2 more steps."""
    model, opt = r.build()
    losses = []

    def train(m, o, steps):
        for s in steps:
            loss = loss_of(m, r.batch(s))
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss.item())

    train(model, opt, range(2))
    mid = _clone(r.inner(model).state_dict())
    plain_load = None
    if r.rank == 0:
        try:
            new_model(7).load_state_dict(mid)  # strict
            plain_load = "ok"
        except Exception as e:  # noqa: BLE001 - recorded, not raised: see the module docstring
            plain_load = repr(e)
    model2, opt2 = r.build(seed=1)
    r.inner(model2).load_state_dict(mid)
    train(model2, opt2, range(2, STEPS))
    return {"losses": losses, "mid": mid if r.rank == 0 else None, "plain_load": plain_load,
            "state": r.state(model2, opt2)}


def p_torch_save(r: Run):
    model, opt = r.build()
    loss_of(model, r.batch(0)).backward()
    opt.step()
    opt.zero_grad()
    buffer = io.BytesIO()
    try:
        torch.save(model, buffer)
    except Exception as e:  # noqa: BLE001
        return {"error": _err(e)}
    state = _clone(model.state_dict())  # mode "allreduce": every weight is in this process
    out = {"error": None}
    try:
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        got = loaded.state_dict()
        out["keys_match"] = set(got) == set(state)
        out["worst"] = max((got[k] - v).abs().max().item() for k, v in state.items())
        reference = new_model(7)
        reference.load_state_dict(state)
        ids, bags, _ = r.batch(1)
        with torch.no_grad():  # runs alone on this rank: a plain model communicates nothing
            out["forward_worst"] = (loaded(ids, bags) - reference(ids, bags)).abs().max().item()
    except Exception:  # noqa: BLE001 - recorded, not raised
        out["load_error"] = traceback.format_exc()
    return out


def p_ddp_submodule(r: Run):
    model = new_model()
    model.fc1 = DDP(model.fc1)  # every rank: DDP's constructor is a collective
    try:
        tilework.parallelize(model, torch.optim.SGD(model.parameters(), lr=0.1), log=False,
                             **OPTIONS[r.system])
    except Exception as e:  # noqa: BLE001
        return {"error": _err(e)}
    return {"error": None}


def p_zero_grad_pending(r: Run):
    model, opt = r.build()
    loss_of(model, r.batch(0)).backward()
    model.zero_grad()  # table gradients pending on the servers, no optimizer.step() yet
    try:
        loss_of(model, r.batch(1))  # the next forward would train on tables never updated
    except Exception as e:  # noqa: BLE001
        return {"error": _err(e)}
    return {"error": None}


PATTERNS = {name[2:]: fn for name, fn in globals().items() if name.startswith("p_")}


def run_patterns(system: str, optimizer: str, names, rank: int = 0, world_size: int = 1,
                 sparse_tables: bool = True) -> dict:
    r = Run(system, optimizer, rank, world_size, sparse_tables)
    out = {}
    for name in names:
        try:
            out[name] = ("ok", PATTERNS[name](r))
        except Exception:  # noqa: BLE001 - reported per pattern by the test
            out[name] = ("error", traceback.format_exc())
    return out


def local_gradients(rank: int, world_size: int, scale: float = 1 / K) -> dict:
    """What one rank's backward of batch 0 alone gives (the loss scaled as _accumulate scales
    it): the gradient a rank holds after a backward with sync off."""
    r = Run("plain", "sgd", rank, world_size)
    model = new_model()
    (loss_of(model, r.batch(0)) * scale).backward()
    return r.visible_grads(model)


def rank_main(rank: int, world_size: int, system: str, optimizer: str, names) -> dict:
    """spawn's entry point: every pattern of `names` in turn, on fresh models."""
    return run_patterns(system, optimizer, names, rank, world_size)
