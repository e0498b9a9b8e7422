"""The parameter server's exchanges for every table of a step at once: the ranks meet a fixed
number of times per hop however many tables the model has.

- Pull (forward): the lookups waiting in a batch (parallel/rows/lookups.py) travel together: their
  ids in one all-to-all of blocks sized from earlier steps, each leading with its counts (a
  second one, of what did not fit, only on a step whose ids outgrew a block), their rows back
  in one.
- Push (backward; parallel/rows/push.py): the gradient rows retrace the route each pull took, kept
  here (`PullRoute`).

The rows are what separate exchanges per table would send; the id blocks are per exchange (their
headers, capacities and overflow): the cost model replays both (cost.ps_step_bytes).
Tables of different dtypes (or devices) go in separate exchanges, since a message has one dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ...comm.counted import all_to_all_v, group_size
from ...comm.wire import id_block_capacity
from .ahead import Ahead, Entry
from .sparse import PSTable, _by_destination


@dataclass
class PullRoute:
    """The way one pull's ids went, hop by hop: what the push of their gradients retraces."""

    ids: torch.Tensor                                  # the unique ids this rank asked for
    # per hop: (order, counts, arrived, inverse, merged): how this rank sorted its ids to the
    # peers and how many went to each, how many arrived from each, and how they were merged
    hops: list[tuple] = field(default_factory=list)
    together: list = field(default_factory=list)  # the tables whose routes this pull kept

    @property
    def owned(self) -> torch.Tensor:
        """The ids that reached the owner (this rank) at the last hop."""
        return self.hops[-1][4] if self.hops else self.ids


def _batches(tables: list[PSTable], *rest):
    by_kind: dict[tuple, list[int]] = {}
    for i, table in enumerate(tables):
        by_kind.setdefault((table.shard.dtype, table.shard.device), []).append(i)
    return [([tables[i] for i in idx], *[[r[i] for i in idx] for r in rest])
            for idx in by_kind.values()]


def _to_owners(tables, h, ids_list, payloads, n: int):
    """Each table's payload rows (aligned with its ids) sorted by the peer its ids go to at hop
    `h`: (orders and per-peer counts per table, the (n x T) counts, each peer's flat parts)."""
    device = tables[0].shard.device
    counts = torch.zeros(n, len(tables), dtype=torch.int64, device=device)
    to_peer: list[list[torch.Tensor]] = [[] for _ in range(n)]
    orders = []
    for t, (table, ids, payload) in enumerate(zip(tables, ids_list, payloads)):
        order, per_peer = _by_destination(table.hops[h].dest(ids), n)
        orders.append((order, per_peer))
        counts[:, t] = torch.tensor(per_peer, dtype=torch.int64, device=device)
        for j, part in enumerate(torch.split(payload[order], per_peer)):
            to_peer[j].append(part.reshape(-1))
    return orders, counts, to_peer


def _per_table(got: list[torch.Tensor], sizes: list[list[int]], width: list[int]):
    """What each peer sent (flat, table after table, `sizes[peer][t]` elements) as one
    (rows x width[t]) tensor per table. reshape, not view: a single received row counts as
    contiguous whatever its stride."""
    pieces = [torch.split(flat, s) for flat, s in zip(got, sizes)]
    return [torch.cat([peer[t] for peer in pieces]).reshape(-1, w) for t, w in enumerate(width)]


def _lengths(tables, h, counts: torch.Tensor, group=None) -> list[torch.Tensor]:
    """Every table's per-peer lengths at once: T int64 per peer, as T exchanges would send
    (over `group`, default the hop's)."""
    hop = tables[0].hops[h]
    group = hop.group if group is None else group
    return all_to_all_v(list(counts), group, tables[0].stats, "ps", hop.remote,
                        recv_lengths=[len(tables)] * group_size(group))


# -- pull ---------------------------------------------------------------------------------------

