"""`estimate(plan, cluster, ...) -> PlanCost`: what one step of a Plan costs, from its parts.

Pure (the meta device, no process group). Its parts are the estimates that exist, each read from
the plan rather than from a configuration: the bytes each entry sends and their seconds on the
links its groups cross (cost.py: the planner's own predictions, a served table without traffic
at every row), the per-rank memory (plan_memory.plan_memory, read from the plan), and on a mesh
the step of step.predict (stage compute at a FLOP rate, the tp and cp exchanges, the pipeline
simulator, the dp all-reduce; a data-parallel plan is the mesh of one stage), given a FLOP rate
and the batch. Without them `compute_s` and `step_s` are None and `comm_s` is what the step
waits on the wire.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..cluster.topology import Cluster
from ..comm.wire import ALL_GATHER
from ..errors import PlanError
from ..plans.plan import Plan, assign_buckets, config_of, dtype_bytes
from .compute import step_flops
from .cost import (
    compressed_entry,
    dense_rides_push,
    dense_served,
    dense_sync_bytes,
    grad_wire,
    link_for,
    meetings_s,
    outer_entry,
    outer_step_seconds,
    predict,
    ring_allreduce,
    seconds,
    shared_meetings,
    zero_bucket_seconds,
)
from .memory import MemoryEstimate
from .plan_memory import plan_memory
from .step import predict as predict_step


@dataclass(frozen=True)
class EntryCost:
    name: str
    bytes_sent: float
    seconds: float


@dataclass(frozen=True)
class PlanCost:
    comm_s: float                        # seconds per step on the wire (all axes)
    compute_s: float | None = None       # seconds per step of compute (None: not modelled)
    step_s: float | None = None          # the step, as the plan overlaps the two (None: unknown)
    memory: tuple[MemoryEstimate, ...] | None = None   # every rank's (None: no example inputs)
    entries: tuple[EntryCost, ...] = ()  # the data-parallel axis, per parameter
    parts: dict = field(default_factory=dict)   # on a mesh: the step's terms, per axis
    why: str = ""                        # why the step cannot run (then step_s is None)


def entry_costs(plan: Plan, cluster: Cluster, traffic: dict | None = None) -> list[EntryCost]:
    """Each entry's predicted step over its dp group (a served table without traffic: every
    row)."""
    topo, links, traffic = _dp_topology(plan, cluster), cluster.links, traffic or {}
    out = []
    for p in plan.params:
        if plan.outer is not None and p.method == "allreduce":
            c = outer_entry(p, plan.outer, topo, links)
        elif plan.grad_compress != "none" and p.method == "allreduce" and not p.zero:
            c = compressed_entry(p, plan.grad_compress, topo, links, plan.powersgd_rank,
                                 plan.topk_ratio)
        else:
            c = predict(p, traffic.get(p.name), topo, links, plan.local_aggregation) \
                or dense_served(p, topo, links)
        out.append(EntryCost(p.name, c.bytes_sent, c.seconds))
    return out


def dense_seconds(plan: Plan, cluster: Cluster, beside_s: float = 0.0) -> float:
    """The bucketed dense parameters' part of `comm_seconds`: their all-reduce (in its wire
    width) and ZeRO's exchanges bucket by bucket, or under local SGD the sync's share and a
    host's own exchanges (ZeRO's too); `beside_s`: an inner step's compute, which a layer-wise
    sync runs beside (`cost.outer_step_seconds`)."""
    topo, links, part = _dp_topology(plan, cluster), cluster.links, plan.part(0)
    if plan.outer is not None:
        return outer_step_seconds(part.of("allreduce"), plan.outer, topo, links,
                                  part.bucket_bytes, beside_s)
    # ZeRO-1's gradients are all-reduced in the replicated parameters' buckets.
    bucketed = [p for p in part.of("allreduce") if p.zero <= 1]
    dense = sum(p.nbytes for p in bucketed)
    sharded = zero_bucket_seconds(part.of("allreduce"), topo.world_size,
                                  link_for(topo, links), topo.num_hosts, part.bucket_bytes)
    if not dense:
        return sharded
    if plan.grad_compress == "topk":   # an all-gather a bucket
        order = list(reversed(bucketed))
        buckets = assign_buckets([p.nbytes for p in order], part.bucket_bytes)
        n = topo.world_size
        sent = dense_sync_bytes([p.nbytes for p in bucketed], part.bucket_bytes, n, 0,
                                grad_compress="topk", item=dtype_bytes(bucketed[0].dtype),
                                topk_ratio=plan.topk_ratio)
        link = link_for(topo, links)
        return seconds(sent, link, 0) + meetings_s(ALL_GATHER, n, link, len(buckets)) + sharded
    if dense_rides_push(part, topo):
        # The one bucket goes whole to every peer at the end of the servers' push
        # (wire.bucket_rides_push): its bytes on the push's link, no meeting of its own.
        # Priced as an all-reduce, the recommender's servers at 4 emulated hosts came out 40%
        # over what they measured (six meetings of 1.2 ms that the step never held).
        return seconds((topo.world_size - 1) * dense, link_for(topo, links), 0) + sharded
    wire = sum(grad_wire(p.nbytes, plan.grad_compress, dtype_bytes(p.dtype), p.shape,
                         plan.powersgd_rank) for p in bucketed)
    # PowerSGD: a second all-reduce a bucket, its Qs.
    rounds = 2 if plan.grad_compress == "powersgd" else 1
    return ring_allreduce(wire, topo, links,
                          rounds * math.ceil(dense / part.bucket_bytes)).seconds + sharded


def comm_seconds(plan: Plan, cluster: Cluster, traffic: dict | None = None) -> float:
    """Data-parallel communication per step (on a mesh: pp rank 0's part over its dp group):
    dense parameters in their buckets (ZeRO's in its own), tables by their own prices less the
    meetings they share (`cost.shared_meetings`)."""
    part = plan.part(0)
    total = dense_seconds(plan, cluster)
    held = {p.name for p in part.params}
    tables = [p for p in plan.params if p.name in held and p.method != "allreduce"]
    costs = dict(zip((p.name for p in plan.params), entry_costs(plan, cluster, traffic)))
    return total + sum(costs[p.name].seconds for p in tables) - shared_meetings(
        tables, traffic or {}, _dp_topology(plan, cluster), cluster.links,
        plan.local_aggregation)


def estimate(plan: Plan, cluster: Cluster, model=None, example_inputs: tuple | None = None,
             *, traffic: dict | None = None, optimizer="adam", flops: float | None = None,
             replica_batch: int | None = None, seq: int | None = None,
             message_overhead_s: float = 0.0, with_memory: bool = True,
             cache: dict | None = None) -> PlanCost:
    """One step of `plan` on `cluster`. `model` (meta device will do) with `example_inputs`
    (one rank's batch; on a mesh one dp replica's) adds every rank's memory; `flops` (FLOP/s
    per rank) adds the step: the reference GPT's step model (estimate/step.py) for it, with
    `replica_batch` sequences of `seq` tokens (default: the inputs' shape), any other model's
    counted FLOPs (estimate/compute.py) plus its data-parallel exchanges. `message_overhead_s`:
    LogP's o per message; a step that cannot run says why and skips the memory (as
    `with_memory=False` does: a search prices memory only where the step could win).
    `cache`: a search's, where plans that recompute alike share their counted compute (its
    FLOP-counting meta forward is most of a candidate's price: 0.7 s for LM1B's LSTM)."""
    entries = tuple(entry_costs(plan, cluster, traffic))
    config = config_of(plan)

    def memory():
        if model is None or example_inputs is None or not with_memory:
            return None
        return tuple(plan_memory(model, plan, example_inputs, optimizer))

    comm = comm_seconds(plan, cluster, traffic)
    if model is None or flops is None:
        return PlanCost(comm, memory=memory(), entries=entries)
    if plan.parallel is None and not _steps_like_the_reference_gpt(model):
        if example_inputs is None:
            return PlanCost(comm, memory=memory(), entries=entries)
        # Any model: its counted FLOPs at the rate, then the data-parallel exchanges (not
        # overlapped: the bound the step cannot exceed).
        cache = {} if cache is None else cache
        key = ("counted compute", plan.recompute,
               flops if isinstance(flops, (int, float)) else id(flops),
               tuple(tuple(x.shape) if hasattr(x, "shape") else repr(x)
                     for x in example_inputs))
        if key not in cache:
            cache[key] = _counted_compute(model, example_inputs, plan.recompute, flops)
        compute = cache[key] * pace(plan, cluster)
        if plan.outer is not None and plan.outer.schedule == "layerwise":
            # Each group's sync travels beside an inner step: what the compute hides.
            comm -= dense_seconds(plan, cluster) - dense_seconds(plan, cluster, compute)
        runtime = _runtime_seconds(model, example_inputs, plan, cluster, flops, optimizer)
        return PlanCost(comm, compute, compute + comm + runtime, memory(), entries,
                        {"compute": compute, "dp": comm, "runtime": runtime})
    if replica_batch is None or seq is None:
        if example_inputs is None:
            return PlanCost(comm, memory=memory(), entries=entries)
        replica_batch, seq = example_inputs[0].shape[:2]
    # The plan's own stage cut: config_of cannot give back the weights it was made by.
    cut = plan.parallel.stages if plan.parallel is not None and plan.parallel.stages else None
    found = predict_step(model, config, cluster, replica_batch, seq, flops, cut=cut,
                         message_overhead_s=message_overhead_s, optimizer=optimizer)
    parts = dict(found.parts)
    if found.step_s is None:
        return PlanCost(comm, entries=entries, parts=parts, why=found.why)
    step = found.step_s
    if plan.outer is not None or plan.grad_compress != "none":
        # The step model all-reduces every step in full width: these plans do not.
        dense = dense_seconds(plan, cluster, parts.get("compute", 0.0))
        step += dense - parts["dp"]
        parts["dp"] = dense
    comm = sum(parts.get(axis, 0.0) for axis in ("tp", "cp", "dp"))
    if config.pp == 1:   # under pp the step model times each stage's speed
        step, parts = paced(step, parts, pace(plan, cluster))
    else:
        step, parts = paced(step, parts, pipeline_pace(config, cluster))
    return PlanCost(comm, parts.get("compute"), step, memory(), entries, parts)


def paced(step: float, parts: dict, slowest: float) -> tuple[float, dict]:
    """A step-model step (without pipeline stages) at the pace of its slowest rank: that
    rank's compute (its share at its speed) sets the pace of the stages' timeline (exchanges
    inside it are scaled too: a bound)."""
    if slowest == 1.0:
        return step, parts
    return step + parts["pipeline"] * (slowest - 1.0), \
        parts | {"compute": parts["compute"] * slowest, "pace": slowest}


def pace(plan: Plan, cluster: Cluster) -> float:
    """How much longer than an even share on a speed-1 rank the slowest rank computes, which a
    data-parallel step waits for: max over ranks of (its share / the mean share) / its speed
    (1 on a cluster of equal hosts with even shares)."""
    return share_pace(plan.rank_shares(), cluster.speeds())


def config_pace(config, cluster: Cluster) -> float:
    """`pace` of a mesh configuration before its plan is made (the search's candidates, the
    mesh report): each rank takes its replica's share of `config.batch_shares`."""
    from ..cluster.mesh import parallel_mesh

    shares = config.batch_shares if isinstance(config.batch_shares, list) else None
    if shares is not None:
        mesh = parallel_mesh(cluster.world_size, cluster.procs_per_host, config.tp, config.pp,
                             config.cp)
        shares = [shares[mesh.coords(r)["dp"]] for r in range(cluster.world_size)]
    return share_pace(shares, cluster.speeds())


