"""Graded tests for Phase 3: INT8 and INT4 KV-cache quantization (``vkv/engine/quantizer.py``).

``uv run pytest tests/test_phase3.py -k part2 -v`` runs the tests of part 3.2. The error bound
is checked with a float32 allowance of ``EPS * max|x|`` on top of ``scale / 2``: the arithmetic
of ``(x - min) / scale`` and ``code * scale + min`` rounds too, by a few units in the last place
of the largest magnitude involved.
"""

import re
import subprocess
import sys
from pathlib import Path

import kernel_device  # noqa: F401 (first: Triton must not be imported before it)
import pytest
import torch
import triton
import triton.language as tl
from grading_policy import policy_test
from hypothesis import given
from hypothesis import strategies as st
from hypothesis_settings import graded_settings
from kernel_device import DEVICE, compile_for_gpu, launched

# The torch functions the assertions compare with, bound before vkv.engine is imported: a
# solution region that replaced torch.equal (or allclose, isnan) later would not change them.
from torch import allclose, equal, isnan

from vkv.engine.cache_engine import QuantizedCache
from vkv.engine.key_residual import KeyPlan, KeyResidual, partial_blocks
from vkv.engine.quantizer import (
    QuantizedTensor,
    Quantizer,
    bytes_per_token,
    pack_int4,
    unpack_int4,
)
from vkv.kernels import triton_attention
from vkv.kernels.quantized import (
    dequantize_blocks,
    quantized_decode_attention,
    quantized_prefill_attention,
    store_keys_per_channel,
    store_quantized,
)
from vkv.kernels.triton_quantized import load_dequantized

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


# Each part's first test: its regions follow the grading policy (tests/grading_policy.py).
test_part1_follows_the_grading_policy = policy_test("3.1")
test_part2_follows_the_grading_policy = policy_test("3.2")
test_part3_follows_the_grading_policy = policy_test("3.3")
test_part4_follows_the_grading_policy = policy_test("3.4")
test_part5_follows_the_grading_policy = policy_test("3.5")
test_part6_follows_the_grading_policy = policy_test("3.6")
test_part7_follows_the_grading_policy = policy_test("3.7")
test_part8_follows_the_grading_policy = policy_test("3.8")


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
    assert q.scale.dtype == torch.float32 and q.zero.dtype == torch.float32, (
        "scales and zeros are float32 whatever the input's dtype (quantize computes in float32;"
        f" the cache converts them when it stores them): got scale {q.scale.dtype}, zero "
        f"{q.zero.dtype}"
    )
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
    assert q.scale.dtype == torch.float32, (
        f"a float16 input is quantized in float32: its scales are float32, got {q.scale.dtype}"
    )
    assert_within_half_a_step(x.float(), q, quantizer.dequantize(q))


# ---- Part 3.2: INT4 packing ------------------------------------------------------------------


def test_part2_byte_i_holds_code_i_low_and_code_n_plus_i_high():
    codes = torch.tensor([[1, 2, 15, 0, 7, 9]], dtype=torch.uint8)
    packed = pack_int4(codes)
    expected = [0x01, 0x72, 0x9F]
    assert packed.dtype == torch.uint8 and packed.tolist() == [expected], (
        f"of 2n codes, byte i holds code i in bits 0-3 and code n + i in bits 4-7 (by halves): "
        f"expected {[hex(b) for b in expected]}, got "
        f"{[hex(b) for b in packed.flatten().tolist()]}"
    )


def test_part2_unpack_reads_the_same_order():
    packed = torch.tensor([[0x21, 0x0F], [0xF0, 0x5A]], dtype=torch.uint8)
    expected = [[1, 15, 2, 0], [0, 10, 15, 5]]
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
    for odd in (3, 7):  # packed before the check, 7's halves (3 and 4 codes) raise torch's error
        with pytest.raises(ValueError, match=rf"\beven last dimension, got {odd}$"):
            pack_int4(torch.zeros(2, 4, odd, dtype=torch.uint8))
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


# ---- Parts 3.5 and 3.6: the quantized paged cache (vkv/kernels/quantized.py) -----------------
#
# Caches are built here, plane by plane, as ``cache_engine.py`` lays them out: codes
# [blocks, block_size, kv_heads, head_dim * bits / 8] and per-token scale and zero
# [blocks, block_size, groups, 1]. The tests' own decoding (``decode_slot``, ``dense_values``)
# reads the planes with the formulas of the handout, in float64, independently of the code
# under test.

NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 5, 4, 2, 4


def empty_cache(bits: int, groups: int = KV_HEADS, dtype=torch.float32) -> QuantizedCache:
    stored = HEAD_DIM * bits // 8
    codes = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, stored, dtype=torch.uint8)
    scale = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, groups, 1, dtype=dtype)
    return QuantizedCache(codes, scale, scale.clone(), bits)


def codes_of(cache: QuantizedCache) -> torch.Tensor:
    """The unpacked codes of every slot: [slots, kv_heads, head_dim] (int64)."""
    raw = cache.codes.reshape(-1, KV_HEADS, cache.codes.shape[-1]).long()
    if cache.bits == 8:
        return raw
    return torch.cat((raw & 15, raw >> 4), dim=-1)  # a head's first half, then its second


def decode_slot(cache: QuantizedCache, slot: int) -> torch.Tensor:
    """Slot ``slot``'s values [kv_heads, head_dim] in float64: codes * scale + zero per group."""
    groups = cache.scale.shape[2]
    codes = codes_of(cache)[slot].double().reshape(groups, -1)
    scale = cache.scale.reshape(-1, groups, 1)[slot].double()
    zero = cache.zero.reshape(-1, groups, 1)[slot].double()
    return (codes * scale + zero).reshape(KV_HEADS, HEAD_DIM)


def step_tensors(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=g) * 3,
        torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=g) + 1,
    )


def assert_slot_holds(cache, slot, x, what, allowance=1e-5):
    """``x [kv_heads, head_dim]`` stored at ``slot``: the group's min as zero, the decoded
    values within half a step of x."""
    groups = cache.scale.shape[2]
    rows = x.double().reshape(groups, -1)
    scale = cache.scale.reshape(-1, groups)[slot].double()
    expected_scale = (rows.amax(1) - rows.amin(1)) / (2**cache.bits - 1)
    assert allclose(scale, expected_scale, rtol=1e-3, atol=1e-6), (
        f"{what} at slot {slot}: a group's scale is (max - min) / {2**cache.bits - 1} over its "
        f"{rows.shape[1]} channels; expected {expected_scale.tolist()}, got {scale.tolist()}"
    )
    error = (decode_slot(cache, slot) - x.double()).abs().reshape(groups, -1)
    worst = float((error - scale[:, None] / 2 - allowance).max())
    assert worst <= 0, (
        f"{what} at slot {slot}: codes * scale + zero must be within scale / 2 of the stored "
        f"token; it is off by {worst:.3g} more"
    )


def written_slots(cache: QuantizedCache) -> list[int]:
    """The slots whose codes, scale or zero are not all zero."""
    codes = cache.codes.reshape(NUM_BLOCKS * BLOCK_SIZE, -1).ne(0).any(1)
    scale = cache.scale.reshape(NUM_BLOCKS * BLOCK_SIZE, -1).ne(0).any(1)
    zero = cache.zero.reshape(NUM_BLOCKS * BLOCK_SIZE, -1).ne(0).any(1)
    return (codes | scale | zero).nonzero().flatten().tolist()


@pytest.mark.parametrize("bits", [8, 4])
def test_part5_each_token_lands_in_its_slot_quantized_per_token_and_head(bits):
    key, value = step_tensors(3, seed=10)
    k_cache, v_cache = empty_cache(bits), empty_cache(bits)
    slots = [6, 0, 13]  # block 1 offset 2, block 0 offset 0, block 3 offset 1
    store_quantized(key, value, k_cache, v_cache, torch.tensor(slots))
    for cache, x, what in ((k_cache, key, "keys"), (v_cache, value, "values")):
        assert sorted(written_slots(cache)) == sorted(slots), (
            f"{what}: tokens go to slots {slots} (slot s is block s // {BLOCK_SIZE}, offset "
            f"s % {BLOCK_SIZE}) and nowhere else; written: {written_slots(cache)}"
        )
        for token, slot in enumerate(slots):
            assert_slot_holds(cache, slot, x[token], what)


