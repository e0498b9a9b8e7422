"""The user-facing entry points: parallelize, stats, state_dict / load_state_dict, save / load."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import planner
from .cluster.topology import Cluster, Topology
from .cluster.worker_env import WorkerEnv
from .comm.groups import Groups, build_groups, init_from_env, live_topology
from .config.parallel import ParallelConfig
from .errors import CheckpointError, PlanError
from .plans.plan import Plan
from .runtime.apply import apply
from .runtime.handle import runtime_of


def parallelize(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                config: ParallelConfig | None = None, *, groups: Groups | None = None,
                cluster: Cluster | None = None, density: dict[str, float] | None = None,
                traffic: dict | None = None, plan: Plan | str | None = None, log: bool = True,
                example_inputs: tuple | None = None, **options):
    """Make `model` and `optimizer` train in parallel by a plan; returns the model and the
    optimizer (the same objects, except under pp: a pipeline whose `step(...)` runs the
    schedule, `tilework.unparallelize` giving the model back).

    Gradients follow DistributedDataParallel's rules: when `backward()` returns every dense
    `.grad` is the average over ranks; `model.no_sync()` / `model.require_backward_grad_sync`
    keep a backward local. `optimizer=None` (a hand-written update) all-reduces everything.

    How: `config` (a `tilework.ParallelConfig`), or its fields as keywords (`mode="ps"`,
    `overrides={...}`, ...). The plan is `tilework.plan(model, config, cluster, density,
    traffic)` on the world's discovered topology: `cluster` adds the links of a cluster file,
    `density` measured touched-row fractions of dense-layout tables, `traffic` expected rows per
    step (hybrid mode then chooses each table by cost). `groups` defaults to the world torchrun
    describes (one process: no group at all); `plan` (from `tilework.plan`, on any axes) skips
    planning: it is applied as it is.

    `plan="auto"` (or `ParallelConfig(plan="auto")`) lets the planner choose the ZeRO stage
    and scope, recompute and each table's placement (and tp, cp, pp where given as "auto") by
    predicted step within 80% of each rank's memory, priced on `example_inputs` (one rank's
    batch, as the model takes it); the choice and its runner-up are printed.
    """
    if isinstance(plan, str):
        if plan != "auto":
            raise PlanError(f"plan: a Plan from tilework.plan, or 'auto', got {plan!r}")
        if config is not None:
            config = dataclasses.replace(config, plan="auto")
        else:
            options["plan"] = "auto"
        plan = None
    config = _config(config, options)
    if groups is None:
        # Called from a user's script, this is its entry point into tilework: read the
        # environment here, once, as tilework's own entry points do.
        env = WorkerEnv.from_environ()
        groups = build_groups(init_from_env(env=env) if env.world_size > 1 else None, env=env)
    if getattr(model, "_tilework_engine", None) is not None:
        raise PlanError("this model is already parallelized")
    if plan is not None and plan.parallel is not None:
        config = _config_of_mesh_plan(config, plan)
    elif plan is not None and config.model_parallel:
        raise PlanError(f"plan=: a data-parallel plan, but the config asks for tp={config.tp}, "
                        f"pp={config.pp}, cp={config.cp}: pass a plan made with them "
                        "(tilework.plan(model, config, cluster)), or leave plan out")
    if plan is None and config.plan == "auto":
        from .runtime.auto import choose_live

        config = choose_live(model, optimizer, config, groups, cluster, example_inputs, traffic,
                             log)
    if plan is None:
        plan = _plan(model, optimizer, config, groups, cluster, density, traffic)
    if plan.world_size != groups.world_size:
        raise PlanError(f"plan is for {plan.world_size} ranks, the world has {groups.world_size}")
    return apply(model, optimizer, plan, config, groups, log)


def _plan(model, optimizer, config: ParallelConfig, groups: Groups, cluster, density,
          traffic) -> Plan:
    """The plan parallelize runs: `tilework.plan`'s on the discovered topology; without an
    optimizer (a hand-written update) everything all-reduced, since no server could apply an
    update."""
    if optimizer is None and config.zero:
        raise PlanError(f"zero={config.zero} runs the optimizer on each rank's shard: pass the "
                        "optimizer (parallelize(model, opt, zero=...)), or zero=0 for a "
                        "hand-written update")
    if optimizer is not None or config.model_parallel:
        return planner.plan(model, config, cluster, density, traffic, topology=groups.topology)
    if config.mode == "ps" or "ps" in (config.overrides or {}).values():
        raise PlanError("the parameter server applies the optimizer's update: pass the "
                        "optimizer (parallelize(model, opt)), or use mode='allreduce'")
    everything = dataclasses.replace(config, mode="allreduce", overrides=None)
    plan = planner.plan(model, everything, cluster, density, topology=groups.topology)
    return dataclasses.replace(plan, params=tuple(
        dataclasses.replace(p, reason="no optimizer: the servers could not apply updates")
        for p in plan.params))


def plan(model: nn.Module, config: ParallelConfig | None = None, cluster: Cluster | None = None,
         density: dict[str, float] | None = None, traffic: dict | None = None, *,
         topology: Topology | None = None) -> Plan:
    """`tilework.plan` (planner.plan, pure): the plan for `model` under `config`. Without a
    cluster or topology it plans for the world this process is part of (inside an
    initialised process group), else for tp x pp x cp ranks on one host."""
    if cluster is None and topology is None:
        topology = live_topology(WorkerEnv.from_environ())   # a script's entry point
    return planner.plan(model, config, cluster, density, traffic, topology=topology)


def estimate_memory(model: nn.Module, config: ParallelConfig | None = None,
                    example_inputs: tuple = (), cluster: Cluster | None = None,
                    optimizer="adam", rank: int | None = None, world_size: int | None = None):
    """`tilework.estimate_memory` (estimate.estimate_memory, pure): bytes rank `rank` holds.
    Without a cluster or world size it estimates for the world this process is part of
    (inside an initialised process group: this rank, by default), as `parallelize` would
    plan it there."""
    from .estimate import estimate_memory as estimate

    live = live_topology(WorkerEnv.from_environ()) if cluster is None and world_size is None \
        else None   # a script's entry point
    if live is not None:
        cluster = Cluster.of_topology(live)
        if rank is None:
            import torch.distributed as dist

            rank = dist.get_rank()
    return estimate(model, config, example_inputs, cluster, optimizer, rank or 0, world_size)


def _config(config: ParallelConfig | None, options: dict) -> ParallelConfig:
    """`config`, or one built from keyword shortcuts (never both)."""
    if not options:
        return config if config is not None else ParallelConfig()
    if config is not None:
        raise PlanError(f"pass either config=ParallelConfig(...) or its fields as keywords, not "
                        f"both (got {', '.join(sorted(options))} too)")
    fields = {f.name for f in dataclasses.fields(ParallelConfig)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise PlanError(f"parallelize: unknown option {unknown[0]!r} (expected one of: "
                        f"{', '.join(sorted(fields))})")
    return ParallelConfig(**options)


def _config_of_mesh_plan(config: ParallelConfig, plan: Plan) -> ParallelConfig:
    """The config a plan with tp, pp or cp runs under: the plan's mesh, layout and schedule
    (`plans.config_of`, the one reading of a plan), which a config naming other sizes
    contradicts; the rest (input checks, bucket sizes the plan does not hold) the user's."""
    from .plans.plan import config_of

    ran = config_of(plan)
    sizes = {axis: getattr(ran, axis) for axis in ("tp", "pp", "cp")}
    asked = {axis: getattr(config, axis) for axis in sizes}
    if config.model_parallel and asked != sizes:
        raise PlanError(f"plan=: the plan is for {sizes}, the config asks for {asked}")
    return dataclasses.replace(
        config, **sizes, sequence_parallel=ran.sequence_parallel, schedule=ran.schedule,
        microbatches=ran.microbatches or config.microbatches,
        stages_per_rank=ran.stages_per_rank)


