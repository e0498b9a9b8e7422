"""Models not written for tilework (tests/real_models.py: nanoGPT's model.py, Hugging Face's
LlamaForCausalLM tied and untied, torchtitan's llama3 Transformer where torchtitan is installed)
trained under the dimensions beyond data parallelism, as one process trains them: the same
losses, and the same parameters read back through `tilework.state_dict`, through
`tilework.save` and `tilework.load`, and after `tilework.unparallelize`. Tied weights must
come back tied and whole in each.

Tolerance 1e-4 of each tensor's largest magnitude (AdamW; the ranks' sums reorder one process's).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tilework
from tests.real_models import (
    BufferLM,
    FusedLM,
    NanoGPT,
    have_torchtitan,
    have_transformers,
    hf_llama,
    lm_batch,
    titan_llama,
)
from tilework.checkpoint import file as checkpoint
from tilework.testing import spawn

STEPS, BATCH, SEQ, VOCAB = 3, 4, 8, 64
TOL = 1e-4

needs_transformers = pytest.mark.skipif(
    not have_transformers(), reason="Hugging Face transformers is not installed "
    "(pip install -e '.[models]')")
needs_torchtitan = pytest.mark.skipif(
    not have_torchtitan(), reason="torchtitan is not installed (pip install -e '.[titan]': "
    "about 1.4 GB with triton and datasets, so `make` leaves it out)")


def build(family: str):
    torch.manual_seed(0)
    if family == "nanogpt":
        return NanoGPT(vocab_size=VOCAB, block_size=SEQ)
    if family.startswith("fused"):   # fused: blocks indexed as dicts, q/k/v saved apart
        return FusedLM(vocab_size=VOCAB, named_apart=family != "fused-one-name",
                       dict_blocks=family == "fused")
    if family == "titan":
        return titan_llama(vocab_size=VOCAB, seq=SEQ)
    if family == "buffer-lm":
        return BufferLM(vocab_size=VOCAB, seq=SEQ)
    return hf_llama(tied=family == "llama-tied", vocab_size=VOCAB)


def loss_of(family: str, model, x, y):
    if family == "nanogpt":
        return model(x, y)[1]
    if family.startswith("fused"):
        return model(x, y)
    if family in ("titan", "buffer-lm"):   # logits out; the loop takes the loss, as
        return titan_loss(model(x), y)    # torchtitan's trainer does
    # The targets already shifted (HF's shift_labels), so each cp rank's chunks pair the right
    # tokens; the same loss as labels=ids shifted inside.
    return model(**step_arguments(family, x, y)[1]).loss


def titan_loss(logits, targets):
    """torchtitan's cross-entropy loss (components/loss.py), over every token."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def optimizer_for(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)


def step_arguments(family: str, x, y) -> tuple[tuple, dict]:
    """What the model's forward takes for a batch: what `model.step` takes under pp."""
    if family == "nanogpt" or family.startswith("fused"):
        return (x, y), {}
    if family in ("titan", "buffer-lm"):   # as torchtitan's schedule: step(x, target=y)
        return (x,), {"target": y, "loss_fn": titan_loss}
    y = y.contiguous()   # HF views shift_labels flat
    return (), {"input_ids": x, "labels": y, "shift_labels": y}


