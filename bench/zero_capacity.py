"""The largest GPT that trains under a memory cap (issue 13): DDP, ZeRO-3 and ZeRO-3 with
offload, with torch FSDP2 beside them as the reference peer.

    python bench/zero_capacity.py [--cap-gib 1.5] [--out FILE.md] [--png FILE.png]

Both ranks run in one memory cgroup of their own, from their exec on (the Python interpreter,
torch and gloo included: what a machine with that much memory would have to hold), with swap off
for it, so going over the cap is a real out-of-memory kill. cgroup v2 where its memory controller
is enabled (memory.max, memory.swap.max = 0); else cgroup v1 (memory.limit_in_bytes and
memory.memsw.limit_in_bytes both at the cap), as on the machine these figures come from. The
group is made inside this process's own memory cgroup, so every limit above it still applies,
and removed at the end. Needs root; without a writable memory cgroup it says why and stops.

A trial builds the GPT (6 layers, vocabulary 8192, width a multiple of 64, a head per 64) on 2
ranks and trains 3 AdamW steps (2 sequences of 64 tokens per rank); it fits if both ranks finish,
and is over the cap if the cgroup's OOM-kill count rose. Per system, the width doubles from 256
until a trial fails, then bisection finds the largest width that fits, up to --max-dim.
ZeRO-3 + offload is ParallelConfig(offload="all"): the shards and AdamW's state live in
memory-mapped files (parallel/data/offload.py), whose pages the kernel may write out under the cap.
Every system is searched twice: with glibc's allocator as it comes, and with its mmap threshold
fixed (ALLOCATORS below), since on a CPU host what a sharded system frees between uses only
leaves the resident set, and so the cap, if the allocator hands it back.

The default cap, 1.5 GiB for both ranks, is small enough that a trial takes seconds on 2 cores,
and leaves about 1 GiB beside the two interpreters (torch, gloo and tilework imported, about
0.25 GiB each charged to the group, measured with a width-64 GPT) for a model of tens of
millions of parameters.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tilework.bench.cgroup import MemoryCap, run_capped  # noqa: E402

LAYERS, STEPS = 6, 3
SYSTEMS = ("ddp", "fsdp2", "zero3", "zero3-offload")
# The workers' allocator: glibc as it comes, and with a fixed mmap threshold, so that every
# block of 64 KiB or more is its own mapping, handed back when freed. glibc's default threshold
# rises (up to 32 MB) with each such block freed, after which what a system frees between uses
# (gathered values, gradient buckets) stays in the heap instead.
ALLOCATORS = {"default": {}, "mmap64k": {"MALLOC_MMAP_THRESHOLD_": "65536"}}
LEGEND = {"default": "glibc malloc as it comes", "mmap64k": "glibc mmap threshold fixed at 64 KiB"}


# -- one trial ------------------------------------------------------------------------------------

def worker(system: str, dim: int, port: int) -> None:
    """One rank of a trial (run as `zero_capacity.py --worker ...` by `trial`)."""
    import torch
    import torch.distributed as dist

    from tilework.bench.zero_peers import Shape, batch, build, train_step
    from tilework.comm import exit_worker

    torch.set_num_threads(1)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                          timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    shape = Shape(dim=dim, layers=LAYERS)
    model, opt = build(system, shape)
    for step in range(STEPS):
        train_step(model, opt, batch(shape, step, rank, world_size))
    dist.barrier()
    exit_worker(0)  # not a normal exit: see tilework.comm.exit_worker


def trial(cap: MemoryCap, system: str, dim: int, ranks: int, timeout: float,
          env: dict | None = None) -> dict:
    """Trains `system` at width `dim` on `ranks` workers inside the cap, with `env` added to
    their environment: "fits", "oom", "timeout" or "error" (the first failed rank's last
    line)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, ranks + 1, is_master=True, wait_for_workers=False)
    cap.reset_peak()
    got = run_capped([__file__, "--worker", system, str(dim), str(store.port)], [cap] * ranks,
                     timeout, {**os.environ, **(env or {})})
    return {"dim": dim, **got, "peak": cap.peak()}


# -- the search -----------------------------------------------------------------------------------

