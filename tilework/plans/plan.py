"""The plan: plain data saying where every parameter lives and how it is synchronised, on a
named device mesh. Printable, serialisable (`as_dict` / `from_dict`), diffable (`diff`).

Produced by the planner, executed by the runtime, costed by the cost model. Each entry is
self-contained: its shape, dtype and kind give its bytes, its placement says where its values
and gradients go, and `predicted` what the cost model expects one step of it to send.

Along the data-parallel axis: "allreduce" (replicated, gradients all-reduced over the dp
group; or, with `zero` 1-3, its optimizer state, gradients and values split over the group)
and "ps" (rows on the parameter servers: the table is split into `partitions` row ranges or
hash classes, partition p is served by rank p % world_size, and row r belongs to partition
`partition_of(r)`; a table's first `hot_rows` rows, the head of a frequency-sorted id
distribution, may instead stay replicated with their gradient rows all-reduced), and
"allgather" (a table replicated, each rank's touched rows all-gathered as DDP gathers a sparse
gradient: parallel/rows/gather.py).

On a dp x pp x cp x tp mesh (`Plan.parallel`), each entry also says how tp splits it
(`tp_split`) and which pp ranks hold it (`pp_ranks`); `ParallelPlan` holds the layout, the
stages and the schedule, and `Plan.part(pp_rank)` is the data-parallel plan of one rank's part.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Literal, get_args

from ..cluster.mesh import Mesh
from ..config.parallel import (
    GradCompress,
    Method,
    Mode,
    Offload,
    ParallelConfig,
    RowMap,
    SparseReduce,
    ZeroScope,
)
from ..errors import PlanError

Kind = Literal["sparse", "embedding", "dense"]

_DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8,
                "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8,
                "complex128": 16, "float8_e4m3fn": 1, "float8_e5m2": 1}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype named as torch names it without the "torch." prefix."""
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r} (known: {', '.join(_DTYPE_BYTES)})")
    return _DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class Cost:
    """What the cost model expects: bytes one rank sends (the busiest where ranks differ) and
    seconds, for one step."""

    bytes_sent: float
    seconds: float


class TensorFacts:
    """Sizes from a `shape`, a `dtype` name and a `kind`: shared by the analysis of a model
    (analysis.ParamInfo) and the plan's entries."""

    shape: tuple[int, ...]
    dtype: str
    kind: Kind

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_bytes(self.dtype)

    @property
    def row_bytes(self) -> int:
        return self.nbytes // max(1, self.shape[0]) if self.shape else self.nbytes

    @property
    def is_table(self) -> bool:
        return self.kind in ("sparse", "embedding")


ZERO_PLACEMENTS = {1: "zero-1 (optimizer state sharded)",
                   2: "zero-2 (optimizer state, gradients sharded)",
                   3: "zero-3 (optimizer state, gradients, values sharded)"}


