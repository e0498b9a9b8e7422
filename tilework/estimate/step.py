"""The step of a dp x pp x cp x tp run, predicted for its slowest pipeline rank (Megatron-LM's
reasoning, paper 16); pure (a meta-device model will do). What `estimate(plan)` prices a mesh
plan's step with, what the mesh search ranks by (planner/search.py), and the step `tilework
plan` shows for a model-parallel job (report/job.py).

- compute: each stage's matmul FLOPs (2 per weight per token forward, twice that backward)
  and attention scores (causal: seq/2 keys per query, 2 x 2 x dim FLOPs per key forward), on
  its tokens (batch / dp sequences, seq / cp tokens each), split tp ways, at `flops_per_s`
  (or, given a matmul curve, each microbatch's products at the rate of their shape);
- tp and cp: the bytes `step_bytes.mesh_step_bytes` counts, on the link their groups cross
  (`Links.crossed`), a latency per ring step; on the critical path (Megatron does not overlap
  them either), spread over forward and backward;
- pp: `pipeline.simulate` replays the schedule with those per-stage times and the link between
  stages: bubble and hops included;
- dp: the gradient all-reduce of the rank's parameters over its dp (x cp) group, in buckets,
  after the last backward (not overlapped: an upper bound); ZeRO's exchanges as `dp_seconds`
  prices them (each at its measured factor; ZeRO-3's beside the compute across hosts);
- recompute: "full" runs each recomputed block's forward again in its stage's backward;
- or, given measured op times (estimate/ops.py) instead of a rate, each stage's compute is the
  ops its microbatch runs forward and backward, recorded on the rank's shape-only copy, each at
  its measured time: norms, softmax, copies and recompute (selective's too) included.

A step that cannot run keeps the reason (a layout that does not split, more stages than
blocks, a batch that does not divide).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from ..cluster.mesh import parallel_mesh, pp_speeds
from ..cluster.topology import Cluster, Link
from ..config.parallel import ParallelConfig
from .cost import seconds
from .model_facts import ModelFacts
from .op_stages import stage_recordings
from .ops import OpTimes


@dataclass(frozen=True)
class MeshCandidate:
    config: ParallelConfig
    step_s: float | None               # None: refused
    why: str = ""                      # the refusal
    parts: dict = field(default_factory=dict)   # seconds: compute, tp, cp, pipeline, dp

    @property
    def label(self) -> str:
        c = self.config
        dp = self.parts.get("dp_size", "?")
        return f"dp{dp} x pp{c.pp} x cp{c.cp} x tp{c.tp}"


def _attention(model: nn.Module) -> list[nn.MultiheadAttention]:
    return [m for m in model.modules() if isinstance(m, nn.MultiheadAttention)]


@dataclass(frozen=True)
class _Shapes:
    """What forward_flops and stage_seconds read of a list of modules."""
    weights: int        # matmul_params: every weight and bias that meets each token
    products: tuple     # in module order: ("weight", in, out) of each 2-D weight outside
    #                     embeddings, ("attention", heads, head_dim) of each attention
    other: int          # the rest of those parameters' elements (biases, norms)
    attention: tuple    # each attention's embed_dim

    @staticmethod
    def of(modules: list[nn.Module], facts: ModelFacts | None = None) -> _Shapes:
        """`facts`: the search's, which keeps them per module list (the model unchanged)."""
        if facts is not None:
            return facts.once(("shapes", *modules), lambda: _Shapes.of(modules))
        from ..parallel.pipeline.stages import matmul_params

        products, other = [], 0
        for module in modules:
            for sub in module.modules():
                if isinstance(sub, nn.Embedding):
                    continue
                for p in sub.parameters(recurse=False):
                    if p.dim() == 2:
                        products.append(("weight", p.shape[1], p.shape[0]))
                    else:
                        other += p.numel()
            products += [("attention", a.num_heads, a.head_dim) for a in _attention(module)]
        return _Shapes(sum(matmul_params(m) for m in modules), tuple(products), other,
                       tuple(a.embed_dim for m in modules for a in _attention(m)))


def forward_flops(modules: list[nn.Module], tokens: int, seq: int, tp: int,
                  facts: ModelFacts | None = None) -> float:
    """Forward FLOPs of `modules` on `tokens` tokens of sequences `seq` long, split tp ways: 2
    per matmul weight and bias per token (stages.balance's weights: an embedding is looked
    up, not multiplied) and the causal attention scores and their weighted sum (2 x 2 x dim
    per key, seq / 2 keys per query on average)."""
    shapes = _Shapes.of(modules, facts)
    scores = sum(4 * dim * seq / 2 for dim in shapes.attention)
    return (2 * shapes.weights + scores) * tokens / tp


def stage_seconds(modules: list[nn.Module], tokens: float, seq: int, tp: int,
                  rate, facts: ModelFacts | None = None) -> tuple[float, float]:
    """(forward, backward) seconds of `modules` on `tokens` tokens (one microbatch's) at `rate`:
    one FLOP/s (backward twice the forward), or a MatmulCurve pricing each product by its
    shape: every 2-D weight (out x in) a (tokens x in) @ (in x out / tp) product forward and
    the two gradient products backward; attention's scores and weighted sum per head as
    (seq x head_dim x seq) products, half of them under the causal mask."""
    from ..cluster.matmul_curve import MatmulCurve

    if not isinstance(rate, MatmulCurve):
        f = forward_flops(modules, tokens, seq, tp, facts) / float(rate)
        return f, 2 * f
    shapes = _Shapes.of(modules, facts)
    products = []
    for kind, a, b in shapes.products:
        if kind == "weight":
            products.append((tokens, a, b / tp, 1.0))
        else:
            count = tokens / seq * a / tp / 2
            products += [(seq, b, seq, count), (seq, seq, b, count)]
    rest = 2 * shapes.other * tokens / tp / float(rate)
    forward = sum(rate.seconds(m, k, n, c) for m, k, n, c in products) + rest
    backward = sum(rate.seconds(m, n, k, c) + rate.seconds(k, m, n, c)
                   for m, k, n, c in products) + 2 * rest
    return forward, backward


def _link(cluster: Cluster, groups: list[tuple[int, ...]]) -> tuple[Link, bool]:
    """The link a collective over `groups` runs on: the inter-host one if any group spans
    hosts."""
    topo = cluster.topology()
    hosts = [[topo.host_of(r) for r in g] for g in groups]
    link = cluster.links.crossed(*hosts)
    return link, any(len(set(h)) > 1 for h in hosts)


def _pp_link(cluster: Cluster, mesh) -> tuple[Link, bool]:
    """Where a pipeline's neighbours talk: inter-host if any neighbours are on two hosts (the
    simulator takes one link for every hop)."""
    topo = cluster.topology()
    pairs = [(topo.host_of(a), topo.host_of(b))
             for g in mesh.groups("pp") for a, b in zip(g, g[1:])]
    return cluster.links.crossed(*pairs), any(a != b for a, b in pairs)


