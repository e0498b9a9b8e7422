"""The servers' push: every table's gradient rows to their owners, in one exchange per hop.

A table looked up once since the last push sends only its gradient rows, in the order its pull
sent the ids, so the owner matches them to what it was asked (the route each pull took is kept,
exchange.PullRoute): one all-to-all of rows, no ids, no lengths. A table looked up several times
(accumulation without sync, two lookups in one forward) carries its ids with the rows, after an
exchange of lengths. `EarlyPush` sends the tables of one pull while backward still runs, where
their rows are complete before the rest of the model's.
"""

from __future__ import annotations

import torch

from ...comm.counted import all_to_all_v, group_size
from ...comm.groups import push_group
from ..data.dense import PushRide
from .exchange import _batches, _lengths, _per_table, _to_owners
from .sparse import PSTable


def push_route(tables: list[PSTable], groups) -> PushRide:
    """How this engine's pushes go (parallel/data/dense.py's PushRide). Where every table's push is
    one all-to-all over the world, it runs on a group of its own (made here: collective), and the
    last dense bucket may ride it where the tables' rows are all of one dtype (in the first of
    the push's all-to-alls; in a narrower push width its bits ride viewed in it:
    PushRide.all_to_all)."""
    dtypes = {table.shard.dtype for table in tables}
    one_hop = bool(tables) and all(len(t.hops) == 1 and t.hops[0].group is groups.world
                                   for t in tables)
    return PushRide(dtypes.pop() if len(dtypes) == 1 and one_hop else None, groups.world,
                    push_group(groups) if one_hop else groups.world)


def push_tables(tables: list[PSTable], with_heads: bool, ride: PushRide) -> None:
    """Send every table's pending gradient rows to their owners, which sum them into `received`
    until the step applies them (a collective: every rank calls it with the same tables). Hot
    heads (parallel/rows/hot.py) are all-reduced meanwhile, unless they ride a dense bucket instead.
    `ride`: the route, and the last dense bucket riding along where one does."""
    heads = [t.head for t in tables if t.head is not None] if with_heads else []
    for head in heads:
        head.launch()
    retrace, carry = [], []
    for table in tables:
        (retrace if _retraceable(table) else carry).append(table)
    for batch in _by_width(retrace):
        routes = [table.pulls[0] for table in batch]
        grads = [table.take_pending()[1] for table in batch]
        for h in range(len(batch[0].hops)):
            grads = _retrace_hop(batch, h, [r.hops[h] for r in routes], grads, ride)
        for table, route, g in zip(batch, routes, grads):
            table.receive(route.owned, g)
    for batch in _by_width(carry):
        items = [table.take_pending() for table in batch]
        for h in range(len(batch[0].hops)):
            items = _carry_hop(batch, h, items, ride)
        for table, (ids, grads) in zip(batch, items):
            table.receive(ids, grads)
    for table in tables:
        table.pulls.clear()
    for head in heads:
        head.wait()


def _by_width(tables: list[PSTable]) -> list[list[PSTable]]:
    """The tables pushed in one exchange: of one dtype and device (as pulled together) and one
    push width (push_compress="auto" chooses it per table)."""
    out = []
    for batch, in _batches(tables):
        widths: dict[torch.dtype, list[PSTable]] = {}
        for table in batch:
            widths.setdefault(table.push_dtype, []).append(table)
        out += widths.values()
    return out


def _retraceable(table: PSTable) -> bool:
    """One pull, one gradient for exactly its ids: the owners know what each row is."""
    if len(table.pulls) != 1 or len(table.pending) != 1:
        return False
    ids = table.pending[0][0]
    return ids is table.pulls[0].ids or torch.equal(ids, table.pulls[0].ids)


def _retrace_hop(tables, h, steps, grads, ride: PushRide):
    """Gradient rows the way the pull's ids went: sorted and split as then, summed where the
    ids were merged. Both sides know every length."""
    parts, sizes, widths = _retrace_parts(tables[0].hops[h], steps, grads, tables[0].push_dtype)
    got = ride.all_to_all(parts, tables[0].hops[h], tables[0].stats, [sum(s) for s in sizes])
    return _retrace_land(steps, widths, got, sizes, grads[0].dtype)


def _retrace_parts(hop, steps, grads, wire: torch.dtype):
    """What each peer gets of the gradient rows `grads` retracing the pull's `steps` at `hop`,
    in the push's width `wire`: (each peer's flat part, the element counts that arrive from
    each peer per table, widths)."""
    widths = [g.shape[1] for g in grads]
    to_peer: list[list[torch.Tensor]] = [[] for _ in range(group_size(hop.group))]
    for (order, per_peer, _, _, _), g in zip(steps, grads):
        for j, part in enumerate(torch.split(g[order].to(wire), per_peer)):
            to_peer[j].append(part.reshape(-1))
    sizes = [[a * w for a, w in zip(arrivals, widths)]
             for arrivals in zip(*[step[2] for step in steps])]
    return [torch.cat(parts) for parts in to_peer], sizes, widths


