"""Bytes one rank sends over the cp axis per training step: pure arithmetic, the figures the
counters in comm.py (ring attention) and tensor.apply.average_gradients (the gradients) record
under "cp"; the tests hold them equal.

With B = batch x heads x (seq / cp) x head_dim x itemsize, one K (or V) block of a rank:
    forward, per attention layer    (cp - 1) K/V shifts             (cp - 1) * 2B
    backward, per attention layer   (cp - 1) K/V and cp dK/dV shifts (2cp - 1) * 2B
    gradients, once a step          a ring all-reduce of every parameter's gradient over cp
Received bytes equal sent bytes (a ring: every rank sends and receives each shift).
"""

from __future__ import annotations

from ...comm.wire import ring_allreduce_bytes


def kv_block_bytes(batch: int, heads: int, seq: int, head_dim: int, cp: int,
                   itemsize: int = 4) -> int:
    """One rank's K (or V) for one layer: `seq` is the whole sequence, `batch` this rank's
    sequences (its dp share)."""
    return batch * heads * (seq // cp) * head_dim * itemsize


def cp_attention_bytes(batch: int, heads: int, seq: int, head_dim: int, cp: int, layers: int,
                       itemsize: int = 4, backward: bool = True) -> int:
    """What one rank's ring attention sends in `layers` layers, forward (and backward)."""
    if cp == 1:
        return 0
    kv = 2 * kv_block_bytes(batch, heads, seq, head_dim, cp, itemsize)
    per_layer = (cp - 1) * kv + ((2 * cp - 1) * kv if backward else 0)
    return layers * per_layer


def cp_gradient_bytes(params: int, cp: int, itemsize: int = 4) -> int:
    """The gradients' average over cp: one flat ring all-reduce of `params` numbers."""
    return ring_allreduce_bytes(params * itemsize, cp)


def cp_step_bytes(batch: int, heads: int, seq: int, head_dim: int, cp: int, layers: int,
                  params: int, itemsize: int = 4) -> int:
    """What one rank sends over cp in one training step: ring attention forward and backward
    in every layer, then the gradient all-reduce."""
    return (cp_attention_bytes(batch, heads, seq, head_dim, cp, layers, itemsize)
            + cp_gradient_bytes(params, cp, itemsize))
