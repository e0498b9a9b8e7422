"""A table synchronised as DDP synchronises a sparse gradient on gloo: every rank's touched rows
(ids and values, coalesced) all-gathered, summed and averaged on every rank, so each replica
applies one process's update to its whole table (placement "allgather").

Beside all-reduce (every row, every step) and the servers (each touched row to its owner and
back), this one sends a rank's rows to every other rank: the received bytes grow with the world,
but nothing happens before the forward (no pull) and the table stays whole where the model
runs. The planner prices it beside the others per table (`estimate/cost.sparse_allgather`) and
takes it where that price is the lowest; users choose it with overrides.

Three counted all-gathers per synchronised backward for all such tables together, under
"allgather": each rank's row count per table (8 bytes each), then its ids and its rows, each
table's padded to its largest count (gloo gathers equal sizes); bytes are linear, so a step's
are the sum of each table's `allgather_bytes`. The gradient left in `param.grad` is sparse
(the optimizer must take sparse gradients, as it must for the table alone: SGD, Adagrad,
SparseAdam), the mean over ranks of their gradients (`sparse_reduce="sum"`: their sum).
Under `no_sync` nothing moves: the rows accumulate locally and the next synchronised backward
gathers their sum, as under DDP.
"""

from __future__ import annotations

import torch

from ...comm import counted
from ...comm.counted import Stats


class GatheredTable:
    """One table under "allgather": its parameter, and whether its rows are averaged."""

    def __init__(self, name: str, param: torch.nn.Parameter, mean: bool = True):
        self.name, self.param, self.mean = name, param, mean

    def local_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, rows) this rank's gradient touched, coalesced (none: empty)."""
        p, g = self.param, self.param.grad
        if g is None:
            return (torch.zeros(0, dtype=torch.long, device=p.device),
                    p.new_zeros((0, *p.shape[1:])))
        g = g.coalesce()   # sparse: the planner takes "allgather" for sparse=True tables only
        return g.indices()[0], g.values()

    def set_gradient(self, ids: torch.Tensor, rows: torch.Tensor, world_size: int) -> None:
        if self.mean:
            rows = rows / world_size
        self.param.grad = torch.sparse_coo_tensor(ids[None], rows, self.param.shape,
                                                  check_invariants=False).coalesce()


def sync_tables(tables: list[GatheredTable], group, world_size: int, stats: Stats,
                method: str = "allgather") -> None:
    """Every rank's rows of every table into every rank's gradients, in three collectives
    for all the tables together (a collective: every rank calls it once per synchronised
    backward): the counts, the ids and the rows, each table's padded to its largest count
    (gloo gathers equal sizes; rows of one dtype share one buffer, one more per other dtype)."""
    if not tables:
        return
    local = [t.local_rows() for t in tables]
    device = tables[0].param.device
    counts = torch.tensor([ids.numel() for ids, _ in local], dtype=torch.long, device=device)
    every = torch.stack(counted.all_gather(counts, group, stats, method)).tolist()
    most = [max(rank[k] for rank in every) for k in range(len(tables))]
    ids = torch.cat([_padded(i, m) for (i, _), m in zip(local, most)])
    all_ids = counted.all_gather(ids, group, stats, method)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for k, (_, rows) in enumerate(local):
        by_dtype.setdefault(rows.dtype, []).append(k)
    gathered_rows: dict[int, list[torch.Tensor]] = {}
    for members in by_dtype.values():
        flat = torch.cat([_padded(local[k][1], most[k]).reshape(-1) for k in members])
        parts = counted.all_gather(flat, group, stats, method)
        sizes = [most[k] * tables[k].param.shape[1:].numel() for k in members]
        for r, part in enumerate(parts):
            for k, piece in zip(members, part.split(sizes)):
                shape = (most[k], *tables[k].param.shape[1:])
                gathered_rows.setdefault(k, [None] * world_size)[r] = piece.reshape(shape)
    offsets = [0]
    for m in most:
        offsets.append(offsets[-1] + m)
    for k, table in enumerate(tables):
        a, b = offsets[k], offsets[k + 1]
        kept = [every[r][k] for r in range(world_size)]
        table.set_gradient(
            torch.cat([all_ids[r][a:b][:kept[r]] for r in range(world_size)]),
            torch.cat([gathered_rows[k][r][:kept[r]] for r in range(world_size)]), world_size)


def _padded(t: torch.Tensor, length: int) -> torch.Tensor:
    out = t.new_zeros((length, *t.shape[1:]))
    out[:t.shape[0]] = t
    return out


def allgather_bytes(rows: int, row_bytes: int, world_size: int) -> int:
    """What one rank sends for one table per synchronised backward, `rows` being the largest
    count of touched rows any rank has: its count, then its padded ids and rows (tables
    gathered together send the sum)."""
    from ...comm.wire import ID_BYTES, all_gather_bytes

    return sum(all_gather_bytes(b, world_size) for b in (8, rows * ID_BYTES, rows * row_bytes))