def pull_tables(tables: list[PSTable], ids_list: list[torch.Tensor], record: list[bool],
                keys: list | None = None, ahead: Ahead | None = None) -> list[torch.Tensor]:
    """Rows of each lookup's unique ids (a collective: every rank calls it with the same tables
    in the same order; a table may appear more than once). `record[i]`: keep lookup i's route
    for the push of its gradients. `keys[i]`: where lookup i's ids sit in the loop's current
    batch (parallel/rows/ahead.py), for tables served in one hop; such a pull is served from the
    routes sent ahead and sends the next batch's ids with its rows."""
    out: list = [None] * len(tables)
    keys = keys if keys is not None else [None] * len(tables)
    for batch, ids, keep, keyed, where in _batches(tables, ids_list, record, keys,
                                                   range(len(tables))):
        routes = [PullRoute(i) for i in ids]
        with torch.no_grad():
            if ahead is not None and len(batch[0].hops) == 1 and all(k is not None
                                                                      for k in keyed):
                rows = _fetch_ahead(batch, list(ids), routes, ahead, keyed)
            else:
                rows = _fetch(batch, 0, list(ids), routes)
        kept = [table for table, k in zip(batch, keep) if k]
        for table, route, r, k, i in zip(batch, routes, rows, keep, where):
            if k:
                table.pulls.append(route)
                route.together = kept
            out[i] = r
    return out


def _fetch(tables, h, ids_list, routes):
    if h == len(tables[0].hops):
        return [t.shard[t.layout.local_index(ids)] for t, ids in zip(tables, ids_list)]
    hop, stats = tables[0].hops[h], tables[0].stats
    n = group_size(hop.group)
    orders, counts, to_peer = _to_owners(tables, h, ids_list, ids_list, n)
    heard, got = _send_ids(tables, h, counts, [torch.cat(parts) for parts in to_peer])
    by_peer = [torch.split(flat, c) for flat, c in zip(got, heard)]
    arrived = [[peer[t] for peer in by_peer] for t in range(len(tables))]
    merged = [torch.unique(torch.cat(a), return_inverse=True) for a in arrived]
    rows = _fetch(tables, h + 1, [m for m, _ in merged], routes)
    answers: list[list[torch.Tensor]] = [[] for _ in range(n)]
    for t, (r, (_, inverse)) in enumerate(zip(rows, merged)):
        for j, part in enumerate(torch.split(r[inverse], [len(a) for a in arrived[t]])):
            answers[j].append(part.reshape(-1))
    widths = [t.shard.shape[1] for t in tables]
    sizes = [[c * w for c, w in zip(asked, widths)] for asked in counts.tolist()]
    back = all_to_all_v([torch.cat(a) for a in answers], hop.group, stats, "ps", hop.remote,
                        recv_lengths=[sum(s) for s in sizes])
    out = []
    for t, (table, ids, answered) in enumerate(zip(tables, ids_list,
                                                   _per_table(back, sizes, widths))):
        order, per_peer = orders[t]
        rows_t = table.shard.new_empty(len(ids), widths[t])
        rows_t[order] = answered
        out.append(rows_t)
        routes[t].hops.insert(0, (order, per_peer, [len(a) for a in arrived[t]], merged[t][1],
                                  merged[t][0]))
    return out