@dataclass(frozen=True)
class ParamPlan(TensorFacts):
    name: str
    shape: tuple[int, ...]
    method: Method
    partitions: int = 1
    row_map: RowMap = "contiguous"
    reason: str = ""
    dtype: str = "float32"
    kind: Kind = "dense"     # sparse gradient / embedding with a dense-layout gradient / dense
    predicted: Cost | None = None   # None: a table whose traffic nobody modelled
    hot_rows: int = 0   # ps tables: rows [0, hot_rows) replicated and all-reduced
    #                     (parallel/rows/hot.py)
    zero: int = 0   # allreduce parameters: ZeRO stage (1: optimizer state sharded, 2: and
    #                 gradients, 3: and values; parallel/data/zero.py)
    unit: str | None = None   # stage 3: the module whose forward gathers it ("": the model's)
    zero_scope: ZeroScope = "world"   # shards over all ranks, or each host's
    # On a mesh (Plan.parallel): how the tp axis splits it (parallel/tensor/shards.py's spec as
    # text: "0", "1", "fused:3", "qkv"; "" replicated; `shape` is then one tp rank's), and the pp
    # ranks whose stages hold it (() without pipeline stages: every rank).
    tp_split: str = ""
    pp_ranks: tuple[int, ...] = ()
    # ps tables: the rank serving each partition, where ranks serve unevenly (by their memory:
    # planner/shares.server_map); () is partition p on rank p % world size.
    servers: tuple[int, ...] = ()
    # ps tables: the dtype its gradient rows cross in on the push ("": its own; "bfloat16"
    # under ParallelConfig.push_compress, parallel/rows/push.py).
    push_dtype: str = ""
    # ZeRO (zero_scope "world"): the elements each rank's chunk holds, in rank order, where
    # ranks hold different amounts (by their memory: planner/shares.zero_chunks); () is the
    # even cut, ceil(numel / n) each. On the wire every chunk is padded to the largest.
    zero_chunks: tuple[int, ...] = ()

    @property
    def push_row_bytes(self) -> int:
        """A gradient row as the servers' push sends it (`push_dtype`)."""
        return self.row_bytes if not self.push_dtype else \
            self.row_bytes // dtype_bytes(self.dtype) * dtype_bytes(self.push_dtype)

    def __post_init__(self):
        object.__setattr__(self, "servers", tuple(int(r) for r in self.servers))
        object.__setattr__(self, "zero_chunks", tuple(int(c) for c in self.zero_chunks))
        if self.zero_chunks and (not self.zero or self.zero_scope != "world"
                                 or sum(self.zero_chunks) != self.numel
                                 or min(self.zero_chunks) < 0):
            raise ValueError(f"{self.name}: zero_chunks gives each rank's share of a ZeRO "
                             f"parameter's {self.numel} elements (zero_scope 'world'), got "
                             f"{list(self.zero_chunks)} (zero={self.zero}, "
                             f"scope {self.zero_scope!r})")
        dtype_bytes(self.dtype)
        if self.push_dtype and (self.push_dtype != "bfloat16"
                                or self.method != "ps" or not self.is_table):
            raise ValueError(f"{self.name}: push_dtype is a server table's push width, "
                             f"'bfloat16' (or '' as it is), got {self.push_dtype!r}")
        if self.servers and (self.method != "ps" or len(self.servers) != self.partitions
                             or min(self.servers) < 0):
            raise ValueError(f"{self.name}: servers names the rank of each partition of a "
                             f"server table ({self.partitions} partitions), got "
                             f"{list(self.servers)} ({self.method})")
        if self.method == "ps" and not 1 <= self.partitions <= self.shape[0]:
            raise ValueError(f"{self.name}: partitions must be in 1..{self.shape[0]} (rows), "
                             f"got {self.partitions}")
        if self.hot_rows and (self.method != "ps" or not self.is_table
                              or not 0 <= self.hot_rows < self.shape[0]):
            raise ValueError(f"{self.name}: hot_rows must be in 0..{self.shape[0] - 1} and only "
                             f"on a server table, got {self.hot_rows} ({self.method})")
        if self.zero not in (0, 1, 2, 3) or (self.zero and self.method != "allreduce"):
            raise ValueError(f"{self.name}: zero must be 0..3, and only on an allreduce "
                             f"parameter, got {self.zero!r} ({self.method})")
        if (self.unit is not None) != (self.zero == 3):
            raise ValueError(f"{self.name}: a ZeRO-3 parameter names its unit (the module "
                             f"that gathers it), no other does: zero={self.zero}, "
                             f"unit={self.unit!r}")

    @property
    def placement(self) -> str:
        """Where it lives along the data-parallel axis (the tp and pp axes: `tp_split`,
        `pp_ranks`)."""
        if self.method == "allreduce":
            where = " in each host" if self.zero_scope == "host" else \
                ", uneven chunks" if self.zero_chunks else ""
            if self.zero == 3:
                return f"{ZERO_PLACEMENTS[3]}{where}, gathered by {self.unit or 'the model'}"
            return "allreduce (replicated)" if not self.zero else ZERO_PLACEMENTS[self.zero] + where
        if self.method == "allgather":
            return "allgather (replicated, touched rows all-gathered)"
        hot = f"; rows 0..{self.hot_rows - 1} replicated, all-reduced" if self.hot_rows else ""
        uneven = ", served unevenly" if self.servers else ""
        return f"ps (rows in {self.partitions} {self.row_map} partitions{uneven}{hot})"


