"""The plan: plain data saying how every parameter is synchronised. Printable, serialisable.

Produced by the planner, executed by `sync.engine`, costed by the cost model. A table on the
parameter server is split into `partitions` row ranges (or hash classes), partition p is served
by rank p % world_size, and row r belongs to partition `partition_of(r)`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

Method = Literal["allreduce", "ps"]
RowMap = Literal["contiguous", "hashed"]


@dataclass(frozen=True)
class ParamPlan:
    name: str
    shape: tuple[int, ...]
    method: Method
    partitions: int = 1
    row_map: RowMap = "contiguous"
    reason: str = ""

    def __post_init__(self):
        if self.method == "ps" and not 1 <= self.partitions <= self.shape[0]:
            raise ValueError(f"{self.name}: partitions must be in 1..{self.shape[0]} (rows), "
                             f"got {self.partitions}")


@dataclass(frozen=True)
class Plan:
    params: tuple[ParamPlan, ...]
    world_size: int
    mode: Literal["hybrid", "allreduce", "ps"] = "hybrid"
    sparse_reduce: Literal["mean", "sum"] = "mean"
    local_aggregation: bool = True
    bucket_bytes: int = 25 * 2**20

    def by_name(self) -> dict[str, ParamPlan]:
        return {p.name: p for p in self.params}

    def of(self, method: Method) -> list[ParamPlan]:
        return [p for p in self.params if p.method == method]

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def table(self) -> list[tuple[str, str, str, str, str]]:
        """Rows for printing: name, shape, method, partitions, reason."""
        return [(p.name, "x".join(map(str, p.shape)), p.method,
                 str(p.partitions) if p.method == "ps" else "-", p.reason) for p in self.params]


# -- the row map: pure functions shared by the runtime and the cost model ---------------------

def partition_bounds(rows: int, partitions: int) -> list[tuple[int, int]]:
    """Contiguous map: partition p holds rows [start, end), sizes differing by at most one."""
    base, extra = divmod(rows, partitions)
    bounds, start = [], 0
    for p in range(partitions):
        end = start + base + (1 if p < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def partition_rows(rows: int, partitions: int, row_map: RowMap, p: int) -> range:
    if row_map == "hashed":
        return range(p, rows, partitions)
    start, end = partition_bounds(rows, partitions)[p]
    return range(start, end)


def server_of(partition: int, world_size: int) -> int:
    return partition % world_size


def partitions_of(rank: int, partitions: int, world_size: int) -> list[int]:
    return [p for p in range(partitions) if server_of(p, world_size) == rank]


def bucket_bytes(mb: float) -> int:
    """A bucket size in MB as whole bytes: at least one, and any size beyond every model's (even
    one whose bytes overflow a float) as one bucket for all."""
    return max(1, int(min(mb * 2**20, 2**62)))


def assign_buckets(nbytes_in_order: list[int], bucket_bytes: int) -> list[list[int]]:
    """Group parameters (indices into the list, in launch order) into all-reduce buckets: a
    bucket closes as soon as it holds at least `bucket_bytes`."""
    buckets, current, size = [], [], 0
    for i, n in enumerate(nbytes_in_order):
        current.append(i)
        size += n
        if size >= bucket_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets
