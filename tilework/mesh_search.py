"""Choose the mesh: every dp x pp x cp x tp that can run the model on `world_size` ranks, each
with a predicted step time, fastest first. Pure (a meta-device model will do).

The step of a candidate, for its slowest pipeline rank (Megatron-LM's reasoning, paper 16):

- compute: each stage's matmul FLOPs (2 per weight per token forward, twice that backward)
  and attention scores (causal: seq/2 keys per query, 2 x 2 x dim FLOPs per key forward), on
  its tokens (batch / dp sequences, seq / cp tokens each), split tp ways, at `flops_per_s`;
- tp and cp: the bytes `mesh_cost.mesh_step_bytes` counts, on the link their groups use (inside
  a host when the group is), a latency per ring step of each collective; on the critical
  path (Megatron does not overlap them either), spread over forward and backward;
- pp: `pipeline.simulate` replays the schedule with those per-stage times and the link between
  stages: bubble and hops included;
- dp: the gradient all-reduce of the rank's parameters over its dp group, after the last
  backward (not overlapped: an upper bound).

Refused candidates keep the reason (a layout that does not split, more stages than blocks, a
batch that does not divide), so a user sees why the mesh they expected is absent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from .cluster import Link, Links
from .cost import seconds
from .mesh import parallel_mesh
from .parallel_config import ParallelConfig


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


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(world_size: int, ranks_per_host: int | None, layers: int) -> list[ParallelConfig]:
    """Every split of the world into pp x cp x tp (dp the rest) with tp inside a host."""
    out = []
    for tp in _divisors(world_size):
        if ranks_per_host and ranks_per_host % tp and tp % ranks_per_host:
            continue
        for pp in _divisors(world_size // tp):
            if pp > layers:
                continue
            for cp in _divisors(world_size // (tp * pp)):
                out.append(ParallelConfig(tp=tp, pp=pp, cp=cp,
                                          microbatches=2 * pp if pp > 1 else None))
    return out


def _attention(model: nn.Module) -> list[nn.MultiheadAttention]:
    return [m for m in model.modules() if isinstance(m, nn.MultiheadAttention)]


def _forward_flops(modules: list[nn.Module], tokens: int, seq: int, tp: int) -> float:
    """Forward FLOPs of `modules` on `tokens` tokens of sequences `seq` long, split tp ways:
    2 per matmul weight (Linear, attention's projections; an embedding is looked up) and the
    causal attention scores."""
    weights = sum(p.numel() for m in modules for sub in m.modules()
                  if isinstance(sub, (nn.Linear, nn.MultiheadAttention))
                  for p in sub.parameters(recurse=False) if p.dim() >= 2)
    scores = sum(4 * a.embed_dim * seq / 2 for m in modules for a in _attention(m))
    return (2 * weights + scores) * tokens / tp


def predict(model: nn.Module, config: ParallelConfig, world_size: int, batch: int, seq: int,
            links: Links, flops_per_s: float, ranks_per_host: int | None = None,
            itemsize: int = 4) -> MeshCandidate:
    """One candidate's predicted step (see the module's docstring), or why it cannot run."""
    from .mesh_cost import mesh_step_bytes
    from .pipeline import build, simulate, split_stages
    from .pipeline.model import _stage_modules

    try:
        mesh = parallel_mesh(world_size, ranks_per_host, config.tp, config.pp, config.cp)
        dp = mesh.size_of("dp")
        if batch % dp or (batch // dp) % (config.microbatches or 1):
            raise ValueError(f"a batch of {batch} does not split into {dp} replicas of "
                             f"{config.microbatches or 1} microbatches")
        if seq % (2 * config.cp):
            raise ValueError(f"a sequence of {seq} does not split into 2 x cp = "
                             f"{2 * config.cp} chunks")
        if config.cp > 1 and (config.tp > 1 or config.pp > 1):
            raise ValueError("cp composes with dp only so far")
        per_rank = [mesh_step_bytes(model, config, world_size, r, batch // dp, seq, itemsize)
                    for r in range(world_size) if _first_of_replica(mesh, r)]
    except ValueError as e:
        return MeshCandidate(config, None, str(e))
    tokens = batch // dp * seq // config.cp
    stages = split_stages(model, config.pp) if config.pp > 1 else None
    modules = [[*model.children()]] if stages is None else \
        [_stage_modules(s) for s in stages]
    inside = ranks_per_host is None or ranks_per_host >= config.tp * config.cp * config.pp
    tp_link = links.intra if ranks_per_host is None or config.tp <= ranks_per_host else links.inter
    fwd, bwd, comm, compute = [], [], {"tp": 0.0, "cp": 0.0}, 0.0
    for k, mods in enumerate(modules):
        f = _forward_flops(mods, tokens, seq, config.tp) / flops_per_s
        compute = max(compute, 3 * f)
        sent = per_rank[k]
        extra = 0.0
        for axis, n in (("tp", config.tp), ("cp", config.cp)):
            if sent.get(axis):
                s = seconds(sent[axis], tp_link if axis == "tp" else
                            (links.intra if inside else links.inter), 2 * (n - 1))
                comm[axis] = max(comm[axis], s)
                extra += s
        fwd.append(f + extra / 3)
        bwd.append(2 * f + 2 * extra / 3)
    dp_link = links.intra if ranks_per_host is None or world_size <= ranks_per_host \
        else links.inter
    averaged = dp * config.cp   # the ranks that average gradients together
    dp_s = max(seconds(s.get("allreduce", 0), dp_link, 2 * (averaged - 1)) for s in per_rank)
    if stages is None:
        body = fwd[0] + bwd[0]
    else:
        m = config.microbatches
        schedule = build(config.schedule, config.pp, m, config.stages_per_rank)
        pp_link = links.intra if inside else links.inter
        act = batch // dp // m * seq * model.head.in_features * itemsize
        body = simulate(schedule, [f / m for f in fwd], [b / m for b in bwd], pp_link,
                        act).step_s
    parts = {"compute": compute, **comm,
             "pipeline": body, "dp": dp_s, "dp_size": dp,
             "stage_forward_s": fwd, "stage_backward_s": bwd}
    return MeshCandidate(config, body + dp_s, "", parts)


def _first_of_replica(mesh, rank: int) -> bool:
    """One rank per pipeline stage of the first replica (tp, cp and dp peers send alike)."""
    at = mesh.coords(rank)
    return at["dp"] == 0 and at["cp"] == 0 and at["tp"] == 0


def search_mesh(model: nn.Module, world_size: int, batch: int, seq: int,
                links: Links | None = None, flops_per_s: float = 1e11,
                ranks_per_host: int | None = None) -> list[MeshCandidate]:
    """Every candidate, predicted; runnable ones fastest first, then the refused with why."""
    links = links or Links()
    layers = len(getattr(getattr(model, "blocks", None), "layers", [])) or 1
    found = [predict(model, c, world_size, batch, seq, links, flops_per_s, ranks_per_host)
             for c in candidates(world_size, ranks_per_host, layers)]
    return sorted(found, key=lambda c: (c.step_s is None, c.step_s or 0.0))


__all__ = ["Link", "MeshCandidate", "candidates", "predict", "search_mesh"]