@dataclass(frozen=True)
class ParallelPlan:
    """The model-parallel axes of a plan on a dp x pp x cp x tp mesh (`Plan.mesh`): what the
    runtime applies before the data-parallel part, in that order (tp, cp, pp, dp)."""

    # tp: each split module's style, by its full name (parallel/tensor/layout.py's styles)
    layout: tuple[tuple[str, str], ...] = ()
    sequence_parallel: bool = False
    # pp: the stack of blocks cut, each stage's blocks [start, stop), and the schedule
    stack: str = ""
    stages: tuple[tuple[int, int], ...] = ()
    schedule: str = ""
    microbatches: int = 0
    stages_per_rank: int = 1
    # dp: one data-parallel group's ranks as hosts see them (dp x cp under context parallelism)
    dp_mesh: Mesh | None = None

    def __post_init__(self):
        # As tuples whatever came in (JSON gives lists), so equal plans compare equal.
        object.__setattr__(self, "layout", tuple((str(m), str(s)) for m, s in self.layout))
        object.__setattr__(self, "stages", tuple((int(a), int(b)) for a, b in self.stages))

    def as_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "dp_mesh"}
        out["layout"] = [list(pair) for pair in self.layout]
        out["stages"] = [list(pair) for pair in self.stages]
        out["dp_mesh"] = None if self.dp_mesh is None else self.dp_mesh.as_dict()
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "ParallelPlan":
        mesh = d.get("dp_mesh")
        return cls(**(d | {"dp_mesh": None if mesh is None else Mesh.from_dict(mesh)}))


