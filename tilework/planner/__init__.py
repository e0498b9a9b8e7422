"""The planner: `plan(model, config, cluster)` returns the one Plan a run executes, pure.

tables.py plans the data-parallel axis, parameter by parameter (all-reduce, ZeRO, the servers
with their partitions and hot rows, chosen by cost where a table's traffic is known);
model_parallel.py plans a dp x pp x cp x tp run: the tp layout, the pipeline cut and schedule,
and each pipeline rank's part planned by tables.py over its dp group; search.py ranks mesh
splits by `estimate(plan)`.
"""

from __future__ import annotations

from ..cluster.topology import Cluster, Topology
from ..config.parallel import ParallelConfig
from ..plans.plan import Plan
from . import model_parallel, tables
from .tables import Mode, make_plan, partition_candidates, search


def plan(model, config: ParallelConfig | None = None, cluster: Cluster | None = None,
         density: dict[str, float] | None = None, traffic: dict | None = None, *,
         topology: Topology | None = None) -> Plan:
    """The plan for `model` under `config`: which parameter goes where, on every axis. Pure,
    and the one planning path: `parallelize` calls it with the discovered topology and runs
    what it returns, `tilework plan` calls it with the cluster file.

    `model` may live on the meta device. `cluster` gives the topology and the links (its
    `[links]`); `topology` (default: the cluster's, else one rank) overrides the ranks'
    placement, as `parallelize` passes the one it discovered. `density` is a measured
    touched-row fraction per dense-layout table; `traffic` the expected rows per step per table
    (a job's model of its ids), with which hybrid mode chooses each table by cost. With tp, pp
    or cp > 1 the plan also holds the layout, the stages and the schedule (`Plan.parallel`),
    and every entry the tp split and pp ranks of its parameter.
    """
    config = config or ParallelConfig()
    if topology is None:
        topology = cluster.topology() if cluster is not None else Topology.from_sizes(
            [config.tp * config.pp * config.cp])
    if config.model_parallel:
        return model_parallel.plan_mesh(model, config, topology, cluster, density, traffic)
    return tables.plan(model, config, cluster, density, traffic, topology=topology)


__all__ = ["Mode", "make_plan", "partition_candidates", "plan", "search"]
