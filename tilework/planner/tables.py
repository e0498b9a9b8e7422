"""Choose each parameter's method and partition count.

Pure: takes `ParamInfo`s and a world size (or a topology and links), returns a `Plan`.
"allreduce" and "ps" send everything one way. In "hybrid" mode dense parameters are all-reduced;
a table goes by predicted cost where its traffic is known (`traffic`: expected distinct rows per
step, from a Zipf model or a measured density): the cheaper of all-reduce and the parameter
server with the best partition count, and, for Zipf traffic, the best split by row (the head
replicated and all-reduced, the tail on the servers). Where nothing is known it goes by the sparsity
rule: sparse gradient (or measured touched-row fraction under `density_threshold`) -> servers.
A tied table (one weight, several modules) is all-reduced in every mode that lets the planner
choose: the servers replace one module's lookups, and a tie to a Linear makes its gradient
dense anyway; sending it to the servers by mode="ps" or an override is refused.
"""

from __future__ import annotations

import dataclasses
import math

from ..cluster.mesh import Mesh
from ..cluster.topology import Cluster, Links, Topology
from ..comm.wire import low_rank_view
from ..config.parallel import Method, Mode, ParallelConfig, RowMap, RowMapChoice, SparseReduce
from ..errors import ConfigError, PlanError
from ..estimate.cost import (
    TableTraffic,
    compressed_entry,
    outer_entry,
    predict,
    ps_expected,
    ps_split,
    ring_allreduce,
    sparse_allgather,
)
from ..plans.analysis import ParamInfo, analyze, owning_units, recompute_choices
from ..plans.plan import OVERRIDDEN, OuterSync, ParamPlan, Plan, bucket_bytes
from .shares import server_map, server_partitions, zero_chunks


def recompute_choices_in(model, part, recompute) -> tuple[tuple[str, str], ...]:
    """`recompute` resolved on the whole model (where its repeated blocks are a ModuleList),
    kept for the modules `part` holds."""
    mine = dict(part.named_modules())
    return tuple((name, policy) for name, policy in recompute_choices(model, recompute)
                 if name in mine)


def plan(model, config: ParallelConfig | None = None, cluster: Cluster | None = None,
         density: dict[str, float] | None = None,
         traffic: dict[str, TableTraffic] | None = None, *,
         topology: Topology | None = None, units: dict[str, str] | None = None) -> Plan:
    """The plan for `model`: which parameter goes where. Pure, and the one planning path:
    `parallelize` calls it with the discovered topology, `tilework plan` with the cluster file.

    `model` may live on the meta device. `cluster` gives the topology and the links (its
    `[links]`); `topology` (default: the cluster's, else one rank) overrides the ranks'
    placement, as `parallelize` passes the one it discovered. `density` is a measured
    touched-row fraction per dense-layout table; `traffic` the expected rows per step per table
    (a job's model of its ids), with which hybrid mode chooses each table by cost. `units`:
    ZeRO-3's units by parameter name, where they are not `model`'s own (a pipeline part's
    blocks are found in the whole model).
    """
    config = config or ParallelConfig()
    if topology is None:
        topology = cluster.topology() if cluster is not None else Topology.from_sizes([1])
    links = cluster.links if cluster is not None else Links()
    outer = OuterSync(config.sync_every, config.outer_optimizer, config.outer_lr,
                      config.outer_momentum, config.outer_worker, config.outer_compress,
                      config.outer_fragments, config.outer_delay, config.outer_mix,
                      config.outer_schedule) if config.sync == "diloco" else None
    made = make_plan(analyze(model, density), topology.world_size, config.mode, config.overrides,
                     config.partitions, config.row_map, config.sparse_reduce,
                     config.local_aggregation, bucket_bytes(config.bucket_mb),
                     config.density_threshold, topology, links, traffic, zero=config.zero,
                     recompute=recompute_choices(model, config.recompute),
                     units=(units if units is not None else owning_units(model))
                     if config.zero == 3 else None,
                     offload=(config.offload, config.offload_dir), zero_scope=config.zero_scope,
                     server_weights=config.server_weights, zero_weights=config.zero_weights,
                     # Compressed buckets and local SGD's carry nothing (parallel/data/dense.py).
                     riders=config.grad_compress == "none" and config.sync != "diloco",
                     push_dtype=PUSH_DTYPES[config.push_compress], outer=outer)
    made = dataclasses.replace(made, push_compress=config.push_compress)
    if config.grad_compress != "none":
        made = with_grad_compress(made, config.grad_compress, topology, links,
                                  config.powersgd_rank, config.powersgd_start,
                                  config.topk_ratio)
    if outer is not None:
        made = with_outer_sync(made, outer, topology, links)
    if config.batch_shares is None:
        return made
    return dataclasses.replace(made, batch_shares=tuple(config.batch_shares))


