"""`tilework.ParallelConfig`: every knob of how a model is parallelized, in one typed place.

It is the job file's `[parallel]` table, the one configuration argument of `tilework.plan`,
`tilework.parallelize` and `tilework plan`'s report; `parallelize(mode="ps", ...)` keywords are
sugar that build one. Fields are checked when it is made (`__post_init__`), naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .files import check

# The vocabulary of a configuration and of the plan made from it, declared once (the plan's
# types in plans/plan.py and the planner read these).
Mode = Literal["hybrid", "allreduce", "ps"]
Method = Literal["allreduce", "ps", "allgather"]
RowMap = Literal["contiguous", "hashed"]
RowMapChoice = Literal["auto", "contiguous", "hashed"]   # "auto": the planner chooses per table
SparseReduce = Literal["mean", "sum"]
ZeroScope = Literal["world", "host"]
Offload = Literal["none", "optimizer", "all"]
RecomputePolicy = Literal["full", "selective"]
Recompute = Literal["none", "full", "selective"]
ScheduleName = Literal["1f1b", "gpipe", "interleaved"]
# sync="auto" with sync_every left at 1: the period its local-SGD candidates run at (DiLoCo's
# H as measured here: docs/slow-links.md).
AUTO_SYNC_EVERY = 40
OuterSchedule = Literal["streaming", "layerwise"]
PlanChoice = Literal["config", "auto"]
Auto = Literal["auto"]
Sync = Literal["every_step", "diloco", "auto"]
OuterOptimizer = Literal["nesterov", "sgd"]
OuterWorker = Literal["rank", "host"]
OuterCompress = Literal["none", "bf16", "int8", "int4"]
PushCompress = Literal["none", "bf16", "auto"]
GradCompress = Literal["none", "bf16", "fp16", "powersgd", "topk", "auto"]


@dataclass(kw_only=True)
class ParallelConfig:
    mode: Mode = "hybrid"
    """hybrid: dense parameters all-reduced, sparse tables on the parameter server (chosen by
    cost where the tables' traffic is known); allreduce or ps: everything one way."""

    sparse_reduce: SparseReduce = "mean"
    """How server tables combine the ranks' gradient rows (mean: as DDP averages)."""

    local_aggregation: bool = True
    """Merge gradient rows inside a host before they cross hosts (Parallax's aggregation)."""

    bucket_mb: float = 25.0
    """All-reduce bucket size in MB (as DDP's bucket_cap_mb)."""

    check_inputs: bool = True
    """Every step, ranks agree on finite values and equal batch sizes before anything is
    applied (parallel/data/checks.py); off for deliberately uneven batches."""

    overrides: dict[str, Method] | None = None
    """Force a method per parameter name, e.g. {"emb.weight": "allreduce"}."""

    partitions: int | dict[str, int] | None = None
    """Server partitions per table (one number for all, or by name); default one per rank, or
    the cost search's choice."""

    row_map: RowMapChoice = "auto"
    """Which rows a partition holds: contiguous ranges, or row % partitions ("hashed"). "auto":
    the planner chooses per table by the busiest server's load where the traffic is modelled,
    else hashed, since contiguous ranges of a frequency-sorted vocabulary put the popular rows
    on one server (docs/planner.md)."""

    zero: int = 0
    """ZeRO stage for the dense all-reduced parameters (server tables stay on the servers):
    0 replicated, 1 optimizer state sharded, 2 also gradients, 3 also the values
    (parallel/data/zero.py)."""

    zero_scope: ZeroScope = "world"
    """Over which ranks ZeRO shards: all of them, or each host's (sharded inside a host,
    replicated across hosts, as FSDP2's HSDP: the gathers stay on the fast links and only a
    chunk's all-reduce crosses hosts)."""

    offload: Offload = "none"
    """Where ZeRO's shards and optimizer state live (parallel/data/offload.py), with zero >= 1:
    "optimizer" moves the optimizer state off the compute device (on a GPU to pinned host
    memory, the step running on the CPU; on a CPU host to memory-mapped files in
    `offload_dir`), "all" the shards of the values too."""

    offload_dir: str | None = None
    """Where a CPU host's offloaded state is mapped (default: the temporary directory);
    the files are unlinked once mapped."""

    density_threshold: float = 0.1
    """A dense-layout table whose measured touched-row fraction is below this goes to the
    servers (where no traffic model decides by cost)."""

    recompute: Recompute | dict[str, RecomputePolicy] = "none"
    """Activation recompute: "full" keeps only a block's inputs and recomputes the rest in
    backward, "selective" keeps the matmul-family outputs and recomputes the cheap ops; given
    as one policy for the model's repeated blocks (`analysis.recompute_units`), or per module
    as {glob pattern over module names: policy}, e.g. {"blocks.layers.*": "selective"}."""

    tp: int | Auto = 1
    """Tensor-parallel ranks per model replica (Megatron's t): the layers `layout` names are
    split over them (tilework/parallel/tensor/); kept inside a host. "auto": the planner's
    choice (with plan="auto"; the loop must then shard the data by
    tilework.data_parallel_rank(model), as every rank of a replica takes one batch)."""

    pp: int | Auto = 1
    """Pipeline stages' ranks (Megatron's p): the model's blocks cut into balanced stages; the
    runtime then owns the step, `model.step(inputs, targets)` (tilework/parallel/pipeline/).
    "auto": the planner's choice (with plan="auto"), so the loop must call model.step."""

    cp: int | Auto = 1
    """Context-parallel ranks: the sequence split over them, attention as a ring. "auto": the
    planner's choice (with plan="auto"; the data sharded by replica, as for tp)."""

    plan: PlanChoice = "config"
    """"config": this configuration is the plan's. "auto": the planner chooses, by predicted
    step within 80% of each rank's memory (planner/search.py, docs/planner.md), the ZeRO stage
    and scope, recompute, and each table's placement; and tp, cp or pp where they are "auto".
    The user's loop stays as it is: the mesh axes only where asked for."""

    auto_axes: list[str] | None = None
    """The mesh axes plan="auto" may choose (set from tp/cp/pp = "auto")."""

    microbatches: int | None = None
    """Microbatches per pipeline step (default: 2 x pp); the batch must split into them."""

    schedule: ScheduleName = "1f1b"
    """The pipeline schedule: "gpipe", "1f1b" (PipeDream-Flush) or "interleaved" (1F1B with
    `stages_per_rank` model chunks per rank)."""

    stages_per_rank: int = 2
    """Model chunks per pipeline rank under the interleaved schedule (Megatron's v)."""

    layout: dict[str, str] | None = None
    """Which module is split how under tp > 1, {module-name pattern: style}
    (docs/tensor-parallel.md); default: `tilework.parallel.tensor.layout_for(model)`."""

    sequence_parallel: bool = False
    """Under tp > 1, also split the sequence between the split layers (norms, dropout):
    all-gather / reduce-scatter in place of all-reduce, activations tp times smaller."""

    batch_shares: list[int] | Auto | None = None
    """Samples of each global batch per data-parallel rank, in rank order (on a tp or cp
    mesh: per data-parallel replica, in dp order, each replica's ranks feeding its count), for
    ranks that differ in speed or memory (planner/shares.batch_shares computes them;
    docs/heterogeneous.md): each rank's gradient is weighted by its share, so the update is
    one process's on the global batch; each rank must feed its own count
    (tilework.data.ShardedBatches(shares=...) hands them out; the input checks say which rank
    did not). None: every rank the same.
    "auto" (with plan="auto"): the planner may choose them where the cluster's hosts differ,
    so the loop must read this rank's count from tilework.batch_shares(model)."""

    sync: Sync = "every_step"
    """How the dense (all-reduced) parameters are synchronised: "every_step", DDP's gradient
    average; "diloco", local SGD as DiLoCo does it (docs/slow-links.md): each rank takes
    `sync_every` steps of the user's optimizer on its own batches, then the ranks average their
    pseudo-gradients (the parameters at the last sync minus their own) and the outer optimizer
    steps from the last sync's parameters; every rank then starts from the result. Server
    tables stay synchronous. For slow links: a sync every H steps sends 1/H of the bytes.
    "auto" (with plan="auto"): the search prices both, local SGD with these outer_* settings
    (sync_every 1 meaning 40), and takes local SGD only where its predicted step is under
    half the synchronous one (planner/search.LOCAL_SGD_STEPS: it needs about twice the steps
    to a loss)."""

    sync_every: int = 1
    """Inner steps between syncs under sync="diloco" (DiLoCo's H)."""

    outer_optimizer: OuterOptimizer = "nesterov"
    """The outer optimizer under sync="diloco": SGD with Nesterov momentum (DiLoCo's), or plain
    SGD with momentum."""

    outer_lr: float = 0.7
    """The outer optimizer's learning rate (DiLoCo: 0.7; 1 with momentum 0 and sync_every=1
    is synchronous training with SGD inside)."""

    outer_momentum: float = 0.9
    """The outer optimizer's momentum (DiLoCo: 0.9)."""

    outer_worker: OuterWorker = "rank"
    """What one local-SGD replica is under sync="diloco": each "rank", or each "host", whose
    ranks average their gradients every step over the host's own link (as DDP) so that only
    the outer sync crosses hosts (the usual deployment: fast inside a machine, slow between)."""

    outer_compress: OuterCompress = "none"
    """The pseudo-gradients' width on the wire under sync="diloco": "none" (as they are),
    "bf16", "int8" or "int4" (one float32 scale per 64 values), with error feedback: what an
    encoding loses is added to the next sync's (docs/slow-links.md)."""

    grad_compress: GradCompress = "none"
    """The dense gradients on the wire under every-step sync: "none"; "bf16" / "fp16", as
    DDP's bf16_compress_hook and fp16_compress_hook send them (each bucket cast, divided by the
    ranks, summed in that width, cast back): half the bytes, and the rounding of that width;
    "powersgd", as DDP's powerSGD_hook (each gradient matrix worth it as two rank-r factors,
    with error feedback and warm start; `powersgd_rank`, `powersgd_start`); or "topk", each
    rank's `topk_ratio` largest values of each bucket with error feedback. The servers' rows
    stay as they are; not with ZeRO, tp/pp/cp or local SGD.
    "auto" (with plan="auto"): the search prices each plain data-parallel candidate also with
    bf16 buckets (taken only where the step is predicted at least planner/search.COMPRESS_GAIN
    shorter), PowerSGD's factors and top-k (their steps weighed by the steps to a loss they
    measured: POWERSGD_STEPS, TOPK_STEPS), so on a fast link none of them."""

    powersgd_rank: int = 1
    """grad_compress="powersgd": the rank of each matrix's factors (torch's
    matrix_approximation_rank). A matrix goes as factors only where they take under half its
    values (torch's min_compression_rate 2)."""

    powersgd_start: int = 1000
    """grad_compress="powersgd": synchronised backward passes all-reduced plainly before the
    factors start (torch's start_powerSGD_iter): early training is the most sensitive to
    approximate gradients."""

    push_compress: PushCompress = "none"
    """The servers' push on the wire: "none", or "bf16": each float32 server table's gradient
    rows cast to bf16 to cross to their owners (its own rows too), cast back there and summed
    in the table's dtype: half the push's bytes, and bf16's rounding of each rank's rows
    (under local aggregation of each hop's partial sums). The pulled rows stay as they are.
    (Not fp16: its range would turn large gradients into inf after the input checks passed.)
    "auto": each table whose traffic is modelled (hybrid mode's
    cost search) pushes in bf16 only where that shortens its predicted exchange by at least
    planner/tables.PUSH_COMPRESS_GAIN, so on a fast link none does."""

    topk_ratio: float = 0.01
    """grad_compress="topk": the share of each bucket's values a rank sends each step (its
    largest in magnitude, with what it left out before added back: error feedback)."""

    outer_fragments: int = 1
    """Streaming DiLoCo under sync="diloco": the dense parameters cut into this many fragments
    of about equal bytes (registration order), fragment f's outer step at inner step
    (f+1) * sync_every / outer_fragments of every period, so each sync sends 1/F of the model."""

    outer_delay: int = 0
    """Inner steps each fragment's exchange runs beside before its outer step lands (Streaming
    DiLoCo's tau; 0: the step waits for it). Below sync_every / outer_fragments."""

    outer_mix: float = 0.5
    """With outer_delay: the parameters after a landing are outer_mix * this rank's own plus
    (1 - outer_mix) * the outer step's (Streaming DiLoCo's alpha)."""

    outer_schedule: OuterSchedule = "streaming"
    """Under sync="diloco": "streaming" (outer_fragments, outer_delay, outer_mix as above), or
    "layerwise" (DreamDDP's partial synchronisation): the dense parameters in sync_every - 1
    groups of about equal bytes (fewer where there are fewer parameters), each launched after
    its own inner step of the period and landing after the next, so every exchange runs
    beside a whole inner step; at the landing a rank's parameters are the outer step's result
    plus what its own step did meanwhile. Each parameter is still synced once every
    sync_every steps (the convergence rule DreamDDP keeps), in 1/(H-1) of the bytes a sync.
    With outer_optimizer="sgd", outer_lr=1, outer_momentum=0 it is DreamDDP's model
    averaging."""

    server_weights: list[float] | None = None
    """How many rows of each server table every rank serves, relative to the others, in rank
    order (e.g. each rank's memory: `tilework train` sets it from the cluster file's
    `memory_gb` where hosts differ). None: each rank the same. The tables are then cut into
    more partitions, each served by the rank that is furthest below its weight
    (planner/shares.server_map)."""

    zero_weights: list[float] | None = None
    """Under ZeRO (zero_scope 'world'): how much of every sharded parameter, its optimizer
    state and (stages 2, 3) its gradient and values each rank keeps, relative to the others,
    in rank order (e.g. each rank's memory: `tilework train` sets it from the cluster file's
    `memory_gb` where hosts differ, as Cephalo sizes state apart from compute). None: even
    chunks. On the wire each chunk is padded to the largest, so an uneven cut sends more."""

    stage_weights: list[float] | None = None
    """Under pp: how much of the model each pipeline rank takes, relative to the others, in pp
    order (blocks balanced by their cost over each rank's weight, as by speed). None: each
    rank's speed (the slowest host at that pp coordinate; all alike on equal hosts). The
    planner sets it from memory where hosts hold different amounts, so that a rank with less
    takes fewer blocks."""

    @property
    def model_parallel(self) -> bool:
        return self.tp * self.pp * self.cp > 1

    def __post_init__(self):
        check(self.plan in ("config", "auto"), "plan",
              f"'config' or 'auto', got {self.plan!r}")
        for axis in ("tp", "pp", "cp"):
            if getattr(self, axis) == "auto":
                check(self.plan == "auto", axis,
                      f"a whole number >= 1; {axis}='auto' is the planner's choice, which "
                      "needs plan='auto'")
                setattr(self, axis, 1)
                self.auto_axes = sorted({*(self.auto_axes or ()), axis})
        for axis in self.auto_axes or ():
            check(axis in ("tp", "pp", "cp"), "auto_axes",
                  f"'tp', 'pp' or 'cp', got {axis!r}")
        check(self.mode in ("hybrid", "allreduce", "ps"), "mode",
              f"'hybrid', 'allreduce' or 'ps', got {self.mode!r}")
        check(self.sparse_reduce in ("mean", "sum"), "sparse_reduce",
              f"'mean' or 'sum', got {self.sparse_reduce!r}")
        check(self.row_map in ("auto", "contiguous", "hashed"), "row_map",
              f"'auto', 'contiguous' or 'hashed', got {self.row_map!r}")
        check(isinstance(self.bucket_mb, (int, float)) and not isinstance(self.bucket_mb, bool)
              and 0 < self.bucket_mb < float("inf"), "bucket_mb",
              f"a positive size in MB, got {self.bucket_mb!r}")
        check(self.zero in (0, 1, 2, 3) and not isinstance(self.zero, bool), "zero",
              f"a ZeRO stage 0, 1, 2 or 3, got {self.zero!r}")
        check(self.zero_scope in ("world", "host"), "zero_scope",
              f"'world' or 'host', got {self.zero_scope!r}")
        check(self.offload in ("none", "optimizer", "all"), "offload",
              f"'none', 'optimizer' or 'all', got {self.offload!r}")
        check(self.offload == "none" or self.zero >= 1, "offload",
              f"a ZeRO stage to offload from: {self.offload!r} needs zero = 1, 2 or 3 "
              f"(zero is {self.zero})")
        check(isinstance(self.density_threshold, (int, float))
              and 0 <= self.density_threshold <= 1, "density_threshold",
              f"a fraction from 0 to 1, got {self.density_threshold!r}")
        for name, method in (self.overrides or {}).items():
            check(method in ("allreduce", "ps", "allgather"), f"overrides.{name}",
                  f"'allreduce', 'ps' or 'allgather', got {method!r}")
        parts = self.partitions
        values = parts.values() if isinstance(parts, dict) else [] if parts is None else [parts]
        for value in values:
            check(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                  "partitions", f"a positive number of partitions, got {value!r}")
        self._check_recompute()
        self._check_mesh()
        self._check_shares()
        self._check_sync()

    def _check_sync(self) -> None:
        check(self.sync in ("every_step", "diloco", "auto"), "sync",
              f"'every_step', 'diloco' or 'auto', got {self.sync!r}")
        # The wire is weighed against the step's compute, which only the search prices.
        check(self.sync != "auto" or self.plan == "auto", "sync",
              "'auto' with plan='auto' (the search weighs the wire against the step's compute)")
        check(isinstance(self.sync_every, int) and not isinstance(self.sync_every, bool)
              and self.sync_every >= 1, "sync_every",
              f"a whole number of steps >= 1, got {self.sync_every!r}")
        check(self.outer_optimizer in ("nesterov", "sgd"), "outer_optimizer",
              f"'nesterov' or 'sgd', got {self.outer_optimizer!r}")
        check(isinstance(self.outer_lr, (int, float)) and not isinstance(self.outer_lr, bool)
              and 0 < self.outer_lr < float("inf"), "outer_lr",
              f"a positive learning rate, got {self.outer_lr!r}")
        check(isinstance(self.outer_momentum, (int, float))
              and not isinstance(self.outer_momentum, bool) and 0 <= self.outer_momentum < 1,
              "outer_momentum", f"a momentum from 0 to below 1, got {self.outer_momentum!r}")
        check(self.outer_worker in ("rank", "host"), "outer_worker",
              f"'rank' or 'host', got {self.outer_worker!r}")
        check(self.outer_compress in ("none", "bf16", "int8", "int4"), "outer_compress",
              f"'none', 'bf16', 'int8' or 'int4', got {self.outer_compress!r}")
        check(self.grad_compress in ("none", "bf16", "fp16", "powersgd", "topk", "auto"),
              "grad_compress", "'none', 'bf16', 'fp16', 'powersgd', 'topk' or 'auto', got "
              f"{self.grad_compress!r}")
        check(self.push_compress in ("none", "bf16", "auto"), "push_compress",
              f"'none', 'bf16' or 'auto', got {self.push_compress!r}")
        check(isinstance(self.topk_ratio, (int, float)) and not isinstance(self.topk_ratio, bool)
              and 0 < self.topk_ratio <= 1, "topk_ratio",
              f"a share above 0 and at most 1, got {self.topk_ratio!r}")
        check(isinstance(self.powersgd_rank, int) and not isinstance(self.powersgd_rank, bool)
              and self.powersgd_rank >= 1, "powersgd_rank",
              f"a whole number of at least 1, got {self.powersgd_rank!r}")
        check(isinstance(self.powersgd_start, int) and not isinstance(self.powersgd_start, bool)
              and self.powersgd_start >= 0, "powersgd_start",
              f"a whole number of steps, 0 or more, got {self.powersgd_start!r}")
        check(self.grad_compress != "auto" or self.plan == "auto", "grad_compress",
              "'auto' with plan='auto' (the search weighs the bytes saved against the step)")
        if self.grad_compress not in ("none", "auto"):
            check(self.sync != "diloco" and not self.zero and not self.model_parallel
                  and not self.auto_axes, "grad_compress",
                  "'none' with sync='diloco' (its wire is outer_compress), ZeRO or tp/pp/cp: "
                  "compressed buckets are built for plain data-parallel all-reduce, got "
                  f"grad_compress={self.grad_compress!r}")
        # Against the period local SGD will run at: sync_every under "diloco", what the search
        # gives its local-SGD candidates under "auto"; not at all for synchronous training (the
        # search's synchronous variant of a streamed config keeps its outer_* as given).
        every = self.sync_every if self.sync == "diloco" else \
            (self.sync_every if self.sync_every > 1 else AUTO_SYNC_EVERY) \
            if self.sync == "auto" else None
        check(isinstance(self.outer_fragments, int) and not isinstance(self.outer_fragments, bool)
              and 1 <= self.outer_fragments <= (every or self.outer_fragments),
              "outer_fragments", f"a whole number from 1 to sync_every ({every}), got "
              f"{self.outer_fragments!r}")
        period = every // self.outer_fragments if every else self.outer_delay + 1
        check(isinstance(self.outer_delay, int) and not isinstance(self.outer_delay, bool)
              and 0 <= self.outer_delay < period, "outer_delay",
              f"a whole number of steps below sync_every / outer_fragments ({period}), got "
              f"{self.outer_delay!r}")
        check(isinstance(self.outer_mix, (int, float)) and not isinstance(self.outer_mix, bool)
              and 0 <= self.outer_mix < 1, "outer_mix",
              f"a weight from 0 to below 1, got {self.outer_mix!r}")
        check(self.outer_schedule in ("streaming", "layerwise"), "outer_schedule",
              f"'streaming' or 'layerwise', got {self.outer_schedule!r}")
        if self.outer_schedule == "layerwise" and every is not None:
            check(every >= 2 and self.outer_fragments == 1 and self.outer_delay == 0,
                  "outer_schedule", "'layerwise' with sync_every >= 2 and outer_fragments, "
                  "outer_delay left alone (it sets its own groups and overlap), got "
                  f"sync_every={every}, outer_fragments={self.outer_fragments}, "
                  f"outer_delay={self.outer_delay}")
        if self.sync != "diloco":   # "auto" offers local SGD only where it can run
            return
        # ZeRO inside a host, local SGD between hosts (HSDP inside, DiLoCo across): a host's
        # ranks are one replica, so their shards are one optimizer's.
        check(not self.zero or (self.zero in (1, 2) and self.zero_scope == "host"
                                and self.outer_worker == "host"), "zero",
              "zero 1 or 2 with zero_scope='host' and outer_worker='host' under "
              f"sync='diloco' (shards inside each host, local SGD across hosts), got zero="
              f"{self.zero}, zero_scope={self.zero_scope!r}, outer_worker={self.outer_worker!r}")
        for field, value in (("tp, pp or cp", self.model_parallel or bool(self.auto_axes)),
                             ("batch_shares", self.batch_shares is not None)):
            check(not value, "sync", f"'every_step' with {field} (local SGD with it is not "
                                     "built yet)")

    def _check_shares(self) -> None:
        if self.zero_weights is not None:
            self.zero_weights = _weights(self.zero_weights, "zero_weights", "rank")
            check(self.zero in (1, 2, 3) and self.zero_scope == "world", "zero_weights",
                  f"weights for ZeRO's chunks: zero 1-3 with zero_scope='world', got zero="
                  f"{self.zero!r}, zero_scope={self.zero_scope!r}")
            check(not self.auto_axes, "zero_weights",
                  "weights without 'auto' mesh axes: on a tp, pp or cp mesh they are one per "
                  "data-parallel replica, and how many replicas there are is the planner's "
                  "choice there")
        if self.server_weights is not None:
            self.server_weights = _weights(self.server_weights, "server_weights", "rank")
            check(not self.auto_axes, "server_weights",
                  "weights without 'auto' mesh axes: on a tp, pp or cp mesh they are one per "
                  "data-parallel replica, and how many replicas there are is the planner's "
                  "choice there")
        shares = self.batch_shares
        if shares is None:
            return
        if shares == "auto":
            check(self.plan == "auto", "batch_shares",
                  "a list of sample counts; 'auto' is the planner's choice, which needs "
                  "plan='auto'")
            return
        check(isinstance(shares, (list, tuple)) and len(shares) >= 1 and all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in shares),
            "batch_shares", "a list of positive sample counts, one per rank (on a tp, cp or "
            f"pp mesh: per data-parallel replica), got {shares!r}")
        self.batch_shares = list(shares)
        check(not self.auto_axes, "batch_shares",
              "'auto' where tp, cp or pp are the planner's: how many replicas there are is its "
              f"choice too, so a list of {len(shares)} counts may not fit it")
        m = self.microbatches or 2 * self.pp   # planner/model_parallel.py's default
        check(self.pp == 1 or all(n % m == 0 for n in shares), "batch_shares",
              f"with pp, counts that split into the {m} equal microbatches of each replica's "
              f"pipeline (each a multiple of {m}), got {shares!r}")

    def _check_mesh(self) -> None:
        def count(value) -> bool:
            return isinstance(value, int) and not isinstance(value, bool) and value >= 1

        for name in ("tp", "pp", "cp", "stages_per_rank"):
            check(count(getattr(self, name)), name,
                  f"a whole number >= 1, got {getattr(self, name)!r}")
        check(self.microbatches is None or count(self.microbatches), "microbatches",
              f"a whole number >= 1, got {self.microbatches!r}")
        check(self.schedule in ("1f1b", "gpipe", "interleaved"), "schedule",
              f"'1f1b', 'gpipe' or 'interleaved', got {self.schedule!r}")
        if self.layout is not None:
            check(isinstance(self.layout, dict) and all(
                isinstance(k, str) and isinstance(v, str) for k, v in self.layout.items()),
                "layout", f"a table of module-name pattern = style, got {self.layout!r}")
        check(isinstance(self.sequence_parallel, bool), "sequence_parallel",
              f"true or false, got {self.sequence_parallel!r}")
        if self.stage_weights is not None:
            self.stage_weights = _weights(self.stage_weights, "stage_weights", "pipeline rank")
            check("pp" not in (self.auto_axes or ()), "stage_weights",
                  "no weights with pp='auto' (the planner cuts the stages)")
            check(self.pp > 1, "stage_weights", "weights for pipeline stages: pp > 1")
            check(len(self.stage_weights) == self.pp, "stage_weights",
                  f"one weight per pipeline rank (pp={self.pp}), got "
                  f"{len(self.stage_weights)}")
        if self.model_parallel:
            check(self.mode != "ps", "mode", "'hybrid' or 'allreduce' with tp, pp or cp > 1: "
                  "mode='ps' would serve the split layers' shards")

    def _check_recompute(self) -> None:
        policies = ("full", "selective")
        if isinstance(self.recompute, dict):
            for pattern, policy in self.recompute.items():
                check(isinstance(pattern, str) and pattern != "", "recompute",
                      f"module-name patterns (non-empty strings), got {pattern!r}")
                check(policy in policies, f"recompute.{pattern}",
                      f"'full' or 'selective', got {policy!r}")
        else:
            check(self.recompute in ("none", *policies), "recompute",
                  f"'none', 'full', 'selective' or {{pattern: 'full' | 'selective'}}, "
                  f"got {self.recompute!r}")


def _weights(weights, field: str, each: str) -> list[float]:
    """`weights` as floats, refused by `field` unless a list of positive finite numbers."""
    check(isinstance(weights, (list, tuple)) and len(weights) >= 1 and all(
        isinstance(w, (int, float)) and not isinstance(w, bool) and 0 < w < float("inf")
        for w in weights), field, f"a list of positive weights, one per {each}, got {weights!r}")
    return [float(w) for w in weights]