def test_part5_int8_codes_are_exact_on_a_known_token():
    key = torch.tensor([[[0.0, 255.0, 10.0, 128.0], [-1.0, 1.0, 0.2, 0.5]]])
    k_cache, v_cache = empty_cache(8), empty_cache(8)
    store_quantized(key, key.clone(), k_cache, v_cache, torch.tensor([9]))
    got = codes_of(k_cache)[9].tolist()
    expected = [[0, 255, 10, 128], [0, 255, 153, 191]]
    assert got == expected, (
        f"INT8 per (token, head): code = round((x - min) / scale), scale = (max - min) / 255; "
        f"slot 9 expected codes {expected}, got {got}"
    )
    zero = k_cache.zero[2, 1].flatten().tolist()
    assert zero == [0.0, -1.0], f"zero is each head's minimum: expected [0.0, -1.0], got {zero}"


def test_part5_int4_codes_are_packed_two_per_byte_by_halves():
    key = torch.tensor([[[0.0, 15.0, 3.0, 12.0], [1.0, 1.0, 1.0, 16.0]]])
    k_cache, v_cache = empty_cache(4), empty_cache(4)
    store_quantized(key, key.clone(), k_cache, v_cache, torch.tensor([2]))
    got = k_cache.codes[0, 2].tolist()
    expected = [[0 | 3 << 4, 15 | 12 << 4], [0 | 0 << 4, 0 | 15 << 4]]
    assert got == expected, (
        "INT4: codes 0..15, byte i holds channel i's code in bits 0-3 and channel "
        f"head_dim / 2 + i's in bits 4-7 (pack_int4's order); slot 2 expected bytes {expected}, "
        f"got {got}"
    )


def test_part5_int4_packs_each_head_by_halves_when_a_group_covers_all_heads():
    key = torch.tensor([[[0.0, 15.0, 3.0, 12.0], [1.0, 1.0, 1.0, 14.0]]])
    k_cache, v_cache = empty_cache(4, groups=1), empty_cache(4, groups=1)
    store_quantized(key, key.clone(), k_cache, v_cache, torch.tensor([2]))
    got = k_cache.codes[0, 2].tolist()
    expected = [[0 | 3 << 4, 15 | 12 << 4], [1 | 1 << 4, 1 | 14 << 4]]
    assert got == expected, (
        "INT4 with one group per token (scale 1, zero 0 over both heads): each head's row of "
        "bytes holds that head's channels, packed by halves on their own (the kernels read a "
        f"head's row at a time); slot 2 expected bytes {expected}, got {got}"
    )


def test_part5_padding_slots_are_skipped():
    key, value = step_tensors(4, seed=11)
    k_cache, v_cache = empty_cache(8), empty_cache(8)
    store_quantized(key, value, k_cache, v_cache, torch.tensor([3, -1, 7, -1]))
    for cache, x, what in ((k_cache, key, "keys"), (v_cache, value, "values")):
        assert written_slots(cache) == [3, 7], (
            f"{what}: a slot of -1 is padding and writes nothing (not the last slot, which "
            f"index -1 would be); written: {written_slots(cache)}, expected [3, 7]"
        )
        assert_slot_holds(cache, 3, x[0], what)
        assert_slot_holds(cache, 7, x[2], what)


def test_part5_a_step_of_padding_only_writes_nothing():
    key, value = step_tensors(2, seed=16)
    k_cache, v_cache = empty_cache(4), empty_cache(4)
    store_quantized(key, value, k_cache, v_cache, torch.tensor([-1, -1]))
    assert written_slots(k_cache) == [] and written_slots(v_cache) == [], (
        "every slot -1: a step of padding only writes nothing (and quantizes nothing: there is "
        "no token to take a range of)"
    )


@pytest.mark.parametrize(
    "where", ["a NaN key", "an infinite value", "a -inf key past the first token"]
)
def test_part5_a_nan_or_infinite_token_is_refused_and_nothing_is_written(where):
    key, value = step_tensors(3, seed=12)
    if where == "a NaN key":
        key[0, 1, 2] = float("nan")
    elif where == "an infinite value":
        value[2, 0, 0] = float("inf")
    else:
        key[1, 0, 3] = -float("inf")
    k_cache, v_cache = empty_cache(8), empty_cache(8)
    with pytest.raises(ValueError, match=r"^cannot quantize NaN or infinite values"):
        store_quantized(key, value, k_cache, v_cache, torch.tensor([0, 1, 2]))
    assert written_slots(k_cache) == [] and written_slots(v_cache) == [], (
        f"with {where}, the step is refused before anything is written: keys and values stay "
        f"as they were (keys written {written_slots(k_cache)}, values {written_slots(v_cache)})"
    )


@pytest.mark.parametrize("bits", [8, 4])
def test_part5_one_group_per_token_covers_all_its_heads(bits):
    key, value = step_tensors(2, seed=13)
    k_cache, v_cache = empty_cache(bits, groups=1), empty_cache(bits, groups=1)
    store_quantized(key, value, k_cache, v_cache, torch.tensor([4, 18]))
    expected = float(key[1].max() - key[1].min()) / (2**bits - 1)
    got = float(k_cache.scale.reshape(-1)[18])
    assert got == pytest.approx(expected, rel=1e-4), (
        "with scale planes [blocks, block_size, 1, 1], one scale covers all of a token's "
        f"{KV_HEADS} heads x {HEAD_DIM} channels: expected {expected:.6g}, got {got:.6g}"
    )
    for cache, x, what in ((k_cache, key, "keys"), (v_cache, value, "values")):
        assert_slot_holds(cache, 4, x[0], what)
        assert_slot_holds(cache, 18, x[1], what)


def test_part5_scales_are_stored_in_the_planes_dtype():
    key, value = step_tensors(1, seed=14)
    k_cache, v_cache = empty_cache(8, dtype=torch.float16), empty_cache(8, dtype=torch.float16)
    store_quantized(key, value, k_cache, v_cache, torch.tensor([5]))
    assert k_cache.scale.dtype == torch.float16, "the planes are the cache's, never replaced"
    assert_slot_holds(k_cache, 5, key[0], "keys", allowance=0.03)  # float16 scale and zero


