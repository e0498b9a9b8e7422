"""The wire encodings (comm/codec.py): sizes as the cost model counts them, rounding within
half a level, and a non-finite value never decoding to a finite one."""

from __future__ import annotations

import pytest
import torch

from tilework.comm.codec import BLOCK, CODECS, LEVELS, decode, encode, encoded_bytes


@pytest.mark.parametrize("codec", CODECS)
def test_an_encoding_has_the_counted_size_and_decodes_back_within_half_a_level(codec):
    torch.manual_seed(0)
    x = torch.randn(3, 4 * BLOCK) * torch.tensor([[1e-3], [1.0], [50.0]])
    x[0, :BLOCK] = 0   # an all-zero block: scale 0, decodes to zeros
    payload = encode(x, codec)
    assert payload.dtype == torch.uint8
    assert payload.shape == (3, encoded_bytes(4 * BLOCK, codec))
    back = decode(payload, codec, 4 * BLOCK)
    if codec == "none":
        assert torch.equal(back, x)
    elif codec == "bf16":
        assert torch.equal(back, x.to(torch.bfloat16).float())
    else:
        blocks = x.view(3, -1, BLOCK)
        half_level = blocks.abs().amax(-1, keepdim=True) / LEVELS[codec] / 2
        assert ((back.view(3, -1, BLOCK) - blocks).abs() <= half_level * (1 + 1e-6)).all()
        assert torch.equal(back[0, :BLOCK], torch.zeros(BLOCK))
    assert torch.equal(encode(x, codec), payload)   # deterministic: a resume is bit-exact


@pytest.mark.parametrize("codec", CODECS[1:])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_value_decodes_non_finite(codec, bad):
    x = torch.randn(1, 2 * BLOCK)
    x[0, 3] = bad
    back = decode(encode(x, codec), codec, 2 * BLOCK)
    assert not torch.isfinite(back[0, :BLOCK]).all()
    assert torch.isfinite(back[0, BLOCK:]).all()   # only its own block


def test_int4_and_int8_sizes_are_a_quarter_and_an_eighth_of_float32_plus_scales():
    n = 1024
    assert encoded_bytes(n, "none") == 4 * n
    assert encoded_bytes(n, "bf16") == 2 * n
    assert encoded_bytes(n, "int8") == n + 4 * n // BLOCK
    assert encoded_bytes(n, "int4") == n // 2 + 4 * n // BLOCK
