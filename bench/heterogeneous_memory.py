"""A host with half the memory gets a share of the batch that fits, where the even split is
killed: measured under real memory caps.

    sudo .venv/bin/python bench/heterogeneous_memory.py [--out FILE]

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
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    from tilework.estimate.plan_memory import share_caps
    from tilework.planner.shares import batch_shares

    meta, even, inputs, peaks = estimates()
    half = SHAPE["batch"] // 2
    # M: the budget (80% of M) holds half of the even share; the even share is over M.
    memory = peaks[half // 2] / pm.SHARE * 1.02
    if peaks[half] <= memory:
        print(f"the even share's estimated peak {peaks[half] / 2**20:.0f} MiB is within M = "
              f"{memory / 2**20:.0f} MiB: choose a shape whose activations weigh more")
        return 1
    given = [2 * memory, memory]
    caps = share_caps(meta, even, inputs, [pm.SHARE * m for m in given], SHAPE["batch"],
                      torch.optim.AdamW)
    shares = list(batch_shares(SHAPE["batch"], [1.0, 1.0], caps))
    splits = {"even": {}, "shares": {"batch_shares": shares}}
    try:
        groups = [MemoryCap(64 * 2**30, name=f"hetero-rank{r}") for r in range(2)]
    except OSError as e:
        print(f"heterogeneous_memory: no memory cgroup can be made here ({e}); nothing was run.")
        return 0
    rows = {}
    try:
        for g in groups:
            g.set_limit(64 * 2**30)
        base = pm.trial(groups, None, a.timeout, ENV, SHAPE)
        baseline = base["peaks"]
        if base["outcome"] != "fits" or None in baseline:
            raise RuntimeError(f"the baseline run did not finish: {base}")
        for g, m, b in zip(groups, given, baseline):
            g.set_limit(int(m + b))
        for name, options in splits.items():
            got = pm.trial(groups, options, a.timeout, ENV, SHAPE)
            counts = shares if name == "shares" else [half, half]
            rows[name] = {"shares": counts, "outcome": got["outcome"], "detail": got["detail"],
                          "estimated": [_estimate(meta, even, inputs, n, r)
                                        for r, n in enumerate(counts)],
                          "measured": [None if p is None else p - b
                                       for p, b in zip(got["peaks"], baseline)]}
    finally:
        for g in groups:
            g.remove()
    before = ", ".join(f"{b / 2**20:.0f}" for b in baseline)
    print(f"M: rank 0 {given[0] / 2**20:.0f} MiB, rank 1 {given[1] / 2**20:.0f} MiB (each cap "
          f"M_r plus its process before any model: {before} MiB); caps from the estimate "
          f"(samples a step within 80% of M_r): {caps}")
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


def _estimate(meta, even, inputs, n: int, rank: int) -> int:
    from tilework.estimate.memory import estimate_per_rank
    from tilework.estimate.plan_memory import with_batch

    return estimate_per_rank(meta, even, with_batch(inputs, n), torch.optim.AdamW,
                             [rank])[0].peak


if __name__ == "__main__":
    sys.exit(main())
