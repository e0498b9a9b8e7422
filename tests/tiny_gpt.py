"""The reference GPT's batches and its one-process SGD run, shared by the tests that train it
under another layout (tensor parallel, pipeline) and compare with one process."""

from __future__ import annotations

import torch


def gpt_batch(step: int, vocab: int, seq: int, batch: int, part: int = 0, parts: int = 1):
    """Step `step`'s global batch of token sequences (inputs, next-token targets), or part
    `part` of `parts` equal slices of it."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    per = batch // parts
    tokens = tokens[part * per:(part + 1) * per]
    return tokens[:, :-1], tokens[:, 1:]


def sgd_losses(model, batch_of, steps: int, lr: float = 0.1) -> list[float]:
    """`model` trained `steps` SGD steps in one process on `batch_of(step)`; the losses."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        loss = model(*batch_of(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses
