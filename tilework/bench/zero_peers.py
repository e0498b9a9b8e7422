"""ZeRO stages 1-3 beside DDP and torch FSDP2 on the reference GPT: each system built the same
way from the same seed, and what one rank holds while it trains. `bench/zero_memory.py` tables
and times them; `bench/zero_capacity.py` caps their memory with a cgroup.

Systems: `ddp` (torch DistributedDataParallel, its defaults), `fsdp2` (torch's `fully_shard` on
every transformer layer and then the root, as torchtitan applies it), `zero1`..`zero3`
(`tilework.parallelize(model, opt, mode="allreduce", zero=k)`). All train with AdamW.

Memory is measured two ways, each by one rule for every system:

- `tracked_peak`: torch's MemTracker (torch.distributed._tools.mem_tracker), a dispatch mode that
  keeps a weak reference to every tensor storage an op creates and follows
  `UntypedStorage.resize_` (which it patches), so parameters that stage 3 and FSDP2 free by
  resizing their storage to zero, and gather back the same way, are counted while they exist
  and not after. The system is built inside the tracker (DDP's buckets, the shards, FSDP2's
  DTensors are all seen from their creation); the peak is over the training steps only.
  Blind spots, the same for all: what the gloo backend allocates on its own threads, and
  allocator overhead.
- `rss_peak`: in a fresh process, the peak resident set (VmHWM), reset just before the system
  is built, less the resident set at that moment (after `gc` and glibc's `malloc_trim`), over
  building it and training: everything, gloo's buffers and allocator slack included. glibc's
  mmap threshold is fixed first (`fix_mmap_threshold`), or the figure would follow the heap's
  high-water layout (and, in a process that ran other systems before, their leftovers).

`held_bytes` counts the storages a rank keeps between steps: parameters (the model's and the
optimizer's, each storage once; a DTensor by its local shard) and optimizer state.
"""

from __future__ import annotations

import ctypes
import gc
import statistics
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..models.gpt import TinyGPT

SYSTEMS = ("ddp", "fsdp2", "zero1", "zero2", "zero3")


