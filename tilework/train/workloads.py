"""From a job to what the loop needs: a model, datasets, a loss per batch, an evaluation."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..cluster.worker_env import WorkerEnv
from ..data import ClickLogs, SyntheticImages, TokenSequences, stdlib_corpus, zipf_tokens
from ..models import DLRM, SmallResNet, TinyGPT, WordLM
from ..models.lm import sample_negatives
from .job import Job


@dataclass
class Workload:
    model: nn.Module
    train_set: Any                                   # has __len__ and collate(indices)
    loss: Callable[[nn.Module, tuple, int], torch.Tensor]
    evaluate: Callable[[nn.Module], dict[str, float]]
    unit: str                                        # what throughput counts: tokens or samples
    units_per_sample: int


def default_cache_dir() -> Path:
    """Where a job without `cache_dir` caches its corpus; the entry points set `cache_dir` from
    XDG_CACHE_HOME (`WorkerEnv.cache_dir`), so this is what a direct call gets."""
    return WorkerEnv().cache_dir


def build(job: Job) -> Workload:
    torch.manual_seed(job.train.seed)  # identical initial weights on every rank
    return {"lm": _lm, "gpt": _gpt, "cnn": _cnn, "recommender": _recommender}[job.workload](job)


def _tokens(job: Job, cfg) -> tuple:
    """The token stream of the lm and gpt workloads (`cfg` is either's table), its vocabulary,
    and its sequences split into training and held-out ones."""
    if cfg.corpus == "stdlib":
        corpus = stdlib_corpus(job.cache_dir or default_cache_dir(), max_vocab=cfg.vocab)
        tokens, vocab = corpus.tokens, corpus.vocab
    else:
        tokens, vocab = (zipf_tokens(cfg.vocab, cfg.zipf_tokens, cfg.zipf_alpha, job.data.seed),
                         cfg.vocab)
    train_set, held_out = TokenSequences(tokens, cfg.seq_len).split(cfg.holdout)
    return vocab, train_set, held_out


def _lm(job: Job) -> Workload:
    cfg = job.lm
    vocab, train_set, held_out = _tokens(job, cfg)
    model = WordLM(vocab, cfg.embed_dim, cfg.hidden, cfg.layers, sparse=cfg.sparse,
                   num_sampled=cfg.num_sampled)
    eval_batch = held_out.collate(range(min(cfg.eval_sequences, len(held_out))))

    def loss(m, batch, step):
        inputs, targets = batch
        negatives = None
        if cfg.num_sampled:
            # Shared by every rank: a function of the step only, like the global batch.
            g = torch.Generator().manual_seed(job.train.seed * 1_000_003 + step)
            negatives = sample_negatives(cfg.num_sampled, vocab, g)
        return m(inputs, targets, negatives)

    return Workload(model, train_set, loss, lambda m: {"ppl": m.perplexity(*eval_batch)},
                    unit="tokens", units_per_sample=cfg.seq_len)


def _gpt(job: Job) -> Workload:
    cfg = job.gpt
    _, train_set, held_out = _tokens(job, cfg)
    # The model's vocabulary is the job's, not the corpus's (a small corpus may hold fewer
    # words): the shapes, and so the checkpoint's fingerprint and tp's split, stay the job's.
    model = TinyGPT(cfg.vocab, cfg.dim, cfg.heads, cfg.layers, cfg.seq_len)
    eval_batch = held_out.collate(range(min(cfg.eval_sequences, len(held_out))))

    def evaluate(m):
        with torch.no_grad():
            if hasattr(m, "evaluate"):   # a PipelineModel: forward only, stage after stage
                return {"eval_loss": m.evaluate(*eval_batch)}
            return {"eval_loss": m(*eval_batch).item()}

    return Workload(model, train_set, lambda m, b, s: m(*b), evaluate, unit="tokens",
                    units_per_sample=cfg.seq_len)


class _Head:
    """The first `count` samples of a dataset; the rest is held out for evaluation."""

    def __init__(self, data, count: int):
        self.data, self.count = data, count

    def __len__(self) -> int:
        return self.count

    def collate(self, indices):
        return self.data.collate(indices)


def _held_out_loss(data, start: int, count: int):
    batch = data.collate(range(start, start + count))

    def evaluate(m):
        with torch.no_grad():
            return {"eval_loss": m(*batch).item()}

    return evaluate


def _cnn(job: Job) -> Workload:
    cfg = job.cnn
    data = SyntheticImages(cfg.samples + 512, cfg.num_classes, cfg.image_size, seed=job.data.seed)
    model = SmallResNet(cfg.num_classes, cfg.width, cfg.blocks)
    return Workload(model, _Head(data, cfg.samples), lambda m, b, s: m(*b),
                    _held_out_loss(data, cfg.samples, 512), unit="samples", units_per_sample=1)


def _recommender(job: Job) -> Workload:
    cfg = job.recommender
    data = ClickLogs(cfg.samples + 2048, cfg.table_sizes, cfg.dense_features, cfg.zipf_alpha,
                     seed=job.data.seed)
    model = DLRM(cfg.table_sizes, cfg.dense_features, cfg.embed_dim, sparse=cfg.sparse)
    return Workload(model, _Head(data, cfg.samples), lambda m, b, s: m(*b),
                    _held_out_loss(data, cfg.samples, 2048), unit="samples", units_per_sample=1)
