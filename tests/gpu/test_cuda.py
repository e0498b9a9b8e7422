"""Checks that need CUDA (issue 11, item 7): tilework on CUDA trains as one plain CUDA process,
and every tensor it creates is on the GPU. Skipped without a GPU; `tests/gpu/run.sh` runs them on
a machine that has one.

One GPU is the common case here: a world of one NCCL rank (every collective short-circuits, but
every tensor tilework makes is a CUDA one), and two gloo ranks sharing the GPU (gloo carries CUDA
tensors, so the real collectives run: all-to-all, all-reduce, gather). NCCL refuses two ranks on
one GPU, so the two-rank NCCL check needs two.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import tilework
from tilework.testing import spawn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU: run when the device tool lends one")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2,
                              reason="NCCL refuses two ranks on one GPU: needs two GPUs")

PACKAGE = str(Path(tilework.__file__).resolve().parent)
STEPS, BATCH, LR = 4, 8, 0.1
MADE = {"zeros", "ones", "empty", "full", "tensor", "as_tensor", "arange", "rand", "randn",
        "randint", "randperm", "linspace", "eye", "zeros_like", "ones_like", "empty_like",
        "full_like", "new_zeros", "new_ones", "new_empty", "new_full", "new_tensor"}


class Hybrid(nn.Module):
    """A sparse table (on the servers), a dense table served by them, a dense head all-reduced."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.table = nn.Embedding(64, 8, sparse=True)
        self.extra = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, ids):
        return self.head(self.table(ids).mean(1) + self.extra(ids % 16).mean(1)).pow(2).mean()


def batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (BATCH, 3), generator=g) for _ in range(STEPS)]