@dataclass(frozen=True)
class OuterSync:
    """Local SGD (DiLoCo): the dense parameters are averaged every `every` steps, as an outer
    step of `optimizer` ("nesterov" | "sgd") with `lr` and `momentum` on the averaged
    pseudo-gradient (parallel/data/outer.py). A `worker` (one replica) is a rank or a host
    (its ranks synchronous); the pseudo-gradients cross in `compress` (comm/codec.py)."""

    every: int
    optimizer: str = "nesterov"
    lr: float = 0.7
    momentum: float = 0.9
    worker: str = "rank"
    compress: str = "none"
    fragments: int = 1
    delay: int = 0
    mix: float = 0.5
    # "streaming": `fragments` runs landing at (f+1) H / F, `delay` steps after their launch,
    # mixed by `mix`; "layerwise" (DreamDDP): groups of about equal bytes, each launched after
    # its own inner step and landing after the next, on top of what that step learnt
    # (`outer_groups`, `sync_slots`).
    schedule: str = "streaming"

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class Plan:
    params: tuple[ParamPlan, ...]
    world_size: int
    mode: Mode = "hybrid"
    sparse_reduce: SparseReduce = "mean"
    local_aggregation: bool = True
    bucket_bytes: int = 25 * 2**20
    mesh: Mesh | None = None   # default: one "world" axis
    # Activation recompute: (module name, "full" | "selective"), applied by runtime/recompute.py.
    recompute: tuple[tuple[str, str], ...] = ()
    offload: Offload = "none"   # ZeRO's shards
    #                                                         (parallel/data/offload.py)
    offload_dir: str | None = None
    # tp, pp and cp: None for a data-parallel run (mesh: host x local); on a mesh (dp, pp, cp,
    # tp) the model-parallel axes, and `params` every parameter as one rank holds it.
    parallel: ParallelPlan | None = None
    # Samples of each global batch per data-parallel rank (None: even); gradients weighted by
    # them (planner/shares.py, runtime/shares.py).
    batch_shares: tuple[int, ...] | None = None
    # Local SGD: the dense parameters synchronised every few steps (None: every step).
    outer: OuterSync | None = None
    # The dense buckets on the wire: "none", "bf16" / "fp16" as DDP's compress hooks,
    # "powersgd" as its PowerSGD hook, at rank `powersgd_rank` after `powersgd_start` steps
    # (parallel/data/powersgd.py), or "topk", each rank's `topk_ratio` largest values
    # (parallel/data/topk.py).
    grad_compress: str = "none"
    # The servers' push as planned (ParallelConfig.push_compress; each table's width is its
    # entry's push_dtype).
    push_compress: str = "none"
    powersgd_rank: int = 1
    powersgd_start: int = 1000
    topk_ratio: float = 0.01
    # ZeRO's chunks by weight (ParallelConfig.zero_weights), as given: each entry's
    # `zero_chunks` are cut from them, and `config_of` gives them back.
    zero_weights: tuple[float, ...] | None = None

    def __post_init__(self):
        if isinstance(self.outer, dict):   # from JSON
            object.__setattr__(self, "outer", OuterSync(**self.outer))
        if self.mesh is None:
            object.__setattr__(self, "mesh", Mesh((("world", self.world_size),)))
        if self.zero_weights is not None:
            object.__setattr__(self, "zero_weights", tuple(float(w) for w in self.zero_weights))
        # A plan.json edited by hand: refused here, not at the runtime. On a mesh the chunks
        # are a dp group's (its ranks: dp x cp).
        sharing = self.world_size if self.parallel is None or self.parallel.dp_mesh is None \
            else self.parallel.dp_mesh.size
        for p in self.params:
            if p.zero_chunks and len(p.zero_chunks) != sharing:
                raise PlanError(f"{p.name}: zero_chunks gives {len(p.zero_chunks)} ranks' "
                                f"shares, the plan's ZeRO group has {sharing} ranks")
        if self.batch_shares is not None:
            object.__setattr__(self, "batch_shares", tuple(int(n) for n in self.batch_shares))
            if len(self.batch_shares) != self.replicas:
                each = "data-parallel replica" if self.parallel is not None else "rank"
                raise PlanError(f"batch_shares: one per {each} ({self.replicas}), got "
                                f"{len(self.batch_shares)}: {list(self.batch_shares)}")
        # As tuples whatever came in (JSON gives lists), so equal plans compare equal.
        object.__setattr__(self, "recompute", tuple((str(m), p) for m, p in self.recompute))
        for module, policy in self.recompute:
            if policy not in ("full", "selective"):
                raise ValueError(f"recompute of {module}: 'full' or 'selective', got {policy!r}")
        if self.mesh.size != self.world_size:
            raise ValueError(f"mesh {self.mesh} has {self.mesh.size} ranks, the plan "
                             f"{self.world_size}")
        # A plan read from plan.json is not a checked ParallelConfig: a rank of 0 would zero
        # every factored gradient, silently.
        kinds = [k for k in get_args(GradCompress) if k != "auto"]   # the config's, decided
        if self.grad_compress not in kinds:
            raise ValueError(f"grad_compress: one of {kinds}, got {self.grad_compress!r}")
        if type(self.powersgd_rank) is not int or self.powersgd_rank < 1 \
                or type(self.powersgd_start) is not int or self.powersgd_start < 0:
            raise ValueError(f"powersgd_rank (a whole number, 1 or more) and powersgd_start (0 "
                             f"or more): got {self.powersgd_rank!r}, {self.powersgd_start!r}")
        if isinstance(self.topk_ratio, bool) or not isinstance(self.topk_ratio, (int, float)) \
                or not 0 < self.topk_ratio <= 1:
            raise ValueError(f"topk_ratio: a share above 0 and at most 1, got "
                             f"{self.topk_ratio!r}")

    def part(self, pp_rank: int = 0) -> "Plan":
        """The data-parallel plan of the part a rank at pipeline coordinate `pp_rank` holds,
        over its dp group: what its engine runs. A data-parallel plan is its own part."""
        if self.parallel is None:
            return self
        if not 0 <= pp_rank < self.mesh.size_of("pp"):
            raise ValueError(f"pp_rank: expected 0..{self.mesh.size_of('pp') - 1}, got {pp_rank}")
        params = tuple(p for p in self.params if not p.pp_ranks or pp_rank in p.pp_ranks)
        held = [p.name for p in params]
        recompute = tuple((m, policy) for m, policy in self.recompute
                          if any(n.startswith(m + ".") for n in held))
        dp_mesh = self.parallel.dp_mesh
        # The dp group's ranks (dp x cp under context parallelism, dp-major): each takes its
        # replica's share.
        cp = self.mesh.size_of("cp")
        shares = None if self.batch_shares is None else \
            tuple(n for n in self.batch_shares for _ in range(cp))
        weights = None if self.zero_weights is None else \
            tuple(w for w in self.zero_weights for _ in range(cp))
        return dataclasses.replace(self, params=params, world_size=dp_mesh.size, mesh=dp_mesh,
                                   recompute=recompute, parallel=None, batch_shares=shares,
                                   zero_weights=weights)

    @property
    def replicas(self) -> int:
        """Data-parallel replicas: the ranks of a data-parallel plan, the dp axis of a mesh."""
        return self.mesh.size_of("dp") if self.parallel is not None else self.world_size

    def rank_shares(self) -> tuple[int, ...] | None:
        """Each rank's samples of the global batch (its replica's share on a mesh), or None
        where every rank takes the same."""
        if self.batch_shares is None:
            return None
        if self.parallel is None:
            return self.batch_shares
        return tuple(self.batch_shares[self.mesh.coords(r)["dp"]]
                     for r in range(self.world_size))

    def by_name(self) -> dict[str, ParamPlan]:
        return {p.name: p for p in self.params}

    def of(self, method: Method) -> list[ParamPlan]:
        return [p for p in self.params if p.method == method]

    def as_dict(self) -> dict:
        """Plain JSON-able data; `from_dict` reads it back to an equal plan."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in
               ("params", "mesh", "parallel")}
        out["mesh"] = self.mesh.as_dict()
        out["parallel"] = None if self.parallel is None else self.parallel.as_dict()
        out["recompute"] = [list(pair) for pair in self.recompute]
        out["batch_shares"] = None if self.batch_shares is None else list(self.batch_shares)
        out["zero_weights"] = None if self.zero_weights is None else list(self.zero_weights)
        out["outer"] = None if self.outer is None else self.outer.as_dict()
        out["params"] = [_entry_dict(p) for p in self.params]
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        params = tuple(_entry_from_dict(p) for p in d["params"])
        rest = {k: v for k, v in d.items() if k not in ("params", "mesh", "parallel")}
        parallel = d.get("parallel")
        return cls(params=params, mesh=Mesh.from_dict(d["mesh"]), **rest,
                   parallel=None if parallel is None else ParallelPlan.from_dict(parallel))

    def diff(self, other: "Plan") -> list[str]:
        """One line per difference, this plan's value first: settings, then entries by name."""
        lines = [f"{k}: {a!r} -> {b!r}" for k, a, b in _pairs(self, other,
                                                             ("params", "recompute", "parallel"))]
        if (self.parallel is None) != (other.parallel is None):
            lines.append(f"parallel: {'tp/pp/cp' if self.parallel else 'none'} -> "
                         f"{'tp/pp/cp' if other.parallel else 'none'}")
        elif self.parallel is not None:
            lines += [f"parallel.{k}: {a!r} -> {b!r}"
                      for k, a, b in _pairs(self.parallel, other.parallel, ())]
        ours, others = dict(self.recompute), dict(other.recompute)
        lines += [f"recompute.{m}: {ours.get(m, 'none')!r} -> {others.get(m, 'none')!r}"
                  for m in sorted(ours.keys() | others.keys()) if ours.get(m) != others.get(m)]
        mine, theirs = self.by_name(), other.by_name()
        for name in sorted(mine.keys() | theirs.keys()):
            if name not in theirs or name not in mine:
                lines.append(f"{name}: "
                             f"{'only in this plan' if name in mine else 'only in the other'}")
                continue
            lines += [f"{name}.{k}: {a!r} -> {b!r}"
                      for k, a, b in _pairs(mine[name], theirs[name], ("name", "reason"))]
        return lines

    def recompute_line(self) -> str:
        """One short line for the printed plan: which modules recompute, by policy."""
        if not self.recompute:
            return "recompute: none"
        by_policy: dict[str, list[str]] = {}
        for module, policy in self.recompute:
            by_policy.setdefault(policy, []).append(module)
        return "recompute: " + "; ".join(f"{policy} on {', '.join(names)}"
                                         for policy, names in by_policy.items())

    def table(self) -> list[tuple[str, ...]]:
        """Rows for printing: name, shape, dtype, placement, predicted bytes and ms, reason."""
        def cost(p):
            if p.predicted is None:
                return ("?", "?")
            return (f"{p.predicted.bytes_sent / 2**20:.3g} MiB",
                    f"{p.predicted.seconds * 1e3:.3g}")

        if self.parallel is None:
            return [(p.name, "x".join(map(str, p.shape)), p.dtype, p.placement, *cost(p),
                     p.reason) for p in self.params]
        return [(p.name, "x".join(map(str, p.shape)), p.dtype, _tp_cell(p.tp_split),
                 ",".join(map(str, p.pp_ranks)) or "all", p.placement, *cost(p), p.reason)
                for p in self.params]

    def columns(self) -> tuple[str, ...]:
        """The headers of `table()`'s rows, the name first."""
        mesh = ("tp", "pp ranks") if self.parallel is not None else ()
        return ("name", "shape", "dtype", *mesh, "placement", "sends/step", "ms/step", "why")