def _runtime(model):
    run = runtime_of(model)
    if run is None:
        raise PlanError("this model was not parallelized by tilework.parallelize")
    return run


def unparallelize(model: nn.Module, optimizer: torch.optim.Optimizer | None = None):
    """Undo `parallelize`: the model and optimizer as one process would hold them after the
    same steps (server tables gathered back into their own modules, their row-wise state into
    the optimizer, every hook and attribute tilework added removed; on a mesh the split
    modules whole again). A collective: every rank calls it, between steps. Returns (model,
    optimizer): under pp the whole model, not the pipeline `parallelize` returned."""
    run = _runtime(model)
    if optimizer is not None and optimizer is not run.engine.optimizer:
        raise PlanError("unparallelize: this optimizer is not the one parallelize was given")
    return run.unparallelize()


def data_parallel_rank(model: nn.Module) -> tuple[int, int]:
    """(this rank's data-parallel replica, how many replicas): how to shard the data, e.g.
    `ShardedBatches(n, batch, *tilework.data_parallel_rank(model))`. Without tp, pp or cp it
    is (rank, world size); on a mesh every rank of a replica (its tp, cp and pp peers) must
    take the same batch, so it is the dp coordinate."""
    return _runtime(model).data_parallel_rank()


def batch_shares(model: nn.Module) -> list[int] | None:
    """Each data-parallel rank's (on a tp or cp mesh: replica's, indexed by
    `data_parallel_rank`) samples of the global batch under the plan the model runs
    (ParallelConfig.batch_shares, given or chosen by plan="auto" with batch_shares="auto"), or
    None where every rank takes the same: e.g. `ShardedBatches(n, sum(shares),
    *tilework.data_parallel_rank(model), shares=shares)`."""
    shares = _runtime(model).batch_shares()
    return None if shares is None else list(shares)


