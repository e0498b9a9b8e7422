"""A host with half the memory gets a share of the batch (or, `--zero`, of ZeRO-3's chunks)
that fits, where the even split is killed: measured under real memory caps.

    sudo .venv/bin/python bench/heterogeneous_memory.py [--zero] [--out FILE]

Two gloo ranks, each in a memory cgroup of its own with swap off (tilework/bench/cgroup.py;
root), training the GPT below with AdamW, a global batch of 8 sequences. Rank 1 is given M
(what its host has for training), rank 0 twice that. M is set from the memory estimate so that
rank 1's estimated peak under the even split (4 sequences) is over M, while a smaller share
fits under 80% of M. The planner's rule (train/planning.job_config: estimate/plan_memory.share_caps
bisects the largest batch each rank's budget holds, planner/shares.batch_shares splits the batch
within those caps) gives the shares; then both splits run, each rank's cap M_r plus what its
process holds before any model exists (measured first, as bench/planner_memory.py does), with
glibc's mmap threshold fixed at 64 KiB (docs/planner.md: the 80% rule holds on CPU hosts only
with it). Prints each split's outcome and each rank's estimated and measured peak over M_r.

`--zero`: ZeRO-3 on a deeper GPT whose parameters and Adam state outweigh its activations
(ZERO_SHAPE), the batch split evenly, rank 0 given three times rank 1's M; M set so that rank
1's estimated peak under even chunks is over M while under chunks by memory (zero_weights 3:1,
what train/planning.job_config sets from the hosts' memory_gb) it is under 80% of M; both
run. (At 2:1 the light rank's peak falls by less: every chunk crosses padded to the largest,
so the buckets and gathered units grow by 4/3 while its shards halve.)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import planner_memory as pm  # noqa: E402
import torch  # noqa: E402

from tilework.bench.cgroup import MemoryCap  # noqa: E402

SHAPE = {"vocab": 4096, "dim": 256, "heads": 4, "layers": 4, "seq": 256, "batch": 8}
# Sixteen blocks under a small vocabulary: ZeRO-3's own units are small beside the shards.
ZERO_SHAPE = {"vocab": 2048, "dim": 512, "heads": 8, "layers": 16, "seq": 32, "batch": 4}
ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def estimates():
    """The even plan, and rank 1's estimated peak at each batch size 1..8."""
    from tilework import ParallelConfig
    from tilework import plan as make_plan
    from tilework.cluster.topology import Topology
    from tilework.estimate.memory import estimate_per_rank
    from tilework.estimate.plan_memory import with_batch

    with torch.device("meta"):
        meta = pm.new_model(SHAPE)
    even = make_plan(meta, ParallelConfig(), topology=Topology.uniform(2, 1))
    ids = torch.zeros(SHAPE["batch"] // 2, SHAPE["seq"], dtype=torch.long)
    peaks = {n: estimate_per_rank(meta, even, with_batch((ids, ids), n), torch.optim.AdamW,
                                  [1])[0].peak for n in range(1, SHAPE["batch"] + 1)}
    return meta, even, (ids, ids), peaks


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--zero", action="store_true",
                    help="ZeRO-3's chunks even and by memory, not the batch's shares")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    made = zero_splits() if a.zero else batch_splits()
    if made is None:
        return 1
    shape, given, splits, estimated, caps = made
    try:
        groups = [MemoryCap(64 * 2**30, name=f"hetero-rank{r}") for r in range(2)]
    except OSError as e:
        print(f"heterogeneous_memory: no memory cgroup can be made here ({e}); nothing was run.")
        return 0
    rows = {}
    try:
        for g in groups:
            g.set_limit(64 * 2**30)
        base = pm.trial(groups, None, a.timeout, ENV, shape)
        baseline = base["peaks"]
        if base["outcome"] != "fits" or None in baseline:
            raise RuntimeError(f"the baseline run did not finish: {base}")
        for g, m, b in zip(groups, given, baseline):
            g.set_limit(int(m + b))
        for name, (options, counts) in splits.items():
            got = pm.trial(groups, options, a.timeout, ENV, shape)
            rows[name] = {"shares": counts, "outcome": got["outcome"], "detail": got["detail"],
                          "estimated": estimated[name],
                          "measured": [None if p is None else p - b
                                       for p, b in zip(got["peaks"], baseline)]}
    finally:
        for g in groups:
            g.remove()
    before = ", ".join(f"{b / 2**20:.0f}" for b in baseline)
    print(f"M: rank 0 {given[0] / 2**20:.0f} MiB, rank 1 {given[1] / 2**20:.0f} MiB (each cap "
          f"M_r plus its process before any model: {before} MiB); {caps}")
    print("| split | shares | outcome | rank 0 estimated / measured of M_0 | "
          "rank 1 estimated / measured of M_1 |\n|---|---|---|---:|---:|")
    for name, r in rows.items():
        cells = [f"{e / m:.0%} / " + ("-" if u is None else f"{u / m:.0%}")
                 for e, u, m in zip(r["estimated"], r["measured"], given)]
        print(f"| {name} | {r['shares']} | {r['outcome']} | " + " | ".join(cells) + " |")
    if a.out:
        a.out.write_text(json.dumps({"memory": given, "baseline": baseline, "caps": caps,
                                     "rows": rows}, indent=1))
    return 0