def _tp_cell(split: str) -> str:
    """A tp split (tensor/shards.py's spec) as the table shows it."""
    if not split:
        return "replicated"
    if split.isdigit():
        return f"dim {split} split"
    if split == "qkv":
        return "q, k, v by heads"
    if split.startswith("fused:"):
        return f"{split.partition(':')[2]} parts, each split"
    return split


def _pairs(a, b, skip):
    return [(f.name, getattr(a, f.name), getattr(b, f.name)) for f in fields(a)
            if f.name not in skip and getattr(a, f.name) != getattr(b, f.name)]


def _entry_dict(p: ParamPlan) -> dict:
    d = {f.name: getattr(p, f.name) for f in fields(p)}
    d["shape"] = list(p.shape)
    d["pp_ranks"] = list(p.pp_ranks)
    d["servers"] = list(p.servers)
    d["zero_chunks"] = list(p.zero_chunks)
    d["predicted"] = None if p.predicted is None else vars(p.predicted).copy()
    d["placement"] = p.placement   # for readers; derived, so from_dict drops it
    return d


def _entry_from_dict(d: dict) -> ParamPlan:
    d = {k: v for k, v in d.items() if k != "placement"}
    predicted = None if d.get("predicted") is None else Cost(**d["predicted"])
    return ParamPlan(**(d | {"shape": tuple(d["shape"]), "predicted": predicted,
                             "pp_ranks": tuple(d.get("pp_ranks", ()))}))


