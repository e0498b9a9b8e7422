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
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

TABLES, ROWS, WIDTH, LOOKUPS = 2, 1000, 16, (256, 8)


class _Tables(nn.Module):
    def __init__(self):
        super().__init__()
        self.tables = nn.ModuleList(nn.Embedding(ROWS, WIDTH, sparse=True)
                                    for _ in range(TABLES))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return sum(t(ids).sum() for t in self.tables)


def table_costs(device=None, steps: int = 30) -> dict[str, float]:
    """Seconds one table adds to a step beside its lookups, by method: {"table ps": ...,
    "table allgather": ...} (never below 0)."""
    from ..comm.groups import solo
    from ..config.parallel import ParallelConfig
    from ..planner import plan as make_plan
    from .apply import apply

    device = torch.device(device or "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    groups = solo()
    # Drawn on the host (a seeded CPU generator), then moved where the tables are.
    ids = torch.randint(0, ROWS, LOOKUPS, generator=torch.Generator().manual_seed(0),
                        device="cpu").to(device)

    def step_seconds(method: str | None) -> float:
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

    plain = step_seconds(None)
    return {f"table {m}": max(0.0, (step_seconds(m) - plain) / TABLES)
            for m in ("ps", "allgather")}


__all__ = ["table_costs"]
