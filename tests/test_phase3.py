"""Graded tests for Phase 3: INT8 and INT4 KV-cache quantization (``vkv/engine/quantizer.py``).

``uv run pytest tests/test_phase3.py -k part2 -v`` runs the tests of part 3.2. The error bound
is checked with a float32 allowance of ``EPS * max|x|`` on top of ``scale / 2``: the arithmetic
of ``(x - min) / scale`` and ``code * scale + min`` rounds too, by a few units in the last place
of the largest magnitude involved.
"""

import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis_settings import graded_settings

# The torch functions the assertions compare with, bound before vkv.engine is imported: a
# solution region that replaced torch.equal (or allclose, isnan) later would not change them.
from torch import allclose, equal, isnan

from vkv.engine.quantizer import (
    QuantizedTensor,
    Quantizer,
    bytes_per_token,
    pack_int4,
    unpack_int4,
)

EPS = 1e-6
PROPERTY = graded_settings(max_examples=80)


@st.composite
def tensors(draw, even_last: bool = False, min_dims: int = 1) -> torch.Tensor:
    """Float tensors of 1 to 3 dimensions, magnitudes from 1e-3 to 1e4, some rows constant."""
    dims = draw(st.integers(min_dims, 3))
    shape = [draw(st.integers(1, 6)) for _ in range(dims - 1)]
    last = draw(st.integers(1, 8)) * (2 if even_last else 1)
    magnitude = draw(st.sampled_from([1e-3, 1.0, 37.0, 1e4]))
    seed = draw(st.integers(0, 2**16))
    x = torch.randn(*shape, last, generator=torch.Generator().manual_seed(seed)) * magnitude
    if draw(st.booleans()):
        x[..., :] = x[..., :1]  # every group along the last dimension is constant
    return x + draw(st.sampled_from([0.0, -5.0, 1e3]))


def assert_within_half_a_step(x: torch.Tensor, quantized: QuantizedTensor, back: torch.Tensor):
    error = (x - back).abs()
    allowed = quantized.scale / 2 + EPS * x.abs().max()
    worst = (error - allowed).max()
    assert worst <= 0, (
        f"|x - dequantize(quantize(x))| must be <= scale / 2 per element: it exceeds it by "
        f"{float(worst):.3g} (x of shape {list(x.shape)})"
    )


# ---- Part 3.1: the Quantizer, INT8 per token ------------------------------------------------


@pytest.mark.parametrize("bits", [3, 16, 0, 8.0, True, "8"])
def test_part1_bits_must_be_4_or_8(bits):
    with pytest.raises(ValueError, match=rf"^bits must be 4 or 8, got {re.escape(repr(bits))}$"):
        Quantizer(bits)


def test_part1_the_default_is_int8_per_token():
    quantizer = Quantizer()
    assert (quantizer.bits, quantizer.granularity, quantizer.max_code) == (8, "per_token", 255)


def test_part1_an_unknown_granularity_is_refused():
    said = "^granularity must be one of per_token, per_channel, got 'per_block'$"
    with pytest.raises(ValueError, match=said):
        Quantizer(8, "per_block")


@pytest.mark.parametrize(
    ("x", "said"),
    [
        (torch.tensor([1.0, float("nan")]), "^cannot quantize NaN or infinite values$"),
        (torch.tensor([[1.0, float("inf")]]), "^cannot quantize NaN or infinite values$"),
        (torch.tensor([-float("inf"), 0.0]), "^cannot quantize NaN or infinite values$"),
        (torch.tensor([1, 2, 3]), "^only a floating-point tensor can be quantized$"),
        (torch.empty(0, 4), "^cannot quantize an empty tensor or a scalar$"),
        (torch.tensor(2.0), "^cannot quantize an empty tensor or a scalar$"),
    ],
    ids=["nan", "inf", "-inf", "integers", "empty", "scalar"],
)
def test_part1_bad_tensors_are_refused(x, said):
    with pytest.raises(ValueError, match=said):
        Quantizer(8).quantize(x)