# A parameter's reason where `overrides` placed it: the user's, or a search's candidate
# (planner/search.with_table_methods), which `config_of` reads back as overrides.
OVERRIDDEN = "set in overrides"


def config_of(plan: Plan) -> ParallelConfig:
    """The configuration `plan` runs under, as far as the plan says it: the mesh's sizes, the
    layout and the schedule, ZeRO, recompute and the data-parallel settings (what the
    estimates that take a configuration read; a data-parallel plan's sizes are 1)."""
    par = plan.parallel or ParallelPlan()
    sizes = {a: plan.mesh.size_of(a) if plan.parallel is not None else 1
             for a in ("tp", "pp", "cp")}
    zeros = [p for p in plan.params if p.zero]
    return ParallelConfig(
        mode=plan.mode, sparse_reduce=plan.sparse_reduce,
        local_aggregation=plan.local_aggregation, bucket_mb=plan.bucket_bytes / 2**20,
        overrides={p.name: p.method for p in plan.params if p.reason == OVERRIDDEN}
        or None,
        zero=max((p.zero for p in zeros), default=0),
        # A plan whose ZeRO shards nothing (every parameter on the servers) offloads nothing.
        zero_scope=zeros[0].zero_scope if zeros else "world",
        zero_weights=list(plan.zero_weights) if plan.zero_weights and zeros else None,
        offload=plan.offload if zeros else "none",
        offload_dir=plan.offload_dir, recompute=dict(plan.recompute) or "none", **sizes,
        layout=dict(par.layout) or None, sequence_parallel=par.sequence_parallel,
        schedule=par.schedule or "1f1b", microbatches=par.microbatches or None,
        stages_per_rank=par.stages_per_rank if par.schedule == "interleaved" else 2,
        batch_shares=list(plan.batch_shares) if plan.batch_shares else None,
        grad_compress=plan.grad_compress, powersgd_rank=plan.powersgd_rank,
        powersgd_start=plan.powersgd_start, topk_ratio=plan.topk_ratio,
        push_compress=plan.push_compress,
        **({} if plan.outer is None else {
            "sync": "diloco", "sync_every": plan.outer.every,
            "outer_optimizer": plan.outer.optimizer, "outer_lr": plan.outer.lr,
            "outer_momentum": plan.outer.momentum, "outer_worker": plan.outer.worker,
            "outer_compress": plan.outer.compress, "outer_fragments": plan.outer.fragments,
            "outer_delay": plan.outer.delay, "outer_mix": plan.outer.mix,
            "outer_schedule": plan.outer.schedule}))


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


