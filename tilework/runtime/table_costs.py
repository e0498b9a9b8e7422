"""What a sparse table's placement costs a step on the rank's own processor, beside the bytes
it sends: measured, for the op model (estimate/ops.OpTimes.per_call["table ps"], ["table
allgather"]; estimate/plan_cost prices each table of a plan at its method's).

The parameter server's pull and push sort a step's ids to their owners, split and merge them,
gather rows back and step the owners' rows with the row-wise optimizer: some two thousand
Python calls a step for the recommender's three tables, which no op of the model's recording
holds. Priced as nothing, the servers looked as cheap as the all-gather on two ranks where they
measured 1-3 ms a step slower (docs/planner.md). Measured here on one rank, no process group:
two tables placed by each method against the same tables left to torch (sparse gradients, the
same optimizer), the difference per table. On one rank every exchange is a local copy, so
what is left is the runtime's own work (the wire is the link model's); more ranks add
per-peer splits that this does not see.

Measured at two lookup counts, the cost is a fixed part per table and a part per id looked up
("table ps" and "table ps id"): one figure at 2,048 ids a table priced the recommender's 128
(two ranks) at 0.95 ms a table on the servers where it costs 0.61.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

TABLES, ROWS, WIDTH = 2, 1000, 16
LOOKUPS = ((64, 1), (256, 8))   # ids a table per step, as (samples, ids a sample): few, many


class _Tables(nn.Module):
    def __init__(self):
        super().__init__()
        self.tables = nn.ModuleList(nn.Embedding(ROWS, WIDTH, sparse=True)
                                    for _ in range(TABLES))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return sum(t(ids).sum() for t in self.tables)


def table_costs(device=None, steps: int = 30) -> dict[str, float]:
    """Seconds one table adds to a step beside its lookups, by method, as a fixed part and a
    part per id it is asked for: {"table ps": ..., "table ps id": ..., "table allgather": ...,
    "table allgather id": ...} (never below 0)."""
    from ..comm.groups import solo
    from ..config.parallel import ParallelConfig
    from ..planner import plan as make_plan
    from .apply import apply

    device = torch.device(device or "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    groups = solo()

    def step_seconds(method: str | None, shape: tuple[int, int]) -> float:
        # Drawn on the host (a seeded CPU generator), then moved where the tables are.
        ids = torch.randint(0, ROWS, shape, generator=torch.Generator().manual_seed(0),
                            device="cpu").to(device)
        torch.manual_seed(0)
        model = _Tables().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if method is not None:
            config = ParallelConfig(overrides={f"tables.{i}.weight": method
                                               for i in range(TABLES)}, check_inputs=False)
            apply(model, opt, make_plan(model, config, topology=groups.topology), config,
                  groups, log=False)
        took = []
        for _ in range(steps + 3):
            sync(device)
            start = time.perf_counter()
            model(ids).backward()
            opt.step()
            opt.zero_grad()
            sync(device)
            took.append(time.perf_counter() - start)
        return statistics.median(took[3:])

    (few, many) = LOOKUPS
    ids = [few[0] * few[1], many[0] * many[1]]
    plain = [step_seconds(None, shape) for shape in LOOKUPS]
    out = {}
    for m in ("ps", "allgather"):
        added = [max(0.0, (step_seconds(m, shape) - base) / TABLES)
                 for shape, base in zip(LOOKUPS, plain)]
        per_id = max(0.0, (added[1] - added[0]) / (ids[1] - ids[0]))
        out[f"table {m}"] = max(0.0, added[0] - per_id * ids[0])
        out[f"table {m} id"] = per_id
    return out


__all__ = ["table_costs"]
