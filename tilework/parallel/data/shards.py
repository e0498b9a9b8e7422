"""What a ZeRO shard is (parallel/data/zero.py shards the parameters, zero3.py gathers them): this
rank's flat, zero-padded chunk of one parameter, an nn.Parameter that stands in for it in the
user's optimizer; the chunk arithmetic; which optimizers can run on chunks; and the stand-in a
stage 2/3 parameter's `.grad` becomes."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import PlanError

# Optimizers whose update of an element reads only that element's gradient and state.
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
               torch.optim.RMSprop, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
               torch.optim.Adadelta, torch.optim.ASGD, torch.optim.Rprop)


class ShardedGradient(torch.Tensor):
    """A stage 2/3 parameter's `.grad` after backward: a stand-in of the gradient's shape
    whose every use raises, naming the fix. With None there, torch's own
    `clip_grad_norm_(model.parameters(), c)` (nanoGPT's line) would silently clip nothing."""

    @staticmethod
    def __new__(cls, param: nn.Parameter, name: str, stage: int):
        stand_in = torch.Tensor._make_wrapper_subclass(cls, param.shape, dtype=param.dtype,
                                                       device=param.device)
        stand_in.param_name, stand_in.stage = name, stage
        return stand_in

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        stand_in = next(a for a in args if isinstance(a, ShardedGradient))
        raise PlanError(f"{stand_in.param_name}.grad: under zero={stand_in.stage} each rank "
                        "holds only its chunk of this gradient, on the optimizer's shard, so "
                        "torch's own clipping and reads of .grad cannot see it: use "
                        "tilework.clip_grad_norm_(model, max_norm) / clip_grad_value_, or zero=1, "
                        "which keeps DDP's .grad")

    def __repr__(self):
        return f"ShardedGradient({self.param_name}, zero={self.stage})"


def chunk_size(numel: int, n: int) -> int:
    return -(-numel // n)


def check_elementwise(optimizer, names: list[str]) -> None:
    """Refuses an optimizer that cannot run on chunks of the parameters `names`; with none
    sharded (zero=0) any optimizer runs on whole parameters (a user's own class, say)."""
    if names and optimizer is not None and not isinstance(optimizer, ELEMENTWISE):
        raise PlanError(f"ZeRO runs the optimizer on each rank's chunk of {names[0]}, which only "
                        f"optimizers that update element by element allow; "
                        f"{type(optimizer).__name__} is not one of them (use zero=0)")


class Sharded:
    """One parameter and this rank's chunk of it: `shard`, an nn.Parameter of `own` elements
    that the user's optimizer updates in the parameter's place.

    `counts` (ParamPlan.zero_chunks): the elements each rank owns, in rank order, where ranks
    hold different amounts (by their memory); () is the even cut, every chunk ceil(numel / n)
    with the last ones zero-padded. On the wire every rank's chunk is padded to `chunk`, the
    largest, so the collectives stay equal-sized (an uneven cut sends n x its largest chunk
    where the even one sends numel, rounded up)."""

    def __init__(self, name: str, param: nn.Parameter, stage: int, rank: int, n: int,
                 unit: str | None = None, place=lambda values: values,
                 counts: tuple[int, ...] = ()):
        self.name, self.param, self.stage, self.rank, self.n = name, param, stage, rank, n
        self.unit = unit   # stage 3: the module whose forward gathers it
        self.numel, self.shape = param.numel(), param.shape
        if counts and (len(counts) != n or sum(counts) != self.numel):
            raise PlanError(f"{name}: zero_chunks {list(counts)} must give each of {n} ranks "
                            f"a count, {self.numel} elements in all")
        self.counts = tuple(counts) if counts and len(set(counts)) > 1 else ()
        self.chunk = max(self.counts) if self.counts else chunk_size(self.numel, n)
        self.own = self.counts[rank] if self.counts else self.chunk   # this rank's elements
        self.start = sum(self.counts[:rank]) if self.counts else rank * self.chunk
        # `place`: the shard's home (parallel/data/offload.py): beside the parameter, or offloaded.
        self.shard = nn.Parameter(place(self.take(param.detach())),
                                  requires_grad=param.requires_grad)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's chunk (a copy; zero-padded under the even cut) of a tensor shaped like
        the parameter, on the shard's device once the shard exists."""
        if self.counts:   # straight from the flat values: no (n, chunk) copy on the way
            chunk = full.reshape(-1)[self.start:self.start + self.own].clone()
        else:
            chunk = self.rows(full)[self.rank].clone()
        home = self.__dict__.get("shard")
        return chunk if home is None else chunk.to(home.device)

    def mine(self, row: torch.Tensor) -> torch.Tensor:
        """This rank's elements of its (chunk-wide) row of a reduce-scattered bucket: a copy
        where it holds fewer, since a view would keep the whole padded row (the bucket's) alive
        as the shard's gradient."""
        return row if self.own == self.chunk else row[..., :self.own].clone()

    def values(self) -> torch.Tensor:
        """The shard's values where the parameter computes, padded to `chunk` for the
        all-gather (a copy up from offload: from pinned memory it queues on the stream without
        stopping the host, and the all-gather that reads it is queued behind it; the shard
        changes only at the next step)."""
        values = self.shard.detach().to(self.param.device, non_blocking=True)
        return padded(values, self.chunk)

    def rows_into(self, full: torch.Tensor, out: torch.Tensor) -> None:
        """`rows(full)` written into `out` ((n, chunk), a column slice of a bucket's buffer)
        with no copy of its own on the way."""
        if not self.counts:
            out.copy_(self.rows(full))
            return
        flat, start = full.reshape(-1), 0
        for j, count in enumerate(self.counts):
            out[j, :count].copy_(flat[start:start + count])
            out[j, count:].zero_()
            start += count

    def rows(self, full: torch.Tensor) -> torch.Tensor:
        """A parameter-shaped tensor as (n, chunk): row j is rank j's chunk (zero-padded); a
        view where the even cut needs no padding."""
        flat = full.reshape(-1)
        if self.counts:
            out = flat.new_empty(self.n, self.chunk)
            self.rows_into(full, out)
            return out
        pad = self.n * self.chunk - self.numel
        return (F.pad(flat, (0, pad)) if pad else flat).view(self.n, self.chunk)

    def write_whole(self, target: torch.Tensor, rows: torch.Tensor) -> None:
        """`target` (contiguous, the parameter's shape) = `whole(rows)`, copied straight from
        the (n, chunk) rows, which may be a column slice of a bucket's gathered buffer: no
        parameter-sized temporary (`whole` of such a slice would make one)."""
        flat = target.view(-1)
        if self.counts:
            start = 0
            for j, count in enumerate(self.counts):
                flat[start:start + count].copy_(rows[j, :count])
                start += count
            return
        full = (self.numel // self.chunk) * self.chunk
        if full:
            flat[:full].view(-1, self.chunk).copy_(rows[:full // self.chunk])
        if full < self.numel:
            flat[full:].copy_(rows[full // self.chunk, :self.numel - full])

    def whole(self, rows: torch.Tensor) -> torch.Tensor:
        """The inverse of `rows`: every rank's chunk, in rank order, back in the parameter's
        shape."""
        if self.counts:
            return torch.cat([rows[j, :count] for j, count in enumerate(self.counts)]
                             ).view(self.shape)
        return rows.reshape(-1)[:self.numel].view(self.shape)


def padded(flat: torch.Tensor, width: int) -> torch.Tensor:
    """A 1-D tensor zero-padded at its end to `width` (itself where it is that wide)."""
    return flat if flat.numel() == width else F.pad(flat, (0, width - flat.numel()))
