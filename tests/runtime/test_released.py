"""A parallelized model a program drops is freed, with everything tilework made for it.

torch keeps a parameter's post-accumulate-grad hooks in the tensor's C++ autograd state, out of
the collector's sight: a hook holding its engine strongly made a cycle that was never collected
(parameter -> hook -> engine -> model -> parameter). Every parallelize in one process then left
its model, buffers and guard thread behind, each thread polling the store: ten in a row measured
their steps 20-30% slower (a trial loop, a sweep, a notebook; the planner's accuracy benches)."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import torch
from torch import nn

import tilework
from tilework.comm.guard import POLL_S
from tilework.models.gpt import TinyGPT
from tilework.testing import spawn


class Tables(nn.Module):
    def __init__(self):
        super().__init__()
        self.sparse = nn.Embedding(64, 4, sparse=True)
        self.dense = nn.Embedding(16, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, ids):
        return self.head(self.sparse(ids).mean(1) + self.dense(ids % 16).mean(1)).pow(2).mean()


CASES = [
    (Tables, {}),                                                    # servers, buckets
    (Tables, {"overrides": {"sparse.weight": "allgather", "dense.weight": "ps"}}),
    (TinyGPT, {"zero": 2}),
    (TinyGPT, {"zero": 3}),
    (TinyGPT, {"tp": 2}),
    (TinyGPT, {"pp": 2, "microbatches": 2}),
]


def _freed(rank, world_size):
    out = []
    for make, options in CASES:
        torch.manual_seed(0)
        model = make() if make is Tables else TinyGPT(vocab=32, dim=16, heads=2, layers=2,
                                                      seq_len=8)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = tilework.parallelize(model, opt, log=False, **options)
        ids = torch.randint(0, 16, (4, 3 if make is Tables else 8))
        for _ in range(2):
            if options.get("pp", 1) > 1:
                model.step(ids, ids)
            else:
                (model(ids) if make is Tables else model(ids, ids)).backward()
            opt.step()
            opt.zero_grad()
        held = weakref.ref(model)
        del model, opt
        gc.collect()
        out.append((make.__name__, options, held() is None))
    time.sleep(4 * POLL_S)   # a guard's watcher ends within a poll of its engine going
    running = [t for t in threading.enumerate() if t.name == "tilework-guard" and t.is_alive()]
    return out, len(running)


def test_a_dropped_parallelized_model_is_freed_with_its_guard():
    """Servers, all-gathered tables, buckets, ZeRO-2 and -3, tp and pp: each model, dropped,
    is collected; then no guard thread is left."""
    cases, running = spawn(_freed, 2, timeout=180)[0]
    for name, options, freed in cases:
        assert freed, f"{name} {options}: the model outlived the program's last reference"
    assert running == 0, f"{running} guard threads still running"
