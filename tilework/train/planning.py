"""A job's inputs to planning, shared by `tilework train` and `tilework plan` (so a job runs
the plan `tilework plan` prints): its model on the meta device, its tables' expected traffic,
one rank's example batch, the cluster it runs on, and the plan.
"""

from __future__ import annotations

import dataclasses

import torch

from ..cluster.topology import Cluster, Topology
from ..errors import PlanError
from ..estimate.cost import TableTraffic
from ..models import DLRM, SmallResNet, TinyGPT, WordLM
from ..planner import plan
from ..plans.analysis import ParamInfo, analyze
from ..plans.plan import Plan
from .job import Job


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


def job_cluster(topology: Topology, cluster: Cluster | None) -> Cluster:
    """The cluster a job runs on, as the planner sees it: the ranks as discovered, the links of
    the cluster file when there is one, and its hosts' memory and speeds where its hosts are
    the ones discovered (as many, as many ranks each)."""
    if cluster is None:
        return Cluster.of_topology(topology)
    same = [h.procs for h in cluster.hosts] == [len(h) for h in topology.hosts]
    return Cluster.of_topology(topology, cluster.links,
                               [h.memory_gb for h in cluster.hosts] if same else None,
                               [h.speed for h in cluster.hosts] if same else None)


def job_config(job: Job, cluster: Cluster):
    """The configuration `tilework train` and `tilework plan` run `job` under on `cluster`: the
    job's, with each rank's batch share chosen by speed, within what its memory holds, where
    the cluster's hosts differ in speed or memory (the slowest rank no longer sets the pace,
    the smallest memory no longer the batch: planner/shares.py) and the job left it to the
    planner (no batch_shares given, data parallel, plan="config"; plan="auto" searches both).
    Equal shares, or none that fits every rank's memory, leave the even split (whose memory
    the report then flags).

    Hosts that give different `memory_gb` (every host giving one) also serve server tables'
    rows in proportion to it (`server_weights`), and keep ZeRO's chunks over the world in
    proportion to it (`zero_weights`), unless the job set its own."""
    config = job.parallel
    memories = {h.memory_gb for h in cluster.hosts} - {None}   # the hosts that say
    by_memory = cluster.memories()
    if (len(memories) > 1 and all(h.memory_gb is not None for h in cluster.hosts)
            and not config.model_parallel and not config.auto_axes):
        if config.server_weights is None:
            config = dataclasses.replace(config, server_weights=by_memory)
        # (plan="auto" weighs the even cut and this one itself: planner/search.with_zero_weights)
        if config.zero_weights is None and config.zero and config.zero_scope == "world" \
                and config.plan != "auto":
            config = dataclasses.replace(config, zero_weights=by_memory)
    if config.plan == "auto" and config.batch_shares is None and cluster.heterogeneous:
        return dataclasses.replace(config, batch_shares="auto")   # the trainer hands them out
    if (config.batch_shares is not None or config.model_parallel or config.plan == "auto"
            or (not cluster.heterogeneous and len(memories) <= 1)):
        return config
    from ..errors import ConfigError
    from ..planner.shares import batch_shares

    caps = None
    if memories:   # each rank's share within what its memory holds
        from ..estimate.memory import rank_budgets
        from ..estimate.plan_memory import share_caps

        model = meta_model(job)
        even = plan(model, config, cluster, traffic=table_traffic(job, analyze(model), cluster))
        caps = share_caps(model, even, example_batch(job, cluster), rank_budgets(cluster),
                          global_batch(job, cluster.world_size), job.train.optimizer)
    try:
        shares = batch_shares(global_batch(job, cluster.world_size), cluster.speeds(), caps)
    except ConfigError:   # no split fits: the even one, which the memory report flags
        return config
    if len(set(shares)) == 1:
        return config
    return dataclasses.replace(config, batch_shares=list(shares))


def global_batch(job: Job, world_size: int) -> int:
    return job.data.batch_size * (world_size if job.data.scaling == "weak" else 1)


def job_plan(job: Job, cluster: Cluster, mode: str | None = None) -> Plan:
    """The plan `tilework train` runs for `job` on `cluster` (another `mode` for comparisons)."""
    model = meta_model(job)
    config = job_config(job, cluster)
    config = config if mode is None else dataclasses.replace(config, mode=mode)
    return plan(model, config, cluster, traffic=table_traffic(job, analyze(model), cluster))


def example_batch(job: Job, cluster: Cluster) -> tuple:
    """One rank's inputs to the job's model, as the trainer passes them (zeros: only their
    shapes matter to the memory estimate)."""
    n = cluster.world_size
    b = (max(1, -(-job.data.batch_size // n)) if job.data.scaling == "strong"
         else job.data.batch_size)
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