def test_part5_keys_per_channel_go_to_the_residual_values_per_token():
    key, value = step_tensors(2, seed=15)
    k_cache = empty_cache(8)
    residual = torch.zeros(2, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    none = torch.zeros(0, dtype=torch.long)
    plan = KeyPlan(torch.tensor([0, 1]), torch.tensor([5, 6]), none, none, none.view(0, 4))
    k_cache = QuantizedCache(
        k_cache.codes,
        torch.zeros(NUM_BLOCKS, 1, KV_HEADS, HEAD_DIM),
        torch.zeros(NUM_BLOCKS, 1, KV_HEADS, HEAD_DIM),
        8,
        residual,
        torch.full((NUM_BLOCKS,), -1, dtype=torch.int32),
        plan,
    )
    v_cache = empty_cache(8)
    store_quantized(key, value, k_cache, v_cache, torch.tensor([9, 10]))
    rows = residual.view(-1, KV_HEADS, HEAD_DIM)
    assert equal(rows[5:7], key), (
        "keys per channel: the keys go to store_keys_per_channel, which writes them to the "
        "residual rows of the step's plan (here rows 5 and 6, in full precision)"
    )
    assert not bool(k_cache.codes.any()), "a partial block's key codes are not written"
    assert written_slots(v_cache) == [9, 10], "values are quantized per token as always"
    assert_slot_holds(v_cache, 10, value[1], "values")


def test_part5_keys_per_channel_get_the_whole_batch_padding_rows_included():
    key, value = step_tensors(3, seed=16)
    residual = torch.zeros(2, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    none = torch.zeros(0, dtype=torch.long)
    plan = KeyPlan(torch.tensor([1, 2]), torch.tensor([5, 6]), none, none, none.view(0, 4))
    k_cache = QuantizedCache(
        empty_cache(8).codes,
        torch.zeros(NUM_BLOCKS, 1, KV_HEADS, HEAD_DIM),
        torch.zeros(NUM_BLOCKS, 1, KV_HEADS, HEAD_DIM),
        8,
        residual,
        torch.full((NUM_BLOCKS,), -1, dtype=torch.int32),
        plan,
    )
    store_quantized(key, value, k_cache, empty_cache(8), torch.tensor([-1, 9, 10]))
    rows = residual.view(-1, KV_HEADS, HEAD_DIM)
    assert equal(rows[5:7], key[1:3]), (
        "the plan's batch rows count every row of the step, padding included (row 0 here is "
        "padding): store_keys_per_channel gets the whole key tensor, not the rows kept for the "
        "values"
    )


def random_cache(bits: int, seed: int, groups: int = KV_HEADS) -> QuantizedCache:
    """A cache of random codes, scales and zeros in every slot."""
    g = torch.Generator().manual_seed(seed)
    stored = HEAD_DIM * bits // 8
    codes = torch.randint(0, 256, (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, stored), generator=g)
    scale = torch.rand(NUM_BLOCKS, BLOCK_SIZE, groups, 1, generator=g) / (2**bits) * 4
    zero = torch.randn(NUM_BLOCKS, BLOCK_SIZE, groups, 1, generator=g)
    return QuantizedCache(codes.to(torch.uint8), scale, zero, bits)


def dense_values(cache: QuantizedCache, table: list[int], length: int) -> torch.Tensor:
    """A sequence's first ``length`` tokens [length, kv_heads, head_dim], float64, read through
    its block table from the planes."""
    slots = [table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE for pos in range(length)]
    return torch.stack([decode_slot(cache, s) for s in slots])


def dense_attention(q, keys, values, positions, scale):
    """``q [rows, heads, dim]`` at ``positions`` attends to keys/values [ctx, kv_heads, dim]
    up to its own position; float64, no cache."""
    group = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, ctx, dim]
    v = values.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.einsum("rhd,hcd->hrc", q.double(), k) * scale
    visible = torch.arange(keys.shape[0])[None, :] <= torch.tensor(positions)[:, None]
    weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hrc,hcd->rhd", weights, v)


TABLES = [[3, 1], [0, -1], [4, 2], [2, 3]]  # blocks out of order; block 2 and 3 shared
LENGTHS = [6, 3, 8, 5]  # 6 and 5 end inside a block; 8 fills two


def assert_attention_close(got, expected, what):
    assert got.shape == expected.shape, (
        f"{what}: shape {list(got.shape)}, expected {list(expected.shape)}"
    )
    diff = float((got.double() - expected).abs().max())
    assert diff < 1e-4, (
        f"{what}: must equal softmax attention over the dequantized keys and values (float32); "
        f"largest difference {diff:.3g}"
    )


@pytest.mark.parametrize(
    ("bits", "num_heads"), [(8, 2), (8, 4), (4, 4)], ids=["int8", "int8-gqa", "int4-gqa"]
)
def test_part6_decode_attends_to_each_sequences_dequantized_context(bits, num_heads):
    k_cache, v_cache = random_cache(bits, 20), random_cache(bits, 21)
    query = torch.randn(4, num_heads, HEAD_DIM, generator=torch.Generator().manual_seed(22))
    got = quantized_decode_attention(
        query, k_cache, v_cache, torch.tensor(TABLES, dtype=torch.int32), torch.tensor(LENGTHS), 0.5
    )
    for i, (table, length) in enumerate(zip(TABLES, LENGTHS, strict=True)):
        expected = dense_attention(
            query[i : i + 1],
            dense_values(k_cache, table, length),
            dense_values(v_cache, table, length),
            [length - 1],
            0.5,
        )[0]
        assert_attention_close(
            got[i], expected, f"sequence {i} (table {table}, {length} tokens, {num_heads} heads)"
        )


def test_part6_decode_never_reads_past_a_context():
    k_cache, v_cache = random_cache(8, 23), random_cache(8, 24)
    tables, lengths = torch.tensor([[1, 2]], dtype=torch.int32), torch.tensor([5])
    query = torch.randn(1, 2, HEAD_DIM, generator=torch.Generator().manual_seed(25))
    before = quantized_decode_attention(query, k_cache, v_cache, tables, lengths, 0.5)
    for cache in (k_cache, v_cache):  # slots 9..11 (block 2, offsets 1..3) and block 0
        cache.scale[2, 1:] = 1e4
        cache.zero[2, 1:] = -1e4
        cache.scale[0] = 1e4
    after = quantized_decode_attention(query, k_cache, v_cache, tables, lengths, 0.5)
    assert_attention_close(
        after, before.double(), "slots at or past the context length (here 5) must not count"
    )


def test_part6_attention_returns_the_querys_dtype():
    k_cache, v_cache = random_cache(8, 26), random_cache(8, 27)
    query = torch.randn(2, 2, HEAD_DIM, generator=torch.Generator().manual_seed(28)).half()
    got = quantized_decode_attention(
        query,
        k_cache,
        v_cache,
        torch.tensor([[0], [4]], dtype=torch.int32),
        torch.tensor([2, 4]),
        1.0,
    )
    assert got.dtype == torch.float16 and got.shape == (2, 2, HEAD_DIM), (
        f"decode returns [batch, num_heads, head_dim] in the query's dtype: got {got.dtype} "
        f"{list(got.shape)}"
    )
    got = quantized_prefill_attention(
        query,
        k_cache,
        v_cache,
        torch.tensor([0, 1, 2]),
        torch.tensor([[0], [4]]),
        torch.tensor([2, 4]),
        1.0,
    )
    assert got.dtype == torch.float16 and got.shape == (2, 2, HEAD_DIM), (
        f"prefill returns [new_tokens, num_heads, head_dim] in the query's dtype: got "
        f"{got.dtype} {list(got.shape)}"
    )


def assert_rounded_once(got, expected, what):
    """``got`` (half precision) is ``expected`` (float64) rounded once to its dtype: element by
    element within half a unit in the last place of that dtype (``torch.finfo(...).eps / 2``
    relative), plus 1e-4 for float32's own rounding on the way. Attention computed in float32
    and cast at the end meets it; scores, softmax or the weighted sum taken in bf16 or fp16
    miss it by far (an error of about 1e-2 on outputs of about 1)."""
    unit = torch.finfo(got.dtype).eps / 2
    error = (got.double() - expected).abs()
    bound = unit * expected.abs() + 1e-4
    worst = int((error - bound).argmax())
    rounded_once = bool((error <= bound).all())
    assert rounded_once, (
        f"{what}: in {got.dtype}, each output must be the float32 attention rounded once to "
        f"{got.dtype} (scores, softmax and the weighted sum in float32, the cast at the end): "
        f"an output of {float(expected.flatten()[worst]):.4f} came back "
        f"{float(got.double().flatten()[worst]):.4f}, {float(error.flatten()[worst]):.2g} off "
        f"(at most {float(bound.flatten()[worst]):.2g})"
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_part6_half_precision_queries_attend_in_float32(dtype):
    k_cache, v_cache = random_cache(8, 36), random_cache(8, 37)
    g = torch.Generator().manual_seed(38)
    decode_query = (torch.randn(4, 4, HEAD_DIM, generator=g) * 2).to(dtype)
    got = quantized_decode_attention(
        decode_query,
        k_cache,
        v_cache,
        torch.tensor(TABLES, dtype=torch.int32),
        torch.tensor(LENGTHS),
        0.5,
    )
    for i, (table, length) in enumerate(zip(TABLES, LENGTHS, strict=True)):
        keys, values = dense_values(k_cache, table, length), dense_values(v_cache, table, length)
        expected = dense_attention(decode_query[i : i + 1], keys, values, [length - 1], 0.5)[0]
        assert_rounded_once(got[i], expected, f"decode, sequence {i}")
    prefill_query = (torch.randn(6, 4, HEAD_DIM, generator=g) * 2).to(dtype)
    got = quantized_prefill_attention(
        prefill_query,
        k_cache,
        v_cache,
        torch.tensor([0, 6]),
        torch.tensor([TABLES[2]], dtype=torch.int32),
        torch.tensor([8]),
        0.5,
    )
    keys, values = dense_values(k_cache, TABLES[2], 8), dense_values(v_cache, TABLES[2], 8)
    expected = dense_attention(prefill_query, keys, values, list(range(2, 8)), 0.5)
    assert_rounded_once(got, expected, "prefill of 6 new tokens after 2 cached ones")


@pytest.mark.parametrize(("bits", "num_heads"), [(8, 2), (4, 4)], ids=["int8", "int4-gqa"])
def test_part6_prefill_is_causal_over_the_cached_context(bits, num_heads):
    k_cache, v_cache = random_cache(bits, 30, groups=1), random_cache(bits, 31, groups=1)
    new = [6, 2, 3]  # sequence 0: a whole prompt; 1 and 2: chunks after a cached context
    lengths = [6, 7, 5]
    tables = [[3, 1], [0, 4], [2, 3]]
    cu = torch.tensor([0, 6, 8, 11])
    query = torch.randn(11, num_heads, HEAD_DIM, generator=torch.Generator().manual_seed(32))
    got = quantized_prefill_attention(
        query,
        k_cache,
        v_cache,
        cu,
        torch.tensor(tables, dtype=torch.int32),
        torch.tensor(lengths),
        0.7,
    )
    for i in range(3):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        positions = list(range(lengths[i] - new[i], lengths[i]))
        expected = dense_attention(
            query[rows],
            dense_values(k_cache, tables[i], lengths[i]),
            dense_values(v_cache, tables[i], lengths[i]),
            positions,
            0.7,
        )
        assert_attention_close(
            got[rows],
            expected,
            f"sequence {i}: new tokens at positions {positions} of {lengths[i]} attend to every "
            "position up to their own",
        )


def test_part6_dequantize_blocks_reads_a_partial_blocks_keys_from_the_residual():
    base = random_cache(8, 33)
    residual = torch.randn(
        2, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(34)
    )
    slots = torch.full((NUM_BLOCKS,), -1, dtype=torch.int32)
    slots[3], slots[4] = 1, 0
    g = torch.Generator().manual_seed(35)
    scale = torch.rand(NUM_BLOCKS, 1, KV_HEADS, HEAD_DIM, generator=g) / 64
    zero = torch.randn(NUM_BLOCKS, 1, KV_HEADS, HEAD_DIM, generator=g)
    keys = QuantizedCache(base.codes, scale, zero, 8, residual, slots, None)
    got = dequantize_blocks(keys, torch.tensor([3, 0, 3, 4]))
    assert got.shape == (4, BLOCK_SIZE, KV_HEADS, HEAD_DIM) and got.dtype == torch.float32, (
        f"[len(blocks), block_size, kv_heads, head_dim] float32: got {got.dtype} {list(got.shape)}"
    )
    assert equal(got[0], residual[1]) and equal(got[2], residual[1]), (
        "block 3 has residual slot 1 (residual_slot[3] == 1): its keys are residual[1], as "
        "stored, not its codes"
    )
    assert equal(got[3], residual[0]), (
        "block 4 has residual slot 0 (residual_slot[4] == 0; -1 means none): its keys are "
        "residual[0]"
    )
    expected = base.codes[0].double() * scale[0].double() + zero[0].double()
    assert allclose(got[1].double(), expected, atol=1e-5), (
        "keys per channel: codes * scale + zero with the block's scale and zero per (head, "
        "channel), shape [1, kv_heads, head_dim]"
    )


# ---- Part 3.3 (continued): the key residual's plan, and the store of a filled block -----------
#
# A KeyResidual of block size 4 over 6 GPU blocks, 3 residual slots; plans read from
# KeyResidual.plan (slot s is block s // 4, offset s % 4).

RES_BLOCK = 4


def key_residual(slots: int = 3, layers: int = 1) -> KeyResidual:
    return KeyResidual(layers, RES_BLOCK, 1, 2, torch.float32, 6, slots, torch.device("cpu"))


def plan_lists(plan: KeyPlan) -> dict[str, list]:
    return {
        "residual_tokens": plan.residual_tokens.tolist(),
        "residual_rows": plan.residual_rows.tolist(),
        "fill_blocks": plan.fill_blocks.tolist(),
        "fill_slots": plan.fill_slots.tolist(),
        "fill_tokens": plan.fill_tokens.tolist(),
    }


def test_part3_a_partial_block_takes_a_residual_slot_for_its_new_keys():
    residual = key_residual()
    plan = plan_lists(residual.plan([8, 9, 10]))  # block 2, offsets 0..2: partial
    slot = residual._slots.get(2)
    assert slot is not None and residual.gpu_blocks == {2}, (
        f"block 2 is written from offset 0 to 2 of 4: partial, it takes a residual slot; "
        f"blocks holding a slot: {sorted(residual.gpu_blocks)}"
    )
    rows = [slot * RES_BLOCK + offset for offset in range(3)]
    assert plan["residual_tokens"] == [0, 1, 2] and plan["residual_rows"] == rows, (
        f"batch rows 0..2 go to residual rows slot * block_size + offset = {rows}; got tokens "
        f"{plan['residual_tokens']} to rows {plan['residual_rows']}"
    )
    assert plan["fill_blocks"] == [] and plan["fill_tokens"] == [], "nothing filled"
    assert residual.slot_of_block.tolist() == [-1, -1, slot, -1, -1, -1], (
        "slot_of_block tells attention where the step's partial block's keys are: "
        f"{residual.slot_of_block.tolist()}"
    )
    assert residual.current is not None and residual.current.residual_rows.tolist() == rows, (
        "plan also leaves its plan in self.current (the cache hands it to the store)"
    )


def test_part3_a_block_written_whole_in_one_step_is_quantized_from_the_batch():
    residual = key_residual()
    plan = plan_lists(residual.plan([-1, 4, 5, 6, 7, 12]))  # block 1 whole; block 3 starts
    assert plan["fill_blocks"] == [1] and plan["fill_slots"] == [], (
        f"block 1 is written from offset 0 to its last: filled, quantized straight from the "
        f"new keys without a residual slot; got fill_blocks {plan['fill_blocks']}, fill_slots "
        f"{plan['fill_slots']}"
    )
    assert plan["fill_tokens"] == [[1, 2, 3, 4]], (
        f"fill_tokens holds the batch rows of a block written whole, in slot order (row 0 is "
        f"padding): expected [[1, 2, 3, 4]], got {plan['fill_tokens']}"
    )
    assert residual.gpu_blocks == {3} and plan["residual_tokens"] == [5], (
        "only the partial block 3 takes a slot, for its one key"
    )


def test_part3_a_block_filled_from_its_residual_keeps_its_slot_for_the_step():
    residual = key_residual()
    residual.plan([20, 21])  # block 5, offsets 0..1
    slot = residual._slots[5]
    plan = plan_lists(residual.plan([22, 23, 0]))  # block 5 fills; block 0 starts
    assert plan["fill_blocks"] == [5] and plan["fill_slots"] == [slot], (
        f"block 5 fills this step from its residual slot {slot}: fill_blocks [5], fill_slots "
        f"[{slot}]; got {plan['fill_blocks']}, {plan['fill_slots']}"
    )
    assert plan["residual_tokens"][:2] == [0, 1], (
        "its new keys still go to its residual rows first (the block is quantized from them)"
    )
    assert plan["residual_rows"][:2] == [slot * RES_BLOCK + 2, slot * RES_BLOCK + 3]
    assert residual.gpu_blocks == {5, 0}, (
        "a filled block keeps its slot until the step is over (a re-run of the step reads the "
        f"same rows); blocks holding a slot: {sorted(residual.gpu_blocks)}"
    )
    assert int(residual.slot_of_block[5]) == -1, (
        "a filled block is read from its codes: slot_of_block is -1 for it"
    )


def test_part3_blocks_filled_from_a_residual_come_before_blocks_written_whole():
    residual = key_residual()
    residual.plan([12, 13, 14])  # block 3, offsets 0..2
    plan = plan_lists(residual.plan([15, 4, 5, 6, 7]))  # block 3 fills; block 1 whole
    assert plan["fill_blocks"] == [3, 1] and plan["fill_tokens"] == [[1, 2, 3, 4]], (
        "fill_blocks lists the blocks filled from a residual slot first (with fill_slots), "
        f"then those written whole (with fill_tokens); got {plan['fill_blocks']}"
    )


def test_part3_a_block_written_past_offset_zero_without_a_residual_is_an_error():
    residual = key_residual()
    residual.plan([0])  # block 0 from offset 0: fine (a stub fails here, not as a RuntimeError)
    with pytest.raises(
        RuntimeError,
        match=r"^block 4 is written from offset 2 but holds no key residual: its earlier keys "
        r"are lost$",
    ):
        residual.plan([18, 19])


def test_part3_a_block_written_again_from_offset_zero_gives_its_old_slot_back_first():
    residual = key_residual(slots=1)
    residual.plan([8])  # block 2 partial: the only slot
    residual.plan([8, 9])  # the step runs again (a re-run, or the block's new owner)
    assert residual.gpu_blocks == {2} and residual.num_used == 1, (
        "written from offset 0, a block gives back the slot it still held before taking one: "
        "with a single slot, the plan must not run out"
    )


def test_part3_a_block_written_whole_again_holds_no_slot():
    residual = key_residual()
    residual.plan([8])  # block 2 partial; then its owner frees it and a new one writes it whole
    residual.plan([8, 9, 10, 11])
    assert residual.num_used == 0 and residual.gpu_blocks == set(), (
        "written from offset 0, block 2 gives back the slot it still held; written whole, it "
        f"takes none: slots in use {residual.num_used}, blocks {sorted(residual.gpu_blocks)}"
    )


def test_part3_store_keys_per_channel_writes_residual_rows_and_quantizes_filled_blocks():
    residual = torch.zeros(2, RES_BLOCK, 1, 2)
    residual[1, :2] = torch.tensor([[[1.0, -2.0]], [[3.5, 0.0]]])  # block 4's first two keys
    key = torch.tensor([[[5.0, 7.0]], [[2.0, 1.0]], [[9.0, 9.0]]])
    plan = KeyPlan(
        residual_tokens=torch.tensor([0, 1, 2]),
        residual_rows=torch.tensor([1 * RES_BLOCK + 2, 1 * RES_BLOCK + 3, 0]),
        fill_blocks=torch.tensor([4]),
        fill_slots=torch.tensor([1]),
        fill_tokens=torch.zeros(0, RES_BLOCK, dtype=torch.long),
    )
    codes = torch.zeros(6, RES_BLOCK, 1, 2, dtype=torch.uint8)
    scale, zero = torch.zeros(6, 1, 1, 2), torch.zeros(6, 1, 1, 2)
    slots = torch.full((6,), -1, dtype=torch.int32)
    cache = QuantizedCache(codes, scale, zero, 8, residual, slots, plan)
    store_keys_per_channel(key, cache)
    assert equal(residual[0, 0], key[2]), "a partial block's key goes to its residual row as is"
    assert zero[4].flatten().tolist() == [1.0, -2.0], (
        "block 4 filled: per channel over its 4 keys (2 from the residual, 2 new), zero is "
        f"each channel's minimum [1.0, -2.0]; got {zero[4].flatten().tolist()}"
    )
    assert allclose(scale[4].flatten(), torch.tensor([4.0 / 255, 9.0 / 255])), (
        f"scale is each channel's (max - min) / 255: expected [4/255, 9/255], got "
        f"{scale[4].flatten().tolist()}"
    )
    assert codes[4, :, 0, 0].tolist() == [0, 159, 255, 64], (
        f"channel 0's codes over the block's keys 1, 3.5, 5, 2: expected [0, 159, 255, 64], got "
        f"{codes[4, :, 0, 0].tolist()}"
    )
    assert not bool(codes[:4].any()) and not bool(codes[5].any()), "only block 4 is quantized"


def test_part3_each_filled_block_gets_its_own_grid_residual_filled_blocks_first():
    residual = torch.zeros(1, RES_BLOCK, 1, 2)
    residual[0, :3] = torch.tensor([[[0.0, 0.0]], [[1.0, 1.0]], [[2.0, 2.0]]])  # block 4's keys
    key = torch.tensor(
        [[[3.0, 3.0]], [[10.0, 20.0]], [[11.0, 21.0]], [[12.0, 22.0]], [[13.0, 26.0]]]
    )
    plan = KeyPlan(
        residual_tokens=torch.tensor([0]),  # block 4's last key
        residual_rows=torch.tensor([3]),
        fill_blocks=torch.tensor([4, 2]),  # 4 from residual slot 0, then 2 written whole
        fill_slots=torch.tensor([0]),
        fill_tokens=torch.tensor([[1, 2, 3, 4]]),
    )
    scale, zero = torch.zeros(6, 1, 1, 2), torch.zeros(6, 1, 1, 2)
    codes = torch.zeros(6, RES_BLOCK, 1, 2, dtype=torch.uint8)
    slots = torch.full((6,), -1, dtype=torch.int32)
    store_keys_per_channel(key, QuantizedCache(codes, scale, zero, 8, residual, slots, plan))
    for block, low, high in ((4, [0.0, 0.0], [3.0, 3.0]), (2, [10.0, 20.0], [13.0, 26.0])):
        assert zero[block].flatten().tolist() == low, (
            f"block {block} is quantized over its own {RES_BLOCK} keys (the blocks filled from a "
            "residual are the first of fill_blocks, those written whole follow): its zero is "
            f"each channel's minimum {low}, got {zero[block].flatten().tolist()}"
        )
        expected = torch.tensor(high) - torch.tensor(low)
        assert allclose(scale[block].flatten(), expected / 255), (
            f"block {block}'s scale is its own channels' (max - min) / 255, not a range shared "
            f"with the other filled block: expected {(expected / 255).tolist()}, got "
            f"{scale[block].flatten().tolist()}"
        )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_part3_store_keys_per_channel_writes_half_precision_planes_in_their_dtype(dtype):
    residual = torch.zeros(2, RES_BLOCK, 1, 2, dtype=dtype)  # a half-precision model's cache
    residual[0, :3] = torch.tensor([[[1.0, -2.0]], [[3.5, 0.0]], [[2.0, 1.0]]])  # block 4's keys
    key = torch.tensor([[[5.0, 7.0]], [[0.5, 0.25]]], dtype=dtype)
    plan = KeyPlan(
        residual_tokens=torch.tensor([0, 1]),
        residual_rows=torch.tensor([3, RES_BLOCK]),  # block 4's last key; a new block's first
        fill_blocks=torch.tensor([4]),
        fill_slots=torch.tensor([0]),
        fill_tokens=torch.zeros(0, RES_BLOCK, dtype=torch.long),
    )
    codes = torch.zeros(6, RES_BLOCK, 1, 2, dtype=torch.uint8)
    scale, zero = torch.zeros(6, 1, 1, 2, dtype=dtype), torch.zeros(6, 1, 1, 2, dtype=dtype)
    slots = torch.full((6,), -1, dtype=torch.int32)
    store_keys_per_channel(key, QuantizedCache(codes, scale, zero, 8, residual, slots, plan))
    assert scale.dtype == zero.dtype == residual.dtype == dtype, (
        "the planes and the residual are the cache's, never replaced"
    )
    assert equal(residual[1, 0], key[1]), "a partial block's key goes to its residual row as is"
    assert zero[4].flatten().tolist() == [1.0, -2.0], (
        f"the scales and zeros (float32 from the Quantizer) go into {dtype} planes, converted "
        f"(an indexed assignment does not convert): zero [1.0, -2.0] expected, got "
        f"{zero[4].flatten().tolist()}"
    )
    expected = torch.tensor([4.0 / 255, 9.0 / 255])
    assert allclose(scale[4].flatten().float(), expected, rtol=1e-2, atol=0), (
        f"scale is each channel's (max - min) / 255, stored in {dtype}: expected "
        f"{expected.tolist()}, got {scale[4].flatten().tolist()}"
    )
    assert codes[4, :, 0, 0].tolist() == [0, 159, 64, 255], (
        f"channel 0's codes over the block's keys 1, 3.5, 2, 5: expected [0, 159, 64, 255], got "
        f"{codes[4, :, 0, 0].tolist()}"
    )


# ---- Part 3.7: the key residual between steps (KeyResidual.apply, partial_blocks) -------------


def holding(residual: KeyResidual, blocks: dict[int, float]) -> KeyResidual:
    """Give each block a residual slot (the given ``_take``) whose rows are all ``value``."""
    for block, value in blocks.items():
        residual.keys[:, residual._take(block)] = value
    return residual


def rows_of(residual: KeyResidual, block: int) -> float:
    return float(residual.keys[:, residual._slots[block]].mean())


def test_part7_slots_of_blocks_that_are_no_partial_block_are_given_back():
    residual = holding(key_residual(), {1: 1.0, 2: 2.0, 3: 3.0})
    residual.apply({}, {}, [], partial_gpu={2}, partial_cpu=set())
    assert residual.gpu_blocks == {2} and residual.num_used == 1, (
        "between steps only running sequences' partial blocks keep a slot (blocks that filled "
        f"or were freed give theirs back); blocks holding a slot: {sorted(residual.gpu_blocks)}"
    )
    assert rows_of(residual, 2) == 2.0, "a kept slot keeps its rows"


def test_part7_a_swapped_partial_block_takes_its_rows_to_the_cpu_and_back():
    residual = holding(key_residual(), {4: 4.0})
    residual.apply({4: 0}, {}, [], partial_gpu=set(), partial_cpu={0})
    assert residual.cpu_blocks == {0} and residual.gpu_blocks == set(), (
        "GPU block 4 swapped out to CPU block 0, the partial block of a swapped sequence: its "
        "rows go with it to the CPU and its GPU slot is given back; CPU blocks holding rows "
        f"{sorted(residual.cpu_blocks)}, GPU {sorted(residual.gpu_blocks)}"
    )
    residual.keys.zero_()
    residual.apply({}, {0: 5}, [], partial_gpu={5}, partial_cpu=set())
    assert residual.gpu_blocks == {5} and residual.cpu_blocks == set(), (
        "swapped back in to GPU block 5 (a running sequence's partial block), it takes a slot "
        f"again and the CPU copy is dropped; GPU {sorted(residual.gpu_blocks)}"
    )
    assert rows_of(residual, 5) == 4.0, "the rows came back as they left"


def test_part7_rows_swapped_in_to_a_block_that_is_no_partial_block_are_not_kept():
    residual = key_residual()
    residual._swapped[1] = torch.full_like(residual.keys[:, 0], 1.0)  # CPU block 1's rows
    residual.apply({}, {1: 3}, [], partial_gpu=set(), partial_cpu=set())
    assert residual.num_used == 0 and residual.cpu_blocks == set(), (
        "GPU block 3 is no running sequence's partial block: the rows swapped in with it take "
        "no slot (and the CPU copy is dropped)"
    )


def test_part7_a_block_swapped_out_that_is_no_partial_block_takes_no_rows():
    residual = holding(key_residual(), {4: 4.0})
    residual.apply({4: 1}, {}, [], partial_gpu=set(), partial_cpu=set())
    assert residual.cpu_blocks == set() and residual.num_used == 0, (
        "a filled (or stale) block swapped out takes no residual rows: its codes are complete"
    )


def test_part7_copy_on_write_copies_the_residual_of_a_partial_block():
    residual = holding(key_residual(), {2: 2.0})
    residual.apply({}, {}, [(2, 3)], partial_gpu={2, 3}, partial_cpu=set())
    assert residual.gpu_blocks == {2, 3} and rows_of(residual, 3) == 2.0, (
        "copy-on-write of partial block 2 into 3: the target takes a slot with a copy of the "
        f"source's rows; GPU blocks holding a slot {sorted(residual.gpu_blocks)}"
    )
    assert residual._slots[2] != residual._slots[3], "two blocks never share a slot"


def test_part7_a_copys_source_that_is_no_partial_block_gives_its_slot_back_after_the_copy():
    residual = holding(key_residual(), {2: 2.0})
    residual.apply({}, {}, [(2, 3)], partial_gpu={3}, partial_cpu=set())
    assert residual.gpu_blocks == {3} and rows_of(residual, 3) == 2.0, (
        "block 2 is copied into 3 (the partial block) and is no partial block itself: its rows "
        "are copied first, then its slot is given back"
    )


def test_part7_slots_are_given_back_before_any_is_taken():
    residual = holding(key_residual(slots=1), {1: 1.0})
    residual._swapped[2] = torch.full_like(residual.keys[:, 0], 7.0)  # CPU block 2's rows
    residual.apply({}, {2: 4}, [], partial_gpu={4}, partial_cpu=set())
    assert residual.gpu_blocks == {4} and rows_of(residual, 4) == 7.0, (
        "with one slot, held by block 1 (no partial block now), swapping in block 4 needs it: "
        "slots are given back before any is taken"
    )


def test_part7_rows_kept_for_a_block_that_is_no_longer_swapped_are_dropped():
    residual = holding(key_residual(), {4: 4.0})
    residual.apply({4: 0}, {}, [], partial_gpu=set(), partial_cpu={0})
    residual.apply({}, {}, [], partial_gpu=set(), partial_cpu=set())
    assert residual.cpu_blocks == set(), (
        "CPU block 0's rows are dropped once it is no swapped sequence's partial block (its "
        "sequence was aborted, say)"
    )


def test_part7_a_block_swapped_in_without_rows_takes_no_slot():
    residual = key_residual()
    residual._swapped[1] = torch.full_like(residual.keys[:, 0], 1.0)  # CPU block 1's rows
    try:
        residual.apply({}, {0: 5, 1: 6}, [], partial_gpu={6}, partial_cpu=set())
    except KeyError as error:
        raise AssertionError(
            "a sequence swapped in brings back its filled blocks too (CPU block 0, no residual "
            "rows: a filled block swapped out takes none) and its partial block (CPU block 1): "
            f"a block without rows just takes no slot, got KeyError {error}"
        ) from None
    assert residual.gpu_blocks == {6} and rows_of(residual, 6) == 1.0, (
        "only the partial block (GPU 6) gets its rows back; GPU blocks holding a slot: "
        f"{sorted(residual.gpu_blocks)}"
    )


def test_part7_a_swap_in_target_still_holding_a_slot_gives_it_back_first():
    residual = holding(key_residual(slots=1), {5: 9.0})  # a stale slot: its owner freed block 5
    residual._swapped[0] = torch.full_like(residual.keys[:, 0], 7.0)  # CPU block 0's rows
    try:
        residual.apply({}, {0: 5}, [], partial_gpu={5}, partial_cpu=set())
    except NotImplementedError:
        raise
    except RuntimeError as error:
        raise AssertionError(
            "GPU block 5 still holds the one slot (its former owner freed it partial) and now "
            "takes the rows swapped in: a target that still holds a slot gives it back first, "
            f"else that slot is lost; got RuntimeError: {error}"
        ) from None
    assert residual.gpu_blocks == {5} and residual.num_used == 1 and rows_of(residual, 5) == 7.0, (
        "block 5 holds one slot, with the rows swapped in (7.0), not its stale ones (9.0); got "
        f"blocks {sorted(residual.gpu_blocks)}"
    )


def test_part7_a_copys_target_still_holding_a_slot_gives_it_back_first():
    residual = holding(key_residual(slots=2), {2: 2.0, 3: 9.0})  # 3: a stale slot
    try:
        residual.apply({}, {}, [(2, 3)], partial_gpu={2, 3}, partial_cpu=set())
    except NotImplementedError:
        raise
    except RuntimeError as error:
        raise AssertionError(
            "both slots are held (source 2 and a stale one of target 3): a copy's target that "
            "still holds a slot gives it back before it takes one for the copy, else that slot "
            f"is lost; got RuntimeError: {error}"
        ) from None
    assert residual.gpu_blocks == {2, 3} and rows_of(residual, 3) == 2.0, (
        "block 3 holds a slot with a copy of block 2's rows (2.0), not its stale ones (9.0)"
    )


class StoredTokens:
    """What ``partial_blocks`` reads of a ``Sequence`` (its contract names no other field): the
    block table and how many of its tokens are stored. Phase 3 does not need Phase 1's code."""

    def __init__(self, block_table: list[int], num_computed_tokens: int) -> None:
        self.block_table = block_table
        self.num_computed_tokens = num_computed_tokens


def test_part7_partial_blocks_are_the_blocks_of_each_sequences_partial_tail():
    seqs = [StoredTokens([5, 1], 6), StoredTokens([0, 2], 8), StoredTokens([4, 3], 3)]
    got = partial_blocks(seqs, 4)
    assert got == {1, 4}, (
        "6 stored tokens end in block_table[6 // 4] = 1, 3 in block_table[0] = 4 (a table may "
        "hold more blocks than the stored tokens use); 8 fill two blocks whole: no partial "
        f"block; expected {{1, 4}}, got {got}"
    )


# ---- Part 3.8: the dequantizing load of the Triton kernels -----------------------------------
#
# The given Triton kernels (vkv/kernels/triton_attention.py) run with your load_dequantized, on
# DEVICE: Triton either compiles for CUDA or interprets on the CPU, one or the other a process,
# so that is CUDA where there is a GPU, else the CPU under the Triton interpreter (set at the top
# of this file); every tensor a kernel reads is made there. The other parts' tests run on the
# CPU. The caches are the ones of parts 3.5 and 3.6, built plane by plane, and the expected
# values come from the tests' own float64 dense attention (the kernels dot float32 queries in
# IEEE precision, on a GPU too: one bound, 1e-4, for both); single tiles go through a small
# kernel of the tests' own.

TILE_D = 32  # the kernels' BLOCK_D for HEAD_DIM 4: two halves of 16 lanes, lanes 2..15 padding


def on_device(cache: QuantizedCache) -> QuantizedCache:
    moved = [None if t is None else t.to(DEVICE) for t in (cache.residual, cache.residual_slot)]
    return QuantizedCache(
        cache.codes.to(DEVICE), cache.scale.to(DEVICE), cache.zero.to(DEVICE), cache.bits, *moved
    )


def triton_decode(query, k_cache, v_cache, tables, lengths, scale):
    got = launched(
        triton_attention.paged_decode_attention,
        query.to(DEVICE),
        on_device(k_cache),
        on_device(v_cache),
        torch.tensor(tables, dtype=torch.int32, device=DEVICE),
        torch.tensor(lengths, dtype=torch.int32, device=DEVICE),
        scale,
    )
    return got.cpu()


def per_channel_keys(bits: int, seed: int) -> QuantizedCache:
    """Keys per channel: random codes, a scale and a zero per (block, head, channel), no block
    in the residual (every ``residual_slot`` is -1)."""
    g = torch.Generator().manual_seed(seed)
    base = random_cache(bits, seed)
    scale = torch.rand(NUM_BLOCKS, 1, KV_HEADS, HEAD_DIM, generator=g) / (2**bits) * 4
    zero = torch.randn(NUM_BLOCKS, 1, KV_HEADS, HEAD_DIM, generator=g)
    residual = torch.zeros(1, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    slots = torch.full((NUM_BLOCKS,), -1, dtype=torch.int32)
    return QuantizedCache(base.codes, scale, zero, bits, residual, slots)


def per_channel_values(cache: QuantizedCache, table: list[int], length: int) -> torch.Tensor:
    """A per-channel cache's first ``length`` tokens through ``table``, float64."""
    codes = codes_of(cache).double().view(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    rows = []
    for pos in range(length):
        block, offset = table[pos // BLOCK_SIZE], pos % BLOCK_SIZE
        rows.append(codes[block, offset] * cache.scale[block, 0].double() + cache.zero[block, 0])
    return torch.stack(rows)


CASES_8 = [(8, KV_HEADS, 2), (8, KV_HEADS, 4), (4, KV_HEADS, 4), (8, 1, 2), (4, 1, 4)]
IDS_8 = ["int8", "int8-gqa", "int4-gqa", "int8-token-group", "int4-token-group-gqa"]


def assert_decodes_as_dense(got, query, keys, values, tables, lengths, what: str) -> None:
    """Each sequence's row of a decode at scale 0.5 against dense attention over
    ``keys(cache_table, length)`` and ``values(...)``; ``what`` names it, formatted with the
    sequence's ``i``, ``table`` and ``length``."""
    for i, (table, length) in enumerate(zip(tables, lengths, strict=True)):
        expected = dense_attention(
            query[i : i + 1], keys(table, length), values(table, length), [length - 1], 0.5
        )[0]
        assert_attention_close(got[i], expected, what.format(i=i, table=table, length=length))


@pytest.mark.parametrize(("bits", "groups", "num_heads"), CASES_8, ids=IDS_8)
def test_part8_triton_decode_reads_the_quantized_cache_as_dense_attention_does(
    bits, groups, num_heads
):
    k_cache, v_cache = random_cache(bits, 80, groups), random_cache(bits, 81, groups)
    query = torch.randn(4, num_heads, HEAD_DIM, generator=torch.Generator().manual_seed(82))
    assert_decodes_as_dense(
        triton_decode(query, k_cache, v_cache, TABLES, LENGTHS, 0.5),
        query,
        lambda table, length: dense_values(k_cache, table, length),
        lambda table, length: dense_values(v_cache, table, length),
        TABLES,
        LENGTHS,
        f"Triton decode, INT{bits}, {groups} scale group(s) a token, sequence {{i}} (table "
        "{table}, {length} tokens): load_dequantized must return codes * scale + zero",
    )


@pytest.mark.parametrize("bits", [8, 4])
def test_part8_triton_decode_reads_keys_with_a_scale_per_channel(bits):
    k_cache, v_cache = per_channel_keys(bits, 83), random_cache(bits, 84)
    query = torch.randn(4, 4, HEAD_DIM, generator=torch.Generator().manual_seed(85))
    assert_decodes_as_dense(
        triton_decode(query, k_cache, v_cache, TABLES, LENGTHS, 0.5),
        query,
        lambda table, length: per_channel_values(k_cache, table, length),
        lambda table, length: dense_values(v_cache, table, length),
        TABLES,
        LENGTHS,
        f"Triton decode, INT{bits} keys per channel, sequence {{i}}: with PER_CHANNEL a key's "
        "channel i has its own scale and zero at scales_at + i",
    )


def test_part8_triton_decode_reads_nothing_past_a_context():
    k_cache, v_cache = random_cache(8, 86), random_cache(8, 87)
    for cache in (k_cache, v_cache):  # block 0 is in no table; block 4 past 6 tokens is unused
        cache.scale[0], cache.zero[0] = float("nan"), float("nan")
        cache.scale[4, 2:], cache.zero[4, 2:] = float("nan"), float("inf")
    tables, lengths = [[3, 4], [2, 1]], [6, 8]
    query = torch.randn(2, 2, HEAD_DIM, generator=torch.Generator().manual_seed(88))
    assert_decodes_as_dense(
        triton_decode(query, k_cache, v_cache, tables, lengths, 0.5),
        query,
        lambda table, length: dense_values(k_cache, table, length),
        lambda table, length: dense_values(v_cache, table, length),
        tables,
        lengths,
        "sequence {i}: a tile's lanes past the context (the kernel points them at block 0, "
        "here full of NaN, and at the last block's unused slots) must be 0.0 and read "
        "nothing: load every plane with the mask, other=0",
    )


@pytest.mark.parametrize(("bits", "num_heads"), [(8, 2), (4, 4)], ids=["int8", "int4-gqa"])
def test_part8_triton_prefill_reads_the_quantized_cache_causally(bits, num_heads):
    k_cache, v_cache = random_cache(bits, 89, groups=1), random_cache(bits, 90, groups=1)
    new, lengths, tables = [6, 2, 3], [6, 7, 5], [[3, 1], [0, 4], [2, 3]]
    cu = [0, 6, 8, 11]
    query = torch.randn(11, num_heads, HEAD_DIM, generator=torch.Generator().manual_seed(91))
    got = launched(
        triton_attention.paged_prefill_attention,
        query.to(DEVICE),
        on_device(k_cache),
        on_device(v_cache),
        torch.tensor(cu, dtype=torch.int32, device=DEVICE),
        torch.tensor(tables, dtype=torch.int32, device=DEVICE),
        torch.tensor(lengths, dtype=torch.int32, device=DEVICE),
        0.7,
    ).cpu()
    for i in range(3):
        rows = slice(cu[i], cu[i + 1])
        positions = list(range(lengths[i] - new[i], lengths[i]))
        expected = dense_attention(
            query[rows],
            dense_values(k_cache, tables[i], lengths[i]),
            dense_values(v_cache, tables[i], lengths[i]),
            positions,
            0.7,
        )
        assert_attention_close(
            got[rows],
            expected,
            f"Triton prefill, INT{bits}, sequence {i}: the prefill kernel reads its tiles through "
            "the same load_dequantized",
        )


def test_part8_triton_decode_agrees_with_your_part_3_6_attention():
    k_cache, v_cache = per_channel_keys(4, 92), random_cache(4, 93)
    query = torch.randn(4, 4, HEAD_DIM, generator=torch.Generator().manual_seed(94))
    tables = torch.tensor(TABLES, dtype=torch.int32)
    yours = quantized_decode_attention(query, k_cache, v_cache, tables, torch.tensor(LENGTHS), 0.5)
    got = triton_decode(query, k_cache, v_cache, TABLES, LENGTHS, 0.5)
    assert_attention_close(
        got,
        yours.double(),
        "the Triton kernel with your load_dequantized against your part 3.6 "
        "quantized_decode_attention on the same INT4 cache (keys per channel): the two backends "
        "must agree",
    )


@triton.jit
def _tile_kernel(
    codes_ptr,
    scale_ptr,
    zero_ptr,
    rows_ptr,
    scales_ptr,
    valid_ptr,
    out_ptr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BITS: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """One tile through ``load_dequantized``: every lane of its two halves written to ``out
    [BLOCK_N, BLOCK_D]``, the first half's lanes, then the second's."""
    tokens = tl.arange(0, BLOCK_N)
    lanes = tl.arange(0, BLOCK_D // 2)
    rows_at = tl.load(rows_ptr + tokens).to(tl.int64)
    scales_at = tl.load(scales_ptr + tokens).to(tl.int64)
    valid = tl.load(valid_ptr + tokens) != 0
    mask = valid[:, None] & (lanes < HEAD_DIM // 2)[None, :]
    first, second = load_dequantized(
        codes_ptr, scale_ptr, zero_ptr, rows_at, scales_at, lanes, mask, BITS, PER_CHANNEL, HEAD_DIM
    )
    at = out_ptr + tokens[:, None] * BLOCK_D + lanes[None, :]
    tl.store(at, first)
    tl.store(at + BLOCK_D // 2, second)


def load_tile(
    codes, scale, zero, rows_at, scales_at, valid, bits, per_channel, head_dim, planes=torch.float32
):
    """``load_dequantized`` on flat planes (scales and zeros in ``planes``): its halves side by
    side, ``[len(rows_at), TILE_D]`` (``lane_of`` says where a channel is)."""
    n = len(rows_at)
    out = torch.full((n, TILE_D), -7.0, device=DEVICE)  # -7: a lane the function left unset

    def flat(values, dtype):
        return torch.tensor(values, dtype=dtype, device=DEVICE)

    launched(
        _tile_kernel[(1,)],
        flat(codes, torch.uint8),
        flat(scale, planes),
        flat(zero, planes),
        flat(rows_at, torch.int64),
        flat(scales_at, torch.int64),
        flat(valid, torch.int32),
        out,
        BLOCK_N=n,
        BLOCK_D=TILE_D,
        BITS=bits,
        PER_CHANNEL=per_channel,
        HEAD_DIM=head_dim,
    )
    return out.cpu()


def lane_of(channel: int, head_dim: int) -> int:
    """Where ``load_tile`` puts a channel: the first half's lanes, then the second's."""
    half = head_dim // 2
    return channel if channel < half else TILE_D // 2 + channel - half


def in_channel_order(tile: torch.Tensor, head_dim: int) -> list[list[float]]:
    return [[float(row[lane_of(i, head_dim)]) for i in range(head_dim)] for row in tile]


def assert_tile(
    got: torch.Tensor, expected: list[list[float]], what: str, head_dim: int = 4
) -> None:
    """``got`` (``load_tile``'s) holds ``expected`` (rows in channel order, ``[]`` for a masked
    token) on its real lanes, 0.0 on every other."""
    want = torch.zeros(len(expected), TILE_D)
    for t, row in enumerate(expected):
        for channel, value in enumerate(row):
            want[t, lane_of(channel, head_dim)] = value
    wrong = (got - want).abs().gt(1e-6).nonzero().tolist()
    if wrong:
        t, lane = wrong[0]
        half, j = divmod(lane, TILE_D // 2)
        where = (
            f"channel {half * head_dim // 2 + j}"
            if j < head_dim // 2
            else f"padding lane {j} of the {('first', 'second')[half]} half"
        )
        raise AssertionError(
            f"{what}: token {t}, {where}, is {float(got[t, lane])}, expected "
            f"{float(want[t, lane])}; the tile in channel order: "
            f"{in_channel_order(got, head_dim)}, expected {in_channel_order(want, head_dim)}"
        )


NAN = float("nan")


def test_part8_an_int8_tile_is_codes_times_the_tokens_scale_plus_zero():
    codes = [9, 9, 9, 9, 0, 1, 2, 255, 10, 20, 30, 40]  # token rows at bytes 4 and 8
    got = load_tile(
        codes, [NAN, 0.5, 2.0], [NAN, -1.0, 3.0], [4, 8], [1, 2], [1, 1], 8, False, head_dim=4
    )
    assert_tile(
        got,
        [[-1.0, -0.5, 0.0, 126.5], [23.0, 43.0, 63.0, 83.0]],
        "INT8 per token: code i of token t is byte rows_at[t] + i, its scale and zero at "
        "scales_at[t]",
    )


def test_part8_an_int4_tile_reads_the_first_half_from_the_low_nibbles():
    got = load_tile([0x21, 0x43, 0xF0], [0.5], [-1.0], [0], [0], [1], 4, False, head_dim=6)
    assert_tile(
        got,
        [[-0.5, 0.5, -1.0, 0.0, 1.0, 6.5]],
        "INT4: bytes 0x21 0x43 0xF0 hold the codes 1, 3, 0 (low nibbles: channels 0-2, the "
        "first half) and 2, 4, 15 (high nibbles: channels 3-5, the second half)",
        head_dim=6,
    )


@pytest.mark.parametrize("bits", [8, 4])
def test_part8_the_multiply_add_is_float32_with_16_bit_scales(bits):
    scale = float(torch.tensor(0.1, dtype=torch.float16))  # 0.0999755859375
    codes = [200] * 4 if bits == 8 else [0xCC] * 2  # INT4: code 12 in every channel
    got = load_tile(codes, [0.1], [-3.0], [0], [0], [1], bits, False, 4, planes=torch.float16)
    code = 200 if bits == 8 else 12
    assert_tile(
        got,
        [[code * scale - 3.0] * 4],
        f"INT{bits}, scale and zero in float16 (the engine's on a GPU): converted to float32 "
        f"before the multiply-add, {code} * {scale} - 3 is {code * scale - 3.0}; a 16-bit "
        "multiply-add rounds it to the nearest float16",
    )


@pytest.mark.parametrize("bits", [8, 4])
def test_part8_keys_per_channel_take_the_channels_scale_and_zero(bits):
    codes = [3, 5, 7, 9] if bits == 8 else [0x73, 0x95]
    scale = [NAN, 1.0, 2.0, 0.5, 0.25]
    zero = [NAN, 0.0, -1.0, 10.0, 100.0]
    got = load_tile(codes, scale, zero, [0], [1], [1], bits, True, head_dim=4)
    assert_tile(
        got,
        [[3.0, 9.0, 13.5, 102.25]],
        f"INT{bits} keys per channel: channel i's scale and zero are at scales_at[t] + i",
    )


@pytest.mark.parametrize(("bits", "per_channel"), [(8, False), (4, False), (8, True)])
def test_part8_masked_lanes_are_zero_and_read_nothing(bits, per_channel):
    width = 4 * bits // 8
    codes = [200] * (2 * width)
    planes = [NAN] * 2 + [2.0] * 4 + [NAN] * 16  # NaN wherever a masked lane would look
    got = load_tile(codes, planes, planes, [width, 0], [2, 0], [1, 0], bits, per_channel, 4)
    codes_of_token_0 = [200] * 4 if bits == 8 else [8, 8, 12, 12]  # 200 is 0xC8
    assert_tile(
        got,
        [[code * 2.0 + 2.0 for code in codes_of_token_0], []],
        f"INT{bits}{' per channel' if per_channel else ''}: token 1 is masked (past a context) "
        "and lanes 2..15 of each half are padding: those lanes are 0.0 and no plane is read "
        "for them (the planes hold NaN there)",
    )


FAR_TILES = """
import sys
sys.path[:0] = {path!r}
from test_phase3 import in_channel_order, load_tile
far = 1 << 44  # elements past every plane: a read there faults
for bits, per_channel in {kinds!r}:
    codes = [7] * 4 if bits == 8 else [0x77] * 2
    print(bits, per_channel, flush=True)  # the kind being read, should the read crash
    tile = load_tile(codes, [0.5] * 4, [1.0] * 4, [0, far], [0, far], [1, 0], bits, per_channel, 4)
    print(in_channel_order(tile, 4), flush=True)
"""
FAR_KINDS = [(8, False), (4, False), (8, True), (4, True)]


def test_part8_a_masked_token_is_never_read_wherever_its_offsets_point():
    """Token 1 is masked and its offsets point 2**44 elements past the planes, where a load
    faults (a crash on a CPU, an illegal address on a GPU), so the tiles are made in a child
    process. The final ``tl.where`` discards a masked lane's value, not its read."""
    source = FAR_TILES.format(path=sys.path, kinds=FAR_KINDS)
    child = subprocess.run(
        [sys.executable, "-c", source], capture_output=True, text=True, timeout=300
    )
    lines = child.stdout.split("\n")[:-1]
    reading = lines[-1] if len(lines) % 2 else "(outside the tiles)"
    crashed = child.returncode != 0
    assert not crashed, (
        f"a masked token's codes, scale and zero must not be loaded at all (pass mask=... to "
        f"every tl.load that reads them): with its offsets far outside the planes, the process "
        f"making the tiles exited with {child.returncode} while reading (bits, per channel) = "
        f"{reading}: {child.stderr.strip()[-400:]}"
    )
    for (bits, per_channel), tile in zip(FAR_KINDS, lines[1::2], strict=True):
        assert tile == str([[4.5] * 4, [0.0] * 4]), (
            f"INT{bits}{' keys per channel' if per_channel else ''}: token 0 is 7 * 0.5 + 1.0 "
            f"= 4.5 in every channel and the masked token 0.0; got {tile}"
        )


@pytest.mark.skipif(DEVICE != "cpu", reason="on a GPU the tests above compile the load for real")
def test_part8_your_load_compiles_for_a_gpu_inside_the_attention_kernel():
    """The interpreter that runs these tests on a CPU accepts code that Triton's compiler
    refuses (a shape unpacked into local names, a Python scalar where a block goes, a dtype no
    GPU instruction takes): a load that passes every test above can still fail on the first GPU
    it meets. ``scripts/compile_for_gpu.py --load`` compiles the given attention kernel around
    your load for an H100 or H200 (sm_90): decode and prefill, INT8 and INT4, per token and
    keys per channel, with Triton's own compiler and the ``ptxas`` its wheel carries; nothing
    runs. Compiled kernels are kept in Triton's cache under the temporary folder: the same
    source compiles once."""
    load_tile([7] * 4, [0.5], [1.0], [0], [0], [1], 8, False, 4)  # first, on the interpreter
    if not (Path(triton.__file__).parent / "backends/nvidia/bin/ptxas").exists():
        pytest.skip("this Triton wheel carries no ptxas to compile with")
    run = compile_for_gpu("--load")
    failed = [line for line in run.stdout.splitlines() if line.startswith("FAILED")]
    first = run.stdout[run.stdout.find("FAILED") :][:1500] if failed else run.stderr[-1500:]
    assert run.returncode == 0 and "12 launches compiled for sm_90, 0 failed" in run.stdout, (
        f"your load_dequantized does not compile for a GPU in {len(failed)} launches "
        f"({', '.join(line.removeprefix('FAILED ') for line in failed[:3])}); the first: {first}"
    )
