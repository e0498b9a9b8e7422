"""Test like a user: three well-known public training programs, rewritten small in examples/ and
adapted the way the README tells users to (`tilework.parallelize` in place of DDP, each rank its
contiguous slice of the global batch), trained as one plain process (`python launch/script.py`:
world size 1, tilework.parallelize included) and under `tilework run -n 2`. The distributed run must
train the same model: the same global mean loss at every step and the same final state.

Each script writes (rank 0) {"losses": [...], "state": single-device state dict, ...} with
--out. Tolerances, relative to each tensor's (or loss sequence's) largest magnitude: 1e-5 for
SGD and the hand-written update (two ranks' averaged gradients only reorder one process's sums),
1e-4 for AdamW (its division by a running norm amplifies last-bit differences). Each script
also runs with --plain (no tilework at all: pure PyTorch), which the one-process run must match.
"""

from __future__ import annotations

import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SGD_TOL, ADAMW_TOL = 1e-5, 1e-4


def run(script: str, *args: str, ranks: int | None = None,
        cwd: Path) -> subprocess.CompletedProcess:
    """`python examples/SCRIPT ARGS`, or `python -m tilework run -n RANKS examples/SCRIPT ARGS`."""
    path = str(EXAMPLES / script)
    cmd = ([sys.executable, "-m", "tilework", "run", "-n", str(ranks), path, *args] if ranks
           else [sys.executable, path, *args])
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=180)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout}\n{r.stderr}"
    assert "Traceback" not in r.stderr, r.stderr
    assert "tilework:" not in r.stderr, r.stderr  # no warning either (e.g. replicas differing)
    return r


def runs(tmp: Path, script: str, steps: int, *extra: str) -> dict:
    """The one-process reference, the plain-PyTorch run and the 2-rank run of one script."""
    out = {}
    for name, ranks, flags in (("ref", None, ()), ("plain", None, ("--plain",)), ("dist", 2, ())):
        r = run(script, "--steps", str(steps), "--out", str(tmp / f"{name}.pt"), *flags, *extra,
                ranks=ranks, cwd=tmp)
        out[name] = torch.load(tmp / f"{name}.pt", weights_only=False)
        out[name]["stdout"] = r.stdout
    return out


def assert_close(a, b, tol: float, what: str) -> None:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    scale = max(a.abs().max().item(), 1e-12) if a.numel() else 1.0
    worst = (a - b).abs().max().item() if a.numel() else 0.0
    assert worst <= tol * scale, f"{what}: differs by {worst:.3g} (scale {scale:.3g}, tol {tol})"


def assert_same_training(ref: dict, other: dict, tol: float, label: str) -> None:
    assert len(ref["losses"]) == len(other["losses"]) > 0
    assert_close(ref["losses"], other["losses"], tol, f"{label}: losses")
    assert set(ref["state"]) == set(other["state"]), label
    for k, v in ref["state"].items():
        assert_close(v, other["state"][k], tol, f"{label}: {k}")


# -- pytorch/examples word_language_model ------------------------------------------------------

