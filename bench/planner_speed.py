"""How long the planner's full search takes (issue 26: an LM1B-sized model at 8 hosts x 8 ranks
in under 10 s, 8,000 ranks in under a minute).

    .venv/bin/python bench/planner_speed.py [--out FILE]

The model is docs/examples/lm1b.toml's (a 793,471-word vocabulary, two 2048-unit LSTM layers,
sampled softmax), built on the meta device; the clusters have 12 GB per rank and the Parallax
testbed's links. The search is plan="auto"'s: ZeRO stage and scope, recompute, each table's
placement (by its modelled traffic), every candidate's step priced and the memory of the fastest
until two fit. A second row adds the reference GPT's mesh axes (tp, pp and cp searched) on 8 x
8 ranks. Each row prints the candidates, the seconds and the choice.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from tilework import ParallelConfig  # noqa: E402
from tilework.cluster.topology import Cluster, Host, Link, Links  # noqa: E402
from tilework.config.files import load  # noqa: E402
from tilework.models.gpt import TinyGPT  # noqa: E402
from tilework.planner.search import auto  # noqa: E402
from tilework.plans.analysis import analyze  # noqa: E402
from tilework.train.job import Job  # noqa: E402
from tilework.train.planning import example_batch, meta_model, table_traffic  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LINKS = Links(intra=Link(96.0, 10.0), inter=Link(100.0, 5.0))
RATE = 12e12   # FLOP/s per rank: a TITAN Xp's fp32 peak, as the Parallax testbed had


def cluster(hosts: int, per_host: int) -> Cluster:
    return Cluster([Host(f"h{i}", per_host, memory_gb=12) for i in range(hosts)], links=LINKS)


def lm1b(hosts: int, per_host: int) -> dict:
    job = load(Job, ROOT / "docs/examples/lm1b.toml")
    where = cluster(hosts, per_host)
    start = time.perf_counter()
    model = meta_model(job)
    choice = auto(model, ParallelConfig(plan="auto"), where, example_batch(job, where), RATE,
                  job.train.optimizer, table_traffic(job, analyze(model), where))
    return {"model": "lm1b", "ranks": where.world_size, "candidates": len(choice.candidates),
            "seconds": time.perf_counter() - start, "choice": choice.why()}


def gpt_mesh(hosts: int, per_host: int) -> dict:
    where = cluster(hosts, per_host)
    with torch.device("meta"):
        model = TinyGPT(vocab=32_000, dim=1024, heads=16, layers=16, seq_len=1024)
    ids = torch.zeros(4, 1024, dtype=torch.long)
    start = time.perf_counter()
    choice = auto(model, ParallelConfig(plan="auto", tp="auto", pp="auto", cp="auto"), where,
                  (ids, ids), RATE)
    return {"model": "gpt 16x1024 (tp, pp, cp searched)", "ranks": where.world_size,
            "candidates": len(choice.candidates), "seconds": time.perf_counter() - start,
            "choice": choice.why()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the rows as JSON here")
    a = parser.parse_args()
    rows = [lm1b(8, 8), lm1b(1000, 8), gpt_mesh(8, 8)]
    for r in rows:
        print(f"{r['model']:<36} {r['ranks']:>6} ranks  {r['candidates']:>4} candidates  "
              f"{r['seconds']:6.2f} s\n    {r['choice']}")
    if a.out:
        Path(a.out).write_text(json.dumps([dataclasses.asdict(r) if dataclasses.is_dataclass(r)
                                           else r for r in rows], indent=2))


if __name__ == "__main__":
    main()