def pipeline_pace(config, cluster: Cluster) -> float:
    """Under pp with uneven batch shares, how much longer than the step model's pipeline
    (every replica on the even batch, each stage at its slowest replica's speed) the slowest
    replica takes: its share over the mean, at its own slowest rank's speed against the
    step model's slowest. A bound for stages balanced by speed (the slowest stage sets a
    pipeline's pace); 1 with even shares on equal hosts."""
    from ..cluster.mesh import least_by, parallel_mesh

    shares = config.batch_shares if isinstance(config.batch_shares, list) else None
    if shares is None or len(set(shares)) == 1:
        return 1.0
    mesh = parallel_mesh(cluster.world_size, cluster.procs_per_host, config.tp, config.pp,
                         config.cp)
    speeds = cluster.speeds()
    mean = sum(shares) / len(shares)
    return max(n / mean * min(speeds) / slowest
               for n, slowest in zip(shares, least_by(mesh, "dp", speeds)))


def share_pace(shares, speeds) -> float:
    """`pace` of ranks taking `shares` of the batch (None: even) at `speeds`."""
    shares = shares or (1,) * len(speeds)
    mean = sum(shares) / len(shares)
    return max(n / mean / s for n, s in zip(shares, speeds))


def _counted_compute(model, example_inputs: tuple, recompute, rate) -> float:
    """A step's compute: its counted FLOPs at `rate` (one FLOP/s or a MatmulCurve), or, given
    OpTimes, every op of its forward and backward at its measured time."""
    from .op_stages import model_recording
    from .ops import OpTimes

    if not isinstance(rate, OpTimes):
        return step_flops(model, example_inputs, recompute).seconds(rate)
    return sum(rate.seconds(model_recording(model, example_inputs, recompute)))


