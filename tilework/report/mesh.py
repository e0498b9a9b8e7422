"""`tilework plan` for a job whose [parallel] has tp, pp or cp > 1: the mesh, the pipeline
stages, the schedule, the predicted step and bubble, and the bytes per axis per rank.

Pure, like the data-parallel report: the model is built on the meta device, nothing runs and no
process group is made. Where each figure comes from:

    mesh      mesh.parallel_mesh (dp x pp x cp x tp, tp fastest: inside a host when it fits)
    stages    pipeline.split_stages, balanced by stages.balance on each block's matmul weights
    schedule  pipeline.build, printed by its own printer (schedule.format_schedule)
    step      estimate/step.predict, the one step model (the mesh search ranks candidates by
              it): per stage the forward FLOPs of a microbatch over tp and cp at `flops` FLOP/s
              per rank (backward 2x), tp's and cp's exchanges on their links, the schedule
              replayed by pipeline.simulate, then the dp all-reduce, not overlapped
    bytes     mesh_cost.mesh_step_bytes for every rank: what tilework.stats counts in a step
"""

from __future__ import annotations

from collections import defaultdict

from torch import nn

from ..cluster.mesh import Mesh, parallel_mesh
from ..cluster.topology import Cluster
from ..config.parallel import ParallelConfig
from ..errors import PlanError
from ..estimate.step import predict
from ..estimate.step_bytes import mesh_step_bytes
from ..parallel.pipeline.stages import matmul_params


def mesh_report(job, cluster: Cluster, flops: float, flops_source: str = "given") -> dict:
    """The report's content for a model-parallel `job` on `cluster` at `flops` FLOP/s of
    compute per rank (`flops_source` says where that figure came from)."""
    from ..parallel.pipeline import build
    from ..train.planning import meta_model

    if not flops > 0:
        raise PlanError(f"compute rate: expected a positive FLOP/s per rank, got {flops!r}")
    config, n = job.parallel, cluster.world_size
    mesh = _mesh(config, cluster)
    dp = mesh.size_of("dp")
    batch = _replica_batch(job, dp)
    m = (config.microbatches or 2 * config.pp) if config.pp > 1 else 1
    if batch % m:
        raise PlanError(f"data.batch_size: each dp replica's {batch} sequences do not split "
                        f"into {m} equal microbatches")
    try:   # pp = 1: one stage, one "microbatch": the step is its forward and backward
        schedule = build(config.schedule if config.pp > 1 else "1f1b", config.pp, m,
                         config.stages_per_rank)
    except ValueError as e:
        raise PlanError(f"parallel.schedule: {e}") from None
    model, seq = meta_model(job), job.gpt.seq_len
    stages = _stages(model, schedule)
    found = predict(model, config, cluster, batch, seq, flops)
    if found.step_s is None:
        raise PlanError(f"[parallel]: {found.why}")
    parts = found.parts
    # A stage's time per microbatch holds its share of tp's and cp's exchanges too.
    for s, forward, count in zip(stages, parts["stage_forward_s"], parts["stage_forward_flops"]):
        s["forward_s"], s["forward_flops"] = forward, count
    link = parts["pp_link"]
    from ..train.planning import job_plan

    return {"world_size": n, "hosts": cluster.topology().num_hosts, "mode": "mesh",
            # The one Plan the job runs (its table: every parameter on every axis).
            "plan": job_plan(job, cluster).as_dict(),
            "mesh": {"axes": dict(mesh.axes),
                     "groups": {a: mesh.groups(a) for a in ("tp", "cp", "pp", "dp")}},
            "batch_per_replica": batch, "seq_len": seq,
            "stages": stages,
            "schedule": {"name": schedule.name, "microbatches": m, "text": schedule.format()},
            "flops_per_s": flops, "flops_source": flops_source,
            "pp_link": {"bandwidth_gbps": link.bandwidth_gbps, "latency_us": link.latency_us,
                        "between_hosts": parts["pp_between_hosts"]},
            "activation_bytes": parts["activation_bytes"],
            "pipeline_step_s": parts["pipeline"], "bubble": parts["bubble"],
            "bubbles": parts["bubbles"], "tp_s": parts["tp"], "cp_s": parts["cp"],
            "dp_allreduce_s": parts["dp"], "predicted_step_s": found.step_s,
            "bytes_per_rank": _bytes_per_rank(model, config, mesh, batch, seq),
            "memory": _memory_per_rank(job, cluster, mesh, batch),
            "bytes_note": "dense all-reduce as replicated parameters (ZeRO's and the servers' "
                          "bytes are not in this model)" if config.zero else None}