def _retrace_land(steps, widths, got, sizes, dtype: torch.dtype) -> list[torch.Tensor]:
    """The rows that arrived (`got`, per peer), summed in the tables' `dtype` per table by the
    ids the pull merged."""
    out = []
    for (_, _, _, inverse, merged), w, rows in zip(steps, widths, _per_table(got, sizes, widths)):
        summed = rows.new_zeros(len(merged), w, dtype=dtype)
        summed.index_add_(0, inverse, rows.to(dtype))
        out.append(summed)
    return out


def _carry_hop(tables: list[PSTable], h: int, items, ride: PushRide):
    """One hop where ids ride with their gradient rows (their 8 bytes viewed as the row's
    dtype, a bit-exact round trip), after the lengths; what arrives is merged by id per table."""
    hop = tables[0].hops[h]
    n, stats = group_size(hop.group), tables[0].stats
    dtype, kept = tables[0].push_dtype, items[0][1].dtype   # on the wire; summed in
    id_width = 8 // dtype.itemsize
    widths = [id_width + grads.shape[1] for _, grads in items]
    packed = [torch.cat([ids.contiguous().view(dtype).reshape(len(ids), id_width),
                         grads.to(dtype)], 1) for ids, grads in items]
    _, counts, to_peer = _to_owners(tables, h, [ids for ids, _ in items], packed, n)
    heard = _lengths(tables, h, counts, ride.group_of(hop))
    arriving = [[int(c) * w for c, w in zip(from_peer.tolist(), widths)] for from_peer in heard]
    got = ride.all_to_all([torch.cat(parts) for parts in to_peer], hop, stats,
                          [sum(sizes) for sizes in arriving])
    out = []
    for width, rows in zip(widths, _per_table(got, arriving, widths)):
        ids = rows[:, :id_width].reshape(-1).view(torch.int64)
        merged, inverse = torch.unique(ids, return_inverse=True)
        summed = rows.new_zeros(len(merged), width - id_width, dtype=kept)
        summed.index_add_(0, inverse, rows[:, id_width:].to(kept))
        out.append((merged, summed))
    return out


class EarlyPush:
    """The tables of one pull pushed while backward still runs. Once each table of a pull holds
    its one gradient (retraceable: no ids travel) and some other table's gradient is still to
    come, their rows go to the owners in an asynchronous all-to-all on the push's group, beside
    the rest of backward: an LM's softmax tables are complete before its LSTM's backward starts,
    and DDP overlaps their sparse all-reduce the same way. The rest go in the end-of-backward
    push, which carries the last dense bucket where it rides, so a table always stays for it.
    Which tables go early follows the autograd order of the step, the same on every rank.
    `checks`: the input checks (parallel/data/checks.py) or None; `touched()`: the engine's trigger
    (queues the end of backward), which says whether this backward synchronises."""

    def __init__(self, tables: dict[str, PSTable], ride: PushRide, checks, touched):
        self.tables, self.ride, self.checks, self.touched = tables, ride, checks, touched
        self.flying: list[tuple] = []   # (tables, routes, widths, sizes, pending work)
        for table in tables.values():
            table.on_grad = self.on_grad

    def on_grad(self, table: PSTable) -> None:
        """After `table` received a gradient."""
        if not self.touched() or len(table.pulls) != 1:
            return
        batch = table.pulls[0].together
        if (len(batch[0].hops) != 1 or any(t.head is not None for t in batch)
                or len({t.push_dtype for t in batch}) != 1   # two widths: at the end
                or not all(_retraceable(t) for t in batch)
                or not any(t.pulls and not t.pending for t in self.tables.values()
                           if t not in batch)):
            return
        if self.checks is not None:   # before any row leaves
            self.checks.on_tables(batch)
        hop, routes = batch[0].hops[0], [t.pulls[0] for t in batch]
        steps = [route.hops[0] for route in routes]
        parts, sizes, widths = _retrace_parts(hop, steps, [t.take_pending()[1] for t in batch],
                                              batch[0].push_dtype)
        work = all_to_all_v(parts, self.ride.group_of(hop), batch[0].stats, "ps", hop.remote,
                            recv_lengths=[sum(s) for s in sizes], async_op=True)
        for t in batch:
            t.pulls.clear()
        self.flying.append((batch, routes, widths, sizes, work))

    def finish(self, with_heads: bool, ride: PushRide) -> None:
        """The end-of-backward push of the tables left (push_tables), then the early pushes'
        rows summed into their owners' `received`."""
        early = {id(t) for flying in self.flying for t in flying[0]}
        push_tables([t for t in self.tables.values() if id(t) not in early], with_heads, ride)
        for batch, routes, widths, sizes, work in self.flying:
            steps = [route.hops[0] for route in routes]
            for table, route, g in zip(batch, routes,
                                       _retrace_land(steps, widths, work.wait(), sizes,
                                                     batch[0].shard.dtype)):
                table.receive(route.owned, g)
        self.flying = []
