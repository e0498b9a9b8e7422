"""`tilework.ParallelConfig`: every knob of how a model is parallelized, in one typed place.

It is the job file's `[parallel]` table, the one configuration argument of `tilework.plan`,
`tilework.parallelize` and `tilework plan`'s report; `parallelize(mode="ps", ...)` keywords are
sugar that build one. Fields are checked when it is made (`__post_init__`), naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .config import check

Mode = Literal["hybrid", "allreduce", "ps"]
Method = Literal["allreduce", "ps"]


@dataclass(kw_only=True)
class ParallelConfig:
    mode: Mode = "hybrid"
    """hybrid: dense parameters all-reduced, sparse tables on the parameter server (chosen by
    cost where the tables' traffic is known); allreduce or ps: everything one way."""

    sparse_reduce: Literal["mean", "sum"] = "mean"
    """How server tables combine the ranks' gradient rows (mean: as DDP averages)."""

    local_aggregation: bool = True
    """Merge gradient rows inside a host before they cross hosts (Parallax's aggregation)."""

    bucket_mb: float = 25.0
    """All-reduce bucket size in MB (as DDP's bucket_cap_mb)."""

    check_inputs: bool = True
    """Every step, ranks agree on finite values and equal batch sizes before anything is
    applied (sync/checks.py); off for deliberately uneven batches."""

    overrides: dict[str, Method] | None = None
    """Force a method per parameter name, e.g. {"emb.weight": "allreduce"}."""

    partitions: int | dict[str, int] | None = None
    """Server partitions per table (one number for all, or by name); default one per rank, or
    the cost search's choice."""

    row_map: Literal["contiguous", "hashed"] = "contiguous"
    """Which rows a partition holds: contiguous ranges, or row % partitions."""

    density_threshold: float = 0.1
    """A dense-layout table whose measured touched-row fraction is below this goes to the
    servers (where no traffic model decides by cost)."""

    def __post_init__(self):
        check(self.mode in ("hybrid", "allreduce", "ps"), "mode",
              f"'hybrid', 'allreduce' or 'ps', got {self.mode!r}")
        check(self.sparse_reduce in ("mean", "sum"), "sparse_reduce",
              f"'mean' or 'sum', got {self.sparse_reduce!r}")
        check(self.row_map in ("contiguous", "hashed"), "row_map",
              f"'contiguous' or 'hashed', got {self.row_map!r}")
        check(isinstance(self.bucket_mb, (int, float)) and not isinstance(self.bucket_mb, bool)
              and 0 < self.bucket_mb < float("inf"), "bucket_mb",
              f"a positive size in MB, got {self.bucket_mb!r}")
        check(isinstance(self.density_threshold, (int, float))
              and 0 <= self.density_threshold <= 1, "density_threshold",
              f"a fraction from 0 to 1, got {self.density_threshold!r}")
        for name, method in (self.overrides or {}).items():
            check(method in ("allreduce", "ps"), f"overrides.{name}",
                  f"'allreduce' or 'ps', got {method!r}")
        parts = self.partitions
        values = parts.values() if isinstance(parts, dict) else [] if parts is None else [parts]
        for value in values:
            check(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                  "partitions", f"a positive number of partitions, got {value!r}")