def _fetch_ahead(tables, ids_list, routes, ahead: Ahead, keys):
    """One hop, the loop's batches read ahead: lookups with an entry (parallel/rows/ahead.py) send
    no ids, the rest send theirs in id blocks first; then one all-to-all carries every answer and,
    leading it, the id blocks of the next batch's same lookups (as the next pull would have
    sent them: same blocks, same capacities). An entry is kept where every rank sent ids."""
    hop, stats = tables[0].hops[0], tables[0].stats
    n = group_size(hop.group)
    steps = [ahead.take(t.name, k, ids) for t, k, ids in zip(tables, keys, ids_list)]
    steps = [None if e is None else ((e.order, e.per_peer), e.arrived) for e in steps]
    fresh = [i for i, s in enumerate(steps) if s is None]
    if fresh:
        sub_ids = [ids_list[i] for i in fresh]
        orders, counts, to_peer = _to_owners([tables[i] for i in fresh], 0, sub_ids, sub_ids, n)
        heard, got = _send_ids([tables[i] for i in fresh], 0, counts,
                               [torch.cat(parts) for parts in to_peer])
        by_peer = [torch.split(flat, c) for flat, c in zip(got, heard)]
        for s, i in enumerate(fresh):
            steps[i] = (orders[s], [peer[s] for peer in by_peer])
    widths = [t.shard.shape[1] for t in tables]
    merged = [torch.unique(torch.cat(arrived), return_inverse=True) for _, arrived in steps]
    payload: list[list[torch.Tensor]] = [[] for _ in range(n)]
    for table, (ids, inverse), (_, arrived) in zip(tables, merged, steps):
        rows = table.shard[table.layout.local_index(ids)][inverse]
        for j, part in enumerate(torch.split(rows, [len(a) for a in arrived])):
            payload[j].append(part.reshape(-1))
    sizes = [[per_peer[j] * w for ((_, per_peer), _), w in zip(steps, widths)]
             for j in range(n)]
    # Blocks go even without a next batch (all held back): a rank whose loader ended early then
    # still sends what its peers expect, and the peers' next pull is stopped by the guard.
    blocks, following = _blocks_ahead(tables, keys, ahead, n)
    dtype = tables[0].shard.dtype
    ratio = 8 // tables[0].shard.element_size()   # an id block's int64 words in the rows' dtype
    lead = [k * ratio for k in blocks.in_lengths]
    payload = [[b.view(dtype), *parts] for b, parts in zip(blocks.out, payload)]
    back = all_to_all_v([torch.cat(parts) for parts in payload], hop.group, stats, "ps",
                        hop.remote, recv_lengths=[a + sum(s) for a, s in zip(lead, sizes)])
    out = []
    for t, (table, ids, answered) in enumerate(zip(
            tables, ids_list, _per_table([b[a:] for b, a in zip(back, lead)], sizes, widths))):
        (order, per_peer), arrived = steps[t]
        rows_t = table.shard.new_empty(len(ids), widths[t])
        rows_t[order] = answered
        out.append(rows_t)
        routes[t].hops.insert(0, (order, per_peer, [len(a) for a in arrived], merged[t][1],
                                  merged[t][0]))
    # a block is cloned to start at 0: an int64 view needs alignment
    _keep_ahead(tables, keys, ahead, following,
                *blocks.read([b[:a].clone().view(torch.int64) for b, a in zip(back, lead)]))
    return out


def _blocks_ahead(tables, keys, ahead: Ahead, n: int):
    """The id blocks of the next batch's lookups like these: (IdBlocks, per table its unique
    ids and their sorting, or None where this rank has none to send: counts -1)."""
    following = []
    for table, key in zip(tables, keys):
        view = ahead.next_ids(key)
        ids = None if view is None else torch.unique(view.reshape(-1))
        if ids is not None and len(ids) and (ids.min() < 0 or ids.max() >= table.layout.rows):
            ids = None   # the next step's lookup stops on it, with the usual message
        following.append(None if ids is None else ids[table.hot_count(ids):])
    present = [i for i, ids in enumerate(following) if ids is not None]
    counts = torch.full((n, len(tables)), -1, dtype=torch.int64, device=tables[0].shard.device)
    to_peer: list = [[] for _ in range(n)]
    if present:
        sent = [following[i] for i in present]
        orders, sub_counts, to_peer = _to_owners([tables[i] for i in present], 0, sent, sent, n)
        counts[:, present] = sub_counts
        orders = dict(zip(present, orders))
        following = [None if ids is None else (ids, orders[i]) for i, ids in enumerate(following)]
    flat = [torch.cat(parts) if parts else counts.new_empty(0) for parts in to_peer]
    return IdBlocks(tables, 0, counts, flat), following


def _keep_ahead(tables, keys, ahead: Ahead, following, heard, ids_in) -> None:
    """An entry for every lookup whose next ids every rank sent."""
    by_peer = [torch.split(flat, [max(c, 0) for c in counts])
               for flat, counts in zip(ids_in, heard)]
    for t, (table, key, mine) in enumerate(zip(tables, keys, following)):
        if mine is not None and all(counts[t] >= 0 for counts in heard):
            ids, (order, per_peer) = mine
            ahead.keep(table.name, key, Entry(ahead.index + 1, ids, order, per_peer,
                                              [peer[t] for peer in by_peer]))