@pytest.fixture(scope="module")
def wlm(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wlm")
    return runs(tmp, "word_language_model.py", 8, "--save", str(tmp / "model.pt"))


def test_word_language_model(wlm):
    """pytorch/examples word_language_model/main.py: no optimizer (`parallelize(model, None)`),
    `model.zero_grad()`, `torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)`, the
    hand-written update `p.data.add_(p.grad, alpha=-lr)`, truncated BPTT with the hidden state
    carried per rank, evaluation on every rank under no_grad each epoch, the lr divided by 4 when
    validation loss does not improve (a decision every rank takes alone), `torch.save(model)` of
    the best model on rank 0 and its `torch.load` on every rank for the test set."""
    ref, plain, dist = wlm["ref"], wlm["plain"], wlm["dist"]
    assert_same_training(ref, dist, SGD_TOL, "2 ranks vs 1 process")
    assert_same_training(ref, plain, SGD_TOL, "1 process vs plain PyTorch")
    # The habits really ran: the lr was annealed, clipping bit at least once, the model learnt.
    assert ref["lrs"] == dist["lrs"] == plain["lrs"] and ref["lrs"][-1] == 20.0 / 4
    assert max(ref["clip_norms"]) > 0.25
    assert_close(ref["clip_norms"], dist["clip_norms"], SGD_TOL, "gradient norms")
    assert_close(ref["val_losses"], dist["val_losses"], SGD_TOL, "validation losses")
    assert ref["val_losses"][-1] < ref["val_losses"][0]
    assert_close(ref["test_loss"], dist["test_loss"], SGD_TOL, "test loss of the best model")


# -- karpathy/nanoGPT train.py -----------------------------------------------------------------

NANOGPT_STEPS = 8


@pytest.fixture(scope="module")
def nanogpt(tmp_path_factory):
    return runs(tmp_path_factory.mktemp("nanogpt"), "nanogpt_style.py", NANOGPT_STEPS)


def test_nanogpt(nanogpt):
    """karpathy/nanoGPT train.py: a tiny GPT with the lm_head tied to the token embedding, AdamW
    with a decay and a no-decay parameter group, gradient accumulation over 2 micro-steps with
    `model.require_backward_grad_sync = (micro_step == accum - 1)`, `clip_grad_norm_(1.0)` behind
    a (disabled) GradScaler, a warmup + cosine lr written into every `param_group["lr"]` by hand,
    and `estimate_loss()` under no_grad on every rank."""
    ref, plain, dist = nanogpt["ref"], nanogpt["plain"], nanogpt["dist"]
    assert_same_training(ref, dist, ADAMW_TOL, "2 ranks vs 1 process")
    assert_same_training(ref, plain, ADAMW_TOL, "1 process vs plain PyTorch")
    assert ref["lrs"] == dist["lrs"] and ref["lrs"][0] < ref["lrs"][3] > ref["lrs"][-1]
    assert max(ref["grad_norms"]) > 1.0  # clipping bit
    assert_close(ref["grad_norms"], dist["grad_norms"], ADAMW_TOL, "gradient norms")
    assert [e[0] for e in ref["evals"]] == [e[0] for e in dist["evals"]] == [0, 4, 8]
    assert_close([e[1:] for e in ref["evals"]], [e[1:] for e in dist["evals"]], ADAMW_TOL,
                 "estimate_loss")
    assert ref["losses"][-1] < ref["losses"][0]
    # Every parameter is dense: all of them all-reduced, none on the servers.
    assert "allreduce" in dist["stdout"] and "│ ps" not in dist["stdout"]


@pytest.mark.parametrize("axis", ["--tp", "--pp", "--cp"])
def test_nanogpt_on_a_mesh(nanogpt, axis, tmp_path):
    """The same program with --tp 2 (its MLP split), --pp 2 (the accumulation's micro-batches
    as the pipeline's, its tied embedding and head on both ends) or --cp 2 (its SDPA attention
    as ring attention): the changed lines the README shows, the same training as one process,
    clipping and evaluation included."""
    r = run("nanogpt_style.py", "--steps", str(NANOGPT_STEPS), "--out", str(tmp_path / "m.pt"),
            axis, "2", ranks=2, cwd=tmp_path)
    mesh = torch.load(tmp_path / "m.pt", weights_only=False)
    mesh["stdout"] = r.stdout
    ref = nanogpt["ref"]
    assert_same_training(ref, mesh, ADAMW_TOL, f"{axis} 2 vs 1 process")
    assert_close(ref["grad_norms"], mesh["grad_norms"], ADAMW_TOL, "gradient norms")
    assert_close([e[1:] for e in ref["evals"]], [e[1:] for e in mesh["evals"]], ADAMW_TOL,
                 "estimate_loss")


def test_nanogpt_resume(nanogpt, tmp_path):
    """nanoGPT's rank-0 checkpoint and init_from='resume': the master process alone saves
    {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "iter_num", ...} (the
    model is all-reduced, so its state_dict is local); a new run loads it with plain torch.load
    and load_state_dict into the model and the AdamW before parallelize, and continues. N/2
    steps, then N/2 resumed, on 2 ranks, equals N steps straight on 2 ranks. The first half
    evaluates and saves as nanoGPT itself does, on the master process alone
    (`--eval_master_only`)."""
    half = NANOGPT_STEPS // 2
    run("nanogpt_style.py", "--steps", str(half), "--out_dir", str(tmp_path),
        "--eval_master_only", ranks=2, cwd=tmp_path)
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    assert ckpt["iter_num"] == half
    assert set(ckpt["model"]) == set(nanogpt["ref"]["state"])  # single-device keys, tied included
    run("nanogpt_style.py", "--steps", str(NANOGPT_STEPS), "--out_dir", str(tmp_path),
        "--resume", "--out", str(tmp_path / "resumed.pt"), ranks=2, cwd=tmp_path)
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=False)
    straight = nanogpt["dist"]
    assert resumed["iter_num"] == NANOGPT_STEPS and len(resumed["losses"]) == half
    assert_close(straight["losses"][half:], resumed["losses"], ADAMW_TOL, "losses after resume")
    for k, v in straight["state"].items():
        assert_close(v, resumed["state"][k], ADAMW_TOL, f"resumed: {k}")


