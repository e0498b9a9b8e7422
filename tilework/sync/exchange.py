"""The push of every server table in one exchange per hop: at the end of backward, the tables'
gradient rows travel together, so the ranks meet twice per hop (the lengths, then the rows)
however many tables the model has, instead of twice per table.

Bytes are what one exchange per table would send (the same lengths, ids and rows, counted the
same way), so the cost model's exact replay is unchanged; only the number of messages drops.
Tables of different dtypes (or devices) go in separate exchanges, since a message has one dtype.
"""

from __future__ import annotations

import torch

from ..comm.counted import all_to_all_v, group_size
from .sparse import PSTable, _by_destination


def push_tables(tables: list[PSTable]) -> None:
    """Send every table's pending gradient rows to their owners, which sum them into `received`
    until the step applies them (a collective: every rank calls it with the same tables)."""
    batches: dict[tuple, list[PSTable]] = {}
    for table in tables:
        batches.setdefault((table.shard.dtype, table.shard.device), []).append(table)
    for batch in batches.values():
        items = [table.take_pending() for table in batch]
        for h in range(len(batch[0].hops)):
            items = _exchange_hop(batch, h, items)
        for table, (ids, grads) in zip(batch, items):
            table.receive(ids, grads)


def _exchange_hop(tables: list[PSTable], h: int, items):
    """One hop for all `tables`: each id rides with its gradient row (its 8 bytes viewed as the
    row's dtype, a bit-exact round trip); what arrives is merged by id per table."""
    hop = tables[0].hops[h]
    group, n, stats = hop.group, group_size(hop.group), tables[0].stats
    dtype, device = items[0][1].dtype, items[0][1].device
    id_width = 8 // items[0][1].element_size()
    widths = [id_width + grads.shape[1] for _, grads in items]
    counts = torch.zeros(n, len(tables), dtype=torch.int64, device=device)
    to_peer: list[list[torch.Tensor]] = [[] for _ in range(n)]
    for t, (table, (ids, grads)) in enumerate(zip(tables, items)):
        order, per_peer = _by_destination(table.hops[h].dest(ids), n)
        packed = torch.cat([ids[order].view(dtype).reshape(len(ids), id_width), grads[order]], 1)
        for j, part in enumerate(torch.split(packed, per_peer)):
            to_peer[j].append(part.reshape(-1))
        counts[:, t] = torch.tensor(per_peer, dtype=torch.int64, device=device)
    # The lengths of every table at once: T int64 per peer, as T separate exchanges would send.
    heard = all_to_all_v(list(counts), group, stats, "ps", hop.remote,
                         recv_lengths=[len(tables)] * n)
    arriving = [[int(c) * w for c, w in zip(from_peer.tolist(), widths)] for from_peer in heard]
    got = all_to_all_v([torch.cat(parts) for parts in to_peer], group, stats, "ps", hop.remote,
                       recv_lengths=[sum(sizes) for sizes in arriving])
    pieces = [torch.split(flat, sizes) for flat, sizes in zip(got, arriving)]
    out = []
    for t, width in enumerate(widths):
        # reshape, not view: a single received row counts as contiguous whatever its stride
        rows = torch.cat([peer[t] for peer in pieces]).reshape(-1, width)
        ids = rows[:, :id_width].reshape(-1).view(torch.int64)
        merged, inverse = torch.unique(ids, return_inverse=True)
        summed = rows.new_zeros(len(merged), width - id_width)
        summed.index_add_(0, inverse, rows[:, id_width:])
        out.append((merged, summed))
    return out