def _send_ids(tables, h, counts: torch.Tensor, flat_ids: list[torch.Tensor]):
    """The pull's ids in blocks of a size both ends know (`IdBlocks`), so no lengths go first.
    Returns each peer's per-table counts and the ids that arrived from it."""
    hop = tables[0].hops[h]
    blocks = IdBlocks(tables, h, counts, flat_ids)
    got = all_to_all_v(blocks.out, hop.group, tables[0].stats, "ps", hop.remote,
                       recv_lengths=blocks.in_lengths)
    return blocks.read(got)


class IdBlocks:
    """Ids to every peer in a block of the pair's capacity: each block leads with its per-table
    counts (-1: this sender has no ids for that table this time, `parallel/rows/ahead.py`) and
    whether its sender overflowed any of its blocks, then holds up to the capacity of ids (padded).
    Every rank reads every sender's flag, so all agree on the second exchange, of what did not
    fit, only when some block overflowed; its sizes are read from the counts. Each end then
    sets the pair's capacity from the same count (wire.id_block_capacity; only growing where
    the block held some table back, -1). A rank's block to itself holds exactly its ids. The
    capacities belong to the tables' exchange at hop `h`, so blocks sent ahead for a pull and
    the blocks of that pull itself share them."""

    def __init__(self, tables, h, counts: torch.Tensor, flat_ids: list[torch.Tensor]):
        self.tables = tables
        self.hop = hop = tables[0].hops[h]
        self.flat_ids = [f.long() for f in flat_ids]   # 8 bytes an id, as the model says
        n, self.width = group_size(hop.group), len(tables) + 1
        me = dist.get_rank(hop.group) if n > 1 else 0
        self.out_caps, self.in_caps = tables[0].id_blocks.setdefault(
            (tuple(t.name for t in tables), h), ([0] * n, [0] * n))
        self.sending = counts.clamp(min=0).sum(1).tolist()
        self.holding_back = bool((counts < 0).any())   # some table's ids are not in it
        self.out_caps[me] = self.sending[me]
        overflow = any(c > k for c, k in zip(self.sending, self.out_caps))
        self.out = []
        for j, (c, k) in enumerate(zip(counts, self.out_caps)):
            ids = self.flat_ids[j][:k]
            self.out.append(torch.cat([c, c.new_tensor([int(overflow)]), ids,
                                       c.new_zeros(k - len(ids))]))
        self.in_caps[me] = self.sending[me]
        self.in_lengths = [self.width + k for k in self.in_caps]

    def read(self, got: list[torch.Tensor]):
        """(each sender's per-table counts, the ids that arrived from each), after the second
        exchange where a block overflowed; the capacities set for the next time."""
        width, in_caps, hop = self.width, self.in_caps, self.hop
        headers = torch.stack([b[:width] for b in got]).tolist()   # one wait on a device
        heard = [head[:-1] for head in headers]
        arriving = [sum(max(c, 0) for c in counts) for counts in heard]
        ids_in = [b[width:width + min(a, k)] for b, a, k in zip(got, arriving, in_caps)]
        if any(head[-1] for head in headers):
            rest = all_to_all_v([f[k:] for f, k in zip(self.flat_ids, self.out_caps)], hop.group,
                                self.tables[0].stats, "ps", hop.remote,
                                recv_lengths=[max(0, a - k) for a, k in zip(arriving, in_caps)])
            ids_in = [torch.cat([a, b]) for a, b in zip(ids_in, rest)]
        for j in range(len(in_caps)):
            self.out_caps[j] = _fit(self.sending[j], self.out_caps[j], self.holding_back)
            in_caps[j] = _fit(arriving[j], in_caps[j], min(heard[j], default=0) < 0)
        return heard, ids_in


def _fit(count: int, capacity: int, held_back: bool) -> int:
    """A pair's capacity after a block (wire.id_block_capacity); one that held a table back
    only grows: its count is not the whole exchange's, so it says nothing of shrinking."""
    if held_back and count <= capacity:
        return capacity
    return id_block_capacity(count, capacity)
