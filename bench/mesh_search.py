"""The mesh search's predictions against measured steps on this machine.

    .venv/bin/python bench/mesh_search.py [--world 2] [--steps 6] [--out FILE]

Every runnable candidate of tilework/planner/search.py for the GPT below on `--world` real gloo
ranks (one thread each) is run through `tilework.parallelize` for a few steps, and its median
step (barrier to the slowest rank's optimizer step) is printed beside the prediction. The
prediction's inputs are measured in the same world first, never fitted to the steps:

- FLOP/s: one rank times the whole model's forward and backward on one replica's batch
  (2 ranks on 2 cores: each rank has a core), divided into the search's own FLOP count;
- the link: calibrate's all-reduce timing around the activations' size, fitted alpha-beta (what
  `tilework calibrate` writes into a cluster file).

Read: the ratio per candidate, and whether the search's order is the measured one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import tilework  # noqa: E402
from tilework.cluster.topology import Cluster, Host, Links  # noqa: E402
from tilework.estimate.step import forward_flops  # noqa: E402
from tilework.models.gpt import TinyGPT  # noqa: E402
from tilework.planner.search import options_of, search_mesh  # noqa: E402
from tilework.testing import spawn  # noqa: E402

VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH = 1024, 256, 8, 8, 64, 16


def new_model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(VOCAB, DIM, HEADS, LAYERS, SEQ)


def batch(step: int, part: int, parts: int):
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    per = BATCH // parts
    tokens = tokens[part * per:(part + 1) * per]
    return tokens[:, :-1], tokens[:, 1:]


def flops_rate(sequences: int, repeats: int = 3) -> float:
    """FLOP/s of this process on the whole model's step, by the search's own count."""
    model = new_model()
    tokens, targets = batch(0, 0, BATCH // sequences)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        model(tokens, targets).backward()
        times.append(time.perf_counter() - start)
        model.zero_grad()
    flops = 3 * forward_flops([*model.children()], sequences * SEQ, SEQ, 1)
    return flops / statistics.median(times[1:])


def run_candidate(config: dict, steps: int) -> list[float]:
    model = new_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = tilework.parallelize(model, opt, log=False, **config)
    mesh = getattr(model._tilework_engine, "mesh", None)   # None: data parallel only
    dp, at = ((dist.get_world_size(), dist.get_rank()) if mesh is None
              else (mesh.mesh.size_of("dp"), mesh.groups.coord("dp")))
    out = []
    for step in range(steps):
        tokens, targets = batch(step, at, dp)

        def run(tokens=tokens, targets=targets):
            if config.get("pp", 1) > 1:
                model.step(tokens, targets)
            else:
                model(tokens, targets).backward()
            opt.step()
            opt.zero_grad()

        out.append(slowest_step(run))
    return out


def slowest_step(run) -> float:
    """Seconds of `run()` on the slowest rank, every rank starting together (a barrier)."""
    dist.barrier()
    start = time.perf_counter()
    run()
    took = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return took.item()


def _allreduce_link(world_size: int, nbytes: int):
    """The all-reduce fit around `nbytes`, as `tilework calibrate` writes a cluster file's link
    (tp's and dp's exchanges are all-reduces; the pipeline's hops use it too, as a plan from
    that cluster file would)."""
    return _allreduce_links(world_size, nbytes)[0]


def _allreduce_links(world_size: int, nbytes: int):
    """(the fit `tilework calibrate` makes, alpha from calls of the smallest size between
    computes; the least-squares fit of the same points, as it made before), around `nbytes`."""
    from tilework.cluster.calibrate import fit_points, time_points, time_small_calls

    sizes = [nbytes // 4, nbytes, 4 * nbytes]
    points = time_points(dist.group.WORLD, world_size, sizes, repeats=9,
                         collectives=("all_reduce",))["all_reduce"]
    small = time_small_calls(dist.group.WORLD, world_size, sizes[0], ("all_reduce",))
    return (fit_points("all_reduce", world_size, points, small["all_reduce"]).link(),
            fit_points("all_reduce", world_size, points).link())


def _world(rank, world_size, configs, steps):
    from tilework.bench.pipeline_runs import Shape, message_overhead

    link = _allreduce_link(world_size, BATCH // world_size * SEQ * DIM * 4)
    shape = Shape(VOCAB, DIM, HEADS, LAYERS, SEQ, microbatch=BATCH // world_size)
    overhead = message_overhead(world_size, shape, quiet=(2.0, 0.0))["overhead_s"]
    rate = None
    if rank == 0:
        rate = flops_rate(BATCH // world_size)
    rates = [rate]
    dist.broadcast_object_list(rates, src=0)
    return {"link": (link.bandwidth_gbps, link.latency_us), "flops": rates[0],
            "overhead_s": overhead, "steps": [run_candidate(c, steps) for c in configs]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    with torch.device("meta"):
        meta = TinyGPT(VOCAB, DIM, HEADS, LAYERS, SEQ)
    here = Cluster([Host("localhost", a.world)])
    runnable = [c for c in search_mesh(meta, here, BATCH, SEQ, 1e11) if c.step_s is not None]
    options = [options_of(c.config) for c in runnable]
    got = spawn(_world, a.world, args=(options, a.steps), timeout=3600)[0]
    link = tilework.cluster.topology.Link(*got["link"])
    measured_here = Cluster([Host("localhost", a.world)], links=Links(intra=link, inter=link))
    plain = {c.label: c for c in search_mesh(meta, measured_here, BATCH, SEQ, got["flops"])}
    with_o = {c.label: c for c in search_mesh(meta, measured_here, BATCH, SEQ, got["flops"],
                                              message_overhead_s=got["overhead_s"])}
    rows = []
    for c, steps in zip(runnable, got["steps"]):
        measured = statistics.median(steps[1:])
        p, po = plain[c.label].step_s, with_o[c.label].step_s
        rows.append({"mesh": c.label, "predicted_ms": p * 1e3, "with_o_ms": po * 1e3,
                     "measured_ms": measured * 1e3, "ratio": measured / p,
                     "ratio_o": measured / po})
    print(f"FLOP/s per rank {got['flops']:.3g}, link {link.bandwidth_gbps:.3g} Gb/s "
          f"{link.latency_us:.0f} us, per-message overhead o {got['overhead_s'] * 1e3:.2f} ms")
    print("| mesh | predicted ms (link) | with o | measured ms | measured / predicted (link, "
          "with o) |")
    print("|---|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['mesh']} | {r['predicted_ms']:.1f} | {r['with_o_ms']:.1f} | "
              f"{r['measured_ms']:.1f} | {r['ratio']:.2f}, {r['ratio_o']:.2f} |")
    order_p = [r["mesh"] for r in sorted(rows, key=lambda r: r["with_o_ms"])]
    order_m = [r["mesh"] for r in sorted(rows, key=lambda r: r["measured_ms"])]
    print(f"predicted order (with o): {order_p}\nmeasured order:           {order_m}")
    if a.out:
        a.out.write_text(json.dumps({"rows": rows, "flops": got["flops"],
                                     "link": got["link"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
