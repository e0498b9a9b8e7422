"""Which tokens each context-parallel rank holds: the load-balanced split, pure functions.

Causal attention over a sequence cut into cp contiguous parts is uneven: the last rank's queries
see every key, the first rank's only its own. Megatron-LM and TransformerEngine cut the sequence
into 2*cp chunks instead and give rank r chunks r and 2*cp-1-r (one early, one late), so every
rank's queries see the same number of keys. A rank's local sequence is its two chunks, in that
order: local positions stay increasing in global position, so a causal mask on the local
sequence is the global one restricted to it.

    cp=2: rank 0 holds chunks 0, 3; rank 1 holds 1, 2
    cp=4: rank 0: 0, 7; rank 1: 1, 6; rank 2: 2, 5; rank 3: 3, 4
"""

from __future__ import annotations

import torch

from ...errors import PlanError

SEQ_DIM = 1   # (batch, sequence, ...) as batch-first models hold tokens and activations


def _check(seq: int, cp_rank: int, cp: int) -> None:
    if not (isinstance(cp, int) and cp >= 1):
        raise PlanError(f"cp must be an integer >= 1, got {cp!r}")
    if not 0 <= cp_rank < cp:
        raise PlanError(f"cp rank {cp_rank} is not in a cp group of {cp}")
    if seq % (2 * cp):
        raise PlanError(f"a sequence of {seq} tokens does not cut into 2*cp = {2 * cp} equal "
                         "chunks (context parallelism's load-balanced layout); pad or choose "
                         "another cp")


def chunks_of(cp_rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of 2*cp) rank `cp_rank` holds, in local order."""
    return cp_rank, 2 * cp - 1 - cp_rank


def local_positions(seq: int, cp_rank: int, cp: int, device=None) -> torch.Tensor:
    """The global positions of rank `cp_rank`'s local tokens, in local order (int64), on
    `device` (default the CPU)."""
    _check(seq, cp_rank, cp)
    c = seq // (2 * cp)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device)
                      for i in chunks_of(cp_rank, cp)])


def global_of_local(ids: torch.Tensor, local_len: int, cp_rank: int, cp: int) -> torch.Tensor:
    """Local slot indices (0..local_len-1, any shape) as global positions, elementwise."""
    c = local_len // 2
    early, late = chunks_of(cp_rank, cp)
    return torch.where(ids < c, ids + early * c, ids - c + late * c)


def shard(x: torch.Tensor, cp_rank: int, cp: int, dim: int = SEQ_DIM) -> torch.Tensor:
    """Rank `cp_rank`'s tokens of `x` along `dim` (a copy, contiguous)."""
    _check(x.shape[dim], cp_rank, cp)
    parts = x.chunk(2 * cp, dim)
    return torch.cat([parts[i] for i in chunks_of(cp_rank, cp)], dim)


def unshard(parts: list[torch.Tensor], dim: int = SEQ_DIM) -> torch.Tensor:
    """The whole sequence from every rank's `shard`, given in cp-rank order."""
    cp = len(parts)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for r, part in enumerate(parts):
        early, late = part.chunk(2, dim)
        chunks[chunks_of(r, cp)[0]], chunks[chunks_of(r, cp)[1]] = early, late
    return torch.cat(chunks, dim)


def shard_sequence(tokens: torch.Tensor, targets: torch.Tensor, cp_rank: int,
                   cp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's load-balanced share of a batch of (batch, seq) tokens and their targets.

    Each rank's mean loss over its tokens averages, over cp, to the one-process mean: every
    rank holds batch * seq / cp tokens (targets with ignore_index would break that equality)."""
    if tokens.shape != targets.shape:
        raise PlanError(f"tokens {tuple(tokens.shape)} and targets {tuple(targets.shape)} "
                         "differ in shape")
    return shard(tokens, cp_rank, cp), shard(targets, cp_rank, cp)


class SequenceCut:
    """The model's (batch, sequence, ...) tensor inputs cut to this rank's load-balanced part
    of the sequence (parallel/context/layout.py), so the script passes whole sequences as before."""

    def __init__(self, cp_rank: int, cp: int):
        self.cp_rank, self.cp = cp_rank, cp

    def __call__(self, module, args, kwargs):
        def cut(x):
            return shard(x, self.cp_rank, self.cp) if torch.is_tensor(x) and x.dim() >= 2 else x

        return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}
