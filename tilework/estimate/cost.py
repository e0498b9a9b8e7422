"""Pure cost functions: bytes each rank sends per step, and seconds, for every sync method.

Two levels. *Exact*: given the ids every rank looks up, replay the runtime's routing and return
the bytes each rank's counters will show (tests hold runtime and model to equality). *Expected*:
from table sizes and a model of the ids (measured density, or Zipf), the expected bytes the
planner compares. Seconds follow the alpha-beta model per link class: alpha per message,
bytes / beta on the slowest link a collective crosses.

No process group is needed: everything here runs at world size 1,000 on a laptop.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from ..cluster.topology import Link, Links, Topology
from ..comm.codec import encoded_bytes, multiple_of
from ..comm.wire import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    CHECK_WORDS,
    ID_BYTES,
    REDUCE_SCATTER,
    all_gather_bytes,
    all_to_all_bytes,
    bucket_rides_push,
    id_block_capacity,
    low_rank_values,
    ring_allreduce_bytes,
    topk_count,
    topk_index_bytes,
)
from ..plans.plan import Cost, OuterSync, ParamPlan, assign_buckets, dtype_bytes, outer_buckets
from ..plans.rows import TableLayout, routes


def link_for(topology: Topology, links: Links) -> Link:
    """The link a collective over `topology`'s ranks runs on (`Links.crossed`): its hosts,
    one each (listing every rank's host would cost a scan per rank at 8,000 ranks)."""
    return links.crossed(range(topology.num_hosts))


def seconds(nbytes: float, link: Link, messages: int) -> float:
    return messages * link.latency_s + nbytes / link.bytes_per_s


def meetings_s(collective, n: int, link: Link, calls: int = 1) -> float:
    """The latency of `calls` small calls of an all-to-all or an all-gather over `n` ranks:
    their messages at the link's latency, scaled by what a small call of that collective was
    measured to take against it (Link.all_to_all_latency_factor, all_gather_latency_factor)."""
    factor = {ALL_TO_ALL.name: link.all_to_all_latency_factor,
              ALL_GATHER.name: link.all_gather_latency_factor}[collective.name]
    return calls * collective.messages(n) * link.latency_s * factor


# -- all-reduce --------------------------------------------------------------------------------

GRAD_WIDTH = 2   # bytes a value of a compressed bucket (bf16, fp16) takes on the wire


def grad_wire(nbytes: int, grad_compress: str, item: int = 4, shape: tuple[int, ...] = (),
              powersgd_rank: int = 1) -> int:
    """An all-reduced gradient's bytes (values of `item` bytes) as its bucket sends it: as they
    are, at GRAD_WIDTH a value under "bf16" / "fp16", or as PowerSGD's factors of a gradient
    of `shape` (both of its bucket's all-reduces). Not for "topk" (`compressed_entry`)."""
    if grad_compress == "powersgd":
        return sum(low_rank_values([shape], powersgd_rank)) * item
    return nbytes if grad_compress == "none" else nbytes // item * GRAD_WIDTH


def compressed_entry(p: ParamPlan, grad_compress: str, topology: Topology, links: Links,
                     powersgd_rank: int = 1, topk_ratio: float = 0.01) -> Cost:
    """An all-reduced entry's share of its bucket's exchange under `grad_compress`: an
    all-reduce of its compressed bytes, or under "topk" an all-gather of its share of the
    positions and values."""
    item = dtype_bytes(p.dtype)
    if grad_compress == "topk":
        n = topology.world_size
        sent = all_gather_bytes(topk_count(p.numel, topk_ratio)
                                * (topk_index_bytes(p.numel) + item), n)
        link = link_for(topology, links)
        return Cost(sent, seconds(sent, link, 0) + meetings_s(ALL_GATHER, n, link)
                    if n > 1 else 0.0)
    return ring_allreduce(grad_wire(p.nbytes, grad_compress, item, p.shape, powersgd_rank),
                          topology, links)

def dense_sync_bytes(param_nbytes: list[int], bucket_bytes: int, n: int,
                     carried_bytes: int = 0, push: bool = False,
                     grad_compress: str = "none", item: int = 4,
                     shapes: list[tuple[int, ...]] | None = None, powersgd_rank: int = 1,
                     topk_ratio: float = 0.01) -> int:
    """Exact: what `parallel.data.dense.DenseSync` counts per step for parameters in registration
    order; `carried_bytes` ride the last bucket (the input check's words: CHECK_WORDS elements, hot
    heads). `push`: a server push over the world happens that step, which the last bucket
    rides where `wire.bucket_rides_push` says so, whole to every peer. `grad_compress`
    (parameters of `item` bytes): each bucket crosses in that width, alone; "powersgd" (each
    parameter's `shapes` given): each bucket in two all-reduces, its plain gradients and Ps,
    then its Qs (none where nothing is factored); "topk": each bucket's share of positions and
    values, all-gathered."""
    order = list(reversed(param_nbytes))
    buckets = assign_buckets(order, bucket_bytes)
    if grad_compress == "topk":
        numels = [sum(order[i] for i in b) // item for b in buckets]
        return sum(all_gather_bytes(topk_count(m, topk_ratio) * (topk_index_bytes(m) + item), n)
                   for m in numels)
    if grad_compress == "powersgd":
        if shapes is None:
            raise ValueError("dense_sync_bytes: grad_compress='powersgd' prices each "
                             "parameter's factors from `shapes`")
        shaped = list(reversed(shapes))
        return sum(ring_allreduce_bytes(values * item, n)
                   for b in buckets
                   for values in low_rank_values([shaped[i] for i in b], powersgd_rank))
    if grad_compress != "none":   # nothing rides a compressed bucket
        return sum(ring_allreduce_bytes(grad_wire(sum(order[i] for i in b), grad_compress,
                                                  item), n) for b in buckets)
    sizes = [sum(order[i] for i in b) for b in buckets]
    if sizes:
        sizes[-1] += carried_bytes
    last = len(sizes) - 1
    return sum((n - 1) * s if k == last and push and bucket_rides_push(s, n)
               else ring_allreduce_bytes(s, n) for k, s in enumerate(sizes))


# -- local SGD: exact replay of parallel/data/outer.py --------------------------------------------

@dataclass(frozen=True)
class OuterWire:
    """What one rank sends in one outer sync: across the workers (bytes, messages) and inside
    its worker (the all-gather of the averaged slices)."""

    across: int
    across_messages: int
    within: int
    within_messages: int
    # Of `across_messages`, the all-gathers' (compressed: the rest are all-to-alls'; else all
    # are a ring all-reduce's).
    across_gathers: int = 0
    compressed: bool = False

    def __add__(self, other: "OuterWire") -> "OuterWire":
        return OuterWire(self.across + other.across,
                         self.across_messages + other.across_messages,
                         self.within + other.within, self.within_messages + other.within_messages,
                         self.across_gathers + other.across_gathers,
                         self.compressed or other.compressed)

    def seconds(self, across: Link, within: Link) -> float:
        """Its bytes at each link's bandwidth and its meetings at their latency, an
        all-to-all's and an all-gather's scaled by their measured factors (`meetings_s`)."""
        if self.compressed:
            meet = across.latency_s * (
                (self.across_messages - self.across_gathers) * across.all_to_all_latency_factor
                + self.across_gathers * across.all_gather_latency_factor)
        else:
            meet = self.across_messages * across.latency_s
        inside = self.within_messages * within.latency_s * within.all_gather_latency_factor
        return (meet + self.across / across.bytes_per_s
                + inside + self.within / within.bytes_per_s)

    @property
    def sent(self) -> int:
        return self.across + self.within


def outer_bucket_wire(numel: int, workers: int, per_worker: int = 1, codec: str = "none",
                      item: int = 4) -> OuterWire:
    """One bucket of `numel` values of `item` bytes among `workers` workers of `per_worker`
    ranks: padded to equal slices (and, compressed, equal blocked parts); a slice all-reduced
    across, or its parts' encodings exchanged (all-to-all) and their averages' gathered; the
    averaged slices (float32 when compressed) gathered inside the worker."""
    unit = per_worker * (1 if codec == "none" else workers * multiple_of(codec))
    carried = -(-numel // unit) * unit // per_worker
    gathers = 0
    if codec == "none":
        across = ring_allreduce_bytes(carried * item, workers)
        messages, item_back = ALL_REDUCE.messages(workers), item
    else:
        encoded = encoded_bytes(carried // workers, codec)
        across = all_to_all_bytes(workers * encoded, workers) + all_gather_bytes(encoded, workers)
        gathers = ALL_GATHER.messages(workers)
        messages = ALL_TO_ALL.messages(workers) + gathers
        item_back = 4
    return OuterWire(across, messages if workers > 1 else 0,
                     all_gather_bytes(carried * item_back, per_worker),
                     ALL_GATHER.messages(per_worker) if per_worker > 1 else 0,
                     gathers if workers > 1 else 0, codec != "none")


def outer_sync_wire(nbytes_in_order: list[int], bucket_bytes: int, workers: int,
                    per_worker: int = 1, codec: str = "none", item: int = 4,
                    fragments: int = 1, every: int = 1,
                    schedule: str = "streaming") -> OuterWire:
    """Exact: what `LocalSGD` counts in one period of `every` steps (every fragment or, under
    the "layerwise" schedule, every group synced once) for parameters of these sizes
    (registration order), cut and bucketed as it cuts them."""
    if schedule == "layerwise" and every < 2:
        raise ValueError(f"every: the layer-wise schedule syncs in every - 1 groups, got {every}")
    total = OuterWire(0, 0, 0, 0)
    for sync in _period_syncs(nbytes_in_order, OuterSync(every, fragments=fragments,
                                                         schedule=schedule),
                              bucket_bytes, workers, per_worker, codec, item):
        for wire in sync:
            total += wire
    return total


def _period_syncs(nbytes_in_order: list[int], outer, bucket_bytes: int, workers: int,
                  per_worker: int, codec: str, item: int) -> list[list[OuterWire]]:
    """Each sync of a period (a fragment's, a layer-wise group's), as its buckets' wires, cut
    and bucketed as `LocalSGD` cuts them."""
    return [[outer_bucket_wire(sum(nbytes_in_order[i] for i in bucket) // item, workers,
                               per_worker, codec, item) for bucket in sync]
            for sync in outer_buckets(nbytes_in_order, outer, bucket_bytes)]


def outer_sync_bytes(nbytes_in_order: list[int], bucket_bytes: int, workers: int,
                     per_worker: int = 1, codec: str = "none", item: int = 4,
                     fragments: int = 1, every: int = 1, schedule: str = "streaming") -> int:
    """Bytes one rank sends in one period's outer syncs (`outer_sync_wire`'s, across and
    within)."""
    return outer_sync_wire(nbytes_in_order, bucket_bytes, workers, per_worker, codec,
                           item, fragments, every, schedule).sent


def _outer_shape(outer, topology: Topology, links: Links) -> tuple[int, int, Link]:
    """(workers, ranks per worker, the link the sync crosses) of local SGD on `topology`."""
    hosts = outer.worker == "host"
    workers = topology.num_hosts if hosts else topology.world_size
    across = links.inter if hosts and workers > 1 else link_for(topology, links)
    return workers, topology.world_size // workers, across


def outer_entry(p: ParamPlan, outer, topology: Topology, links: Links) -> Cost:
    """An all-reduced entry's bytes and seconds per step under local SGD (`outer`, a
    plans.plan.OuterSync): its share of the sync, alone in its bucket, over the H steps it
    spans (the sync's crossing on its link, the gather inside a worker on the host's), and,
    where a worker is a host, its gradient's all-reduce inside the host every step."""
    workers, per_worker, across = _outer_shape(outer, topology, links)
    wire = outer_bucket_wire(p.numel, workers, per_worker, outer.compress, dtype_bytes(p.dtype))
    inner, messages = _inside_worker(p, per_worker)
    return Cost(wire.sent / outer.every + inner,
                wire.seconds(across, links.intra) / outer.every
                + seconds(inner, links.intra, messages))


def _inside_worker(p: ParamPlan, per_worker: int) -> tuple[int, int]:
    """(bytes, messages) an entry sends every step inside a worker of `per_worker` ranks: its
    gradient's all-reduce, or ZeRO's reduce-scatter and gathers over the host alone (no
    copies summed across hosts: that is the outer sync's)."""
    if per_worker == 1:
        return 0, 0
    if p.zero:
        return zero_sync_bytes(p, per_worker, 1)
    return ring_allreduce_bytes(p.nbytes, per_worker), ALL_REDUCE.messages(per_worker)


def outer_step_seconds(entries: list[ParamPlan], outer, topology: Topology, links: Links,
                       bucket_bytes: int, beside_s: float = 0.0) -> float:
    """Seconds per step the all-reduced `entries` (registration order, ZeRO's too) wait on the
    wire under local SGD: a period's syncs, fragment by fragment and bucket by bucket as the
    runtime sends them, over H steps, plus a host worker's bucketed all-reduce every step
    (ZeRO's entries: their exchanges inside the host). Under the "layerwise" schedule each
    group's exchange runs beside one inner step of `beside_s` seconds (its compute), so only
    what outlasts it waits; a streaming delay's overlap is not credited."""
    if not entries:
        return 0.0
    workers, per_worker, across = _outer_shape(outer, topology, links)
    item = dtype_bytes(entries[0].dtype)
    # each sync's seconds: its buckets, across the workers and inside one
    syncs = [sum(w.seconds(across, links.intra) for w in wires)
             for wires in _period_syncs([p.nbytes for p in entries], outer, bucket_bytes,
                                        workers, per_worker, outer.compress, item)]
    hidden = beside_s if outer.schedule == "layerwise" else 0.0
    dense = sum(p.nbytes for p in entries if p.zero <= 1)   # stage 1 rides the buckets
    inner = ring_allreduce_bytes(dense, per_worker)
    sharded = zero_bucket_seconds(entries, per_worker, links.intra, 1, bucket_bytes)
    return (sum(max(0.0, t - hidden) for t in syncs) / outer.every
            + seconds(inner, links.intra,
                      ALL_REDUCE.messages(per_worker) * max(1, -(-dense // bucket_bytes))
                      if per_worker > 1 else 0)
            + sharded)


def push_over_world(topology: Topology, local_aggregation: bool) -> bool:
    """Whether the servers' push is one all-to-all over the world (layout.routes: no local
    aggregation), which the last dense bucket may ride (`dense_sync_bytes`' `push`)."""
    return not (local_aggregation and topology.can_aggregate_locally)


def dense_rides_push(plan, topology: Topology) -> bool:
    """Whether `plan`'s dense gradients (a data-parallel plan, or a mesh plan's part), in one
    bucket with what rides it (the input checks' words; the hot heads' sums, where their dtype
    is the bucket's), ride the servers' push (`wire.bucket_rides_push`) on `topology`, as
    runtime/engine.py decides it: the tables' rows all of one dtype, the bucket's too, and no
    local SGD. Priced as bytes on the push's link, no meeting (`plan_cost.dense_seconds`,
    bench/comm_prediction.py)."""
    dense = [pp for pp in plan.of("allreduce") if pp.zero <= 1]
    tables = [pp for pp in plan.of("ps") if pp.is_table]
    table_dtypes = {pp.dtype for pp in tables}
    if (plan.grad_compress != "none"   # nothing rides a compressed bucket
            or plan.outer is not None or not dense or len(table_dtypes) != 1
            or {pp.dtype for pp in dense} != table_dtypes):
        return False
    nbytes = sum(pp.nbytes for pp in dense)
    # The checks' words ride in float32/float64 only; the heads' dtype is the tables', here
    # the bucket's.
    width = dense[0].dtype
    riders = (CHECK_WORDS * dtype_bytes(width) if width in ("float32", "float64") else 0) \
        + sum(hot_head_bytes(pp) for pp in tables if pp.hot_rows)
    return (nbytes <= plan.bucket_bytes
            and push_over_world(topology, plan.local_aggregation)
            and bucket_rides_push(nbytes + riders, topology.world_size))


def ring_allreduce(nbytes: int, topology: Topology, links: Links, buckets: int = 1) -> Cost:
    n = topology.world_size
    sent = ring_allreduce_bytes(nbytes, n)
    return Cost(sent, seconds(sent, link_for(topology, links), ALL_REDUCE.messages(n) * buckets)
                if n > 1 else 0.0)


# -- ZeRO: exact replay of parallel/data/zero.py ---------------------------------------------------

def zero_shard(plan: ParamPlan, n: int, hosts: int = 1) -> tuple[int, int]:
    """(ranks a ZeRO parameter is sharded over, bytes of each one's padded chunk) on n ranks in
    `hosts` equal hosts: all of them, or one host's with `zero_scope="host"`. Under an uneven
    cut (`zero_chunks`) every chunk crosses padded to the largest."""
    ranks = n // hosts if plan.zero_scope == "host" and hosts > 1 else n
    widest = max(plan.zero_chunks) if plan.zero_chunks else -(-plan.numel // ranks)
    return ranks, widest * dtype_bytes(plan.dtype)


def zero_own_bytes(plan: ParamPlan, n: int, hosts: int = 1, rank: int = 0) -> int:
    """The bytes of a ZeRO parameter that `rank` keeps (its shard, and the state and gradient
    chunk of that size): its padded chunk under the even cut, its own count under an uneven
    one."""
    if plan.zero_chunks:
        return plan.zero_chunks[rank] * dtype_bytes(plan.dtype)
    return zero_shard(plan, n, hosts)[1]


def zero_sync_bytes(plan: ParamPlan, n: int, hosts: int = 1) -> tuple[int, int]:
    """(bytes one rank sends, messages) for a ZeRO parameter's step on n ranks in `hosts`
    equal hosts: its gradient's all-reduce (stage 1) or reduce-scatter (2, 3) and the
    all-gathers of its values (after the step for 1 and 2; before its unit's forward and again
    before its backward for 3). With `zero_scope="host"` the shards are over a host's ranks and
    each chunk of the gradient is then all-reduced across hosts. Exact: padded to equal chunks,
    summed over buckets in any grouping, as the counters count them."""
    scope, chunk = zero_shard(plan, n, hosts)
    gather = all_gather_bytes(chunk, scope)
    # Stage 3 gathers before forward and again before backward, but the model's own unit
    # (parallel/data/zero3.py) stays gathered from its forward to the end of backward.
    gathers = 2 if plan.zero == 3 and plan.unit else 1
    if plan.zero == 1:
        first, messages = ring_allreduce_bytes(plan.nbytes, n), ALL_REDUCE.messages(n)
    else:
        first, messages = REDUCE_SCATTER.sent(chunk * scope, scope), REDUCE_SCATTER.messages(scope)
        if scope < n:   # the chunk's copies, one per host, summed
            first += ring_allreduce_bytes(chunk, n // scope)
            messages += ALL_REDUCE.messages(n // scope)
    return first + gathers * gather, messages + gathers * ALL_GATHER.messages(scope)


def zero_sync_seconds(plan: ParamPlan, n: int, link: Link, hosts: int = 1) -> float:
    """`zero_sync_bytes`'s exchanges on `link`, each at its own measured factor: the
    reduce-scatter's and the all-gathers' (Link), the all-reduces' as fitted."""
    scope, chunk = zero_shard(plan, n, hosts)
    gathers = 2 if plan.zero == 3 and plan.unit else 1
    first = seconds(ring_allreduce_bytes(plan.nbytes, n), link, ALL_REDUCE.messages(n)) \
        if plan.zero == 1 else _scatter_seconds(chunk, scope, n, link)
    return first + gathers * _gather_seconds(chunk, scope, link)


def _scatter_seconds(chunk: int, scope: int, n: int, link: Link) -> float:
    """One reduce-scatter of `chunk`-byte chunks over `scope` ranks at its factor, and the
    chunk's all-reduce across the n // scope copies where the scope is a host's."""
    out = seconds(REDUCE_SCATTER.sent(chunk * scope, scope), link,
                  REDUCE_SCATTER.messages(scope)) * link.reduce_scatter_factor
    if scope < n:
        out += seconds(ring_allreduce_bytes(chunk, n // scope), link,
                       ALL_REDUCE.messages(n // scope))
    return out


def _gather_seconds(chunk: int, scope: int, link: Link) -> float:
    return seconds(all_gather_bytes(chunk, scope), link, ALL_GATHER.messages(scope)) \
        * link.all_gather_factor


def zero_exchanges(entries: list[ParamPlan], n: int, hosts: int,
                   bucket_bytes: int) -> list[tuple[str, int, int]]:
    """ZeRO's own collectives for `entries` (registration order) in one step, as
    parallel/data/zero.py launches them, one per bucket: ("reduce_scatter" or "all_gather",
    each rank's chunk bytes, times a step). Stage 2's gradients are reduce-scattered in buckets
    by size and stage 3's per unit; stage 1 and 2's values gathered after the step in buckets
    by size, stage 3's per unit (twice, the model's own unit once). Stage 1's gradient
    all-reduce is not here: it rides in the replicated parameters' buckets. The bytes are
    `zero_sync_bytes`' summed (each parameter's chunk padded on its own)."""
    sharded = [p for p in reversed(entries) if p.zero]   # backward's order, as launched
    if n == 1 or not sharded:
        return []
    scope = zero_shard(sharded[0], n, hosts)[0]

    def chunk(group):
        return sum(zero_shard(p, n, hosts)[1] for p in group)

    def by_size(group):   # sized as zero._buckets sizes them: every rank's padded chunk
        return [[group[i] for i in b] for b in assign_buckets(
            [scope * zero_shard(p, n, hosts)[1] for p in group], bucket_bytes)]

    units: dict[str, list[ParamPlan]] = {}
    for p in sharded:
        if p.zero == 3:
            units.setdefault(p.unit or "", []).append(p)
    return ([("reduce_scatter", chunk(b), 1)
             for b in by_size([p for p in sharded if p.zero == 2]) + list(units.values())]
            + [("all_gather", chunk(b), 1)
               for b in by_size([p for p in sharded if p.zero in (1, 2)])]
            + [("all_gather", chunk(b), 2 if unit else 1) for unit, b in units.items()])


def zero_bucket_seconds(entries: list[ParamPlan], n: int, link: Link, hosts: int,
                        bucket_bytes: int) -> float:
    """`zero_exchanges` on `link`, each at its measured factor: a bucket's messages, where
    pricing each parameter alone charged a model of many small ones a latency per
    parameter."""
    found = zero_exchanges(entries, n, hosts, bucket_bytes)
    if not found:
        return 0.0
    scope = zero_shard(next(p for p in entries if p.zero), n, hosts)[0]
    return sum(times * (_scatter_seconds(chunk, scope, n, link) if kind == "reduce_scatter"
                        else _gather_seconds(chunk, scope, link))
               for kind, chunk, times in found)


def zero_sharded(plan: ParamPlan, topology: Topology, links: Links) -> Cost:
    n = topology.world_size
    if n == 1:
        return Cost(0, 0.0)
    sent, _ = zero_sync_bytes(plan, n, topology.num_hosts)
    return Cost(sent, zero_sync_seconds(plan, n, link_for(topology, links), topology.num_hosts))


# -- parameter server: exact replay of parallel/rows/sparse.py -------------------------------------

def _pull_counts(plan: ParamPlan, ids_per_rank: list[torch.Tensor], topology: Topology,
                 local_aggregation: bool) -> list[dict[int, tuple[list[int], list[int]]]]:
    """The pull's routing, hop by hop: for every rank, its group's members and how many distinct
    ids it sends each of them (each hop merges what arrived before the next)."""
    n = topology.world_size
    layout = TableLayout(plan, n)
    # The replicated head's ids stay home (its all-reduce is `hot_sync_bytes`).
    current = {r: torch.unique(ids_per_rank[r][ids_per_rank[r] >= plan.hot_rows])
               for r in range(n)}
    hops = []
    for route in routes(layout, topology, local_aggregation):
        arriving: dict[int, list[torch.Tensor]] = {r: [] for r in range(n)}
        sending = {}
        for members in route.groups:
            for rank in members:
                ids = current[rank]
                to = route.dest(ids) if len(members) > 1 else torch.zeros_like(ids)
                sending[rank] = (members, torch.bincount(to, minlength=len(members)).tolist())
                for j, peer in enumerate(members):
                    arriving[peer].append(ids[to == j])
        hops.append(sending)
        current = {r: torch.unique(torch.cat(arriving[r])) for r in range(n)}
    return hops


def ps_step_bytes(plans: list[ParamPlan], ids_per_table: list[list[torch.Tensor]],
                  topology: Topology, local_aggregation: bool,
                  id_blocks: dict | None = None) -> list[int]:
    """Exact bytes each rank sends in one step for tables pulled together (one exchange, as
    parallel/rows/exchange.py sends them; `ids_per_table[t][r]`: the ids rank r looks up in table
    t): the id blocks (per-table counts, a flag, the pair's capacity of ids, and any overflow), the
    rows answered, and the push's gradient rows, which retrace the pull's route (a table looked
    up more than once per step also sends ids and lengths). `id_blocks` carries the blocks'
    capacities from step to step: pass one dict for every step of the same group of tables (a
    new one is the first step, where every id overflows)."""
    n = topology.world_size
    id_blocks = {} if id_blocks is None else id_blocks
    width = len(plans) + 1
    per_table = [_pull_counts(p, ids, topology, local_aggregation)
                 for p, ids in zip(plans, ids_per_table)]
    sent = [0] * n
    for h in range(len(per_table[0])):
        for rank in range(n):
            members, _ = per_table[0][h][rank]
            me = members.index(rank)
            for j, peer in enumerate(members):
                if j == me:
                    continue
                count = sum(table[h][rank][1][j] for table in per_table)
                capacity = id_blocks.get((h, rank, peer), 0)
                sent[rank] += ID_BYTES * (width + capacity + max(0, count - capacity))
                id_blocks[(h, rank, peer)] = id_block_capacity(count, capacity)
            for plan, table in zip(plans, per_table):
                # the push: a gradient row for each id sent (in its push width); the answers:
                # a row for each asked
                asked = sum(table[h][src][1][me] for src in members if src != rank)
                sent[rank] += plan.push_row_bytes * (sum(table[h][rank][1])
                                                     - table[h][rank][1][me]) \
                    + plan.row_bytes * asked
    return sent


def ps_table_bytes(plan: ParamPlan, ids_per_rank: list[torch.Tensor], topology: Topology,
                   local_aggregation: bool, id_blocks: dict | None = None) -> list[int]:
    """`ps_step_bytes` of a table pulled alone."""
    return ps_step_bytes([plan], [ids_per_rank], topology, local_aggregation, id_blocks)


def hot_head_bytes(plan: ParamPlan) -> int:
    """A table's replicated head's buffer (parallel/rows/hot.py): its gradient rows and one touched
    flag per row, in the row's dtype, summed over the world once per synchronised step. Where it
    rides the last dense bucket, `dense_sync_bytes` counts it among that bucket's
    `carried_bytes`; else `hot_sync_bytes`."""
    return plan.hot_rows * (plan.row_bytes + dtype_bytes(plan.dtype))


def hot_sync_bytes(plan: ParamPlan, n: int) -> int:
    """Exact bytes of a table's replicated head all-reduced on its own (no dense bucket of its
    dtype to ride)."""
    return ring_allreduce_bytes(hot_head_bytes(plan), n)


def dense_served_bytes(plan: ParamPlan, n: int) -> list[int]:
    """Exact bytes of a dense parameter on the servers (mode="ps"): push rows, pull shards
    (lengths are static, so no counts travel)."""
    if n == 1:
        return [0]
    sizes = TableLayout(plan, n).shard_sizes
    rows, row_bytes = plan.shape[0], plan.row_bytes
    return [row_bytes * (rows - sizes[r]) + row_bytes * sizes[r] * (n - 1) for r in range(n)]


def dense_served(plan: ParamPlan, topology: Topology, links: Links) -> Cost:
    """A dense parameter on the servers: the busiest rank's bytes, and its two all-to-alls."""
    n = topology.world_size
    sent = max(dense_served_bytes(plan, n))
    link = link_for(topology, links)
    return Cost(sent, seconds(sent, link, 0) + meetings_s(ALL_TO_ALL, n, link, 2)
                if n > 1 else 0.0)


# -- parameter server: expected, for planning ---------------------------------------------------

@functools.lru_cache(maxsize=64)
def _zipf_probs(rows: int, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """P(id) ~ (id+1)^-alpha over `rows` ids: exact per row over the first 10,000 rows, then on
    geometric bins whose probability mass is the midpoint integral. (probability of one id of
    each entry, ids per entry)."""
    head = min(rows, _EXACT_ROWS)
    ranks = np.arange(1, head + 1, dtype=np.float64)
    weights, counts = [ranks ** -alpha], [np.ones(head)]
    if rows > head:
        edges = np.unique(np.geomspace(head + 1, rows + 1, num=1000).astype(np.int64))
        edges[-1] = rows + 1
        lo, hi = edges[:-1] - 0.5, edges[1:] - 0.5
        mass = (np.log(hi / lo) if alpha == 1.0
                else (hi ** (1 - alpha) - lo ** (1 - alpha)) / (1 - alpha))
        width = np.diff(edges).astype(np.float64)
        weights.append(mass / width)
        counts.append(width)
    w, c = np.concatenate(weights), np.concatenate(counts)
    return w / np.sum(w * c), c


_EXACT_ROWS = 10_000


def _touched(p: np.ndarray, lookups: float) -> np.ndarray:
    """Probability that `lookups` draws touch an id of probability p."""
    return -np.expm1(lookups * np.log1p(-np.minimum(p, 1 - 1e-15)))


def expected_unique(rows: int, lookups: float, alpha: float = 1.0) -> float:
    """Expected distinct rows among `lookups` ids drawn with P(id) ~ (id+1)^-alpha.

    sum_i 1 - (1 - p_i)^k: exact over the first 10,000 rows, then on geometric bins (well under
    1% off for any table), so 800,000-row tables cost well under a millisecond.
    """
    if lookups <= 0 or rows <= 0:
        return 0.0
    p, c = _zipf_probs(rows, float(alpha))
    return float(np.sum(c * _touched(p, lookups)))


@dataclass(frozen=True)
class TableTraffic:
    """Expected distinct rows one step touches: per rank, per host, in the whole world.

    `model`: where the traffic is Zipf, (rows, alpha, lookups per rank, per host, in the world),
    from which the traffic of the table's tail past a replicated head follows (`tail`)."""

    per_rank: float
    per_host: float
    world: float
    model: tuple[int, float, float, float, float] | None = None
    start: int = 0   # the first row this traffic covers (a tail past a replicated head)
    # Measured instead of modelled: (rows, every (rank, step)'s distinct ids pooled and
    # sorted, how many (rank, step)s), where the ids' spread over partitions is read from.
    measured: tuple[int, tuple[int, ...], int] | None = None

    @classmethod
    def zipf(cls, rows: int, lookups_per_rank: float, topology: Topology, alpha: float = 1.0,
             shared: float = 0.0):
        """`shared`: lookups every rank makes alike (an LM's sampled negatives), once per step."""
        local, n = len(topology.hosts[0]), topology.world_size
        ks = (lookups_per_rank + shared, lookups_per_rank * local + shared,
              lookups_per_rank * n + shared)
        return cls(*(expected_unique(rows, k, alpha) for k in ks), model=(rows, alpha, *ks))

    @classmethod
    def from_density(cls, rows: int, density: float, topology: Topology):
        # Measured fraction per rank; unions assume independent ranks (an upper bound on overlap).
        local, n = len(topology.hosts[0]), topology.world_size
        return cls(density * rows, rows * (1 - (1 - density) ** local),
                   rows * (1 - (1 - density) ** n))

    def tail(self, hot_rows: int) -> "TableTraffic":
        """The traffic of rows [hot_rows, rows) alone. Without a Zipf model, every head row is
        taken as touched at every level (the most the head can remove)."""
        if not hot_rows:
            return self
        if self.model is None:
            return TableTraffic(*(max(0.0, x - hot_rows)
                                  for x in (self.per_rank, self.per_host, self.world)))
        return dict(self.splits((hot_rows,)))[hot_rows]

    def splits(self, hot_rows=None) -> list[tuple[int, "TableTraffic"]]:
        """(head size, the tail's traffic) for each of `hot_rows` (default: the rows each rank
        touches with probability at least 0.95, 0.8, 0.5, 0.3, 0.1, 0.03): the head sizes worth
        costing. Only with a Zipf model; at most 10,000 head rows, where rows are exact."""
        if self.model is None:
            return []
        if self.start:
            raise ValueError("splits of a tail: split the whole table's traffic")
        rows, alpha, *ks = self.model
        p, c = _zipf_probs(rows, float(alpha))
        exact = min(rows - 1, _EXACT_ROWS)
        touched = [c * _touched(p, k) for k in ks]
        if hot_rows is None:
            hot_rows = sorted({self.touched_rows(q) for q in _TOUCH_PROBABILITIES} - {0})
        if any(h > exact for h in hot_rows):
            raise ValueError(f"a replicated head of at most {exact} rows, got {max(hot_rows)}")
        heads = [np.concatenate([[0.0], np.cumsum(t[:exact])]) for t in touched]
        totals = [float(np.sum(t)) for t in touched]
        return [(h, TableTraffic(*(max(0.0, total - float(head[h]))
                                   for total, head in zip(totals, heads)),
                                 model=self.model, start=h))
                for h in hot_rows]

    def busiest_share(self, partitions: int, servers: int, row_map: str,
                      server_map: tuple[int, ...] = ()) -> float:
        """The fraction of one rank's distinct rows that the busiest server owns. Contiguous
        partitions of a frequency-sorted (Zipf) table are not even: the first holds the
        popular rows, and its server hears more than 1/servers of every rank's requests
        (4 ranks on lm100k: 0.60 MB against 0.35 on average). Hashed rows (row % partitions)
        spread a Zipf table evenly; measured ids are counted where they land either way.
        Traffic without ids or a Zipf model (a measured density) is taken as even over the
        rows. `server_map`: the rank of each partition where ranks serve unevenly (the busiest
        is then the one with the most rows, even traffic or not)."""
        from ..plans.plan import partition_bounds, server_of

        def even() -> float:   # the busiest server's share of the partitions (of the rows)
            if not server_map:
                return 1 / servers
            return max(np.bincount(server_map, minlength=servers)) / partitions

        if servers == 1 or (self.model is None and self.measured is None):
            return even() if servers > 1 else 1.0
        if row_map == "hashed":
            if self.measured is None or not self.measured[2]:
                return even()
            ids = np.asarray(self.measured[1], dtype=np.int64)
            ids = ids[ids >= self.start]
            to = np.asarray(server_map) if server_map else np.arange(partitions) % servers
            owned = np.bincount(to[ids % partitions], minlength=servers)
            return float(owned.max() / len(ids)) if len(ids) else even()
        if self.measured is not None:
            rows, ids, samples = self.measured
            if not samples:
                return even()
            pooled = np.asarray(ids)

            def below(row: float) -> float:   # mean distinct ids under `row` per rank and step
                return float(np.searchsorted(pooled, row)) / samples
        else:
            rows, alpha, per_rank = self.model[:3]
            p, c = _zipf_probs(rows, float(alpha))
            edges = np.concatenate([[0.0], np.cumsum(c)])           # each bin's first row
            upto = np.concatenate([[0.0], np.cumsum(c * _touched(p, per_rank))])

            def below(row: float) -> float:   # expected distinct rows among rows [0, row)
                return float(np.interp(row, edges, upto))

        owned = [0.0] * servers
        for k, (lo, hi) in enumerate(partition_bounds(rows, partitions)):
            lo, hi = max(lo, self.start), max(hi, self.start)
            owned[server_of(k, servers, server_map)] += below(hi) - below(lo)
        total = below(rows) - below(self.start)
        return max(owned) / total if total > 0 else even()

    def touched_rows(self, probability: float) -> int:
        """How many of the most frequent rows each rank touches with at least `probability` (0
        without a Zipf model; at most 10,000 and fewer than the table's rows)."""
        if self.model is None:
            return 0
        rows, alpha, per_rank = self.model[:3]
        p, _ = _zipf_probs(rows, float(alpha))
        exact = min(rows - 1, _EXACT_ROWS)
        return int(np.sum(_touched(p[:exact], per_rank) >= probability))


_TOUCH_PROBABILITIES = (0.95, 0.8, 0.5, 0.3, 0.1, 0.03)


def _exchange(requests: float, requesters: int, servers: int, row_bytes: int,
              mine: float | None = None, push_bytes: int | None = None):
    """Sent and received bytes of the busiest server when `requesters` ranks each ask for
    `requests` distinct rows spread over `servers` ranks, `mine` of them its own (default an
    even 1/servers): requests carry an id for the pull and a gradient row for the push (which
    retraces the pull, so no id; `push_bytes` a row, default `row_bytes`); answers carry a
    row."""
    ask = ID_BYTES + (row_bytes if push_bytes is None else push_bytes)
    answer = row_bytes
    mine = 1 / servers if mine is None else mine
    load = (requesters - 1) * requests * mine          # rows other ranks bring to this server
    sent = requests * (1 - mine) * ask + load * answer
    received = load * ask + requests * (1 - mine) * answer
    return sent, received


def ps_meetings(n: int, link: Link) -> float:
    """The latency of one step's server exchange over `n` ranks, every table's together: three
    all-to-alls, the ids, the pulled rows and the pushed gradients."""
    return meetings_s(ALL_TO_ALL, n, link, 3)


def allgather_meetings(n: int, link: Link) -> float:
    """The latency of one step's "allgather" exchange, every table's together: three
    all-gathers, the counts, the ids and the rows (parallel/rows/gather.py)."""
    return meetings_s(ALL_GATHER, n, link, 3)


def ps_expected(plan: ParamPlan, traffic: TableTraffic, topology: Topology, links: Links,
                local_aggregation: bool) -> Cost:
    """Expected bytes and seconds of one pull and one push of a table, at its busiest server.

    Too few partitions and a few servers carry everyone's rows; at one partition per rank the
    load is even. (Our exchange sends one message per pair of ranks however many partitions a
    rank serves, so partitions beyond the world size add no per-message cost here.)
    """
    n, row_bytes, push = topology.world_size, plan.row_bytes, plan.push_row_bytes
    if n == 1:
        return Cost(0, 0.0)
    servers = min(plan.partitions, n)
    local, hosts = len(topology.hosts[0]), topology.num_hosts
    if not (local_aggregation and topology.can_aggregate_locally):
        share = traffic.busiest_share(plan.partitions, servers, plan.row_map, plan.servers)
        sent, received = _exchange(traffic.per_rank, n, servers, row_bytes, share, push)
        link = link_for(topology, links)
        return Cost(sent, seconds(max(sent, received), link, 0) + ps_meetings(n, link))
    forwarders = min(servers, local)
    s1, r1 = _exchange(traffic.per_rank, local, forwarders, row_bytes, push_bytes=push)
    # Across hosts: each host's forwarders hold what the host merged; a server hears every host.
    s2, r2 = _exchange(traffic.per_host / forwarders, hosts, max(1, servers // forwarders),
                       row_bytes, push_bytes=push)
    t = seconds(max(s1, r1), links.intra, 0) + ps_meetings(local, links.intra) + \
        seconds(max(s2, r2), links.inter, 0) + ps_meetings(hosts, links.inter)
    return Cost(s1 + s2, t)


def sparse_allgather(traffic: TableTraffic, topology: Topology, links: Links,
                     row_bytes: int) -> Cost:
    """What DDP does with a sparse gradient on gloo, and the "allgather" placement does
    (parallel/rows/gather.py): every rank's (ids, rows) go to every other rank (all-gathers of
    the counts, the ids and the rows), so each rank receives (n - 1) times a rank's rows,
    growing with n; a rank's expected touched rows stand for the largest count."""
    from ..parallel.rows.gather import allgather_bytes

    n = topology.world_size
    if n == 1:
        return Cost(0, 0.0)
    sent = allgather_bytes(traffic.per_rank, row_bytes, n)
    link = link_for(topology, links)
    return Cost(sent, seconds(sent, link, 0) + allgather_meetings(n, link))


def meeting_seconds(method: str, topology: Topology, links: Links,
                    local_aggregation: bool) -> float:
    """The latency of one step's exchange of the tables of `method` ("ps" or "allgather"), the
    part of each table's own price (`ps_expected`, `sparse_allgather`) that does not grow with
    its rows."""
    n = topology.world_size
    if n == 1:
        return 0.0
    if method == "allgather":
        return allgather_meetings(n, link_for(topology, links))
    if not (local_aggregation and topology.can_aggregate_locally):
        return ps_meetings(n, link_for(topology, links))
    local, hosts = len(topology.hosts[0]), topology.num_hosts
    return ps_meetings(local, links.intra) + ps_meetings(hosts, links.inter)


def shared_meetings(plans: list[ParamPlan], traffic: dict, topology: Topology, links: Links,
                    local_aggregation: bool) -> float:
    """The seconds the tables' own prices charge more than the runtime spends: the servers'
    tables are pulled and pushed together (parallel/rows/exchange.py, push.py) and the
    gathered ones meet in the same three collectives (parallel/rows/gather.py), so k tables of
    a method meet once, where k prices of their own charge k meetings (the recommender's three
    tables were priced 3x the collectives of their all-gather). Tables of one dtype, as the
    exchanges batch them; and the lookups of one forward pulled together, as the deferred
    lookups (parallel/rows/lookups.py) do where nothing reads a table's rows before the next
    is looked up."""
    groups: dict[tuple, int] = {}
    for p in plans:
        if p.method in ("ps", "allgather") and p.is_table and traffic.get(p.name) is not None:
            key = (p.method, p.dtype)   # each exchange batches the tables of one dtype
            groups[key] = groups.get(key, 0) + 1
    return sum((k - 1) * meeting_seconds(method, topology, links, local_aggregation)
               for (method, _), k in groups.items())


def predict(plan: ParamPlan, traffic: TableTraffic | None, topology: Topology, links: Links,
            local_aggregation: bool, head_rides: bool = False) -> Cost | None:
    """One entry's expected step on its own (dense parameters unbucketed): what the planner
    writes into the plan and the report prints. None for a served table with no traffic model.
    `head_rides`: a hot head's sum rides a dense bucket (no meeting of its own)."""
    if plan.method == "allreduce":
        if plan.zero:
            return zero_sharded(plan, topology, links)
        return ring_allreduce(plan.nbytes, topology, links)
    if plan.method == "allgather":
        return None if traffic is None else \
            sparse_allgather(traffic, topology, links, plan.row_bytes)
    if not plan.is_table:   # a dense parameter on the servers (mode="ps"): every row, every step
        return dense_served(plan, topology, links)
    if traffic is None:
        return None
    return ps_split(plan, traffic, topology, links, local_aggregation, head_rides=head_rides)


def ps_split(plan: ParamPlan, traffic: TableTraffic, topology: Topology, links: Links,
             local_aggregation: bool, tail: bool = False, head_rides: bool = False) -> Cost:
    """A server table whose first `hot_rows` rows are replicated: the head's all-reduce (rows
    and touched flags) plus the servers' traffic of the tail (`tail`: `traffic` is already the
    tail's, as the planner computes it once for every partition count). `head_rides`: the
    head's sum rides the last dense bucket (parallel/data/dense.py), so it costs its bytes and no
    meeting of its own."""
    rest = traffic if tail else traffic.tail(plan.hot_rows)
    tail = ps_expected(plan, rest, topology, links, local_aggregation)
    if not plan.hot_rows:
        return tail
    head = ring_allreduce(hot_head_bytes(plan), topology, links, buckets=0 if head_rides else 1)
    return Cost(tail.bytes_sent + head.bytes_sent, tail.seconds + head.seconds)
