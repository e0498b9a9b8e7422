"""What a rank's runtime runs around its model in one step, as recorded ops (estimate/ops.py):
the optimizer's update and the copies data parallelism makes, which a step's forward and
backward recording does not hold.

On a CPU rank these are not small beside a small model's step: ZeRO-2's packing of gradients
rank-major, the sum of the received chunks and the copy of every gathered value back into the
parameters measured 17-24% of a dp2 step of the planner's GPT, where the plain all-reduce path
copies each gradient once into its bucket. Priced as nothing, ZeRO looked as fast as plain data
parallelism with the same bytes; priced here, each stage costs what it copies.

Recorded by running the runtime's own per-parameter code (parallel/data/shards.Sharded) and the
optimizer's own update on meta tensors of the rank's parameter shapes, with the bucket-level
concatenations, sums and divisions of parallel/data/dense.py and zero.py mirrored beside them
(their classes need process groups). Not recorded: the collectives (the link model prices
them), the input checks' per-step words, server tables and offload's copies.
"""

from __future__ import annotations

import functools
from collections import Counter

import torch
from torch import nn

from .ops import OpCall, TensorSpec, _Recorder


def runtime_calls(params: tuple[TensorSpec, ...], zero: int, shards: int, averaged: int,
                  bucket_bytes: int, optimizer="sgd", checks: bool = True,
                  units: tuple[str, ...] = ()) -> Counter:
    """The aten calls one rank's runtime makes in one step around the forward and backward of
    its parameters `params` (in the model's order): the gradient buckets' copies when
    `averaged` ranks average gradients, ZeRO stage `zero`'s over `shards` ranks, and
    `optimizer`'s update (a name, class or instance, as estimate/memory.optimizer_kind reads
    it) of what the rank steps; `checks`: the input checks' sums (ParallelConfig.check_inputs);
    `units`: each parameter's ZeRO-3 unit (plans.analysis.owning_units; "" the model's own), by
    which stage 3 buckets and gathers (without them, by size). Cached: a search asks for the
    same few under every candidate."""
    from .memory import optimizer_kind

    if not params:   # a stage that holds no parameter (a pipeline's loss, say)
        return Counter()
    return _calls(tuple(params), zero, shards, averaged, bucket_bytes,
                  optimizer_kind(optimizer), checks, tuple(units)).copy()


@functools.lru_cache(maxsize=256)
def _calls(params, zero, shards, averaged, bucket_bytes, optimizer, checks, units) -> Counter:
    from ..parallel.data.shards import Sharded
    from ..plans.plan import assign_buckets

    ps = [nn.Parameter(torch.empty(s.shape, dtype=getattr(torch, s.dtype), device="meta"))
          for s in params]
    for p in ps:
        p.grad = torch.empty_like(p)
    # Gradients that arrive sparse (an embedding's touched rows) are made dense in the buckets.
    arriving = {id(p): _sparse_grad(s) for p, s in zip(ps, params) if s.sparse_dims}
    sparse = {id(arriving[id(p)]): s for p, s in zip(ps, params) if s.sparse_dims}
    backward = ps[::-1]   # buckets fill in backward's order
    out, regions = Counter(), Counter()
    # A host-scoped ZeRO on hosts of one rank shards over one: its packing, gathers and
    # copies still run (the chunks' sums across hosts are the replicas' all-reduce).
    sharded = zero > 0 and averaged > 1
    owned = [Sharded(str(i), p, zero, 0, shards) for i, p in enumerate(ps)] if sharded else []
    stepped = [s.shard for s in owned] if sharded else ps
    for s in owned:
        s.shard.grad = torch.empty_like(s.shard)
    opt = _optimizer(optimizer, stepped)
    opt.step()   # the first step makes the state: recorded from the second on
    with _Recorder(out, regions, "step", ["none"]):
        for p in ps:   # as backward leaves them: sparse where they arrive sparse
            p.grad = arriving.get(id(p), p.grad)
        if averaged > 1 and zero <= 1:
            _dense_buckets(backward, bucket_bytes, averaged, assign_buckets, checks, out, sparse)
        if sharded:
            by_param = {id(s.param): s for s in owned}
            order = [by_param[id(p)] for p in backward]
            by_unit = _by_unit(owned, units) if zero == 3 and units else None
            if zero == 1:
                for s in order:   # ZeroSync.before_step: the chunk of the averaged gradient
                    s.take(s.param.grad)
            elif by_unit is None:
                _reduce_scatter_buckets(order, bucket_bytes, assign_buckets, checks, averaged,
                                        out, sparse)
            else:   # one bucket per unit, the model's own last (zero3.Units)
                _reduce_scatter_buckets([s for _, unit in by_unit[::-1] for s in unit], 0,
                                        _as_given([len(u) for _, u in by_unit[::-1]]), checks,
                                        averaged, out, sparse)
            if by_unit is not None:
                # Before the forward every unit is gathered, and again before the backward but
                # the model's own, which stays whole through both.
                for name, unit in by_unit:
                    for _ in range(1 if name == "" else 2):
                        _gather_buckets(unit, 0, _as_given([len(unit)]))
            else:   # stages 1 and 2 after the step; stage 3 without units before both passes
                for _ in range(2 if zero == 3 else 1):
                    _gather_buckets(order, bucket_bytes, assign_buckets)
        opt.step()
    return out


