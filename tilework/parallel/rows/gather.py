"""A table synchronised as DDP synchronises a sparse gradient on gloo: every rank's touched rows
(ids and values, coalesced) all-gathered, summed and averaged on every rank, so each replica
applies one process's update to its whole table (placement "allgather").

Beside all-reduce (every row, every step) and the servers (each touched row to its owner and
back: two exchanges and a pull), this one sends a rank's rows to every other rank: the received
bytes grow with the world, but there is one exchange, no pull, and the table stays whole where
the model runs. On few ranks with few rows a step it can be the cheapest; the planner prices it
beside the others per table (`estimate/cost.sparse_allgather`) and picks it where it is, which
is how tilework is never slower than the peer (DDP with sparse gradients) by construction.

Three counted all-gathers per table per synchronised backward, under "allgather": each rank's
row count (8 bytes), then its ids and its rows padded to the largest count (gloo gathers equal
sizes). The gradient left in `param.grad` is sparse (the optimizer must take sparse gradients,
as it must for the table alone: SGD, Adagrad, SparseAdam), the mean over ranks of their
gradients (`sparse_reduce="sum"`: their sum). Under `no_sync` nothing moves: the rows
accumulate locally and the next synchronised backward gathers their sum, as under DDP.
"""

from __future__ import annotations

import torch

from ...comm import counted
from ...comm.counted import Stats


class GatheredTable:
    def __init__(self, name: str, param: torch.nn.Parameter, group, world_size: int,
                 stats: Stats, mean: bool = True, method: str = "allgather"):
        self.name, self.param, self.group = name, param, group
        self.n, self.stats, self.mean, self.method = world_size, stats, mean, method

    def sync(self) -> None:
        """Every rank's rows into every rank's `param.grad` (a collective: every rank calls it
        once per synchronised backward, with or without a gradient of its own)."""
        p = self.param
        g = p.grad
        if g is None:
            g = torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.long, device=p.device),
                                        p.new_zeros((0, *p.shape[1:])), p.shape)
        elif not g.is_sparse:   # a dense-layout gradient: its touched rows
            rows = g.reshape(g.shape[0], -1).ne(0).any(1).nonzero().flatten()
            g = torch.sparse_coo_tensor(rows[None], g[rows], g.shape, check_invariants=False)
        g = g.coalesce()
        ids, values = g.indices()[0], g.values()
        counts = torch.tensor([ids.numel()], dtype=torch.long, device=p.device)
        counts = [int(c) for c in counted.all_gather(counts, self.group, self.stats, self.method)]
        most = max(counts)
        padded_ids = ids.new_zeros(most)
        padded_ids[:ids.numel()] = ids
        padded_values = values.new_zeros((most, *values.shape[1:]))
        padded_values[:ids.numel()] = values
        all_ids = counted.all_gather(padded_ids, self.group, self.stats, self.method)
        all_values = counted.all_gather(padded_values, self.group, self.stats, self.method)
        ids = torch.cat([part[:c] for part, c in zip(all_ids, counts)])
        values = torch.cat([part[:c] for part, c in zip(all_values, counts)])
        if self.mean:
            values = values / self.n
        p.grad = torch.sparse_coo_tensor(ids[None], values, p.shape,
                                         check_invariants=False).coalesce()


def allgather_bytes(rows: int, row_bytes: int, world_size: int) -> int:
    """What one rank sends for one table per synchronised backward, `rows` being the largest
    count of touched rows any rank has: the counts, then the padded ids and rows."""
    from ...comm.wire import ID_BYTES, all_gather_bytes

    return sum(all_gather_bytes(b, world_size) for b in (8, rows * ID_BYTES, rows * row_bytes))
