"""Trials of the planner's closest calls: `tilework plan --auto --trial K` trains each of K
candidates that fit (planner/search.trial_candidates: the fastest predicted of each family,
then the next fastest) for a few steps on this host's ranks, as `tilework train` would
(the job's own model, data and optimizer; `[train]` cut to a warm-up window and a measured one,
no checkpoints), and keeps the fastest measured (NeMo's auto-configurator measures everything;
here the model ranks and the trial only settles what it ranks close). The measured step is the
second log window's mean (rank 0's clock, every rank finishing its step before the next); it is
reported beside the prediction.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

from ..errors import UserError


def run_trials(job, candidates: list, world_size: int, window: int = 3) -> list[dict]:
    """Each candidate (planner/search's, fitting) trained for 2 x `window` steps on
    `world_size` local ranks: {"plan", "predicted_step_s", "measured_step_s" (None: it did not
    finish), "config"}."""
    from ..launch import launcher as launch
    from ..launch import worker
    from ..planner.search import label

    if window < 1:
        raise UserError(f"--trial-steps: expected at least 1, got {window}")
    out = []
    with tempfile.TemporaryDirectory(prefix="tilework-trial-") as root:
        for i, c in enumerate(candidates):
            where = Path(root) / f"trial-{i}"
            trial_job = dataclasses.replace(
                job, parallel=dataclasses.replace(c.config, plan="config", auto_axes=None),
                train=dataclasses.replace(job.train, steps=2 * window, log_every=window,
                                          eval_every=0, checkpoint_every=0,
                                          out_dir=str(where)))
            spec = {"job": worker.job_spec(trial_job), "resume": False, "cluster": None}
            print(f"tilework plan --trial: {label(c)} ({i + 1} of {len(candidates)})",
                  file=sys.stderr, flush=True)
            with _stdout_to_stderr():
                rc = launch.run(launch.local_spec(world_size), worker.argv("train", spec))
            out.append({"plan": label(c), "predicted_step_s": c.step_s,
                        "measured_step_s": _measured(where / "metrics.jsonl") if rc == 0
                        else None, "config": c.config})
    return out


@contextlib.contextmanager
def _stdout_to_stderr():
    """The trials' training output (workers inherit the descriptor) on stderr: stdout stays
    the plan's report (or its JSON)."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _measured(metrics: Path) -> float | None:
    windows = [r["step_s"] for r in _records(metrics) if "step_s" in r]
    return windows[-1] if len(windows) >= 2 else None


def _records(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


def fastest(trials: list[dict]) -> dict:
    """The fastest trial that finished; refused in one line when none did."""
    finished = [t for t in trials if t["measured_step_s"] is not None]
    if not finished:
        raise UserError("--trial: no candidate finished its trial steps (each ran as `tilework "
                        "train` would; run the chosen plan with tilework train to see why)")
    return min(finished, key=lambda t: t["measured_step_s"])
