"""The memory estimator on a dp x pp x cp x tp mesh (tilework.estimate_memory with tp, pp, cp)
against torch's MemTracker in each rank of real 2-rank runs of the reference GPT."""

from __future__ import annotations

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

import tilework
from tilework import ParallelConfig
from tilework.models.gpt import TinyGPT

VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH = 2000, 128, 4, 4, 32, 8
CONFIGS = {"tp2": dict(tp=2), "tp2+sp": dict(tp=2, sequence_parallel=True),
           "pp2": dict(pp=2, microbatches=4, schedule="1f1b"), "cp2": dict(cp=2)}


def new_model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab=VOCAB, dim=DIM, heads=HEADS, layers=LAYERS, seq_len=SEQ)


def batch(seed: int = 0):
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def _current(tracker) -> dict:
    snap = tracker.get_tracker_snapshot("current")[torch.device("cpu")]
    return {str(k).rsplit(".", 1)[-1]: v for k, v in snap.items()}


def _measure_rank(rank, world_size, options):
    """MemTracker's categories where each is largest (activations: the most alive at once,
    sampled after every pipeline action under pp), and the peak, over two steps."""
    from tilework.pipeline import runtime
    from tilework.tensor import loss

    # MemTracker reads every module output's storage; split logits refuse any call they do not
    # know, this one computes nothing from the values.
    loss._QUERIES.add(torch.Tensor.untyped_storage)
    model = new_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = tilework.parallelize(model, opt, log=False, check_inputs=False, **options)
    tracker = MemTracker()
    tracker.track_external(model, opt)
    acts = []
    do = runtime._Step.do

    def sampled(self, action, *args):
        if action.kind == "F":   # a stage runs once per microbatch: each call a new "step"
            tracker.reset_mod_stats()
        do(self, action, *args)
        acts.append(_current(tracker)["ACT"])

    runtime._Step.do = sampled
    grads = 0
    try:
        with tracker:
            for _ in range(2):
                if options.get("pp", 1) > 1:
                    model.step(*batch())
                else:
                    loss = model(*batch())
                    acts.append(_current(tracker)["ACT"])
                    loss.backward()
                grads = max(grads, _current(tracker)["GRAD"])
                opt.step()
                after_step = _current(tracker)
                opt.zero_grad()
                tracker.reset_mod_stats()
    finally:
        runtime._Step.do = do
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    peak = {str(k).rsplit(".", 1)[-1]: v for k, v in peak.items()}
    return {"parameters": after_step["PARAM"], "gradients": grads,
            "optimizer_state": after_step["OPT"], "activations": max(acts),
            "peak": peak["Total"] - peak["BUFFER"], "peak_snapshot": peak}


def measure_all():
    from tilework.testing import spawn

    return {name: spawn(_measure_rank, 2, args=(opts,), timeout=300)
            for name, opts in CONFIGS.items()}