def _mesh(config: ParallelConfig, cluster: Cluster) -> Mesh:
    sizes = {h.procs for h in cluster.hosts}
    try:
        return parallel_mesh(cluster.world_size, sizes.pop() if len(sizes) == 1 else None,
                             tp=config.tp, pp=config.pp, cp=config.cp)
    except ValueError as e:
        raise PlanError(f"[parallel] on {cluster.world_size} ranks: {e}") from None


def _replica_batch(job, dp: int) -> int:
    """Sequences each dp replica trains on per step (the trainer's sampler's share)."""
    if job.data.scaling == "weak":
        return job.data.batch_size
    if job.data.batch_size % dp:
        raise PlanError(f"data.batch_size: strong scaling splits {job.data.batch_size} "
                        f"sequences over dp = {dp} replicas: expected a multiple of {dp}")
    return job.data.batch_size // dp


def _stages(model: nn.Module, schedule) -> list[dict]:
    """Each stage: its pp rank, the modules it holds (blocks as a range) and its share of the
    balance's cost (its time is estimate/step.predict's)."""
    from ..parallel.pipeline import split_stages

    try:
        stages = split_stages(model, schedule.stages)
    except ValueError as e:
        raise PlanError(f"parallel.pp: {e}") from None
    ends = matmul_params(model.head) + matmul_params(model.norm)
    costs = [sum(matmul_params(layer) for layer in s.layers) + (ends if s.last else 0)
             for s in stages]
    out = []
    for k, s in enumerate(stages):
        holds = (["tokens", "positions"] if s.first else []) + [_blocks(s.index_range)] \
            + (["norm", "head"] if s.last else [])
        out.append({"stage": k, "pp_rank": schedule.rank_of(k), "holds": holds,
                    "blocks": [s.index_range.start, s.index_range.stop],
                    "cost_share": costs[k] / sum(costs)})
    return out


def _blocks(r: range) -> str:
    return f"block {r.start}" if len(r) == 1 else f"blocks {r.start}-{r.stop - 1}"


def _bytes_per_rank(model, config: ParallelConfig, mesh: Mesh, batch: int, seq: int
                    ) -> list[dict]:
    """mesh_step_bytes of every rank; computed once per (pp, cp, tp) coordinate, which is all
    they depend on (a dp replica's ranks mirror every other's)."""
    seen: dict[tuple, dict] = {}
    out = []
    for rank in range(mesh.size):
        at = mesh.coords(rank)
        key = (at["pp"], at["cp"], at["tp"])
        if key not in seen:
            seen[key] = mesh_step_bytes(model, config, mesh.size, rank, batch, seq)
        out.append({"rank": rank, **seen[key]})
    return out


def _memory_per_rank(job, cluster: Cluster, mesh: Mesh, batch: int) -> list[dict]:
    """estimate_memory for every rank (estimate/mesh_memory.py), with each rank's budget."""
    import torch

    from ..estimate.memory import with_budget
    from ..estimate.mesh_memory import estimate_every_rank
    from ..train.planning import meta_model

    ids = torch.zeros(batch, job.gpt.seq_len, dtype=torch.long, device="cpu")   # shapes only
    return [with_budget(e, cluster) for e in estimate_every_rank(
        meta_model(job), job.parallel, (ids, ids), mesh.size, job.train.optimizer, cluster)]


# -- text ------------------------------------------------------------------------------------------

def format_mesh_report(out: dict, title: str) -> str:
    axes = out["mesh"]["axes"]
    lines = [f"{title}: {out['hosts']} hosts, {out['world_size']} ranks",
             "mesh " + " x ".join(f"{a}={s}" for a, s in axes.items())
             + " (tp fastest: consecutive ranks; dp crosses hosts first)"]
    for axis in ("tp", "cp", "pp", "dp"):
        lines.append(f"  {axis} groups: " + _groups_text(out["mesh"]["groups"][axis], axes[axis]))
    lines += _stage_lines(out)
    if axes["pp"] > 1:
        lines += ["schedule (rank x time, one unit per action):",
                  *("  " + line for line in out["schedule"]["text"].splitlines())]
    lines += _time_lines(out)
    lines.append(f"predicted bytes sent per step (mesh_cost.mesh_step_bytes; "
                 f"{out['batch_per_replica']} sequences of {out['seq_len']} per dp replica):")
    lines += ["  " + line for line in _bytes_lines(out["bytes_per_rank"])]
    if out["bytes_note"]:
        lines.append(f"  ({out['bytes_note']})")
    lines.append("estimated memory per rank (tilework.estimate_memory; docs/memory.md):")
    lines += ["  " + line for line in _memory_lines(out["memory"])]
    return "\n".join(lines)


