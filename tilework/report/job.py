"""`tilework plan`: what tilework would do with a job on a cluster, and what it would cost.

Pure: the model is built on the meta device (no weights, so an LM1B-sized model plans in
milliseconds), the ids are modelled (Zipf over a frequency-sorted vocabulary), nothing runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..cluster.topology import Cluster
from ..errors import PlanError
from ..estimate.cost import ring_allreduce, sparse_allgather
from ..estimate.memory import with_budget
from ..estimate.plan_cost import comm_seconds, entry_costs
from ..plans.analysis import analyze
from ..plans.plan import Plan
from ..train.job import Job
from ..train.planning import example_batch, job_plan, meta_model, table_traffic


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


def memory_per_rank(job: Job, cluster: Cluster, chosen: Plan) -> list[dict]:
    """Each rank's estimated memory under the job's plan, with its budget (80% of the cluster
    file's memory per process, where it says) and whether the estimate's peak exceeds it."""
    from ..estimate.memory import estimate_per_rank

    return [with_budget(e, cluster)
            for e in estimate_per_rank(meta_model(job), chosen, example_batch(job, cluster),
                                       job.train.optimizer)]


def report(job: Job, cluster: Cluster, flops: float | None = None,
           flops_source: str = "given") -> dict:
    """What `tilework plan` shows: with tp, pp or cp > 1 the mesh's report (report/mesh.py,
    its compute at `flops` FLOP/s per rank), else the data-parallel plan and its costs."""
    if job.parallel.model_parallel:
        from .mesh import mesh_report

        if flops is None:
            raise PlanError("a model-parallel plan times its stages' compute: give the FLOP/s "
                            "per rank (tilework plan --gflops)")
        return mesh_report(job, cluster, flops, flops_source)
    infos = analyze(meta_model(job))
    traffic = table_traffic(job, infos, cluster)
    topo, n = cluster.topology(), cluster.world_size
    plans = {mode: job_plan(job, cluster, mode) for mode in ("hybrid", "allreduce", "ps")}
    chosen = job_plan(job, cluster)
    rows = param_costs(chosen, traffic, cluster)
    times = {mode: comm_seconds(p, cluster, traffic) for mode, p in plans.items()}
    # DDP with sparse gradients: dense parameters all-reduced, tables all-gathered.
    dense_plan = plans["allreduce"]
    dense_bytes = sum(i.nbytes for i in infos if i.name not in traffic)
    times["ddp_sparse_allgather"] = (
        ring_allreduce(dense_bytes, topo, cluster.links,
                       max(1, math.ceil(dense_bytes / dense_plan.bucket_bytes))).seconds
        + sum(sparse_allgather(traffic[i.name], topo, cluster.links, i.row_bytes).seconds
              for i in infos if i.name in traffic))
    return {"world_size": n, "hosts": topo.num_hosts,
            "mode": chosen.mode,
            "plan": chosen.as_dict(),
            "recompute": chosen.recompute_line(),
            "params": [vars(r) | {"shape": list(r.shape),
                                  "why": chosen.by_name()[r.name].reason} for r in rows],
            "step_comm_seconds": times,
            "memory": memory_per_rank(job, cluster, chosen),
            "hybrid_speedup_over_allreduce": times["allreduce"] / times["hybrid"]
            if times["hybrid"] else None}
