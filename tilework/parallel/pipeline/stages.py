"""Cut a model whose blocks are a ModuleList into pipeline stages, balanced by per-block cost.

    stages = split_stages(TinyGPT(...), 4)      # 4 GPTStage modules sharing the model's modules

The first stage holds the embeddings and its blocks, the last its blocks, the final norm, the
head and the loss; stages in between hold blocks only. The stages share the model's own modules
(nothing is copied), so a rank that keeps its stages trains the model's parameters in place and
`model.state_dict()` names them as one process does.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import PlanError


def matmul_params(module: nn.Module) -> int:
    """Weights that multiply every token (FLOPs per token ~ 2x this); an embedding's rows are
    looked up, not multiplied, so it costs next to nothing."""
    return sum(p.numel() for m in module.modules() if not isinstance(m, nn.Embedding)
               for p in m.parameters(recurse=False))


def balance(costs: Sequence[float], parts: int, first: float = 0.0, last: float = 0.0,
            speeds: Sequence[float] | None = None) -> list[range]:
    """Contiguous ranges of `costs` (at least one block each) that minimise the largest part's
    cost, `first` and `last` added to the first and last part (the embedding and the head).
    `speeds`: each part's ranks' relative speed, the part's time its cost over it (uneven
    stages for ranks that differ, as AMP and Metis cut them). Exact, by dynamic programming
    over split points: blocks are few."""
    n = len(costs)
    if not 1 <= parts <= n:
        raise PlanError(f"cannot cut {n} blocks into {parts} stages of at least one block each")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    if speeds is not None and (len(speeds) != parts or any(not v > 0 for v in speeds)):
        raise PlanError(f"stage speeds: one positive speed per stage ({parts}), got "
                        f"{list(speeds)}")

    def part(i: int, j: int, k: int) -> float:
        ends = (first if k == 0 else 0.0) + (last if k == parts - 1 else 0.0)
        return (prefix[j] - prefix[i] + ends) / (speeds[k] if speeds is not None else 1.0)

    # best[k][j]: the smallest largest cost of cutting blocks [0, j) into k + 1 parts
    best = [[float("inf")] * (n + 1) for _ in range(parts)]
    cut = [[0] * (n + 1) for _ in range(parts)]
    for j in range(1, n + 1):
        best[0][j] = part(0, j, 0)
    for k in range(1, parts):
        for j in range(k + 1, n + 1):
            for i in range(k, j):
                worst = max(best[k - 1][i], part(i, j, k))
                if worst < best[k][j]:
                    best[k][j], cut[k][j] = worst, i
    bounds, j = [n], n
    for k in range(parts - 1, 0, -1):
        j = cut[k][j]
        bounds.append(j)
    bounds.append(0)
    bounds.reverse()
    return [range(bounds[k], bounds[k + 1]) for k in range(parts)]


def checked_cut(blocks: Sequence[range], stages: int, count: int) -> list[range]:
    """A plan's cut: `stages` contiguous, non-empty ranges covering blocks 0..count-1."""
    blocks = [range(b.start, b.stop) for b in blocks]
    if len(blocks) != stages or blocks[0].start != 0 or blocks[-1].stop != count or any(
            not b or b.stop != c.start for b, c in zip(blocks, blocks[1:])) or not blocks[-1]:
        raise PlanError(f"the plan's stages {[(b.start, b.stop) for b in blocks]} are not "
                         f"{stages} contiguous parts of this model's {count} blocks")
    return blocks


class GPTStage(nn.Module):
    """One stage of TinyGPT (tilework/models/gpt.py): forward(x, targets) takes token ids (first
    stage) or the previous stage's activation and returns its activation; the last stage returns
    the microbatch's mean loss (its logits without targets)."""

    def __init__(self, model: nn.Module, blocks: range, first: bool, last: bool):
        super().__init__()
        self.index_range = blocks
        self.first, self.last = first, last
        self.dim = model.head.in_features
        self.layers = nn.ModuleList([model.blocks.layers[i] for i in blocks])
        if first:
            self.tokens, self.positions = model.tokens, model.positions
        if last:
            self.norm, self.head = model.norm, model.head
        self.register_buffer("causal", model.causal, persistent=False)
        # Under sequence parallelism a boundary carries this rank's slice of the sequence.
        self.sequence_parts = 1

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        t = x.shape[1]
        if self.first:
            x = self.tokens(x) + self.positions(torch.arange(t, device=x.device))
        # Each layer as nn.TransformerEncoder calls it, so the arithmetic is the model's own.
        for layer in self.layers:
            x = layer(x, src_mask=self.causal[:t, :t], is_causal=True)
        if not self.last:
            return x
        logits = self.head(self.norm(x))
        if targets is None:   # a runtime that computes the loss itself (torch's schedules)
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def boundary_like(self, tokens: torch.Tensor) -> torch.Tensor:
        """An empty activation as it crosses a stage boundary for these microbatch tokens: what
        a receiver allocates, so no shapes travel."""
        batch, seq = tokens.shape
        return torch.empty(batch, seq // self.sequence_parts, self.dim, dtype=self.causal.dtype,
                           device=tokens.device)


def split_stages(model: nn.Module, stages: int, costs: Sequence[float] | None = None,
                 blocks: Sequence[range] | None = None,
                 speeds: Sequence[float] | None = None) -> list[GPTStage]:
    """`model` (TinyGPT-shaped: tokens, positions, blocks.layers, norm, head, causal) cut into
    `stages` GPTStages, balanced by `costs` per block (default: each block's matmul weights; the
    head's count towards the last stage). Training cuts any other model by generic.py; the
    estimates that cut stages here (memory, the mesh search) refuse one by name. `blocks`: the
    cut a plan made (its stages' block ranges), taken as it is; `speeds`: each stage's ranks'
    relative speed (balance)."""
    if not all(hasattr(model, a) for a in ("tokens", "positions", "blocks", "norm", "head")):
        raise PlanError(f"pp: the estimate of pipeline stages is built for the reference GPT "
                        f"only, not {type(model).__name__} yet (training with pp cuts it)")
    layers = model.blocks.layers
    if costs is None:
        costs = [matmul_params(layer) for layer in layers]
    if len(costs) != len(layers):
        raise PlanError(f"{len(costs)} costs for {len(layers)} blocks")
    last = matmul_params(model.head) + matmul_params(model.norm)
    parts = balance(costs, stages, first=0.0, last=last, speeds=speeds) if blocks is None \
        else checked_cut(blocks, stages, len(layers))
    return [GPTStage(model, part, k == 0, k == stages - 1) for k, part in enumerate(parts)]