def test_part1_int4_needs_an_even_last_dimension():
    with pytest.raises(
        ValueError, match=r"^INT4 packs two codes per byte: the last dimension must be even, got 5$"
    ):
        Quantizer(4).quantize(torch.randn(2, 4, 5))  # the last dimension, not the second


def test_part1_codes_scale_and_zero_per_token():
    x = torch.tensor([[0.0, 1.0, 0.301, 0.699], [-2.0, 2.0, 0.1, 1.0]])
    q = Quantizer(8).quantize(x)
    assert q.codes.dtype == torch.uint8 and q.codes.shape == x.shape, (
        f"INT8 keeps one uint8 code per element: expected uint8 {list(x.shape)}, got "
        f"{q.codes.dtype} {list(q.codes.shape)}"
    )
    assert q.scale.dtype == q.zero.dtype == torch.float32
    assert q.scale.shape == q.zero.shape == (2, 1), (
        f"per token: one scale and one zero per row, shaped [2, 1]; got {list(q.scale.shape)}"
    )
    assert equal(q.zero, torch.tensor([[0.0], [-2.0]])), f"zero is the row's minimum: {q.zero}"
    assert allclose(q.scale, torch.tensor([[1 / 255], [4 / 255]])), (
        f"scale is (max - min) / 255 for INT8; got {q.scale.flatten().tolist()}"
    )
    expected = [[0, 255, 77, 178], [0, 255, 134, 191]]  # round to the nearest code
    assert q.codes.tolist() == expected, f"codes: expected {expected}, got {q.codes.tolist()}"
    assert q.bits == 8


def test_part1_the_minimum_and_maximum_get_the_end_codes():
    x = torch.randn(5, 3, 16, generator=torch.Generator().manual_seed(1)) * 4
    codes = Quantizer(8).quantize(x).codes
    assert bool((codes.amin(-1) == 0).all()) and bool((codes.amax(-1) == 255).all()), (
        "each token's smallest value must get code 0 and its largest code 255"
    )


@given(tensors())
@PROPERTY
def test_part1_round_trip_error_is_at_most_half_a_step(x):
    quantizer = Quantizer(8)
    q = quantizer.quantize(x)
    back = quantizer.dequantize(q)
    assert back.dtype == torch.float32 and back.shape == x.shape
    assert_within_half_a_step(x, q, back)


def test_part1_a_constant_vector_round_trips_exactly():
    x = torch.tensor([[3.25] * 8, [-1e-3] * 8, [0.0] * 8])
    quantizer = Quantizer(8)
    q = quantizer.quantize(x)
    back = quantizer.dequantize(q)
    assert not bool(isnan(back).any()), "a constant vector must not become NaN (0 / 0)"
    assert equal(q.scale, torch.zeros(3, 1)), f"zero range: scale 0, got {q.scale.flatten()}"
    assert equal(back, x), f"a constant vector dequantizes to itself: got {back.tolist()}"


def test_part1_dequantize_is_code_times_scale_plus_zero():
    q = QuantizedTensor(
        torch.tensor([[0, 1, 255]], dtype=torch.uint8),
        torch.tensor([[0.5]]),
        torch.tensor([[-1.0]]),
        8,
    )
    back = Quantizer(8).dequantize(q)
    assert back.tolist() == [[-1.0, -0.5, 126.5]], f"code * scale + zero: got {back.tolist()}"


def test_part1_half_precision_input_is_quantized_in_float32_and_left_alone():
    x = (torch.randn(4, 8, generator=torch.Generator().manual_seed(2)) * 3).half()
    before = x.clone()
    quantizer = Quantizer(8)
    q = quantizer.quantize(x)
    assert equal(x, before), "quantize must not modify its input"
    assert q.scale.dtype == torch.float32
    assert_within_half_a_step(x.float(), q, quantizer.dequantize(q))


# ---- Part 3.2: INT4 packing ------------------------------------------------------------------