PUSH_DTYPES = {"none": "", "bf16": "bfloat16", "auto": "auto"}   # push_compress: rows' width
# push_compress="auto": a table's push goes in bf16 only where that shortens its predicted
# exchange by this much (the rounding is a cost the model does not price; as grad_compress's
# planner/search.COMPRESS_GAIN).
PUSH_COMPRESS_GAIN = 0.10


def with_grad_compress(plan: Plan, compress: str, topology: Topology | None = None,
                       links: Links | None = None, powersgd_rank: int = 1,
                       powersgd_start: int = 1000, topk_ratio: float = 0.01) -> Plan:
    """`plan` with its bucketed gradients compressed (`grad_compress`: at half width, or as
    PowerSGD's factors): each all-reduced entry's ring all-reduce priced at its compressed
    bytes (PowerSGD's once its factors start), its reason saying so."""
    topology = topology or Topology.from_sizes([plan.world_size])
    links = links or Links()

    def said(p: ParamPlan) -> str:
        if compress == "topk":
            return f"its bucket's largest {topk_ratio:.2%} of values on the wire (top-k)"
        if compress != "powersgd":
            return f"its gradient in {compress} on the wire"
        if low_rank_view(p.shape, powersgd_rank) is None:
            return "its gradient as it is beside PowerSGD's factors (too small to factor)"
        return f"its gradient as PowerSGD's rank-{powersgd_rank} factors"

    params = tuple(dataclasses.replace(
        p, predicted=None if p.predicted is None else compressed_entry(
            p, compress, topology, links, powersgd_rank, topk_ratio),
        reason=f"{p.reason}; {said(p)}" if p.reason else said(p))
        if p.method == "allreduce" and not p.zero else p for p in plan.params)
    return dataclasses.replace(plan, params=params, grad_compress=compress,
                               powersgd_rank=powersgd_rank, powersgd_start=powersgd_start,
                               topk_ratio=topk_ratio)


def with_outer_sync(plan: Plan, outer: OuterSync, topology: Topology | None = None,
                    links: Links | None = None) -> Plan:
    """`plan` with its all-reduced parameters averaged every `outer.every` steps, each entry
    priced at its share (`estimate.cost.outer_entry`) and its reason saying so."""
    topology = topology or Topology.from_sizes([plan.world_size])
    links = links or Links()
    hosts = outer.worker == "host"
    if hosts and len({len(h) for h in topology.hosts}) > 1:
        raise PlanError(f"outer_worker: 'host' splits the outer sync evenly over each host's "
                        f"ranks, which needs hosts of one size; these have "
                        f"{[len(h) for h in topology.hosts]} ranks (use outer_worker='rank')")
    dense = sum(p.method == "allreduce" for p in plan.params)
    if dense and outer.fragments > dense:   # none (mode="ps"): nothing for it to sync
        raise PlanError(f"outer_fragments: {outer.fragments} fragments of {dense} all-reduced "
                        f"parameters (a fragment holds at least one)")
    width = {"none": "", "bf16": " in bf16", "int8": " in int8", "int4": " in int4"}
    streamed = f", in {outer.fragments} fragments" if outer.fragments > 1 else \
        f", layer-wise in {min(outer.every - 1, dense)} groups" \
        if outer.schedule == "layerwise" else ""
    overlapped = f", each beside {outer.delay} inner steps" if outer.delay else \
        ", each beside one inner step" if outer.schedule == "layerwise" else ""
    said = (f"averaged every {outer.every} steps{width[outer.compress]} (local SGD"
            f"{' over hosts' if hosts else ''}{streamed}{overlapped})")
    params = tuple(dataclasses.replace(
        p, predicted=None if p.predicted is None else outer_entry(p, outer, topology, links),
        reason=f"{p.reason}; {said}" if p.reason else said)
        if p.method == "allreduce" else p for p in plan.params)
    return dataclasses.replace(plan, params=params, outer=outer)