# -- facebookresearch/dlrm dlrm_s_pytorch.py ---------------------------------------------------

@pytest.fixture(scope="module")
def dlrm(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dlrm")
    out = runs(tmp, "dlrm_style.py", 8, "--save-model", str(tmp / "ckpt.pt"))
    out["ckpt"] = torch.load(tmp / "ckpt.pt", weights_only=False)  # the last writer: dist
    return out


def fresh_plain_dlrm(monkeypatch):
    """The script's own plain model and optimizer, untrained and of another seed (run in this
    process with --plain --steps 0)."""
    monkeypatch.setattr(sys, "argv", ["dlrm_style.py", "--plain", "--steps", "0",
                                      "--numpy-rand-seed", "7"])
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    return runpy.run_path(str(EXAMPLES / "dlrm_style.py"), run_name="fresh_dlrm")


def test_dlrm(dlrm, monkeypatch):
    """facebookresearch/dlrm dlrm_s_pytorch.py: nn.EmbeddingBag(mode="sum", sparse=True) tables
    of three sizes fed as DLRM feeds them (offsets stacked, indices a list, bags of varying
    length, each rank's offsets rebuilt for its slice), bottom MLP, dot interaction, top MLP,
    BCE loss, SGD with DLRM's per-part parameter groups (the tables' own lr), StepLR;
    in hybrid mode the tables go to the parameter server. `tilework.clip_grad_norm_(model, c)`
    (tables included; on the plain model too), the test metrics all-reduced, and a checkpoint
    through `model.state_dict()` called on every rank (a collective for server tables), written
    by rank 0, which loads (strict) into a fresh plain model."""
    ref, plain, dist = dlrm["ref"], dlrm["plain"], dlrm["dist"]
    assert_same_training(ref, dist, SGD_TOL, "2 ranks vs 1 process")
    assert_same_training(ref, plain, SGD_TOL, "1 process vs plain PyTorch")
    # The tables really were on the servers, and clipping saw their gradients.
    for k in ("emb_l.0.weight", "emb_l.1.weight", "emb_l.2.weight"):
        assert f"│ {k} │" in dist["stdout"] and dist["stats"]["shard_bytes"][k] > 0
    assert dist["stats"]["total"]["ps"]["sent"] > 0
    assert max(ref["norms"]) > 0.5  # clipping bit
    assert_close(ref["norms"], dist["norms"], SGD_TOL, "gradient norms (tables included)")
    assert_close(plain["norms"], dist["norms"], SGD_TOL, "gradient norms vs plain PyTorch")
    assert ref["lrs"] == dist["lrs"] and ref["lrs"][-1] == [0.125, 0.05, 0.05]  # StepLR moved
    assert_close([ref["test_loss"], ref["test_acc"]], [dist["test_loss"], dist["test_acc"]],
                 SGD_TOL, "test metrics")

    ckpt = dlrm["ckpt"]
    for k, v in dist["state"].items():
        assert torch.equal(ckpt["state_dict"][k], v), k
    ns = fresh_plain_dlrm(monkeypatch)
    model, data = ns["dlrm"], ns["data"]
    model.load_state_dict(ckpt["state_dict"])  # strict
    X, lS_o, lS_i, T = data.to_dlrm(*data.samples(10**6, 16), 0, 1)
    with torch.no_grad():
        loss = torch.nn.functional.binary_cross_entropy(model(X, lS_o, lS_i), T).item()
    assert_close(ckpt["test_loss"], loss, SGD_TOL, "the loaded model's test loss")


def test_dlrm_optimizer_state_loads_into_plain_optimizer(dlrm, monkeypatch):
    """DLRM saves "opt_state_dict": optimizer.state_dict() next to the model and, with
    --load-model, loads it back into an optimizer built as before (plain, before any wrapping).
    README: `model.state_dict()` is single-device layout; the optimizer's should load too."""
    ns = fresh_plain_dlrm(monkeypatch)
    ns["optimizer"].load_state_dict(dlrm["ckpt"]["opt_state_dict"])