def test_part2_the_low_nibble_holds_the_even_code():
    codes = torch.tensor([[1, 2, 15, 0, 7, 9]], dtype=torch.uint8)
    packed = pack_int4(codes)
    expected = [0x21, 0x0F, 0x97]
    assert packed.dtype == torch.uint8 and packed.tolist() == [expected], (
        f"byte i holds code 2i in bits 0-3 and code 2i + 1 in bits 4-7: expected "
        f"{[hex(b) for b in expected]}, got {[hex(b) for b in packed.flatten().tolist()]}"
    )


def test_part2_unpack_reads_the_same_order():
    packed = torch.tensor([[0x21, 0x0F], [0xF0, 0x5A]], dtype=torch.uint8)
    expected = [[1, 2, 15, 0], [0, 15, 10, 5]]
    got = unpack_int4(packed)
    assert got.dtype == torch.uint8 and got.tolist() == expected, (
        f"unpack_int4: expected {expected}, got {got.tolist()}"
    )


@given(st.lists(st.integers(0, 15), min_size=2, max_size=64).filter(lambda c: len(c) % 2 == 0))
@PROPERTY
def test_part2_unpack_inverts_pack(values):
    codes = torch.tensor(values, dtype=torch.uint8).view(1, -1)
    packed = pack_int4(codes)
    assert packed.shape[-1] * 2 == codes.shape[-1], "two codes per byte"
    assert equal(unpack_int4(packed), codes), "unpack_int4(pack_int4(c)) must be c"


