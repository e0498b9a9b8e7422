"""What one rank holds in memory under a plan: parameters, gradients, optimizer state,
activations, the dense all-reduce's bucket copies, and the peak. Pure: the model runs forward
on the meta device (no memory, no process group), so a model too large for this machine can be
estimated here.

Per rank, for the plan `tilework.plan` makes:

- parameters: dense ones whole; a server table's shard (its rows in `TableLayout`); a dense
  parameter on the servers (mode="ps") whole plus its owner's shard.
- gradients: dense ones whole (torch accumulates into `.grad`); a server table's rows for the
  ids this rank looked up (at most one row per lookup: an upper bound).
- optimizer state: per element of what the optimizer updates on this rank (Adam's two moments,
  Adagrad's sum, SGD momentum's buffer), dense parameters whole and server tables on the shard.
- activations: what autograd saves for backward in a meta forward of `example_inputs`
  (parameters excluded), the forward's output included; attention taken as a fused kernel
  (`_FusedAttention`). A module the plan recomputes counts what its checkpoint keeps: its
  inputs, and under "selective" the outputs of the kept ops (`_Accounted`).
- recompute: what backward rebuilds of the largest recomputed module (saved inside it, not
  kept), a transient of the backward.
- buckets: the dense all-reduce's flat copy of the gradients it reduces (a bucket holding one
  parameter reduces in place, parallel/data/dense.py).
- temporaries: backward's largest transient, taken as twice the largest saved activation (the
  gradient of that activation and the tensor it flows into), a rule of thumb, not a trace; and
  the optimizer step's (`step_temporaries`): torch's Adam/AdamW as `AdamStep` reads torch
  2.13's optim/adam.py (on the tensors this rank updates, in the optimizer's order), the
  servers' row-wise step as `ROW_STEP_COPIES`; other torch optimizers' none (not modelled).

ZeRO (parallel/data/zero.py), per dense parameter at stage z, with chunk = its 1/n share padded:
stages 1 and 2 hold the parameter whole plus its shard (the optimizer's master copy), stage 3
the shard only; gradients are whole at 0 and 1 (plus the shard's at the step under 1) and a
chunk at 2 and 3; optimizer state is per chunk from stage 1. Stages 2 and 3 keep two
reduce-scatter buckets in flight, each a padded flat copy sent and one received. Stage 3's
`gathered` values are a transient of forward and backward: the model's own unit whole, plus
the largest block unit whole and its prefetched successor's all-gather buffer; the model's own
unit is reduce-scattered last, alone (`last_flight`). Offloaded state
and shards (parallel/data/offload.py: memory-mapped files on a CPU host) are `offloaded`, outside
the peak: the kernel may write them out under pressure.

The peak is parameters + optimizer state + the largest of (activations + temporaries +
gathered) at the end of forward, gradients + the larger of (gathered + the larger of buckets
and recompute) and the last flight in backward, and (gradients + the step's temporaries)
during the step.

With tp, pp or cp > 1, `estimate_memory` hands over to estimate/plan_memory.py: the same rules on
one rank's part of a model transformed as `parallelize` transforms it, its forward measured on the
meta device.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .meta_forward import meta_forward
from .outer_memory import outer_state_bytes, outer_sync_memory, outer_workers

# Optimizer state, in elements per updated element; torch's Adam family and Adagrad also keep
# a float32 step counter per parameter tensor.
STATE_PER_ELEMENT = {"sgd": 0, "sgd-momentum": 1, "adagrad": 1, "adam": 2, "adamw": 2,
                     "sparseadam": 2, "rmsprop": 1}
STEP_COUNTER_BYTES = {"adagrad": 4, "adam": 4, "adamw": 4, "rmsprop": 4}

# The servers' row-wise step (optim/rowwise.py) on R rows allocates R x row bytes this many
# times over, beside the rows' summed gradient it is given (measured:
# tests/estimate/test_memory.py).
# Tables run Adam lazily (SparseAdam's arithmetic); a dense parameter on the servers (mode="ps")
# runs Adam's, one copy more.
ROW_STEP_COPIES = {"adagrad": 2, "adam": 6, "adamw": 6, "sparseadam": 6}


@dataclass(frozen=True)
class AdamStep:
    """What torch's Adam/AdamW step (torch 2.13, optim/adam.py) allocates beyond parameters,
    gradients and state, for one param group. b_i: the i-th updated tensor's bytes in the
    group's order; G_k: the k-th (device, dtype) subgroup's total; e = 1 with a gradient copy
    (maximize's `-grad`, or Adam's L2 weight decay `grad.add(param)`; AdamW's decoupled decay
    is in place), else 0.

    - "single" (`_single_tensor_adam`, torch's default on CPU: foreach is its default only on
      cuda/xpu/mtia/privateuse1): a loop, `denom = (v.sqrt() / c).add_(eps)` holding the sqrt
      and the quotient at once (2 b_i) while the previous tensor's `denom` is still bound
      (b_{i-1}); the gradient copy is made while the previous copy and `denom` live:
      max over i of max((1+e) b_{i-1} + e b_i, b_{i-1} + (2+e) b_i). amsgrad (a maximum
      written in place) and capturable (a tensor divisor) add nothing.
    - "foreach" (`_multi_tensor_adam`, the default on CUDA): each subgroup's list of sqrt's
      (G_k), made while the previous subgroup's is still bound (G_{k-1}); the gradient copy
      and capturable's scaled copy for a tensor beta2 (s) are deleted before the sqrt:
      max over k of G_{k-1} + max(e + s, 1) G_k.
    - "fused" (`_fused_adam`): none.
    Param groups step one after another (a group's locals die with its call): the largest.
    Parameters without a gradient (the servers' after their push) are skipped by torch."""

    path: str              # "single", "foreach" or "fused"
    grad_copy: bool        # e above
    scaled: bool = False   # s above

    def temporaries(self, tensors: list[tuple[int, str]]) -> int:
        """Peak bytes for one param group; `tensors`: (bytes, dtype) in the group's order."""
        e = int(self.grad_copy)
        if self.path == "fused" or not tensors:
            return 0
        if self.path == "single":
            sizes = [b for b, _ in tensors]
            return max(max((1 + e) * prev + e * b, prev + (2 + e) * b)
                       for prev, b in zip([0, *sizes], sizes))
        totals: dict[str, int] = {}   # one device per rank: subgroups by dtype, as first met
        for b, dtype in tensors:
            totals[dtype] = totals.get(dtype, 0) + b
        sums = list(totals.values())
        return max(prev + max(e + int(self.scaled), 1) * g for prev, g in zip([0, *sums], sums))

    @classmethod
    def of(cls, kind: str, group: dict, device: str) -> AdamStep | None:
        """The rule for a param group's hyperparameters (torch's defaults for those it lacks:
        an optimizer given by name or class), on a rank that steps on `device` (a device
        type); None for an optimizer other than Adam/AdamW."""
        import torch

        if kind not in ("adam", "adamw"):
            return None
        decoupled = kind == "adamw" or group.get("decoupled_weight_decay", False)
        weight_decay = group.get("weight_decay", 1e-2 if kind == "adamw" else 0)
        grad_copy = bool(group.get("maximize", False) or (weight_decay and not decoupled))
        fused, foreach = group.get("fused"), group.get("foreach")
        if fused:
            return cls("fused", grad_copy)
        if foreach is None:   # torch's _default_to_fused_or_foreach
            foreach = device in _foreach_devices() and not group.get("differentiable", False)
        scaled = bool(foreach and group.get("capturable", False)
                      and isinstance(group.get("betas", (0, 0))[1], torch.Tensor))
        return cls("foreach" if foreach else "single", grad_copy, scaled)


def _foreach_devices() -> list[str]:
    try:
        from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices
    except ImportError:   # pragma: no cover - another torch
        return ["cuda", "xpu"]
    return _get_foreach_kernels_supported_devices()


@dataclass(frozen=True)
class MemoryEstimate:
    rank: int
    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    buckets: int
    temporaries: int
    step_temporaries: int
    recompute: int = 0   # backward's rebuild of the largest recomputed module's activations
    gathered: int = 0    # ZeRO-3's full values while their units run
    offloaded: int = 0   # in memory-mapped files (not in the peak)
    last_flight: int = 0   # ZeRO-3: the model's own unit's reduce-scatter, the last of backward
    pipelined: int = 0     # pp: activations still held (and backward's transient) beside gradients

    @property
    def peak(self) -> int:
        forward = self.activations + self.temporaries + self.gathered
        # While the blocks run backward: their gathered values, and either a module's rebuilt
        # activations or a bucket in flight (a bucket is launched once its module's backward,
        # recompute included, is done). Then, alone, the model's own unit's reduce-scatter.
        # Under pp later microbatches' activations are held while the gradients exist.
        backward = self.gradients + max(self.gathered + max(self.buckets, self.recompute),
                                        self.last_flight, self.pipelined)
        step = self.gradients + self.step_temporaries
        return self.parameters + self.optimizer_state + max(forward, backward, step)

    def as_dict(self) -> dict:
        return {**vars(self), "peak": self.peak}


def optimizer_kind(optimizer) -> str:
    """The STATE_PER_ELEMENT key of a torch optimizer (instance or class) or a name."""
    if isinstance(optimizer, str):
        kind = optimizer.lower()
    else:
        cls = optimizer if isinstance(optimizer, type) else type(optimizer)
        kind = cls.__name__.lower()
        if kind == "sgd" and not isinstance(optimizer, type):
            momentum = any(g.get("momentum", 0) for g in optimizer.param_groups)
            kind = "sgd-momentum" if momentum else "sgd"
    if kind not in STATE_PER_ELEMENT:
        raise ValueError(f"optimizer: expected one of {', '.join(STATE_PER_ELEMENT)}, got {kind!r}")
    return kind


def estimate_per_rank(model: nn.Module, plan, example_inputs: tuple, optimizer="adam",
                      ranks=None, facts=None) -> list[MemoryEstimate]:
    """`estimate_memory` for `ranks` (default: every rank) of a given plan: the forward runs
    once, each table's layout is built once. `facts`: the forward's, when the caller ran it
    (estimate/plan_memory.py, on a transformed model)."""
    from ..plans.rows import TableLayout

    kind = optimizer_kind(optimizer)
    per_element = STATE_PER_ELEMENT[kind]
    groups = _param_groups(model, optimizer)
    # amsgrad keeps a third moment-sized tensor, the running maximum.
    amsgrad = {name for group, names in groups if kind in ("adam", "adamw")
               and group.get("amsgrad", False) for name in names}
    if facts is None:
        facts = meta_forward(model, example_inputs, plan.recompute)
    uneven = any(pp.zero_chunks for pp in plan.params)   # else every rank's are alike
    served = [(pp, TableLayout(pp, plan.world_size, device="meta").shard_sizes)
              for pp in plan.of("ps")]
    dtypes = {pp.name: pp.dtype for pp in plan.params}
    device = _step_device(model, plan)
    sync = outer_sync_memory(plan, device)   # local SGD's sync, inside the user's step

    def dense_step(zero: DenseFigures) -> int:
        """The user's optimizer on what this rank updates (whole or the shards)."""
        peak = 0
        for group, names in groups:
            rule = AdamStep.of(kind, group, device)
            if rule is not None:
                peak = max(peak, rule.temporaries(
                    [(zero.updated[n], dtypes[n]) for n in names if n in zero.updated]))
        return peak

    out, figures = [], {}   # (dense figures, the optimizer's step) by rank, or once
    for rank in range(plan.world_size) if ranks is None else ranks:
        key = rank if uneven else 0
        if key not in figures:
            zero = zero_figures(plan, per_element, STEP_COUNTER_BYTES.get(kind, 0), amsgrad, key)
            figures[key] = (zero, dense_step(zero))
        zero, zero_step = figures[key]
        params, grads, state = zero.parameters, zero.gradients, zero.state
        received = row_step = 0   # the servers' step, before the dense one (engine._prepare_step)
        for pp, sizes in served:
            shard = sizes[rank] * pp.row_bytes
            if pp.is_table:
                params += shard
                looked_up = min(facts.lookups.get(pp.name, pp.shape[0]), pp.shape[0])
                grads += looked_up * pp.row_bytes
                # The owner steps on the rows any rank sent it: at most every rank's lookups.
                rows = min(sizes[rank], plan.world_size * looked_up) * pp.row_bytes
                copies = ROW_STEP_COPIES.get(kind, 0)
            else:   # mode="ps": a replica to compute with, the shard its owner updates
                params, grads = params + pp.nbytes + shard, grads + pp.nbytes
                rows = shard
                copies = ROW_STEP_COPIES.get(kind, 0) + (kind in ("adam", "adamw"))
            state += (per_element + (pp.name in amsgrad)) * shard
            received += rows
            row_step = max(row_step, copies * rows)
        step = max(zero_step, zero.after_step, received + row_step if served else 0,
                   sync.transient)
        out.append(MemoryEstimate(rank, params, grads, state, facts.activations, zero.buckets,
                                  2 * facts.largest, step, facts.recomputed, zero.gathered,
                                  zero.offloaded, zero.last_flight))
    return out


def _param_groups(model: nn.Module, optimizer) -> list[tuple[dict, list[str]]]:
    """The optimizer's param groups as (hyperparameters, parameter names in its order); a
    name or class: one group of torch's defaults over the model's parameters."""
    everything = [name for name, p in model.named_parameters() if p.requires_grad]
    if isinstance(optimizer, (str, type)):
        return [({}, everything)]
    names = {id(p): name for name, p in model.named_parameters()}
    groups = [({k: v for k, v in g.items() if k != "params"},
               [names[id(p)] for p in g["params"] if id(p) in names])
              for g in optimizer.param_groups]
    if not any(found for _, found in groups):   # not this model's parameters (a copy's)
        return [(groups[0][0] if groups else {}, everything)]
    return groups


def _step_device(model: nn.Module, plan) -> str:
    """The device type the optimizer steps on: the host's with offload (parallel/data/offload.py),
    else the model's (a model on the meta device: a CPU host)."""
    p = next(model.parameters(), None)
    if plan.offload != "none" or p is None or p.device.type == "meta":
        return "cpu"
    return p.device.type


@dataclass(frozen=True)
class DenseFigures:
    """The all-reduced parameters' bytes on every rank (alike on all), ZeRO stages included."""

    parameters: int
    gradients: int
    state: int
    buckets: int
    gathered: int
    offloaded: int
    updated: dict[str, int]   # what the optimizer updates, by name: the parameter or its shard
    after_step: int = 0   # stages 1 and 2: the all-gather of the updated shards
    last_flight: int = 0  # stage 3: the model's own unit's reduce-scatter, after the blocks'


def zero_figures(plan, per_element: int, counter_bytes: int,
                 amsgrad: frozenset[str] | set[str] = frozenset(), rank: int = 0) -> DenseFigures:
    """Per rank, for the plan's all-reduced parameters (the module docstring's rules);
    `amsgrad`: the names whose state has one element more. `rank` matters only where ZeRO
    cuts unevenly (ParamPlan.zero_chunks): what it keeps is its own chunk, what crosses is
    padded to the largest."""
    from ..plans.plan import assign_buckets
    from .cost import zero_own_bytes, zero_shard

    n = plan.world_size
    # A table whose rows are all-gathered is replicated like an all-reduced parameter; its
    # gradient is taken whole (sparse, it holds the touched rows only: an upper bound).
    dense = [*plan.of("allreduce"), *plan.of("allgather")]
    hosts = plan.mesh.size_of("host") if "host" in plan.mesh.names else 1
    shard = {pp.name: zero_shard(pp, n, hosts) for pp in dense}
    over = {name: ranks for name, (ranks, _) in shard.items()}     # ranks it is sharded over
    chunk = {name: nbytes for name, (_, nbytes) in shard.items()}  # each one's padded bytes
    own = {pp.name: zero_own_bytes(pp, n, hosts, rank) for pp in dense}   # what this rank keeps
    # Offloaded state leaves the computing memory: mapped files on a CPU host, pinned host
    # memory beside a GPU (where "optimizer" also moves the shards: not modelled here).
    files = plan.offload != "none"
    params = grads = state = offloaded = 0
    for pp in dense:
        shard = own[pp.name] if pp.zero else 0
        params += (pp.nbytes if pp.zero < 3 else 0) + (0 if plan.offload == "all" else shard)
        grads += pp.nbytes if pp.zero <= 1 else shard
        grads += shard if pp.zero == 1 else 0
        held = ((per_element + (pp.name in amsgrad)) * (shard if pp.zero else pp.nbytes)
                + counter_bytes)
        state += 0 if (pp.zero and files) else held
        offloaded += (held if pp.zero and files else 0) + (shard if plan.offload == "all" else 0)
    replicated = [pp.nbytes for pp in dense if pp.zero <= 1 and pp.method == "allreduce"]
    # Flat all-reduce copies (a lone large parameter is reduced in place, parallel/data/dense.py,
    # but not when compressed). PowerSGD and top-k also keep each rank's error, a copy of every
    # bucket; PowerSGD holds what it sent until the Qs land; top-k ranks a bucket's magnitudes
    # (a copy of one bucket) and receives every rank's positions and values.
    # Under local SGD only a worker's own ranks all-reduce every step (outer_worker="host"):
    # a worker of one rank keeps no buckets.
    reducing = n if plan.outer is None else outer_workers(plan)[1]
    compressed = plan.grad_compress in ("powersgd", "topk") and reducing > 1
    buckets = sum(replicated) if reducing > 1 and (len(replicated) > 1 or compressed) else 0
    if compressed and plan.grad_compress == "powersgd":
        buckets += 2 * sum(replicated)
    elif compressed:
        buckets += sum(replicated) + min(sum(replicated), plan.bucket_bytes) \
            + int(2 * n * plan.topk_ratio * sum(replicated))
    scattered = [pp for pp in reversed(dense) if pp.zero == 2]
    sizes = [chunk[pp.name] * over[pp.name] for pp in scattered]
    flat = [sum(sizes[i] for i in b) for b in assign_buckets(sizes, plan.bucket_bytes)]
    units: dict[str, int] = {}
    for pp in dense:
        if pp.zero == 3:
            units[pp.unit] = units.get(pp.unit, 0) + chunk[pp.name] * over[pp.name]
    flat += [size for name, size in reversed(units.items()) if name]
    # A bucket in flight is sent and received whole (gloo's all-to-all) while the next one's
    # gradients accumulate; the one before is finished before it is packed (parallel/data/zero.py).
    buckets += max((2 * a + b for a, b in zip(flat, flat[1:] + [0])), default=0) if n > 1 else 0
    blocks = [size for name, size in units.items() if name]
    gathered = units.get("", 0) + 2 * max(blocks, default=0)
    # The model's own unit is reduce-scattered last, its values freed as it is packed: sent and
    # received whole, alone.
    last_flight = 2 * units.get("", 0) if n > 1 else 0
    updated = {pp.name: own[pp.name] if pp.zero else pp.nbytes for pp in dense}
    # After the step, stages 1 and 2 gather bucket by bucket, two in flight: while one bucket's
    # gathered values are copied out, its shards' copy (still held by the finished collective)
    # and the next bucket's both exist.
    gathering = [pp for pp in reversed(dense) if pp.zero in (1, 2)]
    widths = [chunk[pp.name] for pp in gathering]
    per_bucket = [(sum(widths[i] for i in b), over[gathering[b[0]].name])
                  for b in assign_buckets([w * over[pp.name] for w, pp in zip(widths, gathering)],
                                          plan.bucket_bytes)]
    after_step = max((w * (m + 1) + w2 * (m2 + 1) for (w, m), (w2, m2)
                      in zip(per_bucket, per_bucket[1:] + [(0, 0)])), default=0) if n > 1 else 0
    state += outer_state_bytes(plan)
    return DenseFigures(params, grads, state, buckets, gathered, offloaded, updated, after_step,
                        last_flight)


BUDGET_SHARE = 0.8   # paper 4's margin: a plan estimated under 80% of memory is not killed


def rank_budgets(cluster, fallback_bytes: float | None = None) -> list[float | None]:
    """Each rank's budget in bytes: 80% of the memory the cluster file gives its process, else
    of `fallback_bytes` (what the machine has), else None (no budget)."""
    out = []
    for h in cluster.hosts:
        budget = BUDGET_SHARE * h.memory_gb * 1e9 if h.memory_gb is not None else \
            None if fallback_bytes is None else BUDGET_SHARE * fallback_bytes
        out += [budget] * h.procs
    return out


def with_budget(estimate, cluster) -> dict:
    """An estimate's figures and its rank's budget (`rank_budgets`), and whether the peak
    exceeds it."""
    budget = rank_budgets(cluster)[estimate.rank]
    return estimate.as_dict() | {"budget": budget,
                                 "over_budget": budget is not None and estimate.peak > budget}