def train(family, model, opt, steps, part=0, parts=1):
    losses = []
    for step in steps:
        x, y = lm_batch(step, VOCAB, SEQ, BATCH, part, parts)
        if hasattr(model, "step"):   # pp: the pipeline runs forward and backward
            args, kwargs = step_arguments(family, x, y)
            loss = model.step(*args, **kwargs)
            loss = torch.tensor(float("nan")) if loss is None else loss
        else:
            loss = loss_of(family, model, x, y)
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def reference(family: str):
    model = build(family)
    losses = train(family, model, optimizer_for(model), range(STEPS))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def tied_names(model) -> set[frozenset[str]]:
    by_param: dict[int, set[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_param.setdefault(id(p), set()).add(name)
    return {frozenset(names) for names in by_param.values() if len(names) > 1}


def _zero3(rank, world_size, family, path, options=None):
    options = {"zero": 3, **(options or {})}
    model = build(family)
    ties = tied_names(model)
    opt = optimizer_for(model)
    tilework.parallelize(model, opt, log=False, **options)
    losses = train(family, model, opt, range(STEPS), rank, world_size)
    state = tilework.state_dict(model, opt)["model"]
    tilework.save(path, model, opt)
    # A fresh model, parallelized the same way, loads the checkpoint and gives it back.
    again = build(family)
    again_opt = optimizer_for(again)
    tilework.parallelize(again, again_opt, log=False, **options)
    tilework.load(path, again, again_opt)
    loaded = tilework.state_dict(again, again_opt)["model"]
    tilework.unparallelize(model, opt)
    plain = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "state": state, "loaded": loaded, "plain": plain,
            "ties_kept": tied_names(model) == ties}


def assert_close(a, b, what):
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    scale = max(b.abs().max().item(), 1e-12)
    worst = (a.double() - b.double()).abs().max().item()
    assert worst <= TOL * scale, f"{what}: differs by {worst:.3g} (scale {scale:.3g})"


def assert_same_state(got: dict, want: dict, what: str):
    assert set(got) == set(want), f"{what}: keys differ: {set(got) ^ set(want)}"
    for k, v in want.items():
        assert got[k].untyped_storage().nbytes() >= v.numel() * v.element_size(), \
            f"{what}: {k} holds no values"
        assert_close(got[k], v, f"{what}: {k}")


def _zero3_trains_as_one_process(family: str, path: str, options: dict | None = None) -> None:
    """ZeRO-3 (with `options`) on 2 ranks: the losses, and the parameters read back three ways
    (state dict, a loaded checkpoint, unparallelize), equal one process's; ties kept."""
    want_losses, want = reference(family)
    results = spawn(_zero3, 2, args=(family, path, options), timeout=180)
    got_losses = [sum(r["losses"][i] for r in results) / 2 for i in range(STEPS)]
    assert_close(torch.tensor(got_losses), torch.tensor(want_losses), "losses")
    for r in results:
        for what in ("state", "loaded", "plain"):
            assert_same_state(r[what], want, f"{family} {what}")
        assert r["ties_kept"], f"{family}: tied parameters are no longer one after unparallelize"


@pytest.mark.parametrize("family", ["nanogpt", "fused",
                                    pytest.param("llama-tied", marks=needs_transformers),
                                    pytest.param("llama", marks=needs_transformers),
                                    pytest.param("titan", marks=needs_torchtitan)])
def test_zero3_keeps_tied_weights_whole_through_state_save_load_and_unparallelize(family,
                                                                                  tmp_path):
    _zero3_trains_as_one_process(family, str(tmp_path / "ckpt.pt"))


@pytest.mark.parametrize("family", ["nanogpt",
                                    pytest.param("llama-tied", marks=needs_transformers)])
def test_zero3_chunks_by_weight_on_a_model_not_written_for_us(family, tmp_path):
    """ZeRO-3 with chunks by memory (zero_weights 3:1) on nanoGPT and a tied Hugging Face
    Llama: trains as one process, its checkpoint loads back, and the ties survive."""
    _zero3_trains_as_one_process(family, str(tmp_path / "ckpt.pt"), {"zero_weights": [3, 1]})


def _on_mesh(rank, world_size, family, options, path):
    """Train under `options` (tp, cp, pp ...), then read the parameters back four ways: the
    state dict, a checkpoint loaded into a fresh parallelized model, the checkpoint loaded
    into a plain model (single-device layout), and the model `unparallelize` gives back."""
    model = build(family)
    opt = optimizer_for(model)
    model, opt = tilework.parallelize(model, opt, log=False, **options)
    dp_rank, dp = tilework.data_parallel_rank(model)
    losses = train(family, model, opt, range(STEPS), dp_rank, dp)
    state = tilework.state_dict(model, opt)["model"]
    tilework.save(path, model, opt)
    again = build(family)
    again_opt = optimizer_for(again)
    again, again_opt = tilework.parallelize(again, again_opt, log=False, **options)
    tilework.load(path, again, again_opt)
    loaded = tilework.state_dict(again, again_opt)["model"]
    plain = build(family)
    plain.load_state_dict(checkpoint.load(path)["state"]["model"])
    sent = {axis: t["sent"] for axis, t in tilework.stats(model)["total"].items()}
    whole, _ = tilework.unparallelize(model, opt)
    return {"losses": losses, "dp": dp, "state": state, "loaded": loaded, "sent": sent,
            "plain": {k: v.detach().clone() for k, v in plain.state_dict().items()},
            "unparallelized": {k: v.detach().clone() for k, v in whole.state_dict().items()},
            "ties_kept": tied_names(plain) == tied_names(build(family))
            and tied_names(whole) == tied_names(build(family))}


def _on_mesh_batch(rank, world_size, runs, directory):
    return [_on_mesh(rank, world_size, family, options, f"{directory}/{i}.pt")
            for i, (family, options) in enumerate(runs)]


NANOGPT_MLP = {"transformer.h.*.mlp.c_fc": "colwise", "transformer.h.*.mlp.c_proj": "rowwise"}
FUSED_LAYOUT = {"layers.*.attn.wqkv": "colwise_fused:3", "layers.*.attn.wo": "rowwise"}
HF = ["llama-tied", "llama"] if have_transformers() else []
# torchtitan's own TP plan (llama3/infra/parallelize.py), written as a layout: the embedding
# split by rows, attention and MLP projections colwise then rowwise, the head colwise with its
# logits gathered (torchtitan keeps them split for its loss-parallel; here the loss is whole).
TITAN_LAYOUT = {"tok_embeddings": "vocab_embedding", "output": "colwise_gather",
                **{f"layers.*.attention.{w}": "colwise" for w in ("wq", "wk", "wv")},
                "layers.*.attention.wo": "rowwise", "layers.*.feed_forward.w1": "colwise",
                "layers.*.feed_forward.w3": "colwise", "layers.*.feed_forward.w2": "rowwise"}
TITAN = [("titan", {"tp": 2, "layout": TITAN_LAYOUT}), ("titan", {"cp": 2})] + [
    ("titan", {"pp": 2, "schedule": schedule, "microbatches": 2})
    for schedule in ("gpipe", "1f1b")] if have_torchtitan() else []
# The 2-rank runs share one world (starting one costs seconds on 2 cores): the first test
# that needs one runs them all; each test reads its own.
BATCHED = [(f, {"tp": 2}) for f in HF] + [
    ("nanogpt", {"tp": 2, "layout": NANOGPT_MLP}),
    ("fused-one-name", {"tp": 2, "layout": FUSED_LAYOUT}),
    ("fused", {"tp": 2, "layout": FUSED_LAYOUT})] + [
    (f, {"pp": 2, "schedule": schedule, "microbatches": 2})
    for f in ["nanogpt", *HF] for schedule in ("gpipe", "1f1b")] + TITAN + [
    ("buffer-lm", {"cp": 2}), ("buffer-lm", {"pp": 2, "schedule": "1f1b", "microbatches": 2})]
_batched: dict = {}


def _run(family, options, world_size, tmp_path) -> list[dict]:
    if world_size == 2 and (family, options) in BATCHED:
        if not _batched:
            results = spawn(_on_mesh_batch, 2, args=(BATCHED, str(tmp_path)), timeout=600)
            for i, key in enumerate(BATCHED):
                _batched[repr(key)] = [r[i] for r in results]
        return _batched[repr((family, options))]
    return spawn(_on_mesh, world_size, args=(family, options, str(tmp_path / "ckpt.pt")),
                 timeout=240)


def check_mesh_run(family, options, world_size, tmp_path) -> list[dict]:
    want_losses, want = reference(family)
    results = _run(family, options, world_size, tmp_path)
    # Each replica's ranks report the replica's loss (under pp only its last stage's rank: NaN
    # elsewhere); the replicas' mean is the global loss.
    got_losses = [torch.tensor([r["losses"][i] for r in results]) for i in range(STEPS)]
    got_losses = [t[~t.isnan()].mean().item() for t in got_losses]
    assert_close(torch.tensor(got_losses), torch.tensor(want_losses), "losses")
    for r in results:
        for what in ("state", "loaded", "plain", "unparallelized"):
            assert_same_state(r[what], want, f"{family} {options} {what}")
        assert r["ties_kept"]
    return results


@pytest.mark.parametrize("family", [pytest.param("llama-tied", marks=needs_transformers),
                                    pytest.param("llama", marks=needs_transformers)])
def test_tp_with_the_models_own_plan(family, tmp_path):
    """layout=None on a Hugging Face model: its own `_tp_plan` (q/k/v colwise, o rowwise, the
    MLP colwise then rowwise, the embedding split by rows, the head colwise with its logits
    gathered for HF's own loss), the tied head and embedding split alike."""
    results = check_mesh_run(family, {"tp": 2}, 2, tmp_path)
    assert all(r["sent"].get("tp", 0) > 0 for r in results)


def test_tp_on_nanogpt_mlp(tmp_path):
    """nanoGPT's MLP split colwise then rowwise; its attention left whole (below: why)."""
    results = check_mesh_run("nanogpt", {"tp": 2, "layout": NANOGPT_MLP}, 2, tmp_path)
    assert all(r["sent"].get("tp", 0) > 0 for r in results)


def _nanogpt_fused_attention(rank, world_size):
    model = build("nanogpt")
    opt = optimizer_for(model)
    layout = {**NANOGPT_MLP, "transformer.h.*.attn.c_attn": "colwise_fused:3",
              "transformer.h.*.attn.c_proj": "rowwise"}
    model, opt = tilework.parallelize(model, opt, tp=2, layout=layout, log=False)
    try:
        loss_of("nanogpt", model, *lm_batch(0, VOCAB, SEQ, BATCH))
    except tilework.UserError as e:
        return str(e)
    return "trained"


def test_tp_refuses_in_one_line_a_forward_that_assumes_whole_widths():
    """nanoGPT's attention splits c_attn's output by `self.n_embd` and views it to the input's
    width: on a split c_attn that is a shape error inside the user's code. It is named as the
    layout's doing, with the way out, instead of 'not enough values to unpack'."""
    for message in spawn(_nanogpt_fused_attention, 2, timeout=120):
        assert message.startswith("tensor parallel: transformer.h.0.attn (CausalSelfAttention) "
                                  "failed on its split modules (c_attn: colwise_fused:3, "
                                  "c_proj: rowwise): "), message
        assert "write those with -1 or the local width" in message



def test_tp_splits_a_fused_qkv_by_its_parts(tmp_path):
    """colwise_fused:3 on a q/k/v projection whose forward finds its heads from the head size:
    each rank holds whole heads of q, k and v, and trains as one process."""
    results = check_mesh_run("fused-one-name", {"tp": 2, "layout": FUSED_LAYOUT}, 2, tmp_path)
    assert all(r["sent"].get("tp", 0) > 0 for r in results)


def test_tp_keeps_a_models_own_state_dict_hooks(tmp_path):
    """The fused model whose hooks save wqkv as wq, wk, wv: under tp the checkpoint gathers
    the shards by parameter name with the hooks set aside, then runs them on the whole state
    (and the load pre-hook before cutting it), so its files name q, k and v apart as one
    process's do, and load back at tp=2 and into a plain model."""
    results = check_mesh_run("fused", {"tp": 2, "layout": FUSED_LAYOUT}, 2, tmp_path)
    assert all("layers.0.attn.wq.weight" in r["state"] for r in results)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("family", ["nanogpt", pytest.param("llama-tied", marks=needs_transformers),
                                    pytest.param("llama", marks=needs_transformers)])
def test_pp_cuts_any_models_stack_of_blocks(family, schedule, tmp_path):
    """pp=2 on models not written for tilework: stages cut over their stack of blocks
    (nanoGPT's transformer.h, HF's model.layers), each stage running the model's own forward;
    the embedding and head (tied in nanoGPT and tied Llama) held by both ends, their gradients
    summed over the pipeline as Megatron-LM does for a tied pair."""
    results = check_mesh_run(family, {"pp": 2, "schedule": schedule, "microbatches": 2}, 2,
                             tmp_path)
    assert all(r["sent"].get("pipeline", 0) > 0 for r in results)


@needs_transformers
def test_tp_and_cp_together_on_hf_llama(tmp_path):
    """tp=2 x cp=2 on 4 ranks with the model's own plan: the head's parent (the model itself)
    runs behind the split's error wrapper, which must keep the forward's signature so the ring
    still hands Llama its global position_ids (else RoPE would place every cp rank's tokens
    from 0, and no error would say so)."""
    results = check_mesh_run("llama", {"tp": 2, "cp": 2}, 4, tmp_path)
    assert all(r["sent"].get("tp", 0) > 0 and r["sent"].get("cp", 0) > 0 for r in results)


def _accumulating(rank, world_size, family):
    """Two model.step calls (each half of the batch) per optimizer step, without no_sync."""
    model = build(family)
    opt = optimizer_for(model)
    model, opt = tilework.parallelize(model, opt, log=False, pp=2, microbatches=2)
    for step in range(STEPS):
        for half in range(2):
            args, kwargs = step_arguments(family, *lm_batch(step, VOCAB, SEQ, BATCH, half, 2))
            model.step(*args, **kwargs)
        opt.step()
        opt.zero_grad()
    return tilework.state_dict(model, opt)["model"]


def test_pp_accumulation_without_no_sync_counts_each_step_once():
    """Gradients accumulated over two synchronised model.step calls before the optimizer's
    step, as one process accumulates two backward passes: the tied embedding's parts are
    summed over the pipeline once each (summing the whole accumulated gradient at the second
    call would count the first call's sum twice)."""
    model = build("nanogpt")
    opt = optimizer_for(model)
    for step in range(STEPS):
        for half in range(2):   # each call's gradient is its half's mean loss's, as model.step's
            loss_of("nanogpt", model, *lm_batch(step, VOCAB, SEQ, BATCH, half, 2)).backward()
        opt.step()
        opt.zero_grad()
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for got in spawn(_accumulating, 2, args=("nanogpt",), timeout=180):
        assert_same_state(got, want, "pp=2, two steps accumulated")


def test_own_state_dict_hooks_under_tp_and_pp(tmp_path):
    """tp=2 x pp=2: every stage's hooks replay on the assembled state on every rank (a rank's
    part holds its own stages' modules only)."""
    results = check_mesh_run("fused-blocks", {"tp": 2, "pp": 2, "layout": FUSED_LAYOUT,
                                              "microbatches": 2}, 4, tmp_path)
    assert all("layers.1.attn.wk.weight" in r["state"] for r in results)


def test_pp_refuses_blocks_the_model_indexes_instead_of_calling():
    from tilework.errors import PlanError
    from tilework.parallel.pipeline.generic import split_model

    with pytest.raises(PlanError, match=r"pp: the blocks of layers are ModuleDicts, which the "
                                        r"model indexes rather than calls"):
        split_model(build("fused"), 2)


@pytest.mark.parametrize("options", [{"cp": 2},
                                     {"pp": 2, "schedule": "1f1b", "microbatches": 2}],
                         ids=["cp2", "pp2"])
def test_a_model_in_torchtitans_shape_without_the_package(options, tmp_path):
    """torchtitan's shapes, run where torchtitan is not installed (tests/real_models.BufferLM):
    cp gives each rank its positions' rows of a rotary buffer sliced [0:T] and hands the
    logits back whole; pp cuts a ModuleDict of blocks and steps as step(x, target=y,
    loss_fn=...)."""
    results = check_mesh_run("buffer-lm", options, 2, tmp_path)
    axis = "cp" if "cp" in options else "pipeline"
    assert all(r["sent"].get(axis, 0) > 0 for r in results)


@needs_torchtitan
@pytest.mark.parametrize("options", [
    {"tp": 2, "layout": TITAN_LAYOUT},
    {"cp": 2},
    {"pp": 2, "schedule": "gpipe", "microbatches": 2},
    {"pp": 2, "schedule": "1f1b", "microbatches": 2},
], ids=["tp2", "cp2", "pp2-gpipe", "pp2-1f1b"])
def test_torchtitan_llama3_on_each_dimension(options, tmp_path):
    """torchtitan's llama3 Transformer as its package ships it (GQA, rotary table as a buffer
    sliced [0:seqlen], blocks in a ModuleDict the forward iterates, logits out and the loss in
    the trainer): tp with torchtitan's own plan as a layout; cp, where the rotary rows are
    this rank's positions and the logits come back whole for the trainer's loss; pp, stepped
    as torchtitan's schedule is (step(x, target=y) with its loss_fn)."""
    results = check_mesh_run("titan", options, 2, tmp_path)
    axis = {"tp": "tp", "cp": "cp", "pp": "pipeline"}[next(iter(options))]
    assert all(r["sent"].get(axis, 0) > 0 for r in results)


@needs_torchtitan
def test_torchtitan_llama3_on_tp_and_pp_together(tmp_path):
    """tp=2 x pp=2 on 4 ranks: torchtitan's plan inside each stage."""
    results = check_mesh_run("titan", {"tp": 2, "pp": 2, "layout": TITAN_LAYOUT,
                                       "microbatches": 2}, 4, tmp_path)
    assert all(r["sent"].get("tp", 0) > 0 and r["sent"].get("pipeline", 0) > 0
               for r in results)


class LinearChain(torch.nn.Module):
    """Blocks whose output is a Linear's (no residual in float32): bf16 under autocast."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))

    def forward(self, x, y):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return F.mse_loss(x.float(), y)


def _chain_batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)


def _autocast_after_plain(rank, world_size):
    torch.manual_seed(0)
    model = LinearChain()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = tilework.parallelize(model, opt, log=False, pp=2, microbatches=2)
    losses = []
    for step in range(3):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=step == 1):
            loss = model.step(*_chain_batch(step))
        opt.step()
        opt.zero_grad()
        losses.append(None if loss is None else loss.item())
    return losses


def test_pp_boundaries_follow_autocast():
    """The activation crossing a stage boundary is bf16 under autocast and float32 without:
    its shape and dtype are probed per call and per autocast state, so a step under autocast
    after a plain one (and a plain one after it) sends what one process computes."""
    torch.manual_seed(0)
    model = LinearChain()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    want = []
    for step in range(3):
        for half in range(2):   # the pipeline's two microbatches, each half the batch's mean
            x, y = (t.chunk(2)[half] for t in _chain_batch(step))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=step == 1):
                loss = model(x, y) / 2
            loss.backward()
            want.append(loss.item()) if half == 0 else want.__setitem__(-1, want[-1] + loss.item())
        opt.step()
        opt.zero_grad()
    got = [r for r in spawn(_autocast_after_plain, 2, timeout=120) if r[0] is not None][0]
    assert got == pytest.approx(want, rel=1e-5)


def _local_sgd(rank, world_size, family, path):
    """Local SGD that is synchronous training (H = 1, SGD inside, a plain outer step) on a
    model not written for tilework, tied weights included; then saved, loaded into a fresh
    parallel model, and undone."""
    model = build(family)
    ties = tied_names(model)
    outer = dict(sync="diloco", sync_every=1, outer_optimizer="sgd", outer_lr=1.0,
                 outer_momentum=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tilework.parallelize(model, opt, mode="allreduce", log=False, **outer)
    losses = train(family, model, opt, range(STEPS), rank, world_size)
    state = tilework.state_dict(model, opt)["model"]
    tilework.save(path, model, opt)
    again = build(family)
    again_opt = torch.optim.SGD(again.parameters(), lr=0.1)
    tilework.parallelize(again, again_opt, mode="allreduce", log=False, **outer)
    tilework.load(path, again, again_opt)
    loaded = tilework.state_dict(again, again_opt)["model"]
    tilework.unparallelize(model, opt)
    return {"losses": losses, "state": state, "loaded": loaded,
            "ties_kept": tied_names(model) == ties and bool(ties)}


@pytest.mark.parametrize("family", ["nanogpt",
                                    pytest.param("llama-tied", marks=needs_transformers)])
def test_local_sgd_on_a_model_with_tied_weights_trains_as_one_process(family, tmp_path):
    model = build(family)
    want_losses = train(family, model, torch.optim.SGD(model.parameters(), lr=0.1),
                        range(STEPS))
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    results = spawn(_local_sgd, 2, args=(family, str(tmp_path / "ckpt.pt")), timeout=180)
    got = results[0]
    assert_same_state(got["state"], want, "state_dict")
    assert_same_state(got["loaded"], want, "loaded")
    assert got["ties_kept"]
    losses = [sum(r["losses"][s] for r in results) / 2 for s in range(STEPS)]
    assert losses == pytest.approx(want_losses, rel=1e-4)
