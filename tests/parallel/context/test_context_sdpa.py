"""Context parallelism on F.scaled_dot_product_attention (tilework/parallel/context/sdpa.py),
through `tilework.parallelize(model, opt, cp=2)`: nanoGPT's model.py (SDPA called in its own
forward, positions from `wpe(torch.arange(0, t))`) and Hugging Face's LlamaForCausalLM (SDPA through
its attention registry, rotary positions from `position_ids`), tied and untied, train with AdamW as
one process trains them; what ring attention cannot run is refused by its call site.

Every cp rank gets the whole batch; cp cuts each sequence into its load-balanced part, so the
mean of the two ranks' losses is one process's loss. Tolerance 1e-4 relative to each tensor's
largest magnitude (AdamW; the ring's block sums run in another order than SDPA's).

    .venv/bin/python -m pytest -p no:warnings tests/parallel/context/test_context_sdpa.py -q
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tilework
from tests.real_models import NanoGPT, have_transformers, hf_llama, lm_batch
from tilework.errors import PlanError
from tilework.testing import spawn

STEPS, BATCH, SEQ, VOCAB = 3, 4, 8, 64
TOL = 1e-4
FAMILIES = ["nanogpt", "nanogpt-recompute"] + (
    ["llama-tied", "llama", "llama-gqa"] if have_transformers() else [])

needs_transformers = pytest.mark.skipif(
    not have_transformers(), reason="Hugging Face transformers is not installed "
    "(pip install -e '.[models]')")


def build(family: str):
    torch.manual_seed(0)
    if family.startswith("nanogpt"):
        return NanoGPT(vocab_size=VOCAB, block_size=SEQ)
    if family == "llama-gqa":   # one key/value head for two query heads: SDPA's enable_gqa
        from transformers import LlamaConfig, LlamaForCausalLM
        return LlamaForCausalLM(LlamaConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
            attn_implementation="sdpa"))
    return hf_llama(tied=family == "llama-tied", vocab_size=VOCAB)


def loss_of(family: str, model, x, y):
    if family.startswith("nanogpt"):
        return model(x, y)[1]
    # shift_labels: the targets already shifted, so each rank's chunks pair the right tokens.
    y = y.contiguous()   # HF views shift_labels flat
    # Without a cache and an attention_mask, HF reads this rank's global positions (which
    # jump between its two chunks) as packed sequences: "llama" checks the mask cp passes.
    extra = {"use_cache": False} if family == "llama" else {}
    return model(input_ids=x, labels=y, shift_labels=y, **extra).loss


def train(family: str, model, opt) -> list[float]:
    losses = []
    for step in range(STEPS):
        loss = loss_of(family, model, *lm_batch(step, VOCAB, SEQ, BATCH))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def optimizer_for(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)


def reference(family: str):
    model = build(family)
    losses = train(family, model, optimizer_for(model))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- what ring attention cannot run --------------------------------------------------------------

class Attention(nn.Module):
    """nanoGPT-shaped self-attention whose SDPA call is given `mask` / `dropout`."""

    def __init__(self, mask: str | None = None, dropout: float = 0.0):
        super().__init__()
        self.qkv, self.mask, self.dropout = nn.Linear(8, 24), mask, dropout

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, 2, 4).transpose(1, 2) for z in self.qkv(x).split(8, dim=2))
        # Upper triangular: each token sees the ones after it, neither causal nor empty.
        mask = torch.ones(t, t, dtype=torch.bool).triu() if self.mask == "anti-causal" else None
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           dropout_p=self.dropout if self.training else 0.0)
        return y.transpose(1, 2).reshape(b, t, 8)


class Tiny(nn.Module):
    def __init__(self, attention: nn.Module | None):
        super().__init__()
        self.embed, self.attn, self.head = nn.Embedding(16, 8), attention, nn.Linear(8, 16)

    def forward(self, tokens):
        x = self.embed(tokens)
        return self.head(x if self.attn is None else self.attn(x)).sum()


def _refused(make) -> str:
    model = make()
    tilework.parallelize(model, torch.optim.SGD(model.parameters(), lr=0.1), cp=2, log=False)
    try:
        model(torch.randint(0, 16, (2, 8)))
    except PlanError as e:
        return str(e)
    return "not refused"


def _refusals() -> dict[str, str]:
    out = {"mask": _refused(lambda: Tiny(Attention(mask="anti-causal"))),
           "dropout": _refused(lambda: Tiny(Attention(dropout=0.1))),
           "none": _refused(lambda: Tiny(None))}
    if have_transformers():
        model = build("llama")
        tilework.parallelize(model, optimizer_for(model), cp=2, log=False)
        x, y = lm_batch(0, VOCAB, SEQ, BATCH)
        try:
            model(input_ids=x, labels=y)
            out["labels"] = "not refused"
        except PlanError as e:
            out["labels"] = str(e)
    return out


# -- two ranks, once for the file ---------------------------------------------------------------

def _cp_rank(rank, world_size):
    out = {}
    for family in FAMILIES:
        model = build(family)
        opt = optimizer_for(model)
        # Recompute reruns the blocks' forward in backward, outside the model's own.
        recompute = {"recompute": "full"} if family.endswith("recompute") else {}
        tilework.parallelize(model, opt, cp=2, log=False, **recompute)
        losses = train(family, model, opt)
        out[family] = {"losses": losses, "state": tilework.state_dict(model, opt)["model"]}
    out["refusals"] = _refusals()
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return spawn(_cp_rank, 2, timeout=240)


def assert_close(got, want, what):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    scale = max(want.abs().max().item(), 1e-12)
    worst = (got.double() - want.double()).abs().max().item()
    assert worst <= TOL * scale, f"{what}: differs by {worst:.3g} (scale {scale:.3g})"


@pytest.mark.parametrize("family", ["nanogpt", "nanogpt-recompute",
                                    pytest.param("llama-tied", marks=needs_transformers),
                                    pytest.param("llama", marks=needs_transformers),
                                    pytest.param("llama-gqa", marks=needs_transformers)])
def test_trains_as_one_process_at_cp2(family, two_ranks):
    want_losses, want = reference(family)
    got = [r[family] for r in two_ranks]
    losses = [sum(r["losses"][i] for r in got) / 2 for i in range(STEPS)]
    assert_close(torch.tensor(losses), torch.tensor(want_losses), f"{family} losses")
    for rank, r in enumerate(got):
        assert set(r["state"]) == set(want), f"{family} rank {rank}: keys differ"
        for k, v in want.items():
            assert_close(r["state"][k], v, f"{family} rank {rank}: {k}")


@pytest.mark.parametrize("case, message", [
    # the call site names the file by its folder and name (sdpa.py's call_site)
    ("mask", r"^attn: F\.scaled_dot_product_attention at context/test_context_sdpa\.py:\d+ "
             r"\(forward\) \(ring attention over cp=2\): this \(4, 4\) torch\.bool attn_mask is "
             r"neither causal nor empty.*pass is_causal=True or no mask"),
    ("dropout", r"^attn: F\.scaled_dot_product_attention at .*: dropout_p=0\.1 .*set the "
                r"attention dropout to 0"),
    ("none", r"^Tiny: context parallelism found no attention .*attn_implementation='sdpa'"),
    pytest.param("labels", r"^LlamaForCausalLM\(labels=\.\.\.\).*shift_labels=",
                 marks=needs_transformers),
])
def test_refused_by_call_site(case, message, two_ranks):
    for r in two_ranks:
        assert re.search(message, r["refusals"][case]), r["refusals"][case]
        assert "\n" not in r["refusals"][case]