def make_plan(infos: list[ParamInfo], world_size: int, mode: Mode = "hybrid",
              overrides: dict[str, Method] | None = None,
              partitions: int | dict[str, int] | None = None, row_map: RowMapChoice = "auto",
              sparse_reduce: SparseReduce = "mean", local_aggregation: bool = True,
              bucket_bytes: int = 25 * 2**20, density_threshold: float = 0.1,
              topology: Topology | None = None, links: Links | None = None,
              traffic: dict[str, TableTraffic] | None = None, zero: int = 0,
              recompute: tuple[tuple[str, str], ...] = (),
              units: dict[str, str] | None = None,
              offload: tuple[str, str | None] = ("none", None),
              zero_scope: str = "world", server_weights: list[float] | None = None,
              riders: bool = True, push_dtype: str = "",
              zero_weights: list[float] | None = None, outer: OuterSync | None = None) -> Plan:
    overrides = _checked(infos, mode, sparse_reduce, overrides)
    topology = topology or Topology.from_sizes([world_size])
    if topology.world_size != world_size:
        raise PlanError(f"topology has {topology.world_size} ranks, expected {world_size}")
    if server_weights is not None and len(server_weights) != world_size:
        raise ConfigError("server_weights", f"one weight per rank ({world_size}), got "
                                            f"{len(server_weights)}")
    uneven = server_weights is not None and len(set(server_weights)) > 1
    if zero_weights is not None and len(zero_weights) != world_size:
        raise ConfigError("zero_weights", f"one weight per rank ({world_size}), got "
                                          f"{len(zero_weights)}")
    if zero_weights is not None and zero_scope != "world":
        raise ConfigError("zero_weights", "weights for ZeRO's chunks over the world "
                                          f"(zero_scope='world'), got {zero_scope!r}")
    links, traffic = links or Links(), traffic or {}
    if zero and zero_scope == "host" and len({len(h) for h in topology.hosts}) > 1:
        raise PlanError(f"zero_scope: 'host' shards inside each host, which needs hosts of one "
                        f"size; these have {[len(h) for h in topology.hosts]} ranks (use "
                        f"zero_scope='world')")
    # A hot head's sum rides the last dense bucket where dense parameters of its dtype are
    # all-reduced in buckets (parallel/data/dense.py): its bytes then, and no meeting of its own.
    bucketed = {i.dtype for i in infos if not i.is_table} if mode == "hybrid" and zero <= 1 \
        and riders \
        else set()
    params = []
    for info in infos:
        method, reason = _rule(info, mode, density_threshold)
        searched = None
        # One rank sends nothing either way: the rule decides (a sparse gradient stays sparse).
        if mode == "hybrid" and info.is_table and info.name in traffic and world_size > 1 \
                and not info.tied:
            searched = search(info, traffic[info.name], topology, links, local_aggregation,
                              row_map, head_rides=info.dtype in bucketed, push_dtype=push_dtype,
                              outer=outer)
            method, reason = searched.method, searched.reason
        if info.name in overrides:
            method, reason = overrides[info.name], OVERRIDDEN
            if method == "allgather" and info.tied:
                raise PlanError(f"{info.name} is tied to {', '.join(info.tied)}: the tie makes "
                                "its gradient dense, which 'allgather' would send row by row; "
                                f"keep it all-reduced")
            if method == "ps" and not info.is_table and mode != "ps":
                raise PlanError(
                    f"{info.name} (shape {tuple(info.shape)}) is not an embedding table: the "
                    "parameter server serves rows looked up by ids. Use mode='ps' to send every "
                    "parameter through the servers.")
        if method == "ps" and info.is_table and info.tied:
            _refuse_tied_table(info, f"overrides={{{info.name!r}: 'ps'}}"
                               if info.name in overrides else f"mode={mode!r}")
        parts = 1
        if method == "ps":
            wanted = partitions.get(info.name) if isinstance(partitions, dict) else partitions
            if wanted is None and searched is not None and searched.method == "ps":
                wanted = searched.partitions
            parts = min(wanted or world_size, info.shape[0])
        servers = ()
        if method == "ps" and uneven and world_size > 1:
            parts = max(parts, server_partitions(info.shape[0], world_size))
            servers = server_map(parts, server_weights)
        hot = searched.hot_rows if method == "ps" and searched is not None else 0
        entry = ParamPlan(info.name, info.shape, method, parts,
                          _row_map(row_map, info, method, searched), reason, info.dtype,
                          info.kind, hot_rows=hot, zero=zero if method == "allreduce" else 0,
                          unit=(units or {}).get(info.name, "")
                          if zero == 3 and method == "allreduce" else None,
                          zero_scope=zero_scope if zero and method == "allreduce" else "world",
                          servers=servers,
                          zero_chunks=zero_chunks(math.prod(info.shape), zero_weights)
                          if zero and method == "allreduce" and zero_weights is not None
                          and world_size > 1 else (),
                          push_dtype=_push_dtype(push_dtype, method, info, searched,
                                                 world_size))
        params.append(dataclasses.replace(entry, predicted=predict(
            entry, traffic.get(info.name), topology, links, local_aggregation,
            head_rides=info.dtype in bucketed)))
    _refuse_recomputed_tables(recompute, params)
    return Plan(tuple(params), world_size, mode, sparse_reduce, local_aggregation, bucket_bytes,
                Mesh.from_topology(topology), recompute, *offload,
                zero_weights=tuple(zero_weights) if zero_weights is not None and zero
                and world_size > 1 else None)