def allreduce_seconds(sent: int, n: int, link: Link, bucket_mb: float,
                      message_overhead_s: float = 0.0) -> float:
    """A ring all-reduce of what one rank sends (2 (n - 1) / n of the buckets), in buckets;
    each of its messages costs `message_overhead_s` at each end."""
    from ..comm.wire import ALL_REDUCE
    from ..plans.plan import bucket_bytes

    if n == 1 or not sent:
        return 0.0
    params = sent * n / (2 * (n - 1))
    buckets = max(1, -(-int(params) // bucket_bytes(bucket_mb)))
    messages = ALL_REDUCE.messages(n) * buckets
    return seconds(sent, link, messages) + message_overhead_s * 2 * messages


def _message_ends(facts: ModelFacts, config: ParallelConfig, stages, schedule) -> dict:
    """Per stage, the message ends (sends and receives) its tp and cp exchanges make on one
    microbatch: a ring all-reduce 4 (n - 1), an all-gather or reduce-scatter 2 (n - 1)
    (tensor.cost.tp_step_calls), and ring attention's shifts, 3 cp - 2 a layer each way."""
    from ..parallel.tensor.cost import tp_step_calls

    names = facts.names()
    parts = [facts.model] if stages is None else stages
    out = {"tp": [0] * len(parts), "cp": [0] * len(parts)}
    layout = facts.layout(config.layout, config.tp, config.sequence_parallel) \
        if config.tp > 1 else None
    for k, part in enumerate(parts):
        held, layers = facts.once(("names and attentions of", part), lambda: (
            {names[id(m)] for m in part.modules() if id(m) in names},
            sum(isinstance(m, nn.MultiheadAttention) for m in part.modules())))
        if layout is not None:
            reduces, gathers = tp_step_calls(layout, held)
            out["tp"][k] = (4 * reduces + 2 * gathers) * (config.tp - 1)
        out["cp"][k] = 2 * layers * (3 * config.cp - 2) if config.cp > 1 else 0
    return out


def predict(model: nn.Module, config: ParallelConfig, cluster: Cluster, replica_batch: int,
            seq: int, flops_per_s, itemsize: int = 4,
            message_overhead_s: float = 0.0, optimizer: str = "adam",
            facts: ModelFacts | None = None,
            cut: tuple[tuple[int, int], ...] | None = None) -> MeshCandidate:
    """One candidate's predicted step (see the module's docstring) for `replica_batch`
    sequences per dp replica, or why it cannot run. `flops_per_s`: one rate, a MatmulCurve
    (stage_seconds), or OpTimes: each stage's recorded ops at their measured times
    (estimate/op_stages.py). `message_overhead_s`: LogP's o, what each
    message costs the CPU at each end beside the link's time (pipeline_runs.message_overhead
    measures it on busy CPU ranks; about 0 where collectives run on their own engines).
    Given OpTimes, what each rank's runtime runs around its stages (the buckets' and ZeRO's
    copies, `optimizer`'s update: estimate/runtime_ops.py) is priced too, after the
    pipeline. `facts`: the search's, shared by its candidates (estimate/model_facts.py); `cut`:
    a plan's stage cut (each stage's block range), taken as it is, where the config's weights
    or the speeds would cut it otherwise (estimate(plan) passes its plan's)."""
    from ..parallel.pipeline import build, simulate
    from ..parallel.pipeline.model import stage_modules
    from .step_bytes import cut_weights, mesh_step_bytes

    facts = ModelFacts.of(model, facts)

    world = cluster.world_size
    m = (config.microbatches or 2 * config.pp) if config.pp > 1 else 1
    try:
        mesh = parallel_mesh(world, cluster.procs_per_host, config.tp, config.pp, config.cp)
        if replica_batch % m:
            raise ValueError(f"each replica's {replica_batch} sequences do not split into {m} "
                             "microbatches")
        if seq % (2 * config.cp):
            raise ValueError(f"a sequence of {seq} does not split into 2 x cp = "
                             f"{2 * config.cp} chunks")
        schedule = build(config.schedule if config.pp > 1 else "1f1b", config.pp, m,
                         config.stages_per_rank)
        speeds = pp_speeds(mesh, cluster, config.pp)
        stage_speeds = schedule.per_stage(speeds)
        # Cut as the plan cuts (planner/model_parallel.py): by the config's weights where it
        # gives them, else by speed; each stage still computes at its ranks' speed.
        stages = None if config.pp == 1 else \
            facts.stages(schedule.stages, cut_weights(config, schedule, speeds)) \
            if cut is None else facts.cut(schedule.stages, cut)
        first = [r for r in range(world) if _first_of_replica(mesh, r)]
        per_rank = [mesh_step_bytes(model, config, world, r, replica_batch, seq, itemsize, facts,
                                    speeds, cut)
                    for r in first]
    except (ValueError, AttributeError, IndexError) as e:
        # ValueError: a split the layout, the schedule or the batch refuses; the others: a
        # model without the reference GPT's shape (a head, blocks, attention) under pp or cp.
        why = str(e) if isinstance(e, ValueError) else \
            f"the model is not shaped like the reference GPT ({type(e).__name__}: {e})"
        return MeshCandidate(config, None, why,
                             {"dp_size": world // (config.tp * config.pp * config.cp)})
    dp = mesh.size_of("dp")
    tokens = replica_batch * seq // config.cp
    modules = [[*model.children()]] if stages is None else [stage_modules(s) for s in stages]
    links = {"tp": _link(cluster, mesh.groups("tp"))[0], "cp": _link(cluster, mesh.groups("cp"))[0]}
    ends = _message_ends(facts, config, stages, schedule)
    recomputed = _recomputed(facts, config)
    fwd, bwd, comm, compute, flops = [], [], {"tp": 0.0, "cp": 0.0}, 0.0, []
    recorded = stage_recordings(model, config, replica_batch, seq) \
        if isinstance(flops_per_s, OpTimes) else None
    for k, mods in enumerate(modules):
        flops.append(forward_flops(mods, tokens, seq, config.tp, facts) / m)
        if recorded is not None:
            # Every op the stage's microbatch runs at its measured time, what recompute runs
            # again included.
            (f, b), again = (m * t for t in flops_per_s.seconds(recorded[k])), 0.0
        else:
            # A microbatch's products are what the rate (a curve: by shape) applies to.
            f, b = (m * t for t in stage_seconds(mods, tokens / m, seq, config.tp,
                                                 flops_per_s, facts))
            # Full recompute runs the stage's recomputed blocks' forward again in backward.
            again = m * stage_seconds(_inside(mods, recomputed, facts), tokens / m, seq, config.tp,
                                      flops_per_s, facts)[0]
        if stage_speeds is not None:   # ranks that differ: this stage's at its own speed
            f, b, again = (t / stage_speeds[k] for t in (f, b, again))
        compute = max(compute, f + b + again)
        sent = per_rank[schedule.rank_of(k)]    # a rank's bytes, over the stages it holds
        share = len(schedule.stages_of(schedule.rank_of(k)))
        extra = 0.0
        for axis, n in (("tp", config.tp), ("cp", config.cp)):
            if sent.get(axis):
                # Every microbatch makes its exchanges (recorded: recompute's second run of
                # the forward's included).
                made = m * (ends[axis][k] if recorded is None else recorded[k].messages[axis])
                # Ring attention's blocks cross the link both ways at once: at its measured
                # factor (Link.ring_shift_factor; 1 where not measured).
                factor = links[axis].ring_shift_factor if axis == "cp" else 1.0
                took = seconds(sent[axis] / share * factor, links[axis], 2 * (n - 1)) \
                    + message_overhead_s * made
                comm[axis] = max(comm[axis], took)
                extra += took
        # A step's exchanges sit on the critical path, a third forward, two thirds backward.
        fwd.append((f + extra / 3) / m)
        bwd.append((b + again + 2 * extra / 3) / m)
    pp_link, crossing = _pp_link(cluster, mesh)
    activation = replica_batch // m * (seq // config.cp) * model.head.in_features * itemsize \
        if config.pp > 1 else 0
    sim = simulate(schedule, fwd, bwd, pp_link, activation,
                   message_overhead_s=message_overhead_s)
    averaged = dp * config.cp   # the ranks that average gradients together
    dp_link, dp_spans = _link(cluster, mesh.groups(("dp", "cp") if config.cp > 1 else "dp"))
    # As parallel/data/zero.py moves them (estimate/cost.zero_sync_bytes replays it): ZeRO-2
    # an all-reduce's bytes (reduce-scatter, all-gather of the values); ZeRO-1 all-reduces the
    # gradient and all-gathers the values, ZeRO-3 gathers them again for backward: three
    # half-ring passes for two.
    units = max(1, facts.units() // config.pp) if config.zero == 3 else 1
    # Uneven chunks (zero_weights) cross padded to the largest.
    weights = config.zero_weights if config.zero else None
    padding = len(weights) * max(weights) / sum(weights) if weights else 1.0
    dp_s = max(dp_seconds(s.get("allreduce", 0), averaged, dp_link, config.bucket_mb,
                          config.zero, compute, units, dp_spans, message_overhead_s, padding)
               for s in per_rank)
    group = mesh.groups(("dp", "cp") if config.cp > 1 else "dp")[0]
    topo = cluster.topology()
    shards = averaged if config.zero_scope == "world" else \
        sum(topo.host_of(r) == topo.host_of(group[0]) for r in group)   # a host's of them
    runtime = _runtime_seconds(flops_per_s, recorded, schedule, config, shards, averaged,
                               optimizer)
    parts = {"compute": compute, **comm, "pipeline": sim.step_s, "dp": dp_s, "dp_size": dp,
             "runtime": runtime,
             "bubble": sim.bubble, "bubbles": list(sim.bubbles), "microbatches": m,
             "stage_forward_s": fwd, "stage_backward_s": bwd, "stage_forward_flops": flops,
             "activation_bytes": activation,
             "pp_link": pp_link, "pp_between_hosts": crossing, "dp_link": dp_link,
             "dp_between_hosts": dp_spans, "bytes_per_rank": per_rank}
    return MeshCandidate(config, sim.step_s + dp_s + runtime, "", parts)


def _runtime_seconds(times, recorded, schedule, config: ParallelConfig, shards: int,
                     averaged: int, optimizer: str) -> float:
    """The slowest rank's runtime work around its stages (0 without measured op times): its
    stages' parameters synchronised over the `averaged` ranks (ZeRO's over `shards` of them)
    and stepped."""
    from ..plans.plan import bucket_bytes
    from .runtime_ops import runtime_calls

    if recorded is None:
        return 0.0
    per_rank: dict[int, float] = {}
    for k, recording in enumerate(recorded):
        calls = runtime_calls(recording.params, config.zero, shards, averaged,
                              bucket_bytes(config.bucket_mb), optimizer, config.check_inputs,
                              recording.units)
        rank = schedule.rank_of(k)
        per_rank[rank] = per_rank.get(rank, 0.0) + times.priced(calls)[0]
    return max(per_rank.values())


def dp_seconds(sent: float, n: int, link: Link, bucket_mb: float, zero: int,
               compute: float = 0.0, units: int = 1, beside: bool = False,
               message_overhead_s: float = 0.0, padding: float = 1.0) -> float:
    """The dp group's wait on the wire for the `sent` bytes of one rank's gradient all-reduce
    over `n` ranks in buckets of `bucket_mb`, as parallel/data/zero.py moves them
    (estimate/cost.zero_sync_bytes replays it): a reduce-scatter and an all-gather are the
    ring's two halves, each at its measured factor (Link). ZeRO-1 all-reduces and gathers,
    ZeRO-2 reduce-scatters and gathers, after the backward and after the step, with no compute
    beside them. ZeRO-3 reduce-scatters and gathers twice per unit (`units` of them), each
    exchange's messages on the critical path; with `beside` (its exchanges cross hosts) the
    transfers run beside `compute` (the next unit's gather launched as one is used, each
    unit's reduce-scatter as its backward ends): only what exceeds it waits, and at least one
    unit's share. `padding`: ZeRO's exchanges over the even cut's (chunks cut unevenly cross
    padded to the largest: n x the largest weight's share). Inside a host on CPU ranks an
    exchange is the cores' own copying, which the compute cannot hide. Measured on 2 emulated
    hosts at 1 Gbit/s: ZeRO-3's step 0.90-1.01x plain dp's though it moves 1.5x the bytes,
    ZeRO-2's 1.23-1.32x."""
    from ..comm.wire import ALL_GATHER, REDUCE_SCATTER

    ring = allreduce_seconds(sent, n, link, bucket_mb, message_overhead_s)
    if zero == 0 or n == 1:
        return ring
    half = allreduce_seconds(sent * padding, n, link, bucket_mb, message_overhead_s) / 2
    if zero == 1:
        return ring + half * link.all_gather_factor
    if zero == 2:
        return half * (link.reduce_scatter_factor + link.all_gather_factor)
    moved = sent * padding / 2 / link.bytes_per_s \
        * (link.reduce_scatter_factor + 2 * link.all_gather_factor)
    messages = units * (REDUCE_SCATTER.messages(n) + 2 * ALL_GATHER.messages(n))
    waits = max(moved - compute, moved / units) if beside else moved
    return waits + messages * (link.latency_s + 2 * message_overhead_s)


def _recomputed(facts: ModelFacts, config: ParallelConfig) -> list[nn.Module]:
    """The modules full recompute runs twice (selective keeps the matmuls' outputs: ~0)."""
    from ..plans.analysis import recompute_choices

    model = facts.model
    return facts.once(("recomputed", repr(config.recompute)), lambda: [
        model.get_submodule(name) for name, policy in recompute_choices(model, config.recompute)
        if policy == "full"])


def _inside(modules: list[nn.Module], chosen: list[nn.Module],
            facts: ModelFacts) -> list[nn.Module]:
    """The chosen modules that sit inside `modules` (a stage's)."""
    held = facts.once(("modules under", *modules),
                      lambda: {id(m) for top in modules for m in top.modules()})
    return [m for m in chosen if id(m) in held]


def _first_of_replica(mesh, rank: int) -> bool:
    """One rank per pipeline stage of the first replica (tp, cp and dp peers send alike)."""
    at = mesh.coords(rank)
    return at["dp"] == 0 and at["cp"] == 0 and at["tp"] == 0


__all__ = ["MeshCandidate", "allreduce_seconds", "dp_seconds", "forward_flops", "predict"]
