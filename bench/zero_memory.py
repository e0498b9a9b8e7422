"""ZeRO stages 1-3 beside DDP and torch FSDP2 on the GPT: per-rank peak memory and step time,
side by side in one run (issue 13).

    python bench/zero_memory.py [--rounds 5] [--steps 8] [--out FILE]

The GPT (tilework/models/gpt.py) at width 256, 6 layers, vocabulary 8192, 64 tokens, 2 sequences
per rank: 9.0 M parameters (36 MB), so parameters, gradients and AdamW's two moments (about 180
MB a rank under DDP) outweigh the activations (about 14 MB). Systems and how memory is measured:
tilework/bench/zero_peers.py. The headline memory figure is MemTracker's peak of live tensor
storage over two training steps (it follows the storage resizes by which stage 3 and FSDP2 free
and regather parameters, so both are counted by one rule; it does not see what gloo allocates on
its own threads). Beside it, the peak resident set above the process's baseline over building
and two steps, with glibc's mmap threshold fixed at 64 KiB so that freed tensors leave the
resident set: it sees everything, gloo's buffers and allocator slack included, and reads a few
MB of noise (Python objects, first-use caches the warm-up did not reach).

The ranks are local gloo processes (tilework.testing.spawn). In one world, each round builds
every system afresh and times `steps` steps after 2 warm-up ones; a step's time is its slowest
rank's, a round's the median step. Rounds interleave the systems so that drifts in the machine's
speed hit all alike; a ratio to FSDP2 is the median of the per-round ratios. The same world then
runs each system once under MemTracker (deterministic; the tracker slows steps, so nothing is
timed there). Each system's resident set is taken in a world of fresh processes of its own, so
that no system inherits another's heap. tilework.estimate_memory's peak is shown for DDP (stage
0) and for the ZeRO stages where the estimator models them.
"""

from __future__ import annotations

import argparse
import statistics

from tilework.bench.zero_peers import SYSTEMS, Shape, batch, compare, rss_peak
from tilework.testing import spawn

MB = 1e6


def estimates(shape: Shape, world_size: int) -> dict[str, int | None]:
    """tilework.estimate_memory's peak per system, None where it does not model it."""
    from tilework import ParallelConfig, estimate_memory
    from tilework.cluster.topology import Cluster, Host

    model = shape.model("meta")
    cluster = Cluster(hosts=[Host("local", world_size)])
    inputs = batch(shape, 0, 0, world_size)
    got = [estimate_memory(model, ParallelConfig(mode="allreduce", zero=k), inputs, cluster,
                           "adamw") for k in range(4)]
    zero = got[3].parameters != got[0].parameters   # an estimator that models ZeRO at all
    return {"ddp": got[0].peak, "fsdp2": None,
            **{f"zero{k}": got[k].peak if zero else None for k in (1, 2, 3)}}


def run(shape: Shape, systems, rounds: int, steps: int, ranks: int, rss_of=None) -> dict:
    """The timed rounds and MemTracker pass in one world; the resident set of each system in
    `rss_of` (default: all) in a world of fresh processes of its own."""
    got = spawn(compare, ranks, args=(shape, systems, rounds, steps), timeout=7200)
    rss = {s: spawn(rss_peak, ranks, args=(s, shape), timeout=600) if s in (rss_of or systems)
           else [None] for s in systems}
    memory = {s: {k: max(r["memory"][s][k] for r in got)   # the busiest rank's
                  for k in ("peak", "parameters", "optimizer_state")} for s in systems}
    for s in systems:
        memory[s]["rss"] = None if None in rss[s] else max(rss[s])
    return {"memory": memory, "losses": {s: got[0]["memory"][s]["losses"] for s in systems},
            "times": got[0]["times"], "world_size": ranks}


def _paired(values: list[float], base: list[float] | None) -> str:
    if not base:
        return "-"
    return f"{statistics.median(v / b for v, b in zip(values, base)):.2f}"


def table(result: dict, estimate: dict) -> list[str]:
    mem, times = result["memory"], result["times"]
    fsdp2 = mem.get("fsdp2", {}).get("peak")
    lines = ["| system | parameters held | optimizer state | peak (MemTracker) | peak / FSDP2 "
             "| peak RSS above baseline | estimate (peak) | step (ms) | step / FSDP2 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in times:
        m = mem[s]
        cells = [s, f"{m['parameters'] / MB:.1f}", f"{m['optimizer_state'] / MB:.1f}",
                 f"{m['peak'] / MB:.1f}", f"{m['peak'] / fsdp2:.2f}" if fsdp2 else "-",
                 f"{m['rss'] / MB:.1f}" if m["rss"] is not None else "-",
                 f"{estimate[s] / MB:.1f}" if estimate.get(s) else "-",
                 f"{statistics.median(times[s]) * 1e3:.1f}", _paired(times[s], times.get("fsdp2"))]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def summary(shape: Shape, result: dict, rounds: int, steps: int) -> list[str]:
    lines = [f"GPT width {shape.dim}, {shape.layers} layers, vocabulary {shape.vocab}, "
             f"{shape.seq} tokens x {shape.batch} sequences per rank, "
             f"{shape.parameters() / 1e6:.2f} M parameters; {result['world_size']} ranks, "
             f"AdamW; MB = 10^6 bytes, per rank (the larger rank's); {rounds} rounds of "
             f"{steps} steps."]
    losses = result["losses"]
    spread = max(abs(a - b) for v in losses.values() for a, b in zip(v, losses["ddp"])) \
        if "ddp" in losses else 0.0
    lines.append(f"Losses of the two measured steps agree across systems to {spread:.1e}.")
    mem, times = result["memory"], result["times"]
    if "zero3" in mem and "fsdp2" in mem:
        ratio = mem["zero3"]["peak"] / mem["fsdp2"]["peak"]
        rss = (f", by resident set {mem['zero3']['rss'] / mem['fsdp2']['rss']:.3f}"
               if mem["zero3"]["rss"] and mem["fsdp2"]["rss"] else "")
        step = _paired(times["zero3"], times["fsdp2"])
        lines.append(f"zero3 / fsdp2: peak memory {ratio:.3f} by MemTracker{rss} (target <= "
                     f"1.05); step time {step} (target <= 1.1).")
    return lines


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    p.add_argument("--dim", type=int, default=Shape.dim)
    p.add_argument("--layers", type=int, default=Shape.layers)
    p.add_argument("--out", help="also write the table (markdown) here")
    a = p.parse_args()
    shape = Shape(dim=a.dim, layers=a.layers)
    result = run(shape, a.systems, a.rounds, a.steps, a.ranks)
    text = "\n".join([*summary(shape, result, a.rounds, a.steps), "",
                      *table(result, estimates(shape, a.ranks))])
    print(text)
    print("step times by round (ms): " + "; ".join(
        f"{s} " + " ".join(f"{t * 1e3:.0f}" for t in v) for s, v in result["times"].items()))
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
