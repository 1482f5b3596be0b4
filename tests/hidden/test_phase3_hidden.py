"""Hidden tests for Phase 3: instructor-only (left out of the student edition)."""

import torch

from vkv.engine.quantizer import Quantizer, bytes_per_token, pack_int4, unpack_int4


def test_part1_a_large_offset_keeps_the_bound():
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(7)) + 1e4
    quantizer = Quantizer(8)
    q = quantizer.quantize(x)
    error = (quantizer.dequantize(q) - x).abs()
    assert bool((error <= q.scale / 2 + 1e-6 * x.abs().max()).all())


def test_part2_packing_a_four_dimensional_block():
    codes = torch.randint(0, 16, (3, 4, 5, 8), generator=torch.Generator().manual_seed(8))
    codes = codes.to(torch.uint8)
    packed = pack_int4(codes)
    assert packed.shape == (3, 4, 5, 4)
    assert torch.equal(packed[..., 0] & 0x0F, codes[..., 0])
    assert torch.equal(unpack_int4(packed), codes)


def test_part3_a_single_token_block_is_exact():
    keys = torch.randn(1, 2, 8, generator=torch.Generator().manual_seed(9))
    quantizer = Quantizer(4, "per_channel")
    assert torch.equal(quantizer.dequantize(quantizer.quantize(keys)), keys)


def test_part4_vkv_tiny_formats():
    assert bytes_per_token(4, 4, 32, "auto") == 2048
    assert bytes_per_token(4, 4, 32, "int8") == 1152
    assert bytes_per_token(4, 4, 32, "int4") == 640