def _push_dtype(asked: str, method: Method, info: ParamInfo, searched: ParamPlan | None,
                world_size: int) -> str:
    """A server table's push width: the asked one, or under "auto" the cost search's choice
    where its traffic is modelled (else as it is); none where it would not be narrower than
    the table's own (a bf16 table) or where nothing crosses (one rank)."""
    if method != "ps" or not info.is_table or world_size == 1 \
            or info.dtype not in ("float32", "float64"):
        return ""
    if asked != "auto":
        return asked
    return searched.push_dtype if searched is not None and searched.method == "ps" else ""


def _row_map(asked: RowMapChoice, info: ParamInfo, method: Method,
             searched: ParamPlan | None) -> RowMap:
    """The rows a table's partitions hold. "auto": the cost search's choice where the table's
    traffic is modelled; else hashed for a server table: a vocabulary is usually sorted by
    frequency, and contiguous ranges of it put nearly every requested row on the first
    partition's server (lm100k's Zipf tokens: 92% at 2 ranks, 85% at 4; cost.busiest_share),
    while row % partitions spreads them evenly whatever their order."""
    if asked != "auto":
        return asked
    if method != "ps" or not info.is_table:
        return "contiguous"
    return searched.row_map if searched is not None and searched.method == "ps" else "hashed"


