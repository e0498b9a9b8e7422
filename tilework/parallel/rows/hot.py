"""A server table's hot head: rows [0, hot_rows) of a frequency-sorted table, which (nearly)
every rank touches every step, kept replicated on every rank instead of on the servers.

No id travels for them. A lookup reads head rows from the local replica and pulls only the tail
from the servers (parallel/rows/sparse.py). Their gradient rows are summed into a local (hot_rows x
width) buffer with one touched flag per row; at the push (parallel/rows/exchange.py) buffer and
flags are summed over the world: riding the last dense all-reduce bucket where the model has one of
the head's dtype (parallel/data/dense.py; no collective of its own, only its bytes), else in an
all-reduce of its own (counted as "allreduce" either way; cost.hot_sync_bytes); at the optimizer
step every rank applies the same row-wise optimizer (optim/rowwise.py) to the rows some rank
touched, identically, so the replicas stay equal and the update is what the servers would have
applied: lazy, as theirs.
"""

from __future__ import annotations

import torch

from ...comm.counted import Stats, all_reduce_async
from ...optim.own import take_rows
from ...plans.plan import ParamPlan


class HotHead:
    def __init__(self, plan: ParamPlan, full: torch.Tensor, groups, stats: Stats, scale: float,
                 make_optimizer):
        self.rows, self.groups, self.stats, self.scale = plan.hot_rows, groups, stats, scale
        self.weight = full.detach().reshape(full.shape[0], -1)[:self.rows].clone()
        self.optimizer = make_optimizer(self.weight)
        self.grad = torch.zeros_like(self.weight)       # this rank's, since the last push
        self.touched = self.weight.new_zeros(self.rows)  # ... and the rows it looked up
        self.received: torch.Tensor | None = None       # summed over ranks, until the step
        self.received_touched: torch.Tensor | None = None
        self._work, self._buffer = None, None
        topo = groups.topology
        self.successor_remote = topo.host_of((groups.rank + 1) % topo.world_size) != groups.host

    def accumulate(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """Gradient rows of head ids (unique) from one lookup's backward."""
        self.grad.index_add_(0, ids, grads)
        self.touched[ids] = 1

    def outgoing(self) -> torch.Tensor:
        """This rank's gradient rows and touched flags since the last push, flat, to be summed
        over the world (by `launch`, or in a dense bucket that hands the sum to `landed`)."""
        buffer = torch.cat([self.grad.reshape(-1), self.touched])
        self.grad.zero_()
        self.touched.zero_()
        return buffer

    def launch(self) -> None:
        """Start summing this rank's gradient rows and flags over the world (a collective)."""
        self._buffer = self.outgoing()
        self._work = all_reduce_async(self._buffer, self.groups.world, self.stats, "allreduce",
                                      self.successor_remote)

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
        self._work = None
        buffer, self._buffer = self._buffer, None
        self.landed(buffer)

    def landed(self, buffer: torch.Tensor) -> None:
        """`outgoing()` summed over the world (this head's own tensor: kept, scaled in place)."""
        grads = buffer[:self.grad.numel()].view_as(self.grad).mul_(self.scale)
        flags = buffer[self.grad.numel():]
        if self.received is None:
            self.received, self.received_touched = grads, flags
        else:
            self.received += grads
            self.received_touched += flags

    def apply(self) -> None:
        """The optimizer step on the rows some rank touched: the same on every rank."""
        if self.received is None:
            rows = torch.empty(0, dtype=torch.long, device=self.weight.device)
            grads = self.weight.new_empty(0, self.weight.shape[1])
        else:
            rows = self.received_touched.nonzero().reshape(-1)
            grads = self.received[rows]
        self.received = self.received_touched = None
        self.optimizer.apply(rows, grads)

    def discard(self) -> None:
        self.grad.zero_()
        self.touched.zero_()
        self.received = self.received_touched = None

    def twin(self, table, local: torch.Tensor) -> torch.Tensor | None:
        """The head's counterpart of one of `table`'s shard tensors (its rows, or a row-wise
        optimizer state), to write over the head's rows of a gathered table."""
        if local is table.shard:
            return self.weight
        for key, value in table.optimizer.state_tensors().items():
            if local is value:
                return self.optimizer.state_tensors()[key]
        return None

    def load(self, step: int, full: dict[str, torch.Tensor], table_rows: int) -> None:
        """Row-wise optimizer state from whole tables (a checkpoint): the head's rows."""
        self.optimizer.load(step, take_rows(full, table_rows,
                                            lambda v: v.reshape(v.shape[0], -1)[:self.rows]))

    def nbytes(self) -> int:
        tensors = [self.weight, self.grad, *self.optimizer.state_tensors().values()]
        return sum(t.numel() * t.element_size() for t in tensors)