# Each kind of estimate/memory.optimizer_kind as torch runs it; foreach=False: the per-tensor
# loop torch picks for CPU tensors by itself (meta ones are no device it fuses for either).
# SparseAdam steps sparse gradients only: a dense parameter's update is priced as Adam's.
_UPDATES = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.01, foreach=False),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9, foreach=False),
    "adam": lambda ps: torch.optim.Adam(ps, foreach=False),
    "sparseadam": lambda ps: torch.optim.Adam(ps, foreach=False),
    "adamw": lambda ps: torch.optim.AdamW(ps, foreach=False),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, foreach=False),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, foreach=False),
}


def _by_unit(owned: list, units: tuple[str, ...]) -> list[tuple[str, list]]:
    """The shards by ZeRO-3 unit, in zero3.Units' order: the model's own first, then each unit
    as its first parameter comes."""
    names = ["", *dict.fromkeys(u for u in units if u)]
    return [(name, [s for s, u in zip(owned, units) if u == name]) for name in names
            if name in units]


def _as_given(lengths: list[int]):
    """An `assign_buckets` stand-in that cuts consecutive runs of `lengths`, whatever the
    sizes."""
    def assign(sizes, bucket_bytes):
        out, start = [], 0
        for n in lengths:
            out.append(list(range(start, start + n)))
            start += n
        return out
    return assign


def _optimizer(optimizer, params: list[nn.Parameter]):
    from .memory import optimizer_kind

    return _UPDATES[optimizer_kind(optimizer)](params)


def _sparse_grad(spec: TensorSpec) -> torch.Tensor:
    values = torch.empty((spec.nnz, *spec.shape[spec.sparse_dims:]),
                         dtype=getattr(torch, spec.dtype), device="meta")
    indices = torch.empty(spec.sparse_dims, spec.nnz, dtype=torch.long, device="meta")
    return torch.sparse_coo_tensor(indices, values, spec.shape, check_invariants=False)


def _densified(grad: torch.Tensor, out: Counter, sparse: dict) -> torch.Tensor:
    """`grad.to_dense()` as the CPU runs it (one call), which the meta device has no kernel
    for: recorded by hand (`sparse`: the spec of each sparse gradient, by id, since asking the
    tensor would record the asking)."""
    if id(grad) not in sparse:
        return grad
    out[OpCall("aten::_to_dense.default", (sparse[id(grad)],), ())] += 1
    return torch.empty(grad.shape, dtype=grad.dtype, device="meta")


