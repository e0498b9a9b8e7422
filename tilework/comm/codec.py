"""Lossy encodings of float vectors for a slow wire: bfloat16, and int8 / int4 with one float32
scale per block of `BLOCK` values (the largest magnitude maps to the top level; rounding to
nearest, so an encoding is deterministic and a resume is bit-exact).

Pure tensor functions, no process group: the runtime (local SGD's outer sync,
parallel/data/outer.py) encodes with them and the cost model sizes with `encoded_bytes`, so the
two cannot disagree. A block holding a non-finite value decodes to non-finite values (its scale
is), so a diverged sender is still seen after the trip.
"""

from __future__ import annotations

from typing import Literal

import torch

Codec = Literal["none", "bf16", "int8", "int4"]
CODECS = ("none", "bf16", "int8", "int4")
BLOCK = 64                           # values per float32 scale (int8, int4)
SCALE_BYTES = 4
LEVELS = {"int8": 127, "int4": 7}    # symmetric: -L..L


def multiple_of(codec: Codec) -> int:
    """What a vector's length must be a multiple of to be encoded in `codec`."""
    return BLOCK if codec in LEVELS else 1


def encoded_bytes(numel: int, codec: Codec, item: int = 4) -> int:
    """Bytes of `numel` values (each `item` bytes as they are) in `codec`; numel a multiple of
    `multiple_of(codec)`."""
    if codec == "none":
        return numel * item
    if codec == "bf16":
        return 2 * numel
    values = numel if codec == "int8" else numel // 2
    return values + SCALE_BYTES * (numel // BLOCK)


def encode(x: torch.Tensor, codec: Codec) -> torch.Tensor:
    """Rows of `x` ([m, k], floating) as uint8 rows of `encoded_bytes(k, codec)`."""
    m, k = x.shape
    if codec == "none":
        return x.contiguous().view(torch.uint8).view(m, -1)
    if codec == "bf16":
        return x.to(torch.bfloat16).view(torch.uint8).view(m, -1)
    levels = LEVELS[codec]
    blocks = x.float().view(m, k // BLOCK, BLOCK)
    scale = blocks.abs().amax(-1, keepdim=True) / levels
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))   # NaN > 0 is False: kept NaN
    # In place after the division: one float temporary, not three (a sync encodes every
    # bucket's slice at once: estimate/outer_memory.py counts what this allocates).
    q = (blocks / divisor).round_().clamp_(-levels, levels).to(torch.int8).view(m, k)
    if codec == "int8":
        values = q.view(torch.uint8)
    else:   # two values a byte, offset to 1..15
        nibbles = (q + 8).to(torch.uint8).view(m, k // 2, 2)
        values = nibbles[..., 0] | (nibbles[..., 1] << 4)
    return torch.cat([values, scale.view(m, -1).contiguous().view(torch.uint8)], dim=1)


def decode(payload: torch.Tensor, codec: Codec, k: int,
           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`encode`'s rows back as [m, k] of `dtype`."""
    m = payload.shape[0]
    payload = payload.contiguous()
    if codec == "none":
        return payload.view(dtype).view(m, k)
    if codec == "bf16":
        return payload.view(torch.bfloat16).view(m, k).to(dtype)
    split = k if codec == "int8" else k // 2
    values, scale = payload[:, :split], payload[:, split:].contiguous().view(torch.float32)
    if codec == "int8":
        q = values.contiguous().view(torch.int8).float()
    else:
        q = torch.stack([values & 0x0F, values >> 4], dim=-1).view(m, k).float().sub_(8)
    return q.view(m, k // BLOCK, BLOCK).mul_(scale.view(m, -1, 1)).view(m, k).to(dtype)


__all__ = ["BLOCK", "CODECS", "Codec", "decode", "encode", "encoded_bytes", "multiple_of"]