def _runtime_seconds(model, example_inputs: tuple, plan: Plan, cluster: Cluster, rate,
                     optimizer) -> float:
    """Given OpTimes, what the runtime runs around a data-parallel step (estimate/runtime_ops.py):
    the bucketed dense parameters' copies (a sparse gradient made dense), ZeRO's, and the
    optimizer's update of what the rank steps; and each table's own work on the servers or
    all-gathered, at its method's measured cost (OpTimes.per_call["table ps"], ...)."""
    from .meta_forward import meta_forward
    from .op_stages import model_recording
    from .ops import OpTimes
    from .runtime_ops import runtime_calls

    if not isinstance(rate, OpTimes):
        return 0.0
    dense = {p.name: p for p in plan.params if p.method == "allreduce"}
    # The recording's specs: each parameter's, or its gradient's where that arrives sparse.
    recorded = model_recording(model, example_inputs, plan.recompute).params
    trained = [name for name, p in model.named_parameters() if p.requires_grad]
    held = [(name, spec) for name, spec in zip(trained, recorded, strict=True)
            if name in dense]
    specs = tuple(spec for _, spec in held)
    zero = max((p.zero for p in dense.values()), default=0)
    host_scope = any(p.zero and p.zero_scope == "host" for p in dense.values())
    shards = min(h.procs for h in cluster.hosts) if host_scope else plan.world_size
    units = tuple(dense[n].unit or "" for n, _ in held)
    # Each table on the servers or all-gathered: its runtime's own work a step, as measured
    # (runtime/table_costs.py; 0 where not measured): a fixed part and a part per id this
    # rank looks it up with. A whole loop's wall time, so not scaled as the ops timed one by
    # one are (on emulated hosts the scale reached 1.9 and priced the servers 36% over what
    # they measured).
    placed = [p for p in plan.params if p.is_table and p.method in ("ps", "allgather")]
    lookups = meta_forward(model, example_inputs, plan.recompute).lookups if placed else {}
    tables = sum(rate.per_call.get(f"table {p.method}", 0.0)
                 + rate.per_call.get(f"table {p.method} id", 0.0) * lookups.get(p.name, 0)
                 for p in placed)
    return rate.priced(runtime_calls(specs, zero, shards, plan.world_size, plan.bucket_bytes,
                                     optimizer, units=units))[0] + tables


def _steps_like_the_reference_gpt(model) -> bool:
    """The step model of estimate/step.py (stages, tp and cp exchanges) is the reference
    GPT's; every other model is priced by its counted FLOPs."""
    from ..parallel.pipeline.model import is_reference_gpt

    return is_reference_gpt(model)


def _dp_topology(plan: Plan, cluster: Cluster):
    """The topology of the group the plan's entries synchronise over: the world's for a
    data-parallel plan, one dp group's (its host mesh) on a mesh."""
    if cluster.world_size != plan.world_size:
        raise PlanError(f"the plan is for {plan.world_size} ranks, the cluster has "
                        f"{cluster.world_size}")
    if plan.parallel is None:
        return cluster.topology()
    return _from_mesh(plan.parallel.dp_mesh)


def _from_mesh(mesh):
    from ..cluster.topology import Topology

    if mesh.names == ("host", "local"):
        return Topology.from_sizes([mesh.size_of("local")] * mesh.size_of("host"))
    return Topology.from_sizes([mesh.size])


__all__ = ["EntryCost", "PlanCost", "comm_seconds", "config_pace", "entry_costs", "estimate",
           "pace", "paced", "pipeline_pace", "share_pace"]
