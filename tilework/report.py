"""`tilework plan`: what tilework would do with a job on a cluster, and what it would cost.

Pure: the model is built on the meta device (no weights, so an LM1B-sized model plans in
milliseconds), the ids are modelled (Zipf over a frequency-sorted vocabulary), nothing runs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from .analysis import ParamInfo, analyze
from .cluster import Cluster, Host, Links, Topology
from .cost import TableTraffic, dense_served, predict, ring_allreduce, sparse_allgather
from .errors import PlanError
from .models import DLRM, SmallResNet, TinyGPT, WordLM
from .plan import Plan
from .planner import plan
from .train.job import Job


def meta_model(job: Job) -> torch.nn.Module:
    """The job's model with shapes and no memory; a PlanError where it cannot be built."""
    try:
        with torch.device("meta"):
            if job.workload == "lm":
                c = job.lm
                return WordLM(c.vocab, c.embed_dim, c.hidden, c.layers, c.sparse, c.num_sampled)
            if job.workload == "gpt":
                c = job.gpt
                return TinyGPT(c.vocab, c.dim, c.heads, c.layers, c.seq_len)
            if job.workload == "cnn":
                c = job.cnn
                return SmallResNet(c.num_classes, c.width, c.blocks)
            c = job.recommender
            return DLRM(c.table_sizes, c.dense_features, c.embed_dim, sparse=c.sparse)
    except (RuntimeError, TypeError) as e:
        # The job's sizes are the only input: torch refuses a tensor of 2**63 elements or more
        # (RuntimeError), or a dimension beyond int64 (TypeError).
        raise PlanError(f"[{job.workload}]: sizes too large for any model "
                        f"({str(e).splitlines()[0]})") from None


def table_traffic(job: Job, infos: list[ParamInfo], cluster: Cluster) -> dict[str, TableTraffic]:
    """Expected distinct rows per step of each table, from the job's batch and a Zipf model."""
    topo = cluster.topology()
    n = topo.world_size
    per_rank = job.data.batch_size / n if job.data.scaling == "strong" else job.data.batch_size
    out = {}
    for info in infos:
        if not info.is_table:
            continue
        rows = info.shape[0]
        if job.workload == "lm":
            tokens = per_rank * job.lm.seq_len
            alpha = job.lm.zipf_alpha if job.lm.corpus == "zipf" else 1.0
            if info.name == "embedding.weight":
                out[info.name] = TableTraffic.zipf(rows, tokens, topo, alpha)
            elif job.lm.num_sampled:
                # targets (Zipf) plus negatives shared by every rank (log-uniform, ~Zipf 1)
                t = TableTraffic.zipf(rows, tokens, topo, alpha)
                neg = TableTraffic.zipf(rows, job.lm.num_sampled, topo, 1.0)
                out[info.name] = TableTraffic(min(rows, t.per_rank + neg.per_rank),
                                              min(rows, t.per_host + neg.per_rank),
                                              min(rows, t.world + neg.per_rank))
            else:
                out[info.name] = TableTraffic(rows, rows, rows)  # the full softmax reads all rows
        elif job.workload == "recommender":
            out[info.name] = TableTraffic.zipf(rows, per_rank, topo, job.recommender.zipf_alpha)
    return out


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
    """Each entry's predicted step on `cluster` (a served table without traffic: every row)."""
    topo, links = cluster.topology(), cluster.links
    rows = []
    for pp in plan.params:
        t = traffic.get(pp.name)
        c = predict(pp, t, topo, links, plan.local_aggregation) or dense_served(pp, topo, links)
        method = pp.method if not pp.zero else \
            f"zero-{pp.zero}" + ("/host" if pp.zero_scope == "host" else "")
        rows.append(Row(pp.name, pp.shape, t.per_rank / pp.shape[0] if t else None, method,
                        pp.partitions, c.bytes_sent, c.seconds))
    return rows