def server_of(partition: int, world_size: int, servers: tuple[int, ...] = ()) -> int:
    """The rank serving `partition`: the plan's map where it has one, else round robin."""
    return servers[partition] if servers else partition % world_size


def partitions_of(rank: int, partitions: int, world_size: int,
                  servers: tuple[int, ...] = ()) -> list[int]:
    return [p for p in range(partitions) if server_of(p, world_size, servers) == rank]


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


def outer_groups(nbytes_in_order: list[int], outer: OuterSync) -> list[list[int]]:
    """The parameters (indices, registration order) each sync of a local-SGD period sends:
    Streaming DiLoCo's `fragments` runs, or, under the "layerwise" schedule, `layerwise_groups`
    over the period's steps."""
    if outer.schedule == "layerwise":
        return layerwise_groups(nbytes_in_order, outer.every)
    return fragments_of(nbytes_in_order, outer.fragments)


def outer_buckets(nbytes_in_order: list[int], outer: OuterSync,
                  bucket_bytes: int) -> list[list[list[int]]]:
    """Each sync of a local-SGD period (`outer_groups`) cut into buckets as LocalSGD sends
    them: its members in reverse registration order, bucketed by `assign_buckets`; indices
    into `nbytes_in_order`. One cut for the runtime, the wire's replay and the memory walk."""
    out = []
    for members in outer_groups(nbytes_in_order, outer):
        order = list(reversed(members))
        out.append([[order[i] for i in bucket] for bucket in
                    assign_buckets([nbytes_in_order[j] for j in order], bucket_bytes)])
    return out


def layerwise_groups(nbytes_in_order: list[int], every: int) -> list[list[int]]:
    """DreamDDP's partial synchronisation: the parameters in min(every - 1, count) groups of
    about equal bytes (the largest first, each to the group with the fewest bytes so far,
    ties to the first), members in registration order. Each group's exchange runs beside one
    inner step (`sync_slots`), so the step it can hide under is the same for every group and
    balancing the bytes is the schedule."""
    count = min(every - 1, len(nbytes_in_order))
    groups: list[list[int]] = [[] for _ in range(count)]
    load = [0] * count
    for i in sorted(range(len(nbytes_in_order)), key=lambda i: (-nbytes_in_order[i], i)):
        g = min(range(count), key=lambda k: (load[k], k))
        groups[g].append(i)
        load[g] += nbytes_in_order[i]
    return [sorted(g) for g in groups]


def sync_slots(outer: OuterSync, groups: int) -> list[tuple[int, int]]:
    """(launch, landing) inner step of each of `groups` syncs in a period of `outer.every`
    (steps counted from 1; launched after that step's update, landed after the other's).
    Streaming: fragment f lands at (f+1) H / F, launched `delay` steps before. Layerwise:
    group g launched after step 1 + g (H-1) / G and landed after the next, so every group lands
    within the period and nothing is in flight at its end."""
    if outer.schedule == "layerwise":
        return [(1 + g * (outer.every - 1) // groups, 2 + g * (outer.every - 1) // groups)
                for g in range(groups)]
    return [((f + 1) * outer.every // groups - outer.delay, (f + 1) * outer.every // groups)
            for f in range(groups)]


def fragments_of(nbytes_in_order: list[int], count: int) -> list[list[int]]:
    """Cut parameters (indices, registration order) into `count` runs of about equal bytes,
    each non-empty (local SGD's streaming fragments): a run ends once the bytes so far reach
    its share of the total, or when the rest are needed one each."""
    total, runs, current, size = sum(nbytes_in_order), [], [], 0
    for i, n in enumerate(nbytes_in_order):
        current.append(i)
        size += n
        left, wanted = len(nbytes_in_order) - i - 1, count - len(runs) - 1
        if wanted and (size * count >= total * (len(runs) + 1) or left == wanted):
            runs.append(current)
            current = []
    runs.append(current)
    return runs