def _memory_lines(memory: list[dict]) -> list[str]:
    """Ranks with the same estimate on one line; a rank over its budget says so."""
    rows: dict[tuple, list[int]] = defaultdict(list)
    keys = ("peak", "parameters", "gradients", "optimizer_state", "activations")
    for m in memory:
        rows[tuple(m.get(k, 0) for k in keys) + (m["budget"], m["over_budget"])].append(
            m["rank"])
    lines = []
    for (peak, params, grads, opt, acts, budget, over), ranks in rows.items():
        shown = ", ".join(map(str, ranks[:8])) + (f" ... ({len(ranks)})" if len(ranks) > 8 else "")
        line = (f"ranks {shown}: peak {_kb(peak)} (parameters {_kb(params)}, gradients "
                f"{_kb(grads)}, optimizer state {_kb(opt)}, activations {_kb(acts)})")
        if budget is not None:
            line += (f"; OVER its budget of {_kb(int(budget))} (80% of memory_gb)" if over
                     else f"; budget {_kb(int(budget))}")
        lines.append(line)
    return lines


def _groups_text(groups: list, size: int, shown: int = 4) -> str:
    if size == 1:
        return "none (size 1)"
    text = " ".join("(" + ", ".join(map(str, g)) + ")" for g in groups[:shown])
    return text + (f" ... {len(groups)} groups in all" if len(groups) > shown else "")


def _stage_lines(out: dict) -> list[str]:
    if out["mesh"]["axes"]["pp"] == 1:
        return ["pipeline: none (pp = 1)"]
    lines = ["pipeline stages (cut by stages.balance on each block's matmul weights):"]
    for s in out["stages"]:
        lines.append(f"  stage {s['stage']} on pp rank {s['pp_rank']}: "
                     f"{', '.join(s['holds'])}; cost share {s['cost_share']:.1%}; forward "
                     f"{s['forward_s'] * 1e3:.3f} ms per microbatch")
    return lines


def _time_lines(out: dict) -> list[str]:
    link, pipelined = out["pp_link"], out["mesh"]["axes"]["pp"] > 1
    where = "between hosts" if link["between_hosts"] else "inside a host"
    bubbles = ", ".join(f"{b:.3f}" for b in out["bubbles"])
    first = (f"predicted step {out['predicted_step_s'] * 1e3:.3f} ms: "
             + (f"schedule {out['pipeline_step_s'] * 1e3:.3f} ms (pipeline.simulate)"
                if pipelined else f"forward and backward {out['pipeline_step_s'] * 1e3:.3f} ms")
             + f" + dp all-reduce {out['dp_allreduce_s'] * 1e3:.3f} ms"
             + (f"; bubble {out['bubble']:.3f} (per pp rank {bubbles})" if pipelined else ""))
    pp_link = (f"pp link {where}: {link['bandwidth_gbps']:g} Gbit/s, {link['latency_us']:g} us, "
               f"{out['activation_bytes']:,} bytes per boundary; " if pipelined else "")
    exchanges = ", ".join(f"{axis} {out[f'{axis}_s'] * 1e3:.3f} ms" for axis in ("tp", "cp")
                          if out[f"{axis}_s"])
    return [first, f"  compute {out['flops_per_s'] / 1e9:,.1f} GFLOP/s per rank "
                   f"({out['flops_source']}); {pp_link}"
                   + (f"exchanges on the critical path, in the stages' times: {exchanges}"
                      if exchanges else "no tp or cp exchanges")]


def _bytes_lines(per_rank: list[dict]) -> list[str]:
    """Ranks with the same bytes on one line."""
    rows: dict[tuple, list[int]] = defaultdict(list)
    for b in per_rank:
        rows[tuple((k, v) for k, v in b.items() if k != "rank")].append(b["rank"])
    lines = []
    for axes, ranks in rows.items():
        shown = ", ".join(map(str, ranks[:8])) + (f" ... ({len(ranks)})" if len(ranks) > 8 else "")
        parts = ", ".join(f"{k} {_kb(v)}" for k, v in axes) or "nothing"
        lines.append(f"ranks {shown}: {parts}")
    return lines


def _kb(n: int) -> str:
    return f"{n:,} B" if n < 10_000 else f"{n / 1e3:,.1f} kB" if n < 10_000_000 else \
        f"{n / 1e6:,.1f} MB"