def full_parameters(model: nn.Module):
    """A context in which every ZeRO-3 parameter holds its full values (FSDP's
    `summon_full_params`): for code that reads parameters directly rather than through a
    module's forward (`x @ self.head.weight.t()` in an evaluation method). A collective: every
    rank enters it. Outside ZeRO-3 (or without tilework) it does nothing."""
    engine = getattr(model, "_tilework_engine", None)
    if engine is None or engine.zero.units is None:
        return contextlib.nullcontext()
    return engine.zero.full_values()


def stats(model: nn.Module) -> dict[str, Any]:
    """Bytes this rank sent and received, per method: in total and in the last step (on a
    mesh also "tp", "cp" and "pipeline": the model-parallel axes' bytes)."""
    return _runtime(model).stats()


def state_dict(model, optimizer) -> dict[str, Any]:
    """World-size-independent state in single-device layout (tables complete on rank 0 only)."""
    run = runtime_of(model)
    if run is not None:
        return run.state_dict()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def load_state_dict(model, optimizer, state: dict[str, Any]) -> None:
    run = runtime_of(model)
    if run is not None:
        return run.load_state_dict(state)
    from .checkpoint.state import state_mismatch

    problem = state_mismatch({k: tuple(v.shape) for k, v in model.state_dict().items()},
                             state.get("model") if isinstance(state, dict) else None)
    if problem:  # checked first: torch's own load copies what matches before it complains
        raise CheckpointError(f"checkpoint does not match the model: {problem}")
    saved = state.get("optimizer")
    if optimizer is not None:
        if isinstance(saved, dict) and "rows" in saved:
            raise CheckpointError("this checkpoint's optimizer state is in tilework's layout: "
                                  "parallelize the model first, or pass optimizer=None to load "
                                  "the model alone")
        try:
            optimizer.load_state_dict(saved)
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"checkpoint does not match the optimizer: {e}") from None
    model.load_state_dict(state["model"])


def clip_grad_norm_(model, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over `model`'s parameters and, for a parallelized model,
    the gradients of its tables on the parameter server too (which are not parameters), so
    the norm and the clipping are one process's. A plain or DDP-wrapped module, or an iterable
    of parameters, goes to torch's own. Every rank calls it."""
    run = runtime_of(model)
    if run is not None:
        return run.clip_grad_norm_(float(max_norm), float(norm_type), error_if_nonfinite, foreach)
    params = list(model.parameters() if isinstance(model, nn.Module) else model)
    if not _sparse_grads(params):
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite,
                                              foreach)
    # torch's own refuses sparse gradients (nn.Embedding(sparse=True), under DDP too): the same
    # formula, a sparse gradient's norm being that of its coalesced rows.
    from .runtime.clip import clip_by_total_norm, coalesced_grads, total_norm

    grads = coalesced_grads(params)

    total = total_norm(grads, float(norm_type), foreach)
    return clip_by_total_norm(grads, total, float(max_norm), float(norm_type), error_if_nonfinite)


def clip_grad_value_(model, clip_value: float, foreach: bool | None = None) -> None:
    """torch.nn.utils.clip_grad_value_, server tables included (see clip_grad_norm_)."""
    engine = getattr(model, "_tilework_engine", None)
    if engine is not None:
        return engine.clip_grad_value_(float(clip_value), foreach)
    params = list(model.parameters() if isinstance(model, nn.Module) else model)
    if not _sparse_grads(params):
        return torch.nn.utils.clip_grad_value_(params, clip_value, foreach=foreach)
    from .runtime.clip import coalesced_grads

    for g in coalesced_grads(params):
        g.clamp_(-clip_value, clip_value)


def _sparse_grads(params) -> bool:
    return any(p.grad is not None and p.grad.is_sparse for p in params)


def state_to_write(model, optimizer) -> dict[str, Any] | None:
    """`state_dict`'s content where a checkpoint is written (rank 0): on a mesh gathered there
    alone (None elsewhere), so that no other rank assembles the whole model and optimizer."""
    run = runtime_of(model)
    return run.state_to_write() if run is not None else state_dict(model, optimizer)


def save(path: str | Path, model, optimizer) -> None:
    """Write a checkpoint atomically, with its length and digest (every rank calls it; rank 0
    writes). The same file format as `tilework train`'s checkpoints (checkpoint/file.py)."""
    from .checkpoint import file as checkpoint

    state = state_to_write(model, optimizer)
    run = runtime_of(model)
    if run is None or run.world.rank == 0:
        checkpoint.write(path, state)
    if run is not None and run.world.world_size > 1:
        with run.engine.guard.call("tilework.save()"):
            torch.distributed.barrier(group=run.world.world)


def load(path: str | Path, model, optimizer) -> None:
    """Load a checkpoint from `save` (or `tilework train`): damaged or mismatched files are
    refused before anything is loaded."""
    from .checkpoint import file as checkpoint

    load_state_dict(model, optimizer, checkpoint.load(path)["state"])