def _checked(infos: list[ParamInfo], mode, sparse_reduce, overrides) -> dict[str, Method]:
    """The settings make_plan reads by name, checked; the overrides as a dict."""
    if mode not in ("hybrid", "allreduce", "ps"):
        raise PlanError(f"mode: expected 'hybrid', 'allreduce' or 'ps', got {mode!r}")
    if sparse_reduce not in ("mean", "sum"):
        raise PlanError(f"sparse_reduce: expected 'mean' or 'sum', got {sparse_reduce!r}")
    overrides = dict(overrides or {})
    known = {i.name for i in infos}
    for name, method in overrides.items():
        if name not in known:
            raise PlanError(f"override for {name!r}: no such trainable parameter "
                            f"(parameters: {', '.join(sorted(known))})")
        if method not in ("allreduce", "ps", "allgather"):
            raise PlanError(f"override for {name!r}: expected 'allreduce', 'ps' or 'allgather', "
                            f"got {method!r}")
        table = next(i for i in infos if i.name == name)
        if method == "allgather" and not table.is_table:
            raise PlanError(f"override for {name!r}: 'allgather' gathers the rows an embedding "
                            f"table's gradient touches; {name} (shape {tuple(table.shape)}) is "
                            "not an embedding table")
        if method == "allgather" and table.kind != "sparse":
            raise PlanError(f"override for {name!r}: 'allgather' gathers a sparse gradient's "
                            f"rows, and {name}'s module makes a dense one: build it with "
                            "sparse=True (its optimizer must then take sparse gradients), or "
                            "use 'ps' or 'allreduce'")
    return overrides


def _refuse_recomputed_tables(recompute, params: list[ParamPlan]) -> None:
    """A server table's lookup inside a recomputed module would pull its rows a second time
    in backward, a collective outside the step's exchanges: refused, naming the way out."""
    for module, policy in recompute:
        for pp in params:
            if pp.method == "ps" and pp.is_table and pp.name.startswith(module + "."):
                raise PlanError(
                    f"recompute: module {module!r} ({policy}) holds the server table "
                    f"{pp.name}, whose lookup cannot run again in backward: recompute the "
                    f"modules around it (recompute={{pattern: {policy!r}}}) or keep the table "
                    f"all-reduced (overrides={{{pp.name!r}: 'allreduce'}})")


def _refuse_tied_table(info: ParamInfo, setting: str) -> None:
    tied = ", ".join(info.tied)
    raise PlanError(f"{info.name} is tied to {tied} (one weight, {len(info.tied) + 1} modules) and "
                    f"{setting} sends it to the parameter server, which serves one module's "
                    f"lookups: keep it all-reduced with overrides={{{info.name!r}: 'allreduce'}}")


def _tied_reason(info: ParamInfo) -> str:
    tied = ", ".join(info.tied)
    if info.kind == "embedding":
        return f"tied to {tied}: the tie makes its gradient dense, all-reduced whole"
    return f"tied to {tied}: the servers serve one module's table, all-reduced whole"


def _rule(info: ParamInfo, mode: Mode, threshold: float) -> tuple[Method, str]:
    if mode == "allreduce":
        return "allreduce", "mode=allreduce"
    if mode == "ps":
        return "ps", "mode=ps"
    if info.is_table and info.tied:
        return "allreduce", _tied_reason(info)
    if info.kind == "sparse":
        return "ps", "sparse gradient"
    if info.kind == "embedding" and info.density is not None and info.density < threshold:
        return "ps", f"touched-row fraction {info.density:.3f} < {threshold}"
    if info.kind == "embedding":
        known = "unmeasured" if info.density is None else f"touched-row fraction {info.density:.3f}"
        return "allreduce", f"dense-layout gradient ({known})"
    return "allreduce", "dense"


def partition_candidates(world_size: int, rows: int) -> list[int]:
    """Powers of two up to the world size, and the world size itself (at most `rows`)."""
    out, p = set(), 1
    while p < world_size:
        out.add(p)
        p *= 2
    out.add(world_size)
    return sorted(min(c, rows) for c in out)