@dataclass(frozen=True)
class Shape:
    """The GPT and one rank's batch: `batch` sequences of `seq` tokens."""
    dim: int = 256
    layers: int = 6
    vocab: int = 8192
    seq: int = 64
    batch: int = 2

    def model(self, device=None) -> TinyGPT:
        with torch.device(device or "cpu"):
            return TinyGPT(self.vocab, self.dim, max(1, self.dim // 64), self.layers, self.seq)

    def parameters(self) -> int:
        return sum(p.numel() for p in self.model("meta").parameters())


def build(system: str, shape: Shape):
    """The model and AdamW optimizer of `system`, from seed 0. "zero3-offload": stage 3 with
    ParallelConfig(offload="all") (its shards and optimizer state in memory-mapped files)."""
    torch.manual_seed(0)
    model = shape.model()
    if system == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif system == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.blocks.layers:
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if system.startswith("zero"):
        import tilework

        extra = {"offload": "all"} if system.endswith("-offload") else {}
        tilework.parallelize(model, opt, mode="allreduce", zero=int(system[4]), log=False,
                             **extra)
    return model, opt


def batch(shape: Shape, step: int, rank: int, world_size: int) -> tuple:
    """This rank's share of step `step`'s global batch (the same on every system)."""
    g = torch.Generator(device="cpu").manual_seed(step)
    tokens = torch.randint(0, shape.vocab, (shape.batch * world_size, shape.seq + 1),
                           generator=g, device="cpu")
    mine = tokens[rank * shape.batch:(rank + 1) * shape.batch]
    return mine[:, :-1], mine[:, 1:]


def train_step(model, opt, inputs) -> float:
    loss = model(*inputs)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _storages(tensors) -> dict[int, int]:
    """Storage -> bytes, each storage once; a DTensor by its local shard."""
    out = {}
    for t in tensors:
        if hasattr(t, "to_local"):
            t = t.to_local()
        st = t.untyped_storage()
        out[st._cdata] = st.nbytes()
    return out


def held_bytes(model, opt) -> dict[str, int]:
    """Bytes a rank holds between steps: parameters (the model's and those the optimizer
    updates: ZeRO's shards) and the optimizer's state."""
    params = [*model.parameters(), *(p for g in opt.param_groups for p in g["params"])]
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return {"parameters": sum(_storages(params).values()),
            "optimizer_state": sum(_storages(state).values())}


def tracked_peak(rank: int, world_size: int, system: str, shape: Shape, steps: int = 2) -> dict:
    """MemTracker's peak bytes over `steps` training steps (the second holds Adam's state
    from its start), the bytes held after them, and the losses."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with warnings.catch_warnings():
        # Its gradient hook meets parameters whose .grad ZeRO 2/3 already moved to the shard.
        warnings.simplefilter("ignore", UserWarning)
        with tracker:
            model, opt = build(system, shape)
        tracker.reset_mod_stats()
        losses = []
        with tracker:   # entered again: the peak starts from what the built system holds
            for step in range(steps):
                losses.append(train_step(model, opt, batch(shape, step, rank, world_size)))
                tracker.reset_mod_stats()
    peak = sum(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values())
    return {"peak": peak, **held_bytes(model, opt), "losses": losses}


# -- resident set ---------------------------------------------------------------------------------

def fix_mmap_threshold(nbytes: int = 1 << 16) -> bool:
    """glibc serves every allocation of `nbytes` or more by its own mapping, returned to the
    system when freed. By default the threshold grows (up to 32 MB) each time such a block is
    freed, after which freed tensors stay in the heap and the resident set keeps a high-water
    mark of the heap's layout, not of live memory. Process-wide and for good (timed runs
    belong in other processes)."""
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(-3, nbytes))   # M_MMAP_THRESHOLD
    except OSError:
        return False


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _rss_reset() -> int | None:
    """Freed heap handed back, the peak resident set reset to the current one (Linux 4.0+);
    returns that baseline, or None where this cannot be done."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status("VmRSS")
    except OSError:
        return None


def rss_peak(rank: int, world_size: int, system: str, shape: Shape, steps: int = 2) -> int | None:
    """The peak resident set above the baseline taken just before `system` is built, over
    building it and `steps` training steps; None where it cannot be read. Meant as the first
    thing a fresh process does: the threshold is fixed, and a tiny model of the same system
    trains one step first so that lazy imports and first-use caches are in the baseline."""
    fix_mmap_threshold()
    tiny = Shape(dim=64, layers=2, vocab=256, seq=8, batch=1)
    model, opt = build(system, tiny)
    train_step(model, opt, batch(tiny, 0, rank, world_size))
    del model, opt
    baseline = _rss_reset()
    model, opt = build(system, shape)
    for step in range(steps):
        train_step(model, opt, batch(shape, step, rank, world_size))
    return None if baseline is None else _status("VmHWM") - baseline


# -- time -----------------------------------------------------------------------------------------

def timed_round(system: str, shape: Shape, rank: int, world_size: int, steps: int,
                warmup: int = 2) -> float:
    """The median over `steps` steps (after `warmup`) of the slowest rank's step time."""
    model, opt = build(system, shape)
    times = []
    for step in range(warmup + steps):
        inputs = batch(shape, step, rank, world_size)
        dist.barrier()
        start = time.perf_counter()
        train_step(model, opt, inputs)
        if step >= warmup:
            times.append(time.perf_counter() - start)
    slowest = torch.tensor(times, dtype=torch.float64, device="cpu")
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return statistics.median(slowest.tolist())


def compare(rank: int, world_size: int, shape: Shape, systems, rounds: int, steps: int) -> dict:
    """One rank of the side-by-side run (`tilework.testing.spawn`'s entry): `rounds` rounds
    that time every system in turn, then every system once under MemTracker."""
    times = {s: [] for s in systems}
    for _ in range(rounds):
        for s in systems:
            times[s].append(timed_round(s, shape, rank, world_size, steps))
    return {"times": times, "memory": {s: tracked_peak(rank, world_size, s, shape)
                                       for s in systems}}
