"""What parallelize checks before it changes anything: modules already wrapped for data
parallelism are refused, models that differ across ranks are refused, models on a device the
world's backend cannot carry are refused, parameter values that differ are warned about (rank
0's win, as in DDP)."""

from __future__ import annotations

import hashlib
import json
import warnings

import torch
import torch.distributed as dist
from torch import nn

from ..errors import PlanError, use_allreduce_hint


def refuse_wrapped(model: nn.Module) -> None:
    """A module already wrapped for data parallelism would be synchronised twice (or by ranks
    that disagree on what it holds): refused."""
    for name, m in model.named_modules():
        kinds = {c.__name__ for c in type(m).__mro__}
        wrapper = kinds & {"DistributedDataParallel", "FullyShardedDataParallel", "FSDPModule"}
        if wrapper:
            where = f"submodule {name}" if name else "the model"
            raise PlanError(f"{where} is wrapped in {wrapper.pop()}: tilework synchronises the "
                            "model itself; pass the plain module (turn the script's own "
                            "distributed mode off)")


def model_device(model: nn.Module) -> torch.device | None:
    """The one device of the model's parameters and buffers (None for a model without any)."""
    devices = {t.device for t in [*model.parameters(), *model.buffers()]}
    if len(devices) > 1:
        shown = ", ".join(sorted(str(d) for d in devices))
        raise PlanError(f"the model's parameters and buffers are on several devices ({shown}): "
                        "data parallelism keeps one replica per rank on one device; move the "
                        "model with model.to(device) before parallelize")
    return next(iter(devices), None)


def check_device(model: nn.Module, groups) -> None:
    """Every tensor tilework creates follows the model's device, so the world's backend must
    carry that device: NCCL only CUDA tensors, on this rank's own GPU (gloo carries both)."""
    if groups.world_size == 1:
        return  # no collective runs
    device = model_device(model)
    if device is None or dist.get_backend(groups.world) != "nccl":
        return
    if device.type != "cuda":
        raise PlanError(f"the world's backend is nccl, which carries CUDA tensors only, but the "
                        f"model is on {device}: move it with model.to({str(groups.device)!r}) "
                        "before parallelize, or start the world with dist.init_process_group("
                        "\"gloo\") to train on the CPU")
    if device != groups.device:
        raise PlanError(f"the model is on {device} but this rank's NCCL device is "
                        f"{groups.device}: call torch.cuda.set_device(local_rank) before "
                        "building the model, or move it with model.to(torch.cuda.current_device())")


def check_same_model_everywhere(model: nn.Module, groups) -> None:
    """Parameter names, shapes and dtypes must agree on every rank, else collectives deadlock.
    Values that differ are copied from rank 0 (as DDP does), with a warning naming them: a
    script that seeds each rank differently, or builds rank-dependent tables, learns of it."""
    if groups.world_size == 1:
        return
    with torch.no_grad():
        mine = [(n, tuple(p.shape), str(p.dtype), _fingerprint(p))
                for n, p in model.named_parameters()]
    everyone: list = [None] * groups.world_size
    dist.all_gather_object(everyone, mine, group=groups.world)
    reference = dict((n, (s, d)) for n, s, d, _ in everyone[0])
    for rank, theirs in enumerate(everyone[1:], start=1):
        theirs_map = dict((n, (s, d)) for n, s, d, _ in theirs)
        for name in sorted(set(reference) | set(theirs_map)):
            a, b = reference.get(name), theirs_map.get(name)
            if a != b:
                def show(x):
                    return "absent" if x is None else f"shape {x[0]} {x[1]}"
                raise PlanError(f"the model differs across ranks: parameter {name} is "
                                f"{show(a)} on rank 0 but {show(b)} on rank {rank}")
    differ = [n for i, (n, *_rest) in enumerate(everyone[0])
              if any(theirs[i][3] != everyone[0][i][3] for theirs in everyone[1:])]
    if differ and groups.rank == 0:
        shown = ", ".join(differ[:5]) + (f" and {len(differ) - 5} more" if len(differ) > 5 else "")
        warnings.warn(f"tilework: parameters differ across ranks before training: {shown}; every "
                      "rank starts from rank 0's values (as with DDP). Seed the model the same "
                      "way on every rank (torch.manual_seed before building it) to silence this",
                      stacklevel=4)


def check_same_plan_everywhere(plan, groups) -> None:
    """Every rank must run one plan: ranks that place a parameter differently (a plan made on
    each rank from inputs that differ, or a plan='auto' whose choice differed) meet in
    different collectives, which gloo may answer with corrupt memory rather than an error.
    One digest per rank, gathered; where they differ, the plans themselves, and the first
    difference named. What a plan only says for the reader (each entry's reason and predicted
    cost, which a rank's own measurements may word differently) is left out of the digest, and
    so is the offload directory, a path on each host's own disk."""
    if groups.world_size == 1:
        return
    from ..plans.plan import Plan

    mine = plan.as_dict()
    mine.pop("offload_dir", None)
    for entry in mine["params"]:
        entry.pop("reason", None)
        entry.pop("predicted", None)
    digest = hashlib.sha256(json.dumps(mine, sort_keys=True, default=repr).encode()).hexdigest()
    digests: list = [None] * groups.world_size
    dist.all_gather_object(digests, digest, group=groups.world)
    if len(set(digests)) == 1:
        return
    plans: list = [None] * groups.world_size
    dist.all_gather_object(plans, plan.as_dict(), group=groups.world)
    other = next(r for r, d in enumerate(digests) if d != digests[0])
    lines = [line for line in Plan.from_dict(plans[0]).diff(Plan.from_dict(plans[other]))
             if ".predicted:" not in line and not line.startswith("offload_dir:")] \
        or ["(in detail)"]
    more = f" (and {len(lines) - 1} more)" if len(lines) > 1 else ""
    raise PlanError(f"the plan differs across ranks: rank 0 -> rank {other}: {lines[0]}{more}; "
                    "every rank must run the same plan: make it on one rank and send it to "
                    "the others (Plan.as_dict / Plan.from_dict), or give every rank the same "
                    "density and traffic to plan from")


def _fingerprint(p: torch.Tensor) -> tuple[float, float]:
    # Two float64 sums: different random initialisations never agree on both.
    flat = p.detach().reshape(-1).double()
    return float(flat.sum()), float((flat * flat).sum())


def check_optimizer_covers(model, optimizer) -> None:
    """Every trainable parameter is the optimizer's: the servers take their rows from it."""
    in_opt = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in in_opt:
            raise PlanError(f"{name} is trainable but not in the optimizer: pass an optimizer "
                            "built over model.parameters()")

def check_not_tied(model, name, p) -> None:
    """A table bound for the servers belongs to one module: the servers replace that module's
    lookups, and the other owner would keep a weight nobody updates. The planner keeps tied
    tables all-reduced; this catches a plan made elsewhere (Plan.from_dict)."""
    owners = [m for m in model.modules() if any(q is p for q in m.parameters(recurse=False))]
    if len(owners) > 1:
        raise PlanError(f"{name} is shared by {len(owners)} modules (tied weights), and the "
                        "parameter server serves one module's table; to all-reduce it "
                        f"instead: {use_allreduce_hint(name)}")