def search(info: ParamInfo, traffic: TableTraffic, topology: Topology, links: Links,
           local_aggregation: bool, row_map: RowMapChoice = "auto",
           head_rides: bool = False, push_dtype: str = "",
           outer: OuterSync | None = None) -> ParamPlan:
    """The cheapest way to synchronise one table: all-reduce, the servers with P partitions
    of contiguous or hashed rows ("auto": both costed; a tie goes to hashed), each either alone
    or with the head of a Zipf table replicated (`hot_rows`: the rows every rank touches with
    some probability, all-reduced, the tail on the servers), or, for a table whose gradient is
    sparse, its touched rows all-gathered as DDP does (ties go to all-reduce, then the
    servers). Under local SGD (`outer`) an all-reduced table is a replica averaged with the
    dense parameters every `outer.every` steps (its share of the outer sync), while the
    servers and the all-gather still meet every step: on a slow link with a long period the
    table goes on the outer schedule."""
    dense = ring_allreduce(info.nbytes, topology, links) if outer is None else outer_entry(
        ParamPlan(info.name, info.shape, "allreduce", 1, "contiguous", "", info.dtype,
                  info.kind), outer, topology, links)
    averaged = " on the outer schedule" if outer is not None else ""
    best_ps = None
    maps = ("hashed", "contiguous") if row_map == "auto" else (row_map,)
    for p in partition_candidates(topology.world_size, info.shape[0]):
        for how in maps:
            candidate = ParamPlan(info.name, info.shape, "ps", p, how, "", info.dtype, info.kind,
                                  push_dtype="" if push_dtype == "auto" else push_dtype)
            cost = ps_expected(candidate, traffic, topology, links, local_aggregation)
            if best_ps is None or cost.seconds < best_ps[1].seconds:
                best_ps = (candidate, cost)
    # Splits at the best partition count (a head changes how many rows travel, not where).
    for hot, tail in traffic.splits() if best_ps is not None else []:
        candidate = dataclasses.replace(best_ps[0], hot_rows=hot)
        cost = ps_split(candidate, tail, topology, links, local_aggregation, tail=True,
                        head_rides=head_rides)
        if cost.seconds < best_ps[1].seconds:
            best_ps = (candidate, cost)
    said = ""
    if push_dtype == "auto" and best_ps is not None:   # the push's width, by cost
        half = dataclasses.replace(best_ps[0], push_dtype="bfloat16")
        cost = ps_split(half, traffic, topology, links, local_aggregation,
                        head_rides=head_rides)
        if cost.seconds <= (1 - PUSH_COMPRESS_GAIN) * best_ps[1].seconds:
            said = (f", its push in bf16 ({cost.seconds * 1e3:.3g} ms < "
                    f"{best_ps[1].seconds * 1e3:.3g} ms)")
            best_ps = (half, cost)
    fraction = traffic.per_rank / info.shape[0]
    gathered = sparse_allgather(traffic, topology, links, info.nbytes // info.shape[0]) \
        if info.kind == "sparse" else None
    ps_s = best_ps[1].seconds if best_ps else float("inf")
    if gathered is not None and gathered.seconds < min(ps_s, dense.seconds):
        why = (f"{fraction:.1%} rows/step: all-gathered as DDP does "
               f"{gathered.seconds * 1e3:.3g} ms < servers {ps_s * 1e3:.3g} ms, all-reduce "
               f"{dense.seconds * 1e3:.3g} ms{averaged}")
        return ParamPlan(info.name, info.shape, "allgather", 1, "contiguous", why, info.dtype,
                         info.kind)
    if best_ps is not None and best_ps[1].seconds < dense.seconds:
        plan, cost = best_ps
        head = f", {plan.hot_rows} hot rows all-reduced" if plan.hot_rows else ""
        why = (f"{fraction:.1%} rows/step: servers ({plan.row_map}{head}) "
               f"{cost.seconds * 1e3:.3g} ms < "
               f"all-reduce {dense.seconds * 1e3:.3g} ms{averaged}{said}")
        return dataclasses.replace(plan, reason=why)
    why = (f"{fraction:.1%} rows/step: all-reduce {dense.seconds * 1e3:.3g} ms{averaged} "
           f"<= servers {ps_s * 1e3:.3g} ms")
    return ParamPlan(info.name, info.shape, "allreduce", 1, "contiguous", why, info.dtype,
                     info.kind)