def test_part2_pack_refuses_odd_lengths_and_codes_above_15():
    with pytest.raises(ValueError, match=r"\beven last dimension, got 3$"):
        pack_int4(torch.zeros(2, 4, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"^a 4-bit code is at most 15$"):
        pack_int4(torch.tensor([3, 16], dtype=torch.uint8))


@given(tensors(even_last=True))
@PROPERTY
def test_part2_int4_round_trip_error_is_at_most_half_a_step(x):
    quantizer = Quantizer(4)
    q = quantizer.quantize(x)
    assert q.codes.shape[-1] * 2 == x.shape[-1] and q.codes.dtype == torch.uint8, (
        f"INT4 codes are packed: last dimension {x.shape[-1] // 2}, got {q.codes.shape[-1]}"
    )
    back = quantizer.dequantize(q)
    assert back.shape == x.shape
    assert_within_half_a_step(x, q, back)


def test_part2_int4_has_sixteen_levels():
    x = torch.linspace(0, 15, 16).view(1, 16)
    quantizer = Quantizer(4)
    q = quantizer.quantize(x)
    assert allclose(q.scale, torch.tensor([[1.0]])), f"(15 - 0) / 15 = 1, got {q.scale}"
    assert equal(unpack_int4(q.codes), torch.arange(16, dtype=torch.uint8).view(1, 16))
    assert allclose(quantizer.dequantize(q), x), "integers 0..15 are exact in INT4"


# ---- Part 3.3: keys per channel (KIVI) --------------------------------------------------------


def block_of_keys(outlier: float = 1.0) -> torch.Tensor:
    """A block's keys [16 tokens, 2 heads, 8 channels]; channel 3 of each head scaled."""
    keys = torch.randn(16, 2, 8, generator=torch.Generator().manual_seed(3))
    keys[..., 3] *= outlier
    return keys


def test_part3_one_scale_per_head_and_channel_over_the_blocks_tokens():
    keys = block_of_keys()
    q = Quantizer(8, "per_channel").quantize(keys)
    assert q.scale.shape == q.zero.shape == (1, 2, 8), (
        f"per channel: one scale and zero per (head, channel), shaped [1, 2, 8]; got "
        f"{list(q.scale.shape)}"
    )
    assert equal(q.zero, keys.amin(0, keepdim=True)), "zero is each channel's minimum"
    expected = (keys.amax(0, keepdim=True) - keys.amin(0, keepdim=True)) / 255
    assert allclose(q.scale, expected), "scale is each channel's (max - min) / 255"
    assert bool((q.codes.amin(0) == 0).all()) and bool((q.codes.amax(0) == 255).all()), (
        "over the block's tokens, each channel's minimum gets code 0 and its maximum 255"
    )


@pytest.mark.parametrize("bits", [8, 4])
@given(x=tensors(even_last=True, min_dims=2))
@PROPERTY
def test_part3_per_channel_round_trip_error_is_at_most_half_a_step(bits, x):
    quantizer = Quantizer(bits, "per_channel")
    q = quantizer.quantize(x)
    assert q.scale.shape == (1, *x.shape[1:])
    assert_within_half_a_step(x, q, quantizer.dequantize(q))


def test_part3_an_outlier_channel_costs_only_its_own_precision():
    keys = block_of_keys(outlier=50.0)
    errors = {}
    for granularity in ("per_token", "per_channel"):
        quantizer = Quantizer(4, granularity)
        error = (quantizer.dequantize(quantizer.quantize(keys)) - keys).abs()
        errors[granularity] = float(error[..., [0, 1, 2, 4, 5, 6, 7]].mean())
    assert errors["per_channel"] * 4 < errors["per_token"], (
        "per channel, the other channels keep their own fine grid: mean INT4 error on them "
        f"{errors['per_channel']:.4f} (per channel) vs {errors['per_token']:.4f} (per token)"
    )


def test_part3_a_constant_channel_round_trips_exactly():
    keys = block_of_keys()
    keys[:, 1, 5] = 0.75
    quantizer = Quantizer(4, "per_channel")
    back = quantizer.dequantize(quantizer.quantize(keys))
    assert equal(back[:, 1, 5], keys[:, 1, 5]), "a constant channel dequantizes exactly"
    assert not bool(isnan(back).any())


# ---- Part 3.4: bytes per token -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "keys", "expected"),
    [
        ("auto", "per_token", 2 * 4 * 8 * 128 * 2),
        ("int8", "per_token", 4 * 8 * (2 * 128 + 2 * 2 * 2)),
        ("int4", "per_token", 4 * 8 * (2 * 64 + 2 * 2 * 2)),
        ("int4", "per_channel", 4 * 8 * (2 * 64 + 2 * 2 + 2 * 2 * 128 / 16)),
        ("int8", "per_channel", 4 * 8 * (2 * 128 + 2 * 2 + 2 * 2 * 128 / 16)),
    ],
)
def test_part4_bytes_per_token_count_codes_and_scales(dtype, keys, expected):
    got = bytes_per_token(4, 8, 128, dtype, keys, block_size=16, scale_bytes=2)
    assert got == pytest.approx(expected), (
        f"{dtype} with keys {keys}: 4 layers, 8 KV heads, head_dim 128, block 16: expected "
        f"{expected} bytes per token, got {got}"
    )


def test_part4_the_default_block_is_16_tokens_and_scales_16_bits():
    default = bytes_per_token(4, 8, 128, "int4", "per_channel")
    explicit = bytes_per_token(4, 8, 128, "int4", "per_channel", block_size=16, scale_bytes=2)
    assert default == pytest.approx(explicit), "defaults: block_size 16, scale_bytes 2"


def test_part4_scale_bytes_and_block_size_count():
    base = bytes_per_token(2, 2, 64, "int8", "per_token", scale_bytes=4)
    assert base == pytest.approx(2 * 2 * (2 * 64 + 2 * 2 * 4)), "fp32 scales: 4 bytes each"
    long_blocks = bytes_per_token(2, 2, 64, "int4", "per_channel", block_size=64)
    assert long_blocks == pytest.approx(2 * 2 * (2 * 32 + 4 + 4 * 64 / 64)), (
        "per-channel key scales are shared by the block's tokens"
    )


def test_part4_unknown_formats_are_refused():
    with pytest.raises(ValueError, match=r"^kv_cache_dtype must be auto, int8 or int4, got 'fp8'$"):
        bytes_per_token(1, 1, 8, "fp8")
    with pytest.raises(ValueError, match=r"^unknown key granularity 'per_block'$"):
        bytes_per_token(1, 1, 8, "int8", "per_block")