def batch_splits():
    """(shape, each rank's M, {split: (options, shares)}, each split's estimated peaks, what
    set the split) for the batch's shares; None where the shape cannot show it."""
    from tilework.estimate.plan_memory import share_caps
    from tilework.planner.shares import batch_shares

    meta, even, inputs, peaks = estimates()
    half = SHAPE["batch"] // 2
    # M: the budget (80% of M) holds half of the even share; the even share is over M.
    memory = peaks[half // 2] / pm.SHARE * 1.02
    if peaks[half] <= memory:
        print(f"the even share's estimated peak {peaks[half] / 2**20:.0f} MiB is within M = "
              f"{memory / 2**20:.0f} MiB: choose a shape whose activations weigh more")
        return None
    given = [2 * memory, memory]
    caps = share_caps(meta, even, inputs, [pm.SHARE * m for m in given], SHAPE["batch"],
                      torch.optim.AdamW)
    shares = list(batch_shares(SHAPE["batch"], [1.0, 1.0], caps))
    splits = {"even": ({}, [half, half]), "shares": ({"batch_shares": shares}, shares)}
    estimated = {name: [_estimate(meta, even, inputs, n, r) for r, n in enumerate(counts)]
                 for name, (_, counts) in splits.items()}
    return SHAPE, given, splits, estimated, \
        f"caps from the estimate (samples a step within 80% of M_r): {caps}"


def zero_splits():
    """`batch_splits` for ZeRO-3's chunks: even, and by memory (3:1)."""
    from tilework import ParallelConfig
    from tilework import plan as make_plan
    from tilework.cluster.topology import Topology
    from tilework.estimate.memory import estimate_per_rank

    with torch.device("meta"):
        meta = pm.new_model(ZERO_SHAPE)
    half = ZERO_SHAPE["batch"] // 2
    ids = torch.zeros(half, ZERO_SHAPE["seq"], dtype=torch.long)
    splits = {"even chunks": ({"zero": 3}, [half, half]),
              "chunks by memory": ({"zero": 3, "zero_weights": [3, 1]}, [half, half])}
    estimated = {}
    for name, (options, _) in splits.items():
        plan = make_plan(meta, ParallelConfig(**options), topology=Topology.uniform(2, 1))
        estimated[name] = [e.peak for e in estimate_per_rank(meta, plan, (ids, ids),
                                                             torch.optim.AdamW)]
    light, even = estimated["chunks by memory"][1], estimated["even chunks"][1]
    # M: the budget (80% of M) holds rank 1's peak under chunks by memory, with room.
    memory = light / pm.SHARE * 1.02
    if even <= memory:
        print(f"rank 1's even-chunk peak {even / 2**20:.0f} MiB is within M = "
              f"{memory / 2**20:.0f} MiB: choose a shape whose state weighs more")
        return None
    return ZERO_SHAPE, [3 * memory, memory], splits, estimated, \
        "ZeRO-3, chunks even and 3:1 by memory (zero_weights)"


def _estimate(meta, even, inputs, n: int, rank: int) -> int:
    from tilework.estimate.memory import estimate_per_rank
    from tilework.estimate.plan_memory import with_batch

    return estimate_per_rank(meta, even, with_batch(inputs, n), torch.optim.AdamW,
                             [rank])[0].peak


if __name__ == "__main__":
    sys.exit(main())
