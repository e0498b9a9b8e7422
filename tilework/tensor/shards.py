"""How a full tensor splits over tp ranks, and back: pure arithmetic shared by the layout (which
slices the one-process values into each rank's modules), checkpoints (which gather them whole)
and the cost model (which counts the shards' bytes).

A spec is None (replicated), an int d (even slices along dimension d, rank-major), or "qkv"
(the packed q, k, v in-projection of nn.MultiheadAttention: each of q, k and v split along
dimension 0, this rank's three slices packed again, so its heads stay whole).
"""

from __future__ import annotations

import torch

from ..errors import PlanError

Spec = int | str | None


def check_spec(spec: Spec) -> None:
    if spec is not None and spec != "qkv" and not isinstance(spec, int):
        raise PlanError(f"a shard spec is None, a dimension or 'qkv', got {spec!r}")


def local_shape(shape: tuple[int, ...], spec: Spec, n: int) -> tuple[int, ...]:
    check_spec(spec)
    if spec is None:
        return tuple(shape)
    dim = 0 if spec == "qkv" else spec
    parts = 3 * n if spec == "qkv" else n
    if shape[dim] % parts:
        raise PlanError(f"dimension {dim} of {tuple(shape)} does not split into {parts}")
    out = list(shape)
    out[dim] //= n
    return tuple(out)


def shard(full: torch.Tensor, spec: Spec, rank: int, n: int) -> torch.Tensor:
    """This rank's part of `full` (a view where it can be)."""
    local_shape(tuple(full.shape), spec, n)
    if spec is None:
        return full
    if spec == "qkv":
        return torch.cat([part.chunk(n, 0)[rank] for part in full.chunk(3, 0)])
    return full.chunk(n, spec)[rank]


def unshard(parts: list[torch.Tensor], spec: Spec) -> torch.Tensor:
    """The full tensor from every rank's part, in rank order."""
    check_spec(spec)
    if spec is None:
        return parts[0]
    if spec == "qkv":
        thirds = [p.chunk(3, 0) for p in parts]
        return torch.cat([torch.cat([t[i] for t in thirds]) for i in range(3)])
    return torch.cat(parts, spec)
