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
  parameter reduces in place, sync/dense.py).
- temporaries: backward's largest transient, taken as twice the largest saved activation (the
  gradient of that activation and the tensor it flows into), a rule of thumb, not a trace; and
  the optimizer step's: torch's foreach Adam-family steps build about one parameter-sized
  intermediate (`step_temporaries`), the others none.

ZeRO (sync/zero.py), per dense parameter at stage z, with chunk = its 1/n share padded:
stages 1 and 2 hold the parameter whole plus its shard (the optimizer's master copy), stage 3
the shard only; gradients are whole at 0 and 1 (plus the shard's at the step under 1) and a
chunk at 2 and 3; optimizer state is per chunk from stage 1. Stages 2 and 3 keep two
reduce-scatter buckets in flight, each a padded flat copy sent and one received. Stage 3's
`gathered` values are a transient of forward and backward: the model's own unit whole, plus
the largest block unit whole and its prefetched successor's all-gather buffer; the model's own
unit is reduce-scattered last, alone (`last_flight`). Offloaded state
and shards (sync/offload.py: memory-mapped files on a CPU host) are `offloaded`, outside the
peak: the kernel may write them out under pressure.

The peak is parameters + optimizer state + the largest of (activations + temporaries +
gathered) at the end of forward, gradients + the larger of (gathered + the larger of buckets
and recompute) and the last flight in backward, and (gradients + the step's temporaries)
during the step.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .meta_forward import meta_forward

# Optimizer state, in elements per updated element; torch's Adam family and Adagrad also keep
# a float32 step counter per parameter tensor.
STATE_PER_ELEMENT = {"sgd": 0, "sgd-momentum": 1, "adagrad": 1, "adam": 2, "adamw": 2,
                     "sparseadam": 2, "rmsprop": 1}
STEP_COUNTER_BYTES = {"adagrad": 4, "adam": 4, "adamw": 4, "rmsprop": 4}


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

    @property
    def peak(self) -> int:
        forward = self.activations + self.temporaries + self.gathered
        # While the blocks run backward: their gathered values, and either a module's rebuilt
        # activations or a bucket in flight (a bucket is launched once its module's backward,
        # recompute included, is done). Then, alone, the model's own unit's reduce-scatter.
        backward = self.gradients + max(self.gathered + max(self.buckets, self.recompute),
                                        self.last_flight)
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


def estimate_memory(model: nn.Module, config=None, example_inputs: tuple = (), cluster=None,
                    optimizer="adam", rank: int = 0) -> MemoryEstimate:
    """Bytes rank `rank` holds training `model` on `example_inputs` (one rank's batch) under
    the plan `tilework.plan(model, config, cluster)` makes, with `optimizer` (a torch optimizer,
    its class or its name). Pure: runs on the meta device, needs no process group."""
    from .planner import plan as make_plan

    plan = make_plan(model, config, cluster)
    if not 0 <= rank < plan.world_size:
        raise ValueError(f"rank: expected 0..{plan.world_size - 1}, got {rank}")
    return estimate_per_rank(model, plan, example_inputs, optimizer, ranks=[rank])[0]


def estimate_per_rank(model: nn.Module, plan, example_inputs: tuple, optimizer="adam",
                      ranks=None) -> list[MemoryEstimate]:
    """`estimate_memory` for `ranks` (default: every rank) of a given plan: the forward runs
    once, each table's layout is built once."""
    from .layout import TableLayout

    kind = optimizer_kind(optimizer)
    per_element = STATE_PER_ELEMENT[kind]
    facts = meta_forward(model, example_inputs, plan.recompute)
    zero = zero_figures(plan, per_element, STEP_COUNTER_BYTES.get(kind, 0))
    served = [(pp, TableLayout(pp, plan.world_size, device="meta").shard_sizes)
              for pp in plan.of("ps")]
    step = max(zero.updated if kind in ("adam", "adamw") else 0, zero.after_step)
    out = []
    for rank in range(plan.world_size) if ranks is None else ranks:
        params, grads, state = zero.parameters, zero.gradients, zero.state
        for pp, sizes in served:
            shard = sizes[rank] * pp.row_bytes
            if pp.is_table:
                params += shard
                grads += min(facts.lookups.get(pp.name, pp.shape[0]), pp.shape[0]) * pp.row_bytes
            else:   # mode="ps": a replica to compute with, the shard its owner updates
                params, grads = params + pp.nbytes + shard, grads + pp.nbytes
            state += per_element * shard
        out.append(MemoryEstimate(rank, params, grads, state, facts.activations, zero.buckets,
                                  2 * facts.largest, step, facts.recomputed, zero.gathered,
                                  zero.offloaded, zero.last_flight))
    return out


@dataclass(frozen=True)
class DenseFigures:
    """The all-reduced parameters' bytes on every rank (alike on all), ZeRO stages included."""

    parameters: int
    gradients: int
    state: int
    buckets: int
    gathered: int
    offloaded: int
    updated: int   # what the optimizer updates: its step's intermediates scale with it
    after_step: int = 0   # stages 1 and 2: the all-gather of the updated shards
    last_flight: int = 0  # stage 3: the model's own unit's reduce-scatter, after the blocks'


def zero_figures(plan, per_element: int, counter_bytes: int) -> DenseFigures:
    """Per rank, for the plan's all-reduced parameters (the module docstring's rules)."""
    from .cost import zero_shard
    from .plan import assign_buckets

    n = plan.world_size
    dense = plan.of("allreduce")
    hosts = plan.mesh.size_of("host") if "host" in plan.mesh.names else 1
    shard = {pp.name: zero_shard(pp, n, hosts) for pp in dense}
    over = {name: ranks for name, (ranks, _) in shard.items()}     # ranks it is sharded over
    chunk = {name: nbytes for name, (_, nbytes) in shard.items()}  # each one's padded bytes
    # Offloaded state leaves the computing memory: mapped files on a CPU host, pinned host
    # memory beside a GPU (where "optimizer" also moves the shards: not modelled here).
    files = plan.offload != "none"
    params = grads = state = offloaded = 0
    for pp in dense:
        shard = chunk[pp.name] if pp.zero else 0
        params += (pp.nbytes if pp.zero < 3 else 0) + (0 if plan.offload == "all" else shard)
        grads += pp.nbytes if pp.zero <= 1 else chunk[pp.name]
        grads += shard if pp.zero == 1 else 0
        held = per_element * (shard if pp.zero else pp.nbytes) + counter_bytes
        state += 0 if (pp.zero and files) else held
        offloaded += (held if pp.zero and files else 0) + (shard if plan.offload == "all" else 0)
    replicated = [pp.nbytes for pp in dense if pp.zero <= 1]
    # Flat all-reduce copies (a lone large parameter is reduced in place, sync/dense.py).
    buckets = sum(replicated) if n > 1 and len(replicated) > 1 else 0
    scattered = [pp for pp in reversed(dense) if pp.zero == 2]
    sizes = [chunk[pp.name] * over[pp.name] for pp in scattered]
    flat = [sum(sizes[i] for i in b) for b in assign_buckets(sizes, plan.bucket_bytes)]
    units: dict[str, int] = {}
    for pp in dense:
        if pp.zero == 3:
            units[pp.unit] = units.get(pp.unit, 0) + chunk[pp.name] * over[pp.name]
    flat += [size for name, size in reversed(units.items()) if name]
    # A bucket in flight is sent and received whole (gloo's all-to-all) while the next one's
    # gradients accumulate; the one before is finished before it is packed (sync/zero.py).
    buckets += max((2 * a + b for a, b in zip(flat, flat[1:] + [0])), default=0) if n > 1 else 0
    blocks = [size for name, size in units.items() if name]
    gathered = units.get("", 0) + 2 * max(blocks, default=0)
    # The model's own unit is reduce-scattered last, its values freed as it is packed: sent and
    # received whole, alone.
    last_flight = 2 * units.get("", 0) if n > 1 else 0
    updated = sum(chunk[pp.name] if pp.zero else pp.nbytes for pp in dense)
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
    return DenseFigures(params, grads, state, buckets, gathered, offloaded, updated, after_step,
                        last_flight)
