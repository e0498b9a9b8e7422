"""Uneven batch shares on ranks of different speeds, measured side by side on one machine.

    sudo .venv/bin/python bench/heterogeneous.py [--speeds 1 0.25] [--batch 40] [--steps 8]
        [--rounds 3] [--out FILE] [--png FILE]
    sudo .venv/bin/python bench/heterogeneous.py --speeds 0.5 0.5 0.125 0.125 --pp 2 \
        --microbatches 2 --batch 40      # two pipelines of two ranks, one four times slower

Each rank runs inside a CPU cgroup of its own holding `speeds[r]` cores' worth of time
(tilework/bench/cgroup.CpuQuota: cgroup v1's cfs quota or v2's cpu.max), so a 4:1 skew is real:
the slow rank's compute, its gloo threads and its Python all run at a quarter of the time.
The GPT below trains data parallel on gloo over loopback, global batches of `--batch`
sequences, in `--rounds` rounds; each round is a fresh world that runs three splits, `--steps`
steps each, the median step of each kept: the even split; the shares the planner gives the
quotas as speeds (planner/shares.batch_shares, what `tilework train` runs for a cluster file
with these `speed`s); and the shares it gives the speeds measured for this model (each rank
alone, a world of one at its quota, on the even share: its sequences per second; the additive
ideal is their sum).

Prints, per round and as medians: the step and throughput of each split, throughput as a
fraction of the ideal, the speed-up over the even split, and the predicted step (the planner's
pace: the slowest rank alone on its share, measured; no communication) beside the measured
one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from tilework.bench.cgroup import CpuQuota  # noqa: E402
from tilework.planner.shares import batch_shares  # noqa: E402
from tilework.testing import spawn  # noqa: E402

VOCAB, DIM, HEADS, LAYERS, SEQ = 256, 64, 4, 4, 128
SAMPLES = 4096


def new_model():
    from tilework.models.gpt import TinyGPT

    torch.manual_seed(0)
    return TinyGPT(VOCAB, DIM, HEADS, LAYERS, SEQ)


def batch(indices):
    g = torch.Generator().manual_seed(int(indices[0]))
    tokens = torch.randint(0, VOCAB, (len(indices), SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _join(path: str) -> None:
    with open(f"{path}/cgroup.procs", "w") as f:
        f.write(str(__import__("os").getpid()))
    torch.set_num_threads(1)


def _solo(rank, world_size, path, n, steps):
    """One rank alone at its quota: seconds per step on n sequences."""
    _join(path)
    model = new_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    took = []
    for step in range(steps + 1):
        tokens, targets = batch(range(step * n, step * n + n))
        start = time.perf_counter()
        model(tokens, targets).backward()
        opt.step()
        opt.zero_grad()
        took.append(time.perf_counter() - start)
    return statistics.median(took[1:])


def _world(rank, world_size, paths, splits, steps):
    """Each split in turn, parallelized as `tilework train` would: the median step (barrier to
    the slowest rank's optimizer step)."""
    from mesh_search import slowest_step

    import tilework
    from tilework.data import ShardedBatches

    _join(paths[rank])
    out = {}
    for name, shares in splits:
        model = new_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        tilework.parallelize(model, opt, log=False,
                             batch_shares=list(shares) if len(set(shares)) > 1 else None)
        sampler = ShardedBatches(SAMPLES, sum(shares), rank, world_size, shares=shares)
        took = []
        for step in range(steps + 1):
            tokens, targets = batch(sampler.indices(step))

            def run(tokens=tokens, targets=targets, model=model, opt=opt):
                model(tokens, targets).backward()
                opt.step()
                opt.zero_grad()

            took.append(slowest_step(run))
        out[name] = statistics.median(took[1:])
    return out


def _world_pp(rank, world_size, paths, splits, steps, pp, microbatches):
    """`_world` with each data-parallel replica a pipeline of `pp` ranks: its share of the
    global batch (replica shares, whole microbatches) through `model.step`."""
    from mesh_search import slowest_step

    import tilework
    from tilework.data import ShardedBatches

    _join(paths[rank])
    out = {}
    for name, shares in splits:
        model = new_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        model, opt = tilework.parallelize(
            model, opt, log=False, pp=pp, microbatches=microbatches,
            batch_shares=list(shares) if len(set(shares)) > 1 else None)
        replica, replicas = tilework.data_parallel_rank(model)
        sampler = ShardedBatches(SAMPLES, sum(shares), replica, replicas, shares=shares)
        took = []
        for step in range(steps + 1):
            tokens, targets = batch(sampler.indices(step))

            def run(tokens=tokens, targets=targets, model=model, opt=opt):
                model.step(tokens, targets)
                opt.step()
                opt.zero_grad()

            took.append(slowest_step(run))
        out[name] = statistics.median(took[1:])
    return out


def pipelines(a, quotas) -> int:
    """--pp: the even split against the replicas' shares by their slowest rank's quota (what
    plan="auto" offers a pipeline candidate), in whole microbatches."""
    from tilework.cluster.mesh import least_by, parallel_mesh

    world = len(a.speeds)
    mesh = parallel_mesh(world, world, 1, a.pp, 1)
    replicas = mesh.size_of("dp")
    slowest = least_by(mesh, "dp", a.speeds)
    m = a.microbatches
    if a.batch % (m * replicas):
        raise SystemExit(f"--batch {a.batch}: a multiple of microbatches x replicas "
                         f"({m * replicas}) for the even split")
    splits = {"even": [a.batch // replicas] * replicas,
              "by quota": [m * n for n in batch_shares(a.batch // m, slowest)]}
    rounds = [spawn(_world_pp, world, args=([q.path for q in quotas], list(splits.items()),
                                            a.steps, a.pp, m), timeout=1800)[0]
              for _ in range(a.rounds)]
    step = {k: statistics.median(r[k] for r in rounds) for k in splits}
    print(f"quotas {a.speeds} (CPU cores each), pp={a.pp}, {m} microbatches, replicas' "
          f"slowest {slowest}, global batch {a.batch}")
    print("| split | replica shares | step ms (per round) | median ms | seq/s |\n"
          "|---|---|---|---:|---:|")
    for k, split in splits.items():
        per = ", ".join(f"{r[k] * 1e3:.0f}" for r in rounds)
        print(f"| {k} | {split} | {per} | {step[k] * 1e3:.0f} | {a.batch / step[k]:.1f} |")
    paired = statistics.median(r["even"] / r["by quota"] for r in rounds)
    print(f"by quota over even: {step['even'] / step['by quota']:.2f}x (paired per round "
          f"{paired:.2f}x); the replicas' additive ideal over the even split's pace: "
          f"{sum(slowest) / (replicas * min(slowest)):.2f}x")
    if a.out:
        a.out.write_text(json.dumps({"speeds": a.speeds, "pp": a.pp, "microbatches": m,
                                     "batch": a.batch, "splits": splits, "rounds": rounds,
                                     "step": step}, indent=1))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--speeds", type=float, nargs="+", default=[1.0, 0.25])
    ap.add_argument("--batch", type=int, default=40)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--period-ms", type=float, default=CpuQuota.PERIOD_US / 1e3,
                    help="the quotas' scheduler period (default the kernel's, 100)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--png", type=Path)
    ap.add_argument("--pp", type=int, default=1, help="each data-parallel replica a pipeline "
                    "of this many ranks (the even split against shares by quota)")
    ap.add_argument("--microbatches", type=int, default=2, help="with --pp")
    a = ap.parse_args(argv)
    world = len(a.speeds)
    quotas = [CpuQuota(s, name=f"rank{r}", period_us=int(a.period_ms * 1e3))
              for r, s in enumerate(a.speeds)]
    if a.pp > 1:
        try:
            return pipelines(a, quotas)
        finally:
            for q in quotas:
                q.remove()
    solo: dict = {}

    def alone(rank: int, n: int) -> float:
        """Rank `rank`'s step alone at its quota on n sequences (each measured once)."""
        if (rank, n) not in solo:
            solo[rank, n] = spawn(_solo, 1, args=(quotas[rank].path, n, a.steps),
                                  timeout=1800)[0]
        return solo[rank, n]

    try:
        even = batch_shares(a.batch, [1.0] * world)
        # The speeds as calibration would give them for this model: each rank's sequences per
        # second alone on the even share (a quota's fraction of a core is not the model's
        # rate: small batches run less efficiently).
        rates = [n / alone(r, n) for r, n in enumerate(even)]
        by_quota, by_rate = batch_shares(a.batch, a.speeds), batch_shares(a.batch, rates)
        splits = {"even": even, "by quota": by_quota} if by_quota == by_rate else \
            {"even": even, "by quota": by_quota, "by measured speed": by_rate}
        # The planner's step: the slowest rank alone on its share (no communication).
        predicted = {k: max(alone(r, n) for r, n in enumerate(split))
                     for k, split in splits.items()}
        rounds = [spawn(_world, world, args=([q.path for q in quotas], list(splits.items()),
                                             a.steps), timeout=1800)[0]
                  for _ in range(a.rounds)]
    finally:
        for q in quotas:
            q.remove()
    ideal = sum(rates)
    step = {k: statistics.median(r[k] for r in rounds) for k in splits}
    # The stricter ideal of a split: every rank alone on its own share, added up (a rank's
    # rate grows with its batch, so the even share's rates understate a larger share's).
    own = {k: sum(n / alone(r, n) for r, n in enumerate(split)) for k, split in splits.items()}
    result = {"speeds": a.speeds, "batch": a.batch,
              "splits": {k: list(v) for k, v in splits.items()}, "rates": rates,
              "ideal": ideal, "own_ideal": own, "rounds": rounds, "step": step,
              "predicted": predicted,
              "solo": {f"{r}:{n}": t for (r, n), t in solo.items()},
              "throughput": {k: a.batch / v for k, v in step.items()}}
    print(f"quotas {a.speeds} (CPU cores each), global batch {a.batch}")
    print("alone on the even share: " + ", ".join(
        f"rank {r} {rate:.1f} seq/s" for r, rate in enumerate(rates))
        + f"; additive ideal {ideal:.1f} seq/s")
    print("| split | shares | step ms (per round) | median ms | predicted ms | seq/s | "
          "of the ideal | of its own ideal |\n|---|---|---|---:|---:|---:|---:|---:|")
    for k, split in splits.items():
        per = ", ".join(f"{r[k] * 1e3:.0f}" for r in rounds)
        tput = a.batch / step[k]
        print(f"| {k} | {list(split)} | {per} | {step[k] * 1e3:.0f} | "
              f"{predicted[k] * 1e3:.0f} | {tput:.1f} | {tput / ideal:.0%} | "
              f"{tput / own[k]:.0%} |")
    best = list(splits)[-1]
    print(f"{best} over even: {step['even'] / step[best]:.2f}x, at "
          f"{a.batch / step[best] / ideal:.0%} of the ideal ({a.batch / step[best] / own[best]:.0%}"
          f" of its own); predicted within " + ", ".join(
              f"{abs(predicted[k] - step[k]) / step[k]:.0%} ({k})" for k in splits))
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))
    if a.png:
        _plot(result, a.png)
    return 0


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    names = [*result["throughput"], "additive ideal"]
    values = [*result["throughput"].values(), result["ideal"]]
    ax.bar(names, values, color=["#999999", "#8fb3d9", "#3b75af", "#cccccc"][-len(names):])
    for i, v in enumerate(values):
        ax.text(i, v, f"{v:.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("sequences / s")
    ax.set_title(f"CPU quotas {result['speeds']}, global batch {result['batch']}", fontsize=9)
    ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
