"""Benchmark workloads: a model factory (sparse or dense embedding gradients) and a batch maker.

Every system in a comparison gets the same model (same seed), the same global batch per step and
plain SGD, so step times differ only by how gradients are synchronised.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..data import zipf_tokens
from ..models import DLRM, SmallResNet, TinyGPT, WordLM
from ..models.lm import sample_negatives


def _mine(t: torch.Tensor, rank: int, world_size: int, shares) -> torch.Tensor:
    return t.split(list(shares))[rank] if shares else t.chunk(world_size)[rank]


@dataclass(frozen=True)
class BenchWorkload:
    name: str
    kind: str                                   # "sparse", "dense" or "mixed"
    make: Callable[[bool], nn.Module]           # sparse_gradients -> model
    # (step, rank, world_size, shares=None) -> this rank's inputs: its even slice of the
    # global batch, or its shares[rank] samples of it
    batch: Callable[..., tuple]
    unit: str
    units_per_step: int                         # global units (tokens or samples) per step
    # (world size) -> each table's Zipf lookups per rank: (rows, lookups, alpha, shared by all)
    zipf: Callable[[int], dict[str, tuple]] | None = None
    samples: int = 0                            # the global batch in samples (sequences, ...)

    def traffic(self, topology) -> dict:
        """The tables' expected traffic (cost.TableTraffic), for the planner's hybrid search."""
        from ..estimate.cost import TableTraffic

        if self.zipf is None:
            return {}
        return {name: TableTraffic.zipf(rows, lookups, topology, alpha, shared=shared)
                for name, (rows, lookups, alpha, shared) in self.zipf(topology.world_size).items()}


def _lm(vocab: int, global_batch: int = 32, seq: int = 20, sampled: int = 1024) -> BenchWorkload:
    stream = torch.as_tensor(zipf_tokens(vocab, 200_000, 1.0, seed=1))

    def batch(step, rank, world_size, shares=None):
        g = torch.Generator().manual_seed(step)
        starts = torch.randint(0, len(stream) - seq - 1, (global_batch,), generator=g)
        window = stream[starts[:, None] + torch.arange(seq + 1)]
        mine = _mine(window, rank, world_size, shares)
        return mine[:, :-1], mine[:, 1:], sample_negatives(sampled, vocab, g)

    def zipf(n):   # tokens: Zipf 1; negatives: log-uniform (about Zipf 1), shared by every rank
        tokens = global_batch * seq / n
        return {"embedding.weight": (vocab, tokens, 1.0, 0),
                **{name: (vocab, tokens, 1.0, sampled)
                   for name in ("softmax_weight.weight", "softmax_bias.weight")}}

    return BenchWorkload(f"lm{vocab // 1000}k", "sparse",
                         lambda sparse: WordLM(vocab, 64, 128, 1, sparse=sparse,
                                               num_sampled=sampled),
                         batch, "tokens", global_batch * seq, zipf, global_batch)


def _cnn(global_batch: int = 32) -> BenchWorkload:
    def batch(step, rank, world_size, shares=None):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(global_batch, 3, 16, 16, generator=g)
        y = torch.randint(0, 10, (global_batch,), generator=g)
        return _mine(x, rank, world_size, shares), _mine(y, rank, world_size, shares)

    return BenchWorkload("cnn", "dense", lambda sparse: SmallResNet(10, 16, 2), batch, "samples",
                         global_batch, samples=global_batch)


def _gpt(global_batch: int = 16, seq: int = 32) -> BenchWorkload:
    def batch(step, rank, world_size, shares=None):
        g = torch.Generator().manual_seed(step)
        t = _mine(torch.randint(0, 1000, (global_batch, seq + 1), generator=g), rank, world_size,
                  shares)
        return t[:, :-1], t[:, 1:]

    return BenchWorkload("gpt", "dense", lambda sparse: TinyGPT(1000, 64, 4, 2, seq), batch,
                         "tokens", global_batch * seq, samples=global_batch)


def _recommender(global_batch: int = 256, tables=(200_000, 50_000, 1_000)) -> BenchWorkload:
    def batch(step, rank, world_size, shares=None):
        g = torch.Generator().manual_seed(step)
        dense = torch.randn(global_batch, 8, generator=g)
        ids = torch.stack([torch.as_tensor(zipf_tokens(n, global_batch, 1.1, seed=step * 7 + i))
                           for i, n in enumerate(tables)], dim=1)
        labels = torch.randint(0, 2, (global_batch,), generator=g).float()
        return tuple(_mine(t, rank, world_size, shares) for t in (dense, ids, labels))

    def zipf(n):
        return {f"tables.{i}.weight": (rows, global_batch / n, 1.1, 0)
                for i, rows in enumerate(tables)}

    return BenchWorkload("recommender", "mixed",
                         lambda sparse: DLRM(list(tables), 8, 16, sparse=sparse), batch, "samples",
                         global_batch, zipf, global_batch)


WORKLOADS = {w.name: w for w in (_lm(100_000), _lm(800_000), _cnn(), _gpt(), _recommender())}
