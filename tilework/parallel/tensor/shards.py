"""How a full tensor splits over tp ranks, and back: pure arithmetic shared by the layout (which
slices the one-process values into each rank's modules), checkpoints (which gather them whole)
and the cost model (which counts the shards' bytes).

A spec is None (replicated), an int d (even slices along dimension d, rank-major), or
"fused:K" (K projections packed along dimension 0, as nanoGPT's c_attn packs q, k, v or a
gate_up_proj packs gate and up: each part split along dimension 0, this rank's K slices packed
again, so its heads stay whole). "qkv" (nn.MultiheadAttention's in-projection) is "fused:3".
"""

from __future__ import annotations

import torch

from ...errors import PlanError

Spec = int | str | None


def fused_parts(spec: Spec) -> int:
    """K of a "fused:K" spec ("qkv": 3); 0 for any other spec."""
    if spec == "qkv":
        return 3
    if isinstance(spec, str) and spec.startswith("fused:") and spec[6:].isdigit() \
            and int(spec[6:]) >= 1:
        return int(spec[6:])
    return 0


def check_spec(spec: Spec) -> None:
    if spec is not None and not fused_parts(spec) and not isinstance(spec, int):
        raise PlanError(f"a shard spec is None, a dimension, 'qkv' or 'fused:K', got {spec!r}")


def local_shape(shape: tuple[int, ...], spec: Spec, n: int) -> tuple[int, ...]:
    check_spec(spec)
    if spec is None:
        return tuple(shape)
    k = fused_parts(spec)
    dim = 0 if k else spec
    parts = k * n if k else n
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
    if fused_parts(spec):
        return torch.cat([part.chunk(n, 0)[rank] for part in full.chunk(fused_parts(spec), 0)])
    return full.chunk(n, spec)[rank]


def unshard(parts: list[torch.Tensor], spec: Spec) -> torch.Tensor:
    """The full tensor from every rank's part, in rank order."""
    check_spec(spec)
    if spec is None:
        return parts[0]
    k = fused_parts(spec)
    if k:
        pieces = [p.chunk(k, 0) for p in parts]
        return torch.cat([torch.cat([t[i] for t in pieces]) for i in range(k)])
    return torch.cat(parts, spec)