def _sizes(tensors) -> list[int]:
    return [t.numel() * t.element_size() for t in tensors]


def _dense_buckets(params, bucket_bytes: int, averaged: int, assign, checks: bool,
                   out: Counter, sparse: dict) -> None:
    """parallel/data/dense.py: each bucket's gradients concatenated into its buffer (a bucket
    of one parameter is reduced in place; a sparse gradient made dense first), checked by one
    sum (the last bucket carries the input checks' words), divided by the ranks, and the
    gradients made views of it."""
    from ..comm.wire import CHECK_WORDS

    buckets = assign(_sizes(params), bucket_bytes)
    for k, members in enumerate(buckets):
        bucket = [params[i] for i in members]
        carry = checks and k == len(buckets) - 1
        size = sum(p.numel() for p in bucket)
        dense = [_densified(p.grad, out, sparse) for p in bucket]
        if len(bucket) == 1 and not carry:
            buffer = grads = bucket[0].grad = dense[0]
        else:
            buffer = dense[0].reshape(-1).new_empty(size + (CHECK_WORDS if carry else 0))
            torch.cat([g.reshape(-1) for g in dense], out=buffer[:size])
            grads = buffer[:size]
        if checks:
            grads.sum()
        if carry:   # the words ride out, and are read back once the sum has landed
            buffer[size:] = torch.empty(CHECK_WORDS, dtype=buffer.dtype, device=buffer.device)
        buffer[:size].div_(averaged)
        if carry:
            buffer[size:].double()
        if grads is bucket[0].grad:
            continue
        offset = 0
        for p in bucket:
            p.grad = buffer[offset:offset + p.numel()].view_as(p)
            offset += p.numel()


def _reduce_scatter_buckets(shards, bucket_bytes: int, assign, checks: bool,
                            averaged: int, out: Counter, sparse: dict) -> None:
    """parallel/data/zero.py's `_pack` and `_finish`: each gradient (a sparse one made dense)
    written as (n, chunk) rows into its columns of the bucket's rank-major buffer, checked by
    one sum; the received chunks summed and divided by the `averaged` ranks."""
    for members in assign([s.n * s.chunk * s.param.element_size() for s in shards],
                          bucket_bytes):
        bucket = [shards[i] for i in members]
        dtype = functools.reduce(torch.promote_types, (s.param.dtype for s in bucket))
        rows = torch.empty(bucket[0].n, sum(s.chunk for s in bucket), dtype=dtype,
                           device=bucket[0].param.device)
        for s, part in zip(bucket, torch.split(rows, [s.chunk for s in bucket], dim=-1)):
            s.rows_into(_densified(s.param.grad, out, sparse), part)
        flat = rows.reshape(-1)
        if checks:
            flat.sum()
        n = bucket[0].n
        # Over one rank the packed buffer is its own sum (comm/counted.reduce_scatter_async).
        summed = flat if n == 1 else torch.empty_like(flat).view(n, -1).sum(0)
        summed.div_(averaged)
        torch.split(summed, [s.chunk for s in bucket], dim=-1)


def _gather_buckets(shards, bucket_bytes: int, assign) -> None:
    """ZeroSync.gather_async and write_gathered: the shards' values concatenated, and every
    rank's chunks copied from the gathered buffer into the parameters."""
    for members in assign([s.n * s.chunk * s.param.element_size() for s in shards],
                          bucket_bytes):
        bucket = [shards[i] for i in members]
        part, n = torch.cat([s.values() for s in bucket]), bucket[0].n
        # Over one rank the gather is the part itself (comm/counted.all_gather_async).
        every = (part if n == 1 else part.new_empty(n * part.numel())).view(n, -1)
        with torch.no_grad():
            for s, rows in zip(bucket, torch.split(every, [s.chunk for s in bucket], dim=-1)):
                s.write_whole(s.param.data, rows)


__all__ = ["runtime_calls"]