def train(model, opt, parts, clip):
    losses = []
    for ids in parts:
        loss = model(ids.cuda())
        loss.backward()
        clip(model, 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def reference():
    """One plain CUDA process, full batches."""
    model = Hybrid().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = train(model, opt, batches(), tilework.clip_grad_norm_)  # plain model: torch's rule
    return losses, {k: v.cpu() for k, v in model.state_dict().items()}


class Created(TorchFunctionMode):
    """Where each tensor made by code in tilework/ landed (an explicit device="cpu" is meant)."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, torch.device]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        meant_for_host = isinstance(kwargs.get("device"), str) and kwargs["device"] == "cpu"
        if getattr(func, "__name__", "") in MADE and torch.is_tensor(out) and not meant_for_host:
            caller = sys._getframe(1)
            if caller.f_code.co_filename.startswith(PACKAGE):
                self.seen.append((f"{caller.f_code.co_filename}:{caller.f_lineno}", out.device))
        return out


def parallel(rank, world_size, config, own_gpu=False):
    """One rank: the model on this rank's GPU (the first, unless each rank has its own), its
    share of each batch, tilework's clipping."""
    if not own_gpu:
        torch.cuda.set_device(0)
    model = Hybrid().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    with Created() as created:
        tilework.parallelize(model, opt, log=False, **config)
        losses = train(model, opt, [b.chunk(world_size)[rank] for b in batches()],
                       tilework.clip_grad_norm_)
        state = tilework.state_dict(model, opt)["model"]
    engine = model._tilework_engine
    held = {name: t for name, t in model.state_dict(keep_vars=True).items()
            if name not in engine.tables}
    for name, part in [*engine.tables.items(), *engine.served.items()]:
        held |= {f"{name} shard": part.shard, f"{name} rows": part.layout.shard_rows(rank),
                 f"{name} owners": part.layout.servers}
        held |= {f"{name} {k}": v for k, v in part.optimizer.state_tensors().items()}
    # Only what goes to the backend alone (input-check flags, the clipping scalar) may be on
    # its device instead: the CPU for gloo.
    expected = {"cuda", engine.groups.device.type}
    elsewhere = sorted({where for where, device in created.seen if device.type not in expected})
    return {"losses": losses, "made": len(created.seen), "elsewhere": elsewhere,
            "state": {k: v.cpu() for k, v in state.items()} if rank == 0 else None,
            "held": {k: str(v.device) for k, v in held.items()},
            "gpu": str(torch.device("cuda", torch.cuda.current_device()))}


def check_matches_reference(results):
    want_losses, want_state = reference()
    for r in results:
        assert r["elsewhere"] == [], f"tensors tilework made off the GPU: {r['elsewhere']}"
        assert r["made"] > 0  # the recorder saw tilework's calls at all
        assert set(r["held"].values()) == {r["gpu"]}, r["held"]
    mean = [sum(r["losses"][s] for r in results) / len(results) for s in range(STEPS)]
    assert mean == pytest.approx(want_losses, rel=1e-5)
    state = results[0]["state"]
    assert state.keys() == want_state.keys()
    for key, want in want_state.items():
        torch.testing.assert_close(state[key], want, rtol=1e-5, atol=1e-6, msg=key)


CONFIGS = pytest.mark.parametrize("config", [
    {"overrides": {"extra.weight": "ps"}},  # both tables served, the head all-reduced
    {"mode": "ps"},                         # the head served too: a replica, its rows owned
], ids=["hybrid", "ps"])


@CONFIGS
def test_one_nccl_rank_trains_as_one_cuda_process(config):
    check_matches_reference(spawn(parallel, 1, args=(config,), backend="nccl", timeout=180))


@CONFIGS
def test_two_gloo_ranks_on_one_gpu_train_as_one_cuda_process(config):
    """gloo carries the CUDA tensors: every collective of a step really runs."""
    check_matches_reference(spawn(parallel, 2, args=(config,), backend="gloo", timeout=180))


@two_gpus
@CONFIGS
def test_two_nccl_ranks_train_as_one_cuda_process(config):
    check_matches_reference(spawn(parallel, 2, args=(config, True), backend="nccl",
                                  timeout=180))


def refuse_cpu_model(rank, world_size):
    from tilework.comm.groups import build_groups
    from tilework.errors import PlanError
    from tilework.runtime.preflight import check_device

    groups = build_groups()
    assert groups.device.type == "cuda"
    two = type("G", (), {"world_size": 2, "world": groups.world, "device": groups.device})()
    with pytest.raises(PlanError, match="nccl, which carries CUDA tensors only"):
        check_device(nn.Linear(2, 2), two)
    check_device(nn.Linear(2, 2).cuda(), two)
    return True


def test_an_nccl_world_refuses_a_cpu_model_by_name():
    assert spawn(refuse_cpu_model, 1, backend="nccl", timeout=120) == [True]


def calibrate_on_gpu(rank, world_size, own_gpu, collectives):
    """calibrate's timers and rates on this rank's GPU, every tensor they make there; NCCL
    carries no CPU tensor, so one made on the CPU fails the call."""
    from tilework.cluster import calibrate

    device = torch.device("cuda", rank if own_gpu else 0)
    torch.cuda.set_device(device)
    world = torch.distributed.group.WORLD
    with Created() as created:
        fits = calibrate.measure(world, world_size, calibrate.QUICK_SIZES, 3, collectives,
                                 device=device)
        flops = calibrate.measure_compute(world, world_size, device)
        speeds = calibrate.measure_speeds(world, world_size, [[0], [1]], device)
    off = sorted({where for where, made in created.seen if made.type != "cuda"})
    return {"off": off, "fits": sorted(fits), "flops": flops, "speeds": speeds,
            "made": len(created.seen)}


def test_calibration_times_on_the_gpu_through_gloo():
    """Two gloo ranks on one GPU: calibrate's buffers, times and rates are CUDA tensors (the
    all-reduce, which gloo carries on CUDA)."""
    for r in spawn(calibrate_on_gpu, 2, args=(False, ("all_reduce",)), backend="gloo",
                   timeout=180):
        assert r["made"] > 0 and r["off"] == [], r["off"]
        assert r["fits"] == ["all_reduce"] and r["flops"] > 0


@two_gpus
def test_calibration_runs_on_nccl():
    """`tilework calibrate` and a live plan="auto" time NCCL's collectives on the GPUs (before,
    their buffers were CPU tensors, which NCCL refuses)."""
    for r in spawn(calibrate_on_gpu, 2, args=(True, ("all_reduce", "all_gather",
                                                      "reduce_scatter", "all_to_all")),
                   backend="nccl", timeout=180):
        assert r["off"] == [], r["off"]
        assert "all_reduce" in r["fits"] and r["flops"] > 0
