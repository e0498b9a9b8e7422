"""Paper 4's rule, reproduced: no plan estimated under 80% of a rank's memory is killed.

    .venv/bin/python bench/planner_memory.py [--world 2] [--memory-mb M] [--out FILE.json]

Every candidate the planner's search considers for a GPT (tp, pp, cp, ZeRO 0-3, recompute) on
`--world` gloo ranks is run for a few AdamW steps with each rank in a memory cgroup of its own,
capped, swap off: going over is a real out-of-memory kill (tilework/bench/cgroup.py; root).

What a rank is given for training, M (`--memory-mb`; default: the median plan's estimated peak
over 0.8, so the plans fall on both sides of the 80% line), is what the planner is told; each
rank's cap is M plus what that rank's process holds before any model exists (the interpreter,
torch, gloo's process group, tilework: measured first, the same way, and the estimate does not
count it), as a GPU's memory is its CUDA context plus what the planner may spend.

Per plan it prints the estimated peak of its largest rank (estimate/plan_memory.py), the peak
the cgroups measured over that baseline (the resident set: what the allocator holds, freed
blocks it kept included), both as a share of M, and whether every rank finished. The summary
counts the plans estimated under 80% of M and how many of them were killed (the rule says
none), and how many estimated over M were killed (the cap bites).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from tilework.bench.cgroup import MemoryCap, run_capped  # noqa: E402

VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH = 8192, 384, 6, 6, 128, 8   # BATCH: sequences per step
SHAPE = {"vocab": VOCAB, "dim": DIM, "heads": HEADS, "layers": LAYERS, "seq": SEQ,
         "batch": BATCH}
STEPS = 2
SHARE = 0.8
# The workers' allocator: glibc as it comes, and with its mmap threshold fixed at 64 KiB, so
# every block that large is its own mapping, handed back when freed. As it comes, glibc raises
# the threshold (up to 32 MB) each time such a block is freed, after which freed activations
# and buffers stay in the heap: the resident set is then what the process ever held at once
# plus what it freed and kept (bench/zero_capacity.py found the same).
ALLOCATORS = {"default": {}, "mmap64k": {"MALLOC_MMAP_THRESHOLD_": "65536"}}
LEGEND = {"default": "glibc malloc as it comes", "mmap64k": "glibc mmap threshold fixed at 64 KiB"}


def new_model(shape: dict | None = None):
    from tilework.models.gpt import TinyGPT

    s = shape or SHAPE
    return TinyGPT(s["vocab"], s["dim"], s["heads"], s["layers"], s["seq"])


def worker(options: dict | None, port: int, shape: dict | None = None) -> None:
    """One rank: the process group and tilework, then (options not None) the plan trained on
    `shape`'s GPT (default SHAPE), each rank on its slice of the global batch (its
    batch_shares entry where the options give shares)."""
    import torch.distributed as dist

    import tilework
    from tilework.comm import exit_worker

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False,
                          timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    dist.barrier()
    if options is not None:
        torch.manual_seed(0)
        s = shape or SHAPE
        model = new_model(s)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = tilework.parallelize(model, opt, log=False, **options)
        at, dp = tilework.data_parallel_rank(model)
        shares = options.get("batch_shares")
        for step in range(STEPS):
            g = torch.Generator().manual_seed(step)
            tokens = torch.randint(0, s["vocab"], (s["batch"], s["seq"] + 1), generator=g)
            part = tokens.chunk(dp)[at] if not shares else \
                tokens[sum(shares[:at]):sum(shares[:at + 1])]
            x, y = part[:, :-1].contiguous(), part[:, 1:].contiguous()
            if options.get("pp", 1) > 1:
                model.step(x, y)
            else:
                model(x, y).backward()
            opt.step()
            opt.zero_grad()
    dist.barrier()
    exit_worker(0)   # not a normal exit: see tilework.comm.exit_worker


def trial(caps: list[MemoryCap], options: dict | None, timeout: float,
          env: dict | None = None, shape: dict | None = None) -> dict:
    """The ranks started, rank r in caps[r], with `env` added, training `shape`'s GPT: "fits",
    "oom", "timeout" or "error", and each rank's cgroup peak."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, len(caps) + 1, is_master=True,
                          wait_for_workers=False)
    for c in caps:
        c.empty()
        c.reset_peak()
    got = run_capped([__file__, "--worker", json.dumps(options), str(store.port),
                      json.dumps(shape or SHAPE)], caps, timeout,
                     {**os.environ, **(env or {}),
                      "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    return got | {"peaks": [c.peak() for c in caps], "seconds": round(got["seconds"], 1)}


def candidates(world: int) -> list[dict]:
    """Every runnable candidate of the search, with each rank's estimated peak."""
    from tilework.cluster.topology import Cluster, Host
    from tilework.estimate.plan_memory import plan_memory
    from tilework.planner.search import Space, label, options_of, search

    space = Space(axes=("tp", "pp", "cp"), zero_scopes=("world",), microbatch_factors=(2,))
    with torch.device("meta"):
        meta = new_model()
    ids = torch.zeros(BATCH // world, SEQ, dtype=torch.long)
    out = []
    for c in search(meta, Cluster([Host("localhost", world)]), (ids, ids), 1e11,
                    torch.optim.AdamW, space=space, every=True):
        if c.step_s is None:
            continue
        peaks = [e.peak for e in plan_memory(meta, c.parts["plan"],
                                             _replica_batch(c.config, world), torch.optim.AdamW)]
        out.append({"plan": label(c), "options": options_of(c.config), "estimated": peaks})
    return out


def _replica_batch(config, world: int) -> tuple:
    """One dp replica's sequences (one rank's under plain data parallelism)."""
    replicas = world // (config.tp * config.pp * config.cp)
    ids = torch.zeros(BATCH // replicas, SEQ, dtype=torch.long, device="meta")
    return ids, ids


def run_all(caps: list[MemoryCap], plans: list[dict], memory: float, env: dict,
            timeout: float) -> tuple[list[float], list[dict]]:
    """The baseline, then every plan under caps of M plus the baseline, with `env`."""
    for c in caps:
        c.set_limit(64 * 2**30)
    base = trial(caps, None, timeout, env)
    if base["outcome"] != "fits" or None in base["peaks"]:
        raise RuntimeError(f"the baseline run did not finish: {base}")
    baseline = base["peaks"]
    for r, c in enumerate(caps):
        c.set_limit(int(memory + baseline[r]))
    rows = []
    for p in plans:
        est = max(p["estimated"])
        got = trial(caps, p["options"], timeout, env)
        used = [peak - b for peak, b in zip(got["peaks"], baseline)] \
            if None not in got["peaks"] else None
        rows.append(p | got | {"estimated_share": est / memory,
                               "measured_share": max(used) / memory if used else None})
        print(f"  {p['plan']}: estimated {est / memory:.0%} of M, measured "
              f"{rows[-1]['measured_share'] or 0:.0%}, {got['outcome']} {got['detail']}",
              flush=True)
    return baseline, rows


def summarise(rows: list[dict]) -> dict:
    under = [r for r in rows if r["estimated_share"] < SHARE]
    over = [r for r in rows if r["estimated_share"] > 1.0]
    fitted = [r for r in rows if r["measured_share"] is not None and r["outcome"] == "fits"]
    return {"plans": len(rows), "under_80": len(under),
            "under_80_killed": sum(r["outcome"] == "oom" for r in under),
            "over_100": len(over), "over_100_killed": sum(r["outcome"] == "oom" for r in over),
            "median_measured_over_estimated": statistics.median(
                r["measured_share"] / r["estimated_share"] for r in fitted) if fitted else None,
            "errors": [r["plan"] for r in rows if r["outcome"] in ("error", "timeout")]}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        worker(json.loads(argv[1]), int(argv[2]), json.loads(argv[3]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--memory-mb", type=float, help="M: what each rank is given for training")
    ap.add_argument("--allocators", nargs="+", default=list(ALLOCATORS), choices=ALLOCATORS)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per plan")
    ap.add_argument("--out", type=Path, help="also write every row and the summary (JSON)")
    a = ap.parse_args(argv)
    plans = candidates(a.world)
    if not plans:
        print("planner_memory: the search found no runnable plan")
        return 1
    memory = a.memory_mb * 2**20 if a.memory_mb else \
        statistics.median(max(p["estimated"]) for p in plans) / SHARE
    try:
        caps = [MemoryCap(64 * 2**30, name=f"planner-rank{r}") for r in range(a.world)]
    except OSError as e:
        print(f"planner_memory: no memory cgroup can be made here ({e}); nothing was run.")
        return 0
    results = {}
    try:
        for name in a.allocators:
            print(f"{name}: {LEGEND[name]}", flush=True)
            baseline, rows = run_all(caps, plans, memory, ALLOCATORS[name], a.timeout)
            results[name] = {"baseline_mib": [b / 2**20 for b in baseline], "rows": rows,
                             "summary": summarise(rows)}
    finally:
        for c in caps:
            c.remove()
    print(f"\n{a.world} ranks, M = {memory / 2**20:.0f} MiB per rank; each rank's cap is M "
          "plus its process before any model (" + "; ".join(
              f"{n}: {', '.join(f'{b:.0f}' for b in r['baseline_mib'])} MiB"
              for n, r in results.items()) + ")")
    names = list(results)
    print("| plan | estimated peak | " + " | ".join(f"measured, {n}" for n in names) + " |")
    print("|---|---:|" + "---:|" * len(names))
    by_plan = {n: {r["plan"]: r for r in results[n]["rows"]} for n in names}
    for p in sorted(plans, key=lambda p: max(p["estimated"])):
        cells = []
        for n in names:
            r = by_plan[n][p["plan"]]
            share = f"{r['measured_share']:.0%}" if r["measured_share"] is not None else "-"
            cells.append(share + ("" if r["outcome"] == "fits" else f" ({r['outcome']})"))
        print(f"| {p['plan']} | {max(p['estimated']) / memory:.0%} | " + " | ".join(cells)
              + " |")
    ok = True
    for n in names:
        m = results[n]["summary"]
        ok &= m["under_80_killed"] == 0 and not m["errors"]
        print(f"{n}: {m['under_80']} plans estimated under 80% of M, {m['under_80_killed']} "
              f"killed; {m['over_100']} estimated over M, {m['over_100_killed']} killed; "
              f"measured / estimated median {m['median_measured_over_estimated'] or 0:.2f}; "
              f"errors: {m['errors'] or 'none'}")
    if a.out:
        a.out.write_text(json.dumps({"world": a.world, "memory_mib": memory / 2**20,
                                     "plans": plans, "results": results}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
