"""`tilework plan`: what tilework would do with a job on a cluster, and what it would cost.

Pure: the model is built on the meta device (no weights, so an LM1B-sized model plans in
milliseconds), the ids are modelled (Zipf over a frequency-sorted vocabulary), nothing runs and
no process group is made.

Every report holds the job's one Plan (its table: every parameter on every axis), its recompute
line and each rank's memory. A data-parallel job adds each entry's predicted traffic and the
step's communication under each mode; a job whose [parallel] has tp, pp or cp > 1 adds the mesh's
sections instead. Where those come from:

    mesh      mesh.parallel_mesh (dp x pp x cp x tp, tp fastest: inside a host when it fits)
    stages    pipeline.split_stages, balanced by stages.balance on each block's matmul weights
    schedule  pipeline.build, printed by its own printer (schedule.format_schedule)
    step      estimate/step.predict, the one step model (the mesh search ranks candidates by
              it): per stage the forward FLOPs of a microbatch over tp and cp at `flops` FLOP/s
              per rank (backward 2x), tp's and cp's exchanges on their links, the schedule
              replayed by pipeline.simulate, then the dp all-reduce, not overlapped
    bytes     mesh_cost.mesh_step_bytes for every rank: what tilework.stats counts in a step
    memory    estimate/memory.py (estimate/plan_memory.py on a mesh), with each rank's budget
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from ..cluster.mesh import Mesh, parallel_mesh, pp_speeds
from ..cluster.topology import Cluster
from ..config.parallel import ParallelConfig
from ..errors import PlanError
from ..estimate.cost import ring_allreduce, sparse_allgather
from ..estimate.memory import with_budget
from ..estimate.plan_cost import comm_seconds, config_pace, entry_costs, paced, pipeline_pace
from ..estimate.step import predict
from ..estimate.step_bytes import cut_weights, mesh_step_bytes
from ..parallel.pipeline.stages import matmul_params
from ..plans.analysis import analyze
from ..plans.plan import Plan
from ..train.job import Job
from ..train.planning import example_batch, job_plan, meta_model, table_traffic


def report(job: Job, cluster: Cluster, flops: float | None = None,
           flops_source: str = "given") -> dict:
    """What `tilework plan` shows for any job (report/tables.print_report prints it, --json
    dumps it). With tp, pp or cp > 1 the mesh's sections time its stages' compute at `flops`
    FLOP/s per rank (`flops_source` says where that figure came from); a data-parallel plan
    times only communication and needs none."""
    if job.parallel.model_parallel:
        if flops is None:
            raise PlanError("a model-parallel plan times its stages' compute: give the FLOP/s "
                            "per rank (tilework plan --gflops)")
        sections = mesh_sections(job, cluster, flops, flops_source)   # its checks come first
        chosen = job_plan(job, cluster)
        mode = "mesh"
    else:
        chosen = job_plan(job, cluster)
        sections = dp_costs(job, cluster, chosen)
        mode = chosen.mode
    return {"world_size": cluster.world_size, "hosts": cluster.topology().num_hosts,
            "mode": mode, "plan": chosen.as_dict(), "recompute": chosen.recompute_line(),
            **sections, "memory": memory_per_rank(job, cluster, chosen),
            **shares_section(chosen, cluster)}


def shares_section(chosen: Plan, cluster: Cluster) -> dict:
    """Where ranks differ in speed or take uneven shares: each rank's share and speed, and
    the compute pace (the slowest rank's time, in units of an even share on a speed-1 rank)
    under the plan, under the even split, and at the additive ideal (the batch at the sum of
    the speeds)."""
    if chosen.batch_shares is None and not cluster.heterogeneous:
        return {}
    import dataclasses

    from ..estimate.plan_cost import pace

    speeds = cluster.speeds()
    even = dataclasses.replace(chosen, batch_shares=None)
    return {"shares": {"speeds": speeds,
                       # each rank's (its replica's on a mesh)
                       "batch_shares": list(chosen.rank_shares()) if chosen.batch_shares
                       else None,
                       "pace": pace(chosen, cluster), "even_pace": pace(even, cluster),
                       "ideal_pace": len(speeds) / sum(speeds)}}


def memory_per_rank(job: Job, cluster: Cluster, chosen: Plan) -> list[dict]:
    """Each rank's estimated memory under the job's plan, with its budget (80% of the cluster
    file's memory per process, where it says) and whether the estimate's peak exceeds it. On a
    tp/pp/cp mesh each rank's part (estimate/plan_memory.py reads the plan either way)."""
    from ..estimate.plan_memory import plan_memory

    if chosen.parallel is None:
        inputs = example_batch(job, cluster)
    else:
        import torch

        ids = torch.zeros(_replica_batch(job, chosen.mesh.size_of("dp")), job.gpt.seq_len,
                          dtype=torch.long, device="cpu")   # shapes only
        inputs = (ids, ids)
    return [with_budget(e, cluster)
            for e in plan_memory(meta_model(job), chosen, inputs, job.train.optimizer)]


# -- a data-parallel job: each entry's traffic and cost, the step under each mode ---------------

@dataclass(frozen=True)
class Row:
    name: str
    shape: tuple[int, ...]
    density: float | None
    method: str
    partitions: int
    bytes_sent: float
    seconds: float


def param_costs(plan: Plan, traffic, cluster: Cluster) -> list[Row]:
    """Each entry's row of the report: its predicted step (estimate/plan_cost.entry_costs)
    beside what it is and how its rows are read."""
    rows = []
    for pp, c in zip(plan.params, entry_costs(plan, cluster, traffic)):
        t = traffic.get(pp.name)
        method = pp.method if not pp.zero else \
            f"zero-{pp.zero}" + ("/host" if pp.zero_scope == "host" else "")
        rows.append(Row(pp.name, pp.shape, t.per_rank / pp.shape[0] if t else None, method,
                        pp.partitions, c.bytes_sent, c.seconds))
    return rows


def dp_costs(job: Job, cluster: Cluster, chosen: Plan) -> dict:
    """The data-parallel report's sections: `chosen`'s entries with their traffic and cost, and
    the step's communication under each mode and under DDP with sparse gradients."""
    infos = analyze(meta_model(job))
    traffic = table_traffic(job, infos, cluster)
    topo = cluster.topology()
    plans = {mode: job_plan(job, cluster, mode) for mode in ("hybrid", "allreduce", "ps")}
    times = {mode: comm_seconds(p, cluster, traffic) for mode, p in plans.items()}
    # DDP with sparse gradients: dense parameters all-reduced, tables all-gathered.
    dense_bytes = sum(i.nbytes for i in infos if i.name not in traffic)
    times["ddp_sparse_allgather"] = (
        ring_allreduce(dense_bytes, topo, cluster.links,
                       max(1, math.ceil(dense_bytes / plans["allreduce"].bucket_bytes))).seconds
        + sum(sparse_allgather(traffic[i.name], topo, cluster.links, i.row_bytes).seconds
              for i in infos if i.name in traffic))
    why = chosen.by_name()
    return {"params": [vars(r) | {"shape": list(r.shape), "why": why[r.name].reason}
                       for r in param_costs(chosen, traffic, cluster)],
            "step_comm_seconds": times,
            "hybrid_speedup_over_allreduce": times["allreduce"] / times["hybrid"]
            if times["hybrid"] else None}


# -- a tp/pp/cp job: the mesh, its stages and schedule, the predicted step, bytes per rank ------

def mesh_sections(job: Job, cluster: Cluster, flops: float, flops_source: str = "given") -> dict:
    """The model-parallel report's sections for `job` on `cluster` at `flops` FLOP/s of compute
    per rank."""
    from ..parallel.pipeline import build

    if not flops > 0:
        raise PlanError(f"compute rate: expected a positive FLOP/s per rank, got {flops!r}")
    config = job.parallel
    mesh = _mesh(config, cluster)
    batch = _replica_batch(job, mesh.size_of("dp"))
    m = (config.microbatches or 2 * config.pp) if config.pp > 1 else 1
    if batch % m:
        raise PlanError(f"data.batch_size: each dp replica's {batch} sequences do not split "
                        f"into {m} equal microbatches")
    try:   # pp = 1: one stage, one "microbatch": the step is its forward and backward
        schedule = build(config.schedule if config.pp > 1 else "1f1b", config.pp, m,
                         config.stages_per_rank)
    except ValueError as e:
        raise PlanError(f"parallel.schedule: {e}") from None
    model, seq = meta_model(job), job.gpt.seq_len
    speeds = pp_speeds(mesh, cluster, config.pp)
    stages = _stages(model, schedule, cut_weights(config, schedule, speeds))
    found = predict(model, config, cluster, batch, seq, flops)
    if found.step_s is None:
        raise PlanError(f"[parallel]: {found.why}")
    step, parts = found.step_s, found.parts
    # As estimate(plan) paces it: the slowest rank's share at its speed (under pp, the
    # slowest replica's: the step model times each stage at its ranks' speed).
    step, parts = paced(step, dict(parts), config_pace(config, cluster) if config.pp == 1
                        else pipeline_pace(config, cluster))
    # A stage's time per microbatch holds its share of tp's and cp's exchanges too.
    for s, forward, count in zip(stages, parts["stage_forward_s"], parts["stage_forward_flops"]):
        s["forward_s"], s["forward_flops"] = forward, count
    link = parts["pp_link"]
    return {"mesh": {"axes": dict(mesh.axes),
                     "groups": {a: mesh.groups(a) for a in ("tp", "cp", "pp", "dp")}},
            "batch_per_replica": batch, "seq_len": seq,
            "stages": stages,
            "schedule": {"name": schedule.name, "microbatches": m, "text": schedule.format()},
            "flops_per_s": float(flops), "flops_source": flops_source,
            "pp_link": {"bandwidth_gbps": link.bandwidth_gbps, "latency_us": link.latency_us,
                        "between_hosts": parts["pp_between_hosts"]},
            "activation_bytes": parts["activation_bytes"],
            "pipeline_step_s": parts["pipeline"], "bubble": parts["bubble"],
            "bubbles": parts["bubbles"], "tp_s": parts["tp"], "cp_s": parts["cp"],
            "dp_allreduce_s": parts["dp"], "predicted_step_s": step,
            "pace": parts.get("pace", 1.0),
            "bytes_per_rank": _bytes_per_rank(model, config, mesh, batch, seq, speeds),
            "bytes_note": "dense all-reduce as replicated parameters (ZeRO's and the servers' "
                          "bytes are not in this model)" if config.zero else None}


def _mesh(config: ParallelConfig, cluster: Cluster) -> Mesh:
    try:
        return parallel_mesh(cluster.world_size, cluster.procs_per_host,
                             tp=config.tp, pp=config.pp, cp=config.cp)
    except ValueError as e:
        raise PlanError(f"[parallel] on {cluster.world_size} ranks: {e}") from None


def _replica_batch(job: Job, dp: int) -> int:
    """Sequences each dp replica trains on per step (the trainer's sampler's share)."""
    if job.data.scaling == "weak":
        return job.data.batch_size
    if job.data.batch_size % dp:
        raise PlanError(f"data.batch_size: strong scaling splits {job.data.batch_size} "
                        f"sequences over dp = {dp} replicas: expected a multiple of {dp}")
    return job.data.batch_size // dp


def _stages(model: nn.Module, schedule, weights) -> list[dict]:
    """Each stage: its pp rank, the modules it holds (blocks as a range, cut by `weights` as
    the plan cuts them) and its share of the balance's cost (its time is
    estimate/step.predict's)."""
    from ..parallel.pipeline import split_stages

    try:
        stages = split_stages(model, schedule.stages, speeds=weights)
    except ValueError as e:
        raise PlanError(f"parallel.pp: {e}") from None
    ends = matmul_params(model.head) + matmul_params(model.norm)
    costs = [sum(matmul_params(layer) for layer in s.layers) + (ends if s.last else 0)
             for s in stages]
    out = []
    for k, s in enumerate(stages):
        holds = (["tokens", "positions"] if s.first else []) + [_blocks(s.index_range)] \
            + (["norm", "head"] if s.last else [])
        out.append({"stage": k, "pp_rank": schedule.rank_of(k), "holds": holds,
                    "blocks": [s.index_range.start, s.index_range.stop],
                    "cost_share": costs[k] / sum(costs)})
    return out


def _blocks(r: range) -> str:
    return f"block {r.start}" if len(r) == 1 else f"blocks {r.start}-{r.stop - 1}"


def _bytes_per_rank(model, config: ParallelConfig, mesh: Mesh, batch: int, seq: int,
                    rank_speeds=None) -> list[dict]:
    """mesh_step_bytes of every rank (its stages cut as the plan cuts them: by the config's
    weights, else `rank_speeds`); computed once per (pp, cp, tp) coordinate, which is all
    they depend on (a dp replica's ranks mirror every other's)."""
    seen: dict[tuple, dict] = {}
    out = []
    for rank in range(mesh.size):
        at = mesh.coords(rank)
        key = (at["pp"], at["cp"], at["tp"])
        if key not in seen:
            seen[key] = mesh_step_bytes(model, config, mesh.size, rank, batch, seq,
                                        rank_speeds=rank_speeds)
        out.append({"rank": rank, **seen[key]})
    return out