def largest(cap: MemoryCap, system: str, allocator: str, ranks: int, max_dim: int,
            timeout: float) -> dict:
    """The largest width (a multiple of 64, up to `max_dim`) at which `system` trains under
    the cap: doubling from 256 until a trial fails, then bisection."""
    trials = []

    def fits(dim: int) -> bool:
        trials.append(trial(cap, system, dim, ranks, timeout, ALLOCATORS[allocator]))
        t = trials[-1]
        print(f"  {system:>13} {allocator:>7} width {dim:5d}: {t['outcome']:7} "
              f"{t['seconds']:5.1f} s" + (f"  cgroup peak {t['peak'] / 2**30:.2f} GiB"
                                          if t["peak"] else "")
              + (f"  {t['detail']}" if t["detail"] else ""), flush=True)
        return t["outcome"] == "fits"

    good, bad = 0, None
    dim = 256
    while dim <= max_dim:
        if not fits(dim):
            bad = dim
            break
        good, dim = dim, dim * 2
    if bad is None and good < max_dim:
        good, bad = (max_dim, None) if fits(max_dim) else (good, max_dim)
    while bad is not None and bad - good > 64:
        middle = (good + bad) // 128 * 64
        good, bad = (middle, bad) if fits(middle) else (good, middle)
    failed = next((t for t in trials if t["dim"] == bad), None)
    return {"system": system, "allocator": allocator, "dim": good, "trials": trials,
            "limit": "search limit" if bad is None else failed["outcome"],
            "peak": next((t["peak"] for t in trials if t["dim"] == good), None)}


def params(dim: int) -> int:
    from tilework.bench.zero_peers import Shape

    return Shape(dim=dim, layers=LAYERS).parameters() if dim else 0


def table(rows: list[dict], cap_gib: float) -> list[str]:
    lines = [f"Cap {cap_gib:g} GiB for both ranks (swap off), GPT with {LAYERS} layers and "
             f"vocabulary 8192, {STEPS} AdamW steps; allocator: glibc's default, or its mmap "
             "threshold fixed at 64 KiB (MALLOC_MMAP_THRESHOLD_=65536).", "",
             "| system | allocator | largest width that trains | parameters | vs DDP "
             "| cgroup peak there | the next width up | trials |",
             "|---|---|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        n = params(r["dim"])
        ddp = next((params(d["dim"]) for d in rows
                    if d["system"] == "ddp" and d["allocator"] == r["allocator"]), 0)
        cells = [r["system"], r["allocator"], str(r["dim"] or "none"), f"{n / 1e6:.1f} M",
                 f"{n / ddp:.2f}x" if ddp else "-",
                 f"{r['peak'] / 2**30:.2f} GiB" if r["peak"] else "-", r["limit"],
                 str(len(r["trials"]))]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def plot(rows: list[dict], cap_gib: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = list(dict.fromkeys(r["system"] for r in rows))
    allocators = list(dict.fromkeys(r["allocator"] for r in rows))
    width = 0.8 / len(allocators)
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for i, (allocator, colour) in enumerate(zip(allocators, ("#8d99ae", "#43aa8b"))):
        mine = {r["system"]: r for r in rows if r["allocator"] == allocator}
        xs = [j + (i - (len(allocators) - 1) / 2) * width for j in range(len(systems))]
        sizes = [params(mine[s]["dim"]) / 1e6 if s in mine else 0 for s in systems]
        bars = ax.bar(xs, sizes, width, color=colour, label=LEGEND[allocator])
        for bar, s in zip(bars, systems):
            if s in mine:
                ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(),
                        f"{bar.get_height():.0f} M\nw{mine[s]['dim']}", ha="center",
                        va="bottom", fontsize=7)
    ax.set_xticks(range(len(systems)), systems)
    ax.set_ylabel("parameters of the largest GPT that trains (M)")
    ax.set_ylim(0, max(params(r["dim"]) for r in rows) / 1e6 * 1.3)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title(f"Largest GPT ({LAYERS} layers, vocabulary 8192) that trains {STEPS} AdamW "
                 f"steps\non 2 CPU ranks in a {cap_gib:g} GiB cgroup (swap off)", fontsize=10)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return 0
    p = argparse.ArgumentParser()
    p.add_argument("--cap-gib", type=float, default=1.5)
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    p.add_argument("--allocators", nargs="+", default=list(ALLOCATORS), choices=ALLOCATORS)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--max-dim", type=int, default=2048)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per trial")
    p.add_argument("--out", help="also write the table (markdown) here")
    p.add_argument("--png", help="and the figure here")
    a = p.parse_args()
    try:
        cap = MemoryCap(int(a.cap_gib * 2**30))
    except OSError as e:
        print(f"zero_capacity: no memory cgroup can be made here ({e}); nothing was run.")
        return 0
    try:
        rows = [largest(cap, s, alloc, a.ranks, a.max_dim, a.timeout)
                for alloc in a.allocators for s in a.systems]
    finally:
        cap.remove()
    text = "\n".join(table(rows, a.cap_gib))
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    if a.png:
        plot(rows, a.cap_gib, a.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