def step_seconds(plan: Plan, traffic, cluster: Cluster) -> float:
    """Communication seconds per step: replicated dense parameters bucketed together, tables
    and ZeRO-sharded parameters one by one."""
    topo, links = cluster.topology(), cluster.links
    dense = sum(pp.nbytes for pp in plan.of("allreduce") if not pp.zero)
    total = 0.0
    if dense:
        total += ring_allreduce(dense, topo, links, math.ceil(dense / plan.bucket_bytes)).seconds
    return total + sum(r.seconds for pp, r in zip(plan.params, param_costs(plan, traffic, cluster))
                       if pp.method == "ps" or pp.zero)


def job_cluster(topology: Topology, cluster: Cluster | None) -> Cluster:
    """The cluster a job runs on, as the planner sees it: the ranks as discovered, the links of
    the cluster file when there is one."""
    hosts = [Host(f"host{i}", len(ranks)) for i, ranks in enumerate(topology.hosts)]
    return Cluster(hosts=hosts, links=cluster.links if cluster is not None else Links())


def job_plan(job: Job, cluster: Cluster, mode: str | None = None) -> Plan:
    """The plan `tilework train` runs for `job` on `cluster` (another `mode` for comparisons)."""
    model = meta_model(job)
    config = job.parallel if mode is None else dataclasses.replace(job.parallel, mode=mode)
    return plan(model, config, cluster, traffic=table_traffic(job, analyze(model), cluster))


def example_batch(job: Job, cluster: Cluster) -> tuple:
    """One rank's inputs to the job's model, as the trainer passes them (zeros: only their
    shapes matter to the memory estimate)."""
    n = cluster.world_size
    b = max(1, -(-job.data.batch_size // n)) if job.data.scaling == "strong" else job.data.batch_size
    # On the host: the estimate moves them to the meta device.
    def ids(*shape):
        return torch.zeros(*shape, dtype=torch.long, device="cpu")

    def values(*shape):
        return torch.zeros(*shape, device="cpu")

    if job.workload == "lm":
        c = job.lm
        negatives = ids(c.num_sampled) if c.num_sampled else None
        return ids(b, c.seq_len), ids(b, c.seq_len), negatives
    if job.workload == "gpt":
        return ids(b, job.gpt.seq_len), ids(b, job.gpt.seq_len)
    if job.workload == "cnn":
        return values(b, 3, job.cnn.image_size, job.cnn.image_size), ids(b)
    c = job.recommender
    return values(b, c.dense_features), ids(b, len(c.table_sizes)), values(b)


def memory_per_rank(job: Job, cluster: Cluster, chosen: Plan) -> list[dict]:
    """Each rank's estimated memory under the job's plan, with its budget (80% of the cluster
    file's memory per process, where it says) and whether the estimate's peak exceeds it."""
    from .memory import estimate_per_rank

    return [with_budget(e, cluster)
            for e in estimate_per_rank(meta_model(job), chosen, example_batch(job, cluster),
                                       job.train.optimizer)]


def with_budget(estimate, cluster: Cluster) -> dict:
    """An estimate's figures and its rank's budget: 80% of the memory the cluster file gives
    the process (paper 4's margin), and whether the peak exceeds it."""
    budgets = [h.memory_gb for h in cluster.hosts for _ in range(h.procs)]
    budget = None if budgets[estimate.rank] is None else 0.8 * budgets[estimate.rank] * 1e9
    return estimate.as_dict() | {"budget": budget,
                                 "over_budget": budget is not None and estimate.peak > budget}


def report(job: Job, cluster: Cluster, flops: float | None = None,
           flops_source: str = "given") -> dict:
    """What `tilework plan` shows: with tp, pp or cp > 1 the mesh's report (mesh_report.py,
    its compute at `flops` FLOP/s per rank), else the data-parallel plan and its costs."""
    if job.parallel.model_parallel:
        from .mesh_report import mesh_report

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
    times = {mode: step_seconds(p, traffic, cluster) for mode, p in plans.items()}
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
