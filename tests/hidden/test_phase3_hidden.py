"""Hidden tests for Phase 3: instructor-only (left out of the student edition).

They check the rules of ``assignment/phase3.md`` as ``tests/test_phase3.py`` does, on tensors,
shapes, magnitudes, offsets and model sizes drawn from the grade's seed, so a table of the
visible tests' answers cannot pass them. Every test gets its ``rng`` from ``@seeded``
(``test_seed.py``: the seed is ``VKV_GRADE_SEED``, or a fresh one when it is unset, and every
failure names it); tensors come from a ``torch.Generator`` seeded from that ``rng``. Expected
values are computed here in float64 Python arithmetic from the handout's formulas.

The torch functions the assertions compare with are bound here, before ``vkv.engine`` is
imported (the third-party imports come first): a solution region that replaced
``torch.equal`` or ``torch.allclose`` later would not change what these tests compare with.
"""

import math
import subprocess
import sys

import kernel_device  # noqa: F401 (first: Triton must not be imported before it)
import pytest
import torch
import triton
import triton.language as tl
from kernel_device import DEVICE, launched
from test_seed import seeded
from torch import allclose, equal, isnan

from vkv.engine.cache_engine import QuantizedCache
from vkv.engine.key_residual import KeyPlan, KeyResidual, partial_blocks
from vkv.engine.quantizer import (
    QuantizedTensor,
    Quantizer,
    _channel_range,
    bytes_per_token,
    pack_int4,
    unpack_int4,
)
from vkv.kernels import quantized as quantized_kernels
from vkv.kernels import triton_attention
from vkv.kernels.triton_quantized import load_dequantized

EPS = 1e-6  # the float32 allowance of the visible tests: EPS * max|x| on top of scale / 2


def generator(rng) -> torch.Generator:
    return torch.Generator().manual_seed(rng.getrandbits(63))


def draw_tensor(rng, min_dims: int = 1, even_last: bool = False) -> torch.Tensor:
    """A float32 tensor of 1 to 4 dimensions, magnitudes 1e-3 to 1e4, offsets up to 1e4, some
    groups along the last dimension constant."""
    dims = rng.randint(min_dims, 4)
    shape = [rng.randint(1, 5) for _ in range(dims - 1)]
    last = rng.randint(1, 24) * (2 if even_last else 1)
    magnitude = 10 ** rng.uniform(-3, 4)
    offset = rng.choice([0.0, 0.0, 5.0, -37.0, 1e3, -1e4 * rng.random()])
    x = torch.randn(*shape, last, generator=generator(rng)) * magnitude + offset
    rows = x.view(-1, last)
    for row in range(rows.shape[0]):
        if rng.random() < 0.15:
            rows[row] = rows[row, rng.randrange(last)].item()
    return x


def groups(x: torch.Tensor) -> list[list[float]]:
    """The per-token groups (rows along the last dimension) as Python floats."""
    return x.reshape(-1, x.shape[-1]).double().tolist()


def assert_within_half_a_step(x: torch.Tensor, scale: torch.Tensor, back: torch.Tensor) -> None:
    error = (x.double() - back.double()).abs()
    allowed = scale.double() / 2 + EPS * float(x.abs().max())
    worst = float((error - allowed).max())
    assert worst <= 0, (
        f"|x - dequantize(quantize(x))| must be <= scale / 2 per element (plus {EPS} * max|x| "
        f"for float32): it exceeds that by {worst:.3g} for x of shape {list(x.shape)}, "
        f"max|x| {float(x.abs().max()):.4g}"
    )


def check_codes(values: list[float], low: float, high: float, codes: list[int], levels: int):
    """code = clamp(round((x - min) / scale), 0, L), from the float64 formula: exact except
    within 1e-3 of a half, where float32 may round either way."""
    scale = (high - low) / levels
    if scale == 0:
        return  # a constant group: any code works
    for x, code in zip(values, codes, strict=True):
        exact = min(max((x - low) / scale, 0.0), levels)
        near = round(exact)
        ok = (
            {near}
            if abs(abs(exact - math.floor(exact)) - 0.5) > 1e-3
            else {
                math.floor(exact),
                math.ceil(exact),
            }
        )
        assert code in ok, (
            f"x = {x!r} in a group of min {low!r} and max {high!r}: (x - min) / scale = "
            f"{exact:.6f}, so code = round(...) = {sorted(ok)}, got {code}"
        )


# ---- Part 3.1: the Quantizer, INT8 per token -------------------------------------------------


@seeded
def test_part1_zero_is_each_tokens_minimum_and_scale_its_range_over_255(rng):
    quantizer = Quantizer(8)
    for _ in range(6):
        x = draw_tensor(rng)
        q = quantizer.quantize(x)
        want = [*x.shape[:-1], 1]
        assert list(q.scale.shape) == want and list(q.zero.shape) == want, (
            f"per token: one scale and one zero per group, shaped {want} for x of shape "
            f"{list(x.shape)}; got {list(q.scale.shape)} and {list(q.zero.shape)}"
        )
        assert q.scale.dtype == q.zero.dtype == torch.float32 and q.bits == 8
        assert q.codes.dtype == torch.uint8 and q.codes.shape == x.shape, (
            f"INT8 keeps one uint8 code per element: uint8 {list(x.shape)} expected, got "
            f"{q.codes.dtype} {list(q.codes.shape)}"
        )
        lows = [min(g) for g in groups(x)]
        ranges = [(max(g) - min(g)) / 255 for g in groups(x)]
        assert q.zero.flatten().double().tolist() == lows, "zero is each group's minimum, exactly"
        got = q.scale.flatten().double()
        assert allclose(got, torch.tensor(ranges, dtype=torch.float64), rtol=1e-5, atol=0), (
            f"scale is (max - min) / 255 per group: expected {ranges[:4]}..., got "
            f"{got.tolist()[:4]}..."
        )


@seeded
def test_part1_codes_round_to_the_nearest_level(rng):
    quantizer = Quantizer(8)
    for _ in range(6):
        x = draw_tensor(rng)
        codes = quantizer.quantize(x).codes.reshape(-1, x.shape[-1]).tolist()
        for values, row in zip(groups(x), codes, strict=True):
            check_codes(values, min(values), max(values), row, 255)
            if max(values) > min(values):
                low, high = values.index(min(values)), values.index(max(values))
                assert (row[low], row[high]) == (0, 255), (
                    f"a group's minimum gets code 0 and its maximum 255, got {row[low]} and "
                    f"{row[high]}"
                )


@seeded
def test_part1_the_round_trip_stays_within_half_a_step(rng):
    quantizer = Quantizer(8)
    for _ in range(8):
        x = draw_tensor(rng)
        q = quantizer.quantize(x)
        back = quantizer.dequantize(q)
        assert back.dtype == torch.float32 and back.shape == x.shape
        assert not bool(isnan(back).any()), "nothing becomes NaN (a constant group: scale 0)"
        assert_within_half_a_step(x, q.scale, back)
        for values, again, scale in zip(
            groups(x), groups(back), q.scale.flatten().tolist(), strict=True
        ):
            if max(values) == min(values):
                assert again == values and scale == 0, (
                    f"a constant group ({values[0]!r}) has scale 0 and dequantizes to itself "
                    f"exactly, got scale {scale} and {again[:3]}..."
                )


@seeded
def test_part1_dequantize_is_code_times_scale_plus_zero(rng):
    quantizer = Quantizer(8)
    gen = generator(rng)
    shape = [rng.randint(1, 5) for _ in range(rng.randint(0, 2))]
    last = rng.randint(1, 16)
    codes = torch.randint(0, 256, (*shape, last), generator=gen, dtype=torch.uint8)
    scale = torch.rand(*shape, 1, generator=gen) * 10 ** rng.uniform(-3, 2)
    zero = (torch.rand(*shape, 1, generator=gen) - 0.5) * 10 ** rng.uniform(-2, 3)
    back = quantizer.dequantize(QuantizedTensor(codes, scale, zero, 8))
    want = codes.double() * scale.double() + zero.double()
    assert back.dtype == torch.float32 and back.shape == codes.shape
    tolerance = 1e-6 * float(want.abs().max()) + 1e-12
    assert allclose(back.double(), want, rtol=1e-6, atol=tolerance), (
        f"dequantize is code * scale + zero in float32: worst difference "
        f"{float((back.double() - want).abs().max()):.3g}"
    )


@seeded
def test_part1_bad_bits_granularities_and_tensors_are_refused(rng):
    for bits in (
        rng.choice([b for b in range(-3, 33) if b not in (4, 8)]),
        float(rng.choice([4, 8])),
        True,
        str(rng.choice([4, 8])),
    ):
        with pytest.raises(ValueError) as raised:
            Quantizer(bits)
        assert str(raised.value) == f"bits must be 4 or 8, got {bits!r}", (
            f"Quantizer({bits!r}): expected 'bits must be 4 or 8, got {bits!r}', got "
            f"{raised.value!r}"
        )
    name = rng.choice(["per_block", "per_head", "token", "channel", "PER_TOKEN", ""])
    with pytest.raises(ValueError) as raised:
        Quantizer(8, name)
    want = f"granularity must be one of per_token, per_channel, got {name!r}"
    assert str(raised.value) == want, f"expected {want!r}, got {raised.value!r}"
    x = draw_tensor(rng)
    bads = []
    for value in (float("nan"), math.inf, -math.inf):
        bad = x.clone()
        bad.view(-1)[rng.randrange(bad.numel())] = value
        bads.append((bad, "cannot quantize NaN or infinite values"))
    cases = [
        *bads,
        (
            x.to(rng.choice([torch.int8, torch.int32, torch.int64, torch.uint8, torch.bool])),
            "only a floating-point tensor can be quantized",
        ),
        (torch.empty(rng.randint(1, 3), 0), "cannot quantize an empty tensor or a scalar"),
        (torch.tensor(rng.random()), "cannot quantize an empty tensor or a scalar"),
        (torch.empty(0, dtype=torch.int32), "only a floating-point tensor can be quantized"),
    ]
    for tensor, want in cases:
        with pytest.raises(ValueError) as raised:
            Quantizer(8).quantize(tensor)
        assert str(raised.value) == want, (
            f"a {tensor.dtype} tensor of shape {list(tensor.shape)}: expected {want!r} (checked "
            f"in the docstring's order), got {raised.value!r}"
        )
    odd = 2 * rng.randint(0, 20) + 1
    with pytest.raises(ValueError) as raised:
        Quantizer(4).quantize(torch.randn(rng.randint(1, 4), odd, generator=generator(rng)))
    want = f"INT4 packs two codes per byte: the last dimension must be even, got {odd}"
    assert str(raised.value) == want, f"expected {want!r}, got {raised.value!r}"


@seeded
def test_part1_half_precision_input_is_quantized_in_float32_and_left_alone(rng):
    quantizer = Quantizer(8)
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        x = (torch.randn(rng.randint(1, 6), rng.randint(2, 32), generator=generator(rng)) * 3).to(
            dtype
        )
        before = x.clone()
        q = quantizer.quantize(x)
        assert equal(x, before), f"quantize must not modify its {dtype} input"
        assert q.scale.dtype == q.zero.dtype == torch.float32, "scales and zeros are float32"
        assert_within_half_a_step(x.float(), q.scale, quantizer.dequantize(q))


def subnormal_range(rng, levels: int, width: int) -> tuple[torch.Tensor, int, int]:
    """A group of ``width`` float32 values ``2**-126 + k * 2**-149`` (normal numbers, one
    smallest step apart) whose range, ``K`` steps, is subnormal: the scale ``K / levels`` steps
    rounds to one step, so ``(max - min) / scale`` is ``K``, above ``levels``, and only the
    clamp of ``code = clamp(round((x - min) / scale), 0, L)`` keeps the maximum's code at
    ``levels``. (The half-step bound does not hold here: the scale itself is rounded.) Returns
    the group and the positions of its minimum and maximum. Skips where the CPU flushes
    subnormal results to zero (no such range exists there)."""
    one, tiny = 2.0**-126, 2.0**-149
    if float(torch.tensor([one + tiny]) - torch.tensor([one])) == 0.0:
        pytest.skip("this CPU flushes subnormal floats to zero")
    top = rng.randint(levels + 1, 3 * levels // 2)  # top / levels < 1.5: a scale of one step
    steps = [0, top, *(rng.randint(0, top) for _ in range(width - 2))]
    rng.shuffle(steps)
    x = torch.tensor([one + k * tiny for k in steps], dtype=torch.float64).float()  # exact
    return x, steps.index(0), steps.index(top)


@seeded
def test_part1_a_subnormal_range_still_gives_the_maximum_code_255(rng):
    x, low, high = subnormal_range(rng, 255, rng.randint(2, 9))
    codes = Quantizer(8).quantize(x).codes.tolist()
    assert (codes[low], codes[high]) == (0, 255), (
        f"a group {float(x[high] - x[low]):.4g} wide (subnormal): its scale (max - min) / 255 "
        f"rounds to 2**-149, so (max - min) / scale exceeds 255 and the clamp of "
        f"clamp(round((x - min) / scale), 0, 255) must keep the maximum's code at 255 (before "
        f"the conversion to uint8, which would wrap it); minimum and maximum got "
        f"{codes[low]} and {codes[high]}"
    )


# ---- Part 3.2: INT4, two codes per byte ------------------------------------------------------


def draw_codes(rng, limit: int = 16) -> torch.Tensor:
    shape = [rng.randint(1, 4) for _ in range(rng.randint(0, 3))]
    return torch.randint(0, limit, (*shape, 2 * rng.randint(1, 12)), generator=generator(rng)).to(
        torch.uint8
    )


@seeded
def test_part2_byte_i_holds_code_i_low_and_code_n_plus_i_high(rng):
    for _ in range(5):
        codes = draw_codes(rng)
        packed = pack_int4(codes)
        want_shape = [*codes.shape[:-1], codes.shape[-1] // 2]
        assert packed.dtype == torch.uint8 and list(packed.shape) == want_shape, (
            f"[..., 2n] codes pack into [..., n] uint8 bytes: expected uint8 {want_shape}, got "
            f"{packed.dtype} {list(packed.shape)}"
        )
        flat = codes.reshape(-1, codes.shape[-1]).tolist()
        half = codes.shape[-1] // 2
        want = [[row[i] | (row[half + i] << 4) for i in range(half)] for row in flat]
        got = packed.reshape(-1, packed.shape[-1]).tolist()
        assert got == want, (
            "of 2n codes, byte i = c[i] | (c[n + i] << 4): the first half in the low nibbles, "
            f"the second in the high ones; codes {flat[0]} pack to {[hex(b) for b in want[0]]}, "
            f"got {[hex(b) for b in got[0]]}"
        )


@seeded
def test_part2_unpack_reads_the_same_order_and_inverts_pack(rng):
    for _ in range(5):
        shape = [rng.randint(1, 4) for _ in range(rng.randint(0, 3))]
        packed = torch.randint(0, 256, (*shape, rng.randint(1, 12)), generator=generator(rng))
        packed = packed.to(torch.uint8)
        codes = unpack_int4(packed)
        flat = packed.reshape(-1, packed.shape[-1]).tolist()
        want = [[b & 0x0F for b in row] + [b >> 4 for b in row] for row in flat]
        got = codes.reshape(-1, codes.shape[-1]).tolist()
        assert codes.dtype == torch.uint8 and got == want, (
            f"unpack_int4: every byte's low nibble, then every byte's high nibble; bytes "
            f"{[hex(b) for b in flat[0]]} give {want[0]}, got {got[0]} ({codes.dtype})"
        )
        assert list(codes.shape) == [*shape, 2 * packed.shape[-1]]
        assert equal(pack_int4(codes), packed), "pack_int4(unpack_int4(b)) must be b"
        again = draw_codes(rng)
        assert equal(unpack_int4(pack_int4(again)), again), "unpack_int4(pack_int4(c)) must be c"


@seeded
def test_part2_pack_refuses_an_odd_last_dimension_and_a_code_above_15(rng):
    odd = 2 * rng.randint(0, 15) + 1
    shape = [rng.randint(1, 3) for _ in range(rng.randint(0, 2))]
    with pytest.raises(ValueError) as raised:
        pack_int4(torch.zeros(*shape, odd, dtype=torch.uint8))
    want = f"pack_int4 needs an even last dimension, got {odd}"
    assert str(raised.value) == want, f"expected {want!r}, got {raised.value!r}"
    for big in (16, rng.randint(17, 255)):
        codes = draw_codes(rng)
        codes.view(-1)[rng.randrange(codes.numel())] = big
        with pytest.raises(ValueError) as raised:
            pack_int4(codes)
        assert str(raised.value) == "a 4-bit code is at most 15", (
            f"a code of {big} cannot be packed: expected 'a 4-bit code is at most 15', got "
            f"{raised.value!r}"
        )


@seeded
def test_part2_int4_quantizes_to_sixteen_levels_within_half_a_step(rng):
    quantizer = Quantizer(4)
    for _ in range(6):
        x = draw_tensor(rng, even_last=True)
        q = quantizer.quantize(x)
        assert q.codes.dtype == torch.uint8 and q.codes.shape[-1] * 2 == x.shape[-1], (
            f"INT4 codes are packed two per byte: last dimension {x.shape[-1] // 2}, got "
            f"{q.codes.shape[-1]}"
        )
        ranges = [(max(g) - min(g)) / 15 for g in groups(x)]
        got = q.scale.flatten().double()
        assert allclose(got, torch.tensor(ranges, dtype=torch.float64), rtol=1e-5, atol=0), (
            "INT4: scale is (max - min) / 15"
        )
        codes = unpack_int4(q.codes).reshape(-1, x.shape[-1]).tolist()
        for values, row in zip(groups(x), codes, strict=True):
            check_codes(values, min(values), max(values), row, 15)
        back = quantizer.dequantize(q)
        assert back.shape == x.shape
        assert_within_half_a_step(x, q.scale, back)


@seeded
def test_part2_a_subnormal_range_still_gives_codes_up_to_15(rng):
    x, low, high = subnormal_range(rng, 15, 2 * rng.randint(1, 5))
    q = Quantizer(4).quantize(x)  # a code of 16 or more would make pack_int4 refuse it
    codes = unpack_int4(q.codes).tolist()
    assert (codes[low], codes[high]) == (0, 15), (
        f"INT4, a group {float(x[high] - x[low]):.4g} wide (subnormal): its scale rounds to "
        f"2**-149, so (max - min) / scale exceeds 15 and the clamp must keep the maximum's "
        f"code at 15; minimum and maximum got {codes[low]} and {codes[high]}"
    )


# ---- Part 3.3: keys per channel (KIVI) -------------------------------------------------------


def draw_block(rng, even_last: bool = True) -> torch.Tensor:
    """A block of keys [tokens, heads, head_dim], a random channel an outlier."""
    tokens, heads = rng.randint(1, 20), rng.randint(1, 4)
    dim = rng.randint(1, 12) * (2 if even_last else 1)
    keys = torch.randn(tokens, heads, dim, generator=generator(rng)) * 10 ** rng.uniform(-2, 2)
    keys[:, :, rng.randrange(dim)] *= rng.uniform(5, 80)
    return keys + rng.choice([0.0, 3.0, -250.0])


def channels(x: torch.Tensor) -> list[list[float]]:
    """Each (head, channel)'s values over the block's tokens, as Python floats."""
    flat = x.reshape(x.shape[0], -1).double()
    return flat.t().tolist()


@seeded
def test_part3_channel_range_is_over_the_blocks_tokens(rng):
    for _ in range(5):
        keys = draw_block(rng, even_last=False)
        low, high = _channel_range(keys)
        want = [1, *keys.shape[1:]]
        assert list(low.shape) == want and list(high.shape) == want, (
            f"per channel: the minimum and maximum over the tokens (dimension 0), kept as 1: "
            f"{want} for a block of {list(keys.shape)}; got {list(low.shape)}, "
            f"{list(high.shape)}"
        )
        got = (low.flatten().double().tolist(), high.flatten().double().tolist())
        want_values = ([min(c) for c in channels(keys)], [max(c) for c in channels(keys)])
        assert got == want_values, "each (head, channel)'s minimum and maximum over its tokens"


@seeded
def test_part3_per_channel_scale_zero_and_codes(rng):
    for bits in rng.sample([4, 8], 2):
        levels = (1 << bits) - 1
        keys = draw_block(rng)
        q = Quantizer(bits, "per_channel").quantize(keys)
        want = [1, *keys.shape[1:]]
        assert list(q.scale.shape) == want and list(q.zero.shape) == want, (
            f"INT{bits} per channel: one scale and zero per (head, channel), shaped {want}; got "
            f"{list(q.scale.shape)}"
        )
        cols = channels(keys)
        assert q.zero.flatten().double().tolist() == [min(c) for c in cols], (
            "zero is each channel's minimum over the block's tokens"
        )
        ranges = torch.tensor([(max(c) - min(c)) / levels for c in cols], dtype=torch.float64)
        assert allclose(q.scale.flatten().double(), ranges, rtol=1e-5, atol=0), (
            f"scale is each channel's (max - min) / {levels}"
        )
        codes = unpack_int4(q.codes) if bits == 4 else q.codes
        for values, row in zip(cols, channels(codes), strict=True):
            check_codes(values, min(values), max(values), [int(c) for c in row], levels)


@seeded
def test_part3_per_channel_round_trip_stays_within_half_a_step(rng):
    for bits in (8, 4, rng.choice([4, 8])):
        quantizer = Quantizer(bits, "per_channel")
        x = draw_tensor(rng, min_dims=2, even_last=True)
        q = quantizer.quantize(x)
        assert list(q.scale.shape) == [1, *x.shape[1:]]
        back = quantizer.dequantize(q)
        assert back.shape == x.shape and not bool(isnan(back).any())
        assert_within_half_a_step(x, q.scale, back)


@seeded
def test_part3_a_constant_channel_round_trips_exactly(rng):
    keys = draw_block(rng)
    keys = torch.cat([keys, keys[:1] + 1.0])  # at least two tokens
    flat = keys.view(keys.shape[0], -1)
    chosen = rng.sample(range(flat.shape[1]), rng.randint(1, flat.shape[1]))
    for column in chosen:
        flat[:, column] = rng.uniform(-100, 100)
    for bits in (4, 8):
        quantizer = Quantizer(bits, "per_channel")
        q = quantizer.quantize(keys)
        back = quantizer.dequantize(q).view(keys.shape[0], -1)
        for column in chosen:
            assert equal(back[:, column], flat[:, column]), (
                f"INT{bits}: a constant channel (value {flat[0, column].item()!r}) has scale 0 "
                f"and dequantizes to itself exactly, got {back[:3, column].tolist()}..."
            )
        assert float(q.scale.view(-1)[chosen[0]]) == 0.0


# ---- Part 3.4: bytes per token ----------------------------------------------------------------


def expected_bytes(layers, heads, dim, dtype, keys, block_size, scale_bytes) -> float:
    """The handout's table."""
    if dtype == "auto":
        return 2 * layers * heads * dim * 2
    codes = dim * {"int8": 8, "int4": 4}[dtype] / 8
    if keys == "per_token":
        return layers * heads * (2 * codes + 2 * 2 * scale_bytes)
    return layers * heads * (2 * codes + 2 * scale_bytes + 2 * scale_bytes * dim / block_size)


@seeded
def test_part4_bytes_per_token_count_the_codes_and_the_scales(rng):
    for _ in range(40):
        layers, heads, dim = rng.randint(1, 64), rng.randint(1, 16), 2 * rng.randint(1, 128)
        dtype = rng.choice(["auto", "int8", "int4"])
        keys = "per_token" if dtype == "auto" else rng.choice(["per_token", "per_channel"])
        block_size, scale_bytes = rng.choice([1, 2, 4, 8, 16, 32, 64, 128]), rng.choice([1, 2, 4])
        want = expected_bytes(layers, heads, dim, dtype, keys, block_size, scale_bytes)
        got = bytes_per_token(layers, heads, dim, dtype, keys, block_size, scale_bytes)
        assert math.isclose(got, want, rel_tol=1e-12), (
            f"{dtype}, keys {keys}: {layers} layers, {heads} KV heads, head_dim {dim}, block "
            f"{block_size}, scales of {scale_bytes} bytes: expected {want} bytes per token, got "
            f"{got}"
        )


@seeded
def test_part4_the_defaults_are_blocks_of_16_and_16_bit_scales(rng):
    for _ in range(10):
        layers, heads, dim = rng.randint(1, 48), rng.randint(1, 16), 2 * rng.randint(1, 128)
        dtype, keys = rng.choice(["int8", "int4"]), rng.choice(["per_token", "per_channel"])
        want = expected_bytes(layers, heads, dim, dtype, keys, 16, 2)
        got = bytes_per_token(layers, heads, dim, dtype, keys)
        assert math.isclose(got, want, rel_tol=1e-12), (
            f"{dtype}, keys {keys}, {layers} layers, {heads} heads, head_dim {dim}, by default "
            f"block_size 16 and scale_bytes 2: expected {want}, got {got}"
        )
        plain = bytes_per_token(layers, heads, dim, "auto")
        assert math.isclose(plain, 4 * layers * heads * dim, rel_tol=1e-12)


@seeded
def test_part4_unknown_formats_are_refused(rng):
    dtype = rng.choice(["fp8", "int2", "float16", "INT8", "bf16", ""])
    with pytest.raises(ValueError) as raised:
        bytes_per_token(rng.randint(1, 8), rng.randint(1, 8), 8, dtype)
    want = f"kv_cache_dtype must be auto, int8 or int4, got {dtype!r}"
    assert str(raised.value) == want, f"expected {want!r}, got {raised.value!r}"
    name = rng.choice(["per_block", "per_head", "channel", "token", ""])
    with pytest.raises(ValueError) as raised:
        bytes_per_token(rng.randint(1, 8), rng.randint(1, 8), 8, rng.choice(["int8", "int4"]), name)
    want = f"unknown key granularity {name!r}"
    assert str(raised.value) == want, f"expected {want!r}, got {raised.value!r}"


# ---- Parts 3.5 and 3.6: the quantized paged cache ---------------------------------------------


def draw_layout(rng) -> dict:
    """A cache's geometry: blocks, block size, KV heads, an even head_dim, bits, groups."""
    heads = rng.randint(1, 3)
    return {
        "blocks": rng.randint(3, 7),
        "block_size": rng.randint(1, 5),
        "heads": heads,
        "dim": 2 * rng.randint(1, 4),
        "bits": rng.choice([8, 4]),
        "groups": rng.choice([heads, 1]),
    }


def new_cache(layout: dict, fill: torch.Generator | None = None) -> QuantizedCache:
    """An empty cache of ``layout`` (all zero), or with random planes from ``fill``."""
    b, s, h, d, bits = (layout[k] for k in ("blocks", "block_size", "heads", "dim", "bits"))
    stored = d * bits // 8
    if fill is None:
        codes = torch.zeros(b, s, h, stored, dtype=torch.uint8)
        scale = torch.zeros(b, s, layout["groups"], 1)
        return QuantizedCache(codes, scale, scale.clone(), bits)
    codes = torch.randint(0, 256, (b, s, h, stored), generator=fill).to(torch.uint8)
    scale = torch.rand(b, s, layout["groups"], 1, generator=fill) * 4 / 2**bits
    zero = torch.randn(b, s, layout["groups"], 1, generator=fill)
    return QuantizedCache(codes, scale, zero, bits)


def slot_values(cache: QuantizedCache, slot: int) -> list[float]:
    """A slot's values from the planes, float64 Python arithmetic: ``[heads * dim]``."""
    flat = cache.codes.reshape(-1, cache.codes.shape[2] * cache.codes.shape[3])[slot].tolist()
    if cache.bits == 4:  # each head's bytes: its first half low, its second half high
        heads = [
            flat[i : i + cache.codes.shape[3]] for i in range(0, len(flat), cache.codes.shape[3])
        ]
        flat = [c for row in heads for c in [b & 15 for b in row] + [b >> 4 for b in row]]
    codes = flat
    groups = cache.scale.shape[2]
    scales = cache.scale.reshape(-1, groups)[slot].double().tolist()
    zeros = cache.zero.reshape(-1, groups)[slot].double().tolist()
    width = len(codes) // groups
    return [c * scales[i // width] + zeros[i // width] for i, c in enumerate(codes)]


def touched(cache: QuantizedCache) -> set[int]:
    slots = cache.codes.shape[0] * cache.codes.shape[1]
    planes = (cache.codes, cache.scale, cache.zero)
    changed = torch.zeros(slots, dtype=torch.bool)
    for plane in planes:
        changed |= plane.reshape(slots, -1).ne(0).any(1)
    return set(changed.nonzero().flatten().tolist())


def assert_reads_back(cache, x, slots, layout, what, held) -> None:
    """Each token of ``x`` stored at its slot (-1: skipped) reads back from ``cache`` within half
    a step (scale / 2) of its group, channel by channel."""
    width = layout["heads"] * layout["dim"] // layout["groups"]
    levels = 2 ** layout["bits"] - 1
    for token, slot in enumerate(slots):
        if slot < 0:
            continue
        row, back = x[token].reshape(-1).double().tolist(), slot_values(cache, slot)
        for g0 in range(0, len(row), width):
            group = row[g0 : g0 + width]
            step = (max(group) - min(group)) / levels
            allowed = step / 2 + 1e-5 * max(1.0, max(abs(v) for v in group))
            worst = max(abs(a - b) for a, b in zip(group, back[g0 : g0 + width], strict=True))
            assert worst <= allowed * (1 + 1e-3), (
                f"{what}, token {token} at slot {slot}{held}: a group of {width} channels reads "
                f"back within scale / 2 = {step / 2:.4g}; off by {worst:.4g} ({layout})"
            )


@seeded
def test_part5_every_token_of_a_step_reads_back_within_half_a_step(rng):
    for _ in range(4):
        layout = draw_layout(rng)
        slots_in_cache = layout["blocks"] * layout["block_size"]
        tokens = rng.randint(1, slots_in_cache)
        slots = rng.sample(range(slots_in_cache), tokens)
        for i in range(tokens):
            if rng.random() < 0.2:
                slots[i] = -1
        g = generator(rng)
        shape = (tokens, layout["heads"], layout["dim"])
        key = torch.randn(*shape, generator=g) * 10 ** rng.uniform(-2, 2)
        value = torch.randn(*shape, generator=g) + rng.uniform(-5, 5)
        k_cache, v_cache = new_cache(layout), new_cache(layout)
        quantized_kernels.store_quantized(key, value, k_cache, v_cache, torch.tensor(slots))
        stored = {slot for slot in slots if slot >= 0}
        for cache, x, what in ((k_cache, key, "keys"), (v_cache, value, "values")):
            assert touched(cache) <= stored, (
                f"{what}: only the step's slots {sorted(stored)} change (-1 is padding); "
                f"changed: {sorted(touched(cache))} ({layout})"
            )
            assert_reads_back(cache, x, slots, layout, what, "")


@seeded
def test_part5_a_step_overwrites_its_slots_and_keeps_every_other_slots_bytes(rng):
    for _ in range(4):
        layout = draw_layout(rng)
        slots_in_cache = layout["blocks"] * layout["block_size"]
        tokens = rng.randint(1, slots_in_cache)
        slots = rng.sample(range(slots_in_cache), tokens)
        g = generator(rng)
        shape = (tokens, layout["heads"], layout["dim"])
        key, value = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)
        k_cache, v_cache = new_cache(layout, fill=g), new_cache(layout, fill=g)  # old content
        before = [plane.clone() for c in (k_cache, v_cache) for plane in (c.codes, c.scale, c.zero)]
        quantized_kernels.store_quantized(key, value, k_cache, v_cache, torch.tensor(slots))
        after = [plane for c in (k_cache, v_cache) for plane in (c.codes, c.scale, c.zero)]
        kept = sorted(set(range(slots_in_cache)) - set(slots))
        for old, new_plane in zip(before, after, strict=True):
            flat_old, flat_new = (
                old.reshape(slots_in_cache, -1),
                new_plane.reshape(slots_in_cache, -1),
            )
            changed = [s for s in kept if not equal(flat_old[s], flat_new[s])]
            assert not changed, (
                f"slots outside the step's {sorted(slots)} keep every byte they held; slots "
                f"{changed} changed ({layout})"
            )
        for cache, x, what in ((k_cache, key, "keys"), (v_cache, value, "values")):
            assert_reads_back(cache, x, slots, layout, what, ", which held other codes")


@seeded
def test_part5_a_non_finite_token_anywhere_writes_nothing(rng):
    for _ in range(4):
        layout = draw_layout(rng)
        tokens = rng.randint(1, layout["blocks"] * layout["block_size"])
        g = generator(rng)
        shape = (tokens, layout["heads"], layout["dim"])
        key, value = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)
        bad = rng.choice([key, value])
        where = tuple(rng.randrange(n) for n in shape)
        bad[where] = rng.choice([float("nan"), float("inf"), -float("inf")])
        k_cache, v_cache = new_cache(layout), new_cache(layout)
        with pytest.raises(ValueError, match=r"^cannot quantize NaN or infinite values"):
            quantized_kernels.store_quantized(key, value, k_cache, v_cache, torch.arange(tokens))
        assert not touched(k_cache) and not touched(v_cache), (
            f"a NaN or infinity at {where} of the {'keys' if bad is key else 'values'}: the step "
            "is refused before anything is written, keys and values alike"
        )


def draw_tables(rng, layout: dict, batch: int) -> tuple[list[list[int]], list[int]]:
    """Block tables (distinct blocks a sequence, -1 padding to the widest) and lengths."""
    width = rng.randint(1, layout["blocks"])
    tables, lengths = [], []
    for _ in range(batch):
        used = rng.randint(1, width)
        tables.append(rng.sample(range(layout["blocks"]), used) + [-1] * (width - used))
        lengths.append(
            rng.randint((used - 1) * layout["block_size"] + 1, used * layout["block_size"])
        )
    return tables, lengths


def oracle_rows(q, k_cache, v_cache, table, positions, scale):
    """Attention for query rows ``q [rows, heads * group, dim]`` at ``positions``, float64 from
    the planes' formula, read slot by slot through ``table``."""
    block = k_cache.codes.shape[1]
    kv_heads, dim = k_cache.codes.shape[2], q.shape[2]
    group = q.shape[1] // kv_heads
    context = max(positions) + 1
    slot = [table[p // block] * block + p % block for p in range(context)]
    keys = torch.tensor([slot_values(k_cache, s) for s in slot], dtype=torch.float64)
    values = torch.tensor([slot_values(v_cache, s) for s in slot], dtype=torch.float64)
    keys, values = keys.view(context, kv_heads, dim), values.view(context, kv_heads, dim)
    out = torch.zeros(q.shape, dtype=torch.float64)
    for r, pos in enumerate(positions):
        for h in range(q.shape[1]):
            kv = h // group
            scores = (keys[: pos + 1, kv] @ q[r, h].double()) * scale
            weights = torch.softmax(scores, 0)
            out[r, h] = weights @ values[: pos + 1, kv]
    return out


def assert_decode_equals_dense(rng, decode, rounds: int, what: str) -> None:
    """``decode`` (``quantized_decode_attention``'s signature) on ``rounds`` drawn layouts,
    tables and GQA groups, sequence by sequence against ``oracle_rows``."""
    for _ in range(rounds):
        layout = draw_layout(rng)
        group = rng.choice([1, 2, 3])
        batch = rng.randint(1, 4)
        tables, lengths = draw_tables(rng, layout, batch)
        g = generator(rng)
        k_cache, v_cache = new_cache(layout, g), new_cache(layout, g)
        query = torch.randn(batch, layout["heads"] * group, layout["dim"], generator=g)
        scale = rng.uniform(0.1, 1.0)
        got = decode(
            query, k_cache, v_cache, torch.tensor(tables, dtype=torch.int32),
            torch.tensor(lengths), scale,
        )  # fmt: skip
        for i in range(batch):
            expected = oracle_rows(
                query[i : i + 1], k_cache, v_cache, tables[i], [lengths[i] - 1], scale
            )
            diff = float((got[i].double() - expected[0]).abs().max())
            assert diff < 1e-4, (
                f"{what}, sequence {i} (table {tables[i]}, {lengths[i]} tokens, block size "
                f"{layout['block_size']}, {group} query heads per KV head): decode must equal "
                f"attention over the dequantized context; off by {diff:.3g} ({layout})"
            )


def assert_prefill_equals_dense(rng, prefill, rounds: int, what: str) -> None:
    """``prefill`` (``quantized_prefill_attention``'s signature) on ``rounds`` drawn layouts and
    chunks, sequence by sequence against ``oracle_rows`` at the new tokens' positions."""
    for _ in range(rounds):
        layout = draw_layout(rng)
        group = rng.choice([1, 2])
        batch = rng.randint(1, 3)
        tables, lengths = draw_tables(rng, layout, batch)
        new = [rng.randint(1, length) for length in lengths]
        cu = [0]
        for n in new:
            cu.append(cu[-1] + n)
        g = generator(rng)
        k_cache, v_cache = new_cache(layout, g), new_cache(layout, g)
        query = torch.randn(cu[-1], layout["heads"] * group, layout["dim"], generator=g)
        scale = rng.uniform(0.1, 1.0)
        got = prefill(
            query, k_cache, v_cache, torch.tensor(cu), torch.tensor(tables, dtype=torch.int32),
            torch.tensor(lengths), scale,
        )  # fmt: skip
        for i in range(batch):
            positions = list(range(lengths[i] - new[i], lengths[i]))
            rows = slice(cu[i], cu[i + 1])
            expected = oracle_rows(query[rows], k_cache, v_cache, tables[i], positions, scale)
            diff = float((got[rows].double() - expected).abs().max())
            assert diff < 1e-4, (
                f"{what}, sequence {i}: its {new[i]} new tokens at positions {positions[0]}.."
                f"{positions[-1]} of {lengths[i]} attend causally to the dequantized context; "
                f"off by {diff:.3g} (table {tables[i]}, {layout})"
            )


@seeded
def test_part6_decode_equals_dense_attention_on_drawn_tables(rng):
    assert_decode_equals_dense(
        rng,
        quantized_kernels.quantized_decode_attention,
        3,
        "quantized_kernels.quantized_decode_attention",
    )


@seeded
def test_part6_prefill_equals_dense_causal_attention_on_drawn_chunks(rng):
    assert_prefill_equals_dense(
        rng,
        quantized_kernels.quantized_prefill_attention,
        3,
        "quantized_kernels.quantized_prefill_attention",
    )


@seeded
def test_part6_dequantize_blocks_reads_codes_or_the_residual(rng):
    layout = draw_layout(rng)
    layout["groups"] = layout["heads"]
    g = generator(rng)
    base = new_cache(layout, g)
    b, s, h, d = layout["blocks"], layout["block_size"], layout["heads"], layout["dim"]
    scale = torch.rand(b, 1, h, d, generator=g) / 32
    zero = torch.randn(b, 1, h, d, generator=g)
    residual = torch.randn(3, s, h, d, generator=g)
    slots = torch.full((b,), -1, dtype=torch.int32)
    partial = rng.sample(range(b), 2)
    slots[partial[0]], slots[partial[1]] = rng.sample(range(3), 2)
    keys = QuantizedCache(base.codes, scale, zero, layout["bits"], residual, slots, None)
    blocks = [rng.randrange(b) for _ in range(rng.randint(1, 6))]
    got = quantized_kernels.dequantize_blocks(keys, torch.tensor(blocks))
    codes = base.codes.long()
    if layout["bits"] == 4:
        codes = torch.cat((codes & 15, codes >> 4), -1)
    for i, block in enumerate(blocks):
        if int(slots[block]) >= 0:
            expected = residual[int(slots[block])].double()
        else:
            expected = codes[block].double() * scale[block].double() + zero[block].double()
        diff = float((got[i].double() - expected).abs().max())
        assert diff < 1e-5, (
            f"block {block} (residual slot {int(slots[block])}): a partial block reads its "
            "residual, any other its codes * scale + zero per (head, channel); "
            f"off by {diff:.3g}"
        )


# ---- Parts 3.3 and 3.7: the key residual ---------------------------------------------------------


@seeded
def test_part3_plans_of_a_drawn_trace_follow_the_rules(rng):
    """Sequences append chunks to their own blocks; an oracle of stored counts per block says
    which blocks each step fills (from a residual or whole) and which stay partial."""
    block = rng.randint(2, 5)
    num_blocks = 24
    residual = KeyResidual(1, block, 1, 2, torch.float32, num_blocks, 64, torch.device("cpu"))
    free = list(range(num_blocks))
    rng.shuffle(free)
    seqs = [{"table": [], "stored": 0} for _ in range(rng.randint(1, 3))]
    for step in range(8):
        slots, owner = [], {}
        for seq in seqs:
            for _ in range(rng.randint(0, 2 * block)):
                if seq["stored"] % block == 0:
                    if not free:
                        break
                    seq["table"].append(free.pop())
                b = seq["table"][seq["stored"] // block]
                slots.append(b * block + seq["stored"] % block)
                owner[b] = seq
                seq["stored"] += 1
        if rng.random() < 0.3:
            slots.insert(rng.randint(0, len(slots)), -1)
        first = {}
        for s in slots:
            if s >= 0:
                first.setdefault(s // block, s % block)
        filled = {b for b in first if any(s == b * block + block - 1 for s in slots)}
        from_residual = [b for b in first if b in filled and first[b] > 0]
        whole = [b for b in first if b in filled and first[b] == 0]
        partial = [b for b in first if b not in filled]
        plan = residual.plan(slots)
        got = plan.fill_blocks.tolist()
        assert got == from_residual + whole, (
            f"step {step} (block size {block}, slots {slots}): fill_blocks lists the blocks "
            f"filled from a residual slot {from_residual}, then those written whole {whole}; "
            f"got {got}"
        )
        assert plan.fill_slots.tolist() == [residual._slots[b] for b in from_residual], (
            "fill_slots: the residual slot of each block filled from one, in the same order"
        )
        expected_whole = [
            [t for t, s in enumerate(slots) if s >= 0 and s // block == b] for b in whole
        ]
        assert plan.fill_tokens.tolist() == expected_whole, (
            f"step {step}: fill_tokens, the batch rows of each block written whole in slot "
            f"order: expected {expected_whole}, got {plan.fill_tokens.tolist()}"
        )
        rows = {}
        for t, s in enumerate(slots):
            if s >= 0 and s // block not in whole:
                rows[t] = residual._slots[s // block] * block + s % block
        got_rows = dict(
            zip(plan.residual_tokens.tolist(), plan.residual_rows.tolist(), strict=True)
        )
        assert got_rows == rows, (
            f"step {step}: each new key of a partial block or of a block filled from its "
            f"residual goes to row slot * {block} + offset: expected {rows}, got {got_rows}"
        )
        marked = {b: int(v) for b, v in enumerate(residual.slot_of_block.tolist()) if v >= 0}
        assert marked == {b: residual._slots[b] for b in partial}, (
            f"step {step}: slot_of_block names the step's partial blocks {partial} only; got "
            f"{marked}"
        )


@seeded
def test_part3_store_keys_per_channel_converts_to_the_residuals_and_planes_dtype(rng):
    """float32 keys into a half-precision cache: the residual rows take the keys in the
    residual's dtype, the planes the grids in theirs (an indexed assignment converts nothing)."""
    dtype, bits = rng.choice([torch.float16, torch.bfloat16]), rng.choice([8, 4])
    block, heads, dim = rng.randint(2, 5), rng.randint(1, 3), 2 * rng.randint(1, 4)
    g = generator(rng)
    residual = torch.zeros(2, block, heads, dim, dtype=dtype)
    residual[0, : block - 1] = torch.randn(block - 1, heads, dim, generator=g).to(dtype)
    key = torch.randn(block + 2, heads, dim, generator=g) * 10 ** rng.uniform(-1, 2)
    # block 3's keys as the cache's dtype holds them: an implementation may convert the step's
    # keys first (the engine's keys are in that dtype already), and get the same grid
    key[1 : block + 1] = key[1 : block + 1].to(dtype).float()
    plan = KeyPlan(
        residual_tokens=torch.tensor([0, block + 1]),  # block 1's last key; block 5's first
        residual_rows=torch.tensor([block - 1, block]),
        fill_blocks=torch.tensor([1, 3]),  # 1 from residual slot 0, 3 written whole
        fill_slots=torch.tensor([0]),
        fill_tokens=torch.arange(1, block + 1)[None],
    )
    codes = torch.zeros(6, block, heads, dim * bits // 8, dtype=torch.uint8)
    scale = torch.zeros(6, 1, heads, dim, dtype=dtype)
    zero = scale.clone()
    slots = torch.full((6,), -1, dtype=torch.int32)
    cache = QuantizedCache(codes, scale, zero, bits, residual, slots, plan)
    quantized_kernels.store_keys_per_channel(key, cache)
    assert residual.dtype == scale.dtype == zero.dtype == dtype, "the cache's tensors stay"
    for row, token in ((residual[0, block - 1], 0), (residual[1, 0], block + 1)):
        assert equal(row, key[token].to(dtype)), (
            f"key row {token} (float32) goes to its residual row in the residual's dtype "
            f"{dtype}, as it is"
        )
    levels = 2**bits - 1
    for b, tokens in ((1, residual[0].float()), (3, key[1 : block + 1])):
        assert equal(zero[b, 0], tokens.amin(0).to(dtype)), (
            f"block {b}'s zero, each channel's minimum over its {block} keys, stored in {dtype}"
        )
        expected = (tokens.amax(0) - tokens.amin(0)) / levels
        assert allclose(scale[b, 0].float(), expected, rtol=1e-2, atol=1e-6), (
            f"block {b}'s scale, each channel's (max - min) / {levels}, stored in {dtype}"
        )


@seeded
def test_part7_apply_on_drawn_moves_keeps_exactly_the_partial_blocks_rows(rng):
    for _ in range(5):
        residual = KeyResidual(1, 2, 1, 2, torch.float32, 16, 16, torch.device("cpu"))
        blocks = rng.sample(range(16), 10)
        held = blocks[: rng.randint(1, 6)]
        value = {}
        for b in held:
            value[b] = float(b + 1)
            residual.keys[:, residual._take(b)] = value[b]
        cpu_rows = {}
        for c in rng.sample(range(8), rng.randint(0, 2)):
            cpu_rows[c] = 100.0 + c
            residual._swapped[c] = torch.full_like(residual.keys[:, 0], cpu_rows[c])
        rest = [b for b in range(16) if b not in held]
        out_gpu = rng.sample(held, rng.randint(0, min(2, len(held))))
        cpus = [c for c in range(8, 16)]
        swap_out = {g: cpus.pop() for g in out_gpu}
        kept = [b for b in held if b not in out_gpu]
        sources = rng.sample(kept, rng.randint(0, min(2, len(kept))))
        targets = rng.sample(rest, len(sources) + 2)
        copies = list(zip(sources, targets, strict=False))
        swap_in = {c: targets[-1 - i] for i, c in enumerate(list(cpu_rows)[:2])}
        partial_gpu = {b for b in kept + targets if rng.random() < 0.6}
        partial_cpu = {c for c in list(swap_out.values()) + list(cpu_rows) if rng.random() < 0.6}
        # the oracle: the rules of the module docstring, in order
        gpu = dict(value)
        cpu = dict(cpu_rows)
        for g, c in swap_out.items():
            cpu.pop(c, None)
            if g in gpu and c in partial_cpu:
                cpu[c] = gpu[g]
        src = {s for s, _ in copies}
        gpu = {b: v for b, v in gpu.items() if b in partial_gpu or b in src}
        for c, g in swap_in.items():
            rows = cpu.pop(c, None)
            if rows is not None and g in partial_gpu:
                gpu[g] = rows
        for s_, d in copies:
            if s_ in gpu and d in partial_gpu:
                gpu[d] = gpu[s_]
        gpu = {b: v for b, v in gpu.items() if b in partial_gpu}
        cpu = {c: v for c, v in cpu.items() if c in partial_cpu}
        residual.apply(swap_out, swap_in, copies, partial_gpu, partial_cpu)
        got = {b: float(residual.keys[:, slot].mean()) for b, slot in residual._slots.items()}
        assert got == gpu, (
            f"held {value}, swap_out {swap_out}, swap_in {swap_in}, copies {copies}, partial "
            f"GPU blocks {sorted(partial_gpu)}: after apply the GPU blocks holding rows (block: "
            f"rows) must be {gpu}, got {got}"
        )
        assert len(set(residual._slots.values())) == len(residual._slots), "a slot per block"
        got_cpu = {c: float(rows.mean()) for c, rows in residual._swapped.items()}
        assert got_cpu == cpu, (
            f"CPU blocks holding rows must be {cpu} (partial CPU blocks {sorted(partial_cpu)}), "
            f"got {got_cpu}"
        )


@seeded
def test_part7_a_full_residual_gives_slots_back_before_it_takes_any(rng):
    for _ in range(5):
        num_slots = rng.randint(2, 6)
        residual = KeyResidual(1, 2, 1, 2, torch.float32, 32, num_slots, torch.device("cpu"))
        blocks = rng.sample(range(32), 3 * num_slots)
        held, others = blocks[:num_slots], blocks[num_slots:]
        for b in held:  # every slot in use
            residual.keys[:, residual._take(b)] = float(b + 1)
        dropped = rng.sample(held, rng.randint(1, num_slots))  # no partial block after the step
        kept = [b for b in held if b not in dropped]
        arriving = rng.randint(1, len(dropped))  # as many new partial blocks at most
        copied = rng.randint(0, arriving) if kept else 0
        targets = others[:arriving]
        copies = [(rng.choice(kept), d) for d in targets[:copied]]
        swap_in = {}
        for i, g in enumerate(targets[copied:]):
            swap_in[100 + i] = g
            residual._swapped[100 + i] = torch.full_like(residual.keys[:, 0], 500.0 + i)
        partial_gpu = set(kept) | set(targets)
        try:
            residual.apply({}, swap_in, copies, partial_gpu, set())
        except NotImplementedError:  # a RuntimeError too: the stub's, which the check must see
            raise
        except RuntimeError as error:
            pytest.fail(
                f"{num_slots} slots, all in use; {sorted(dropped)} are no partial block after "
                f"the step, and {len(targets)} blocks arrive (swap-ins {swap_in}, copies "
                f"{copies}): their slots must be given back before any is taken ({error})",
                pytrace=False,
            )
        assert set(residual._slots) == partial_gpu, (
            f"after apply the blocks holding slots are the partial ones, {sorted(partial_gpu)}; "
            f"got {sorted(residual._slots)}"
        )
        assert len(residual._free) == num_slots - len(partial_gpu), (
            f"the {num_slots - len(partial_gpu)} slots no partial block holds are free after "
            f"apply; {len(residual._free)} are"
        )


class StoredTokens:
    def __init__(self, block_table: list[int], num_computed_tokens: int) -> None:
        self.block_table = block_table
        self.num_computed_tokens = num_computed_tokens


@seeded
def test_part7_partial_blocks_of_drawn_sequences(rng):
    block = rng.randint(1, 6)
    seqs, expected = [], set()
    for _ in range(rng.randint(1, 6)):
        stored = rng.randint(1, 5 * block)
        table = rng.sample(range(100), -(-stored // block) + rng.randint(0, 1))
        seqs.append(StoredTokens(table, stored))
        if stored % block:
            expected.add(table[stored // block])
    got = partial_blocks(seqs, block)
    drawn = [(s.block_table, s.num_computed_tokens) for s in seqs]
    assert got == expected, (
        f"block size {block}, (table, stored) {drawn}: each sequence's block holding its "
        f"partial tail, {expected}; got {got}"
    )


# ---- Part 3.8: the Triton kernels with the submitted load_dequantized --------------------------
# On DEVICE, as the visible tests: CUDA where there is a GPU, else the CPU under the interpreter
# (set at the top; Triton does one or the other a process). The other parts run on the CPU.


def to_device(cache: QuantizedCache) -> QuantizedCache:
    return QuantizedCache(
        cache.codes.to(DEVICE), cache.scale.to(DEVICE), cache.zero.to(DEVICE), cache.bits
    )


def on_device(*args):
    """Tensors and caches moved to ``DEVICE``; other arguments as they are."""
    return [
        arg.to(DEVICE) if isinstance(arg, torch.Tensor)
        else to_device(arg) if isinstance(arg, QuantizedCache)
        else arg
        for arg in args
    ]  # fmt: skip


def triton_decode(*args):
    return launched(triton_attention.paged_decode_attention, *on_device(*args)).cpu()


def triton_prefill(*args):
    return launched(triton_attention.paged_prefill_attention, *on_device(*args)).cpu()


@seeded
def test_part8_triton_decode_equals_dense_attention_on_drawn_tables(rng):
    assert_decode_equals_dense(rng, triton_decode, 2, "Triton decode with load_dequantized")


@seeded
def test_part8_triton_prefill_equals_dense_causal_attention_on_drawn_chunks(rng):
    assert_prefill_equals_dense(rng, triton_prefill, 2, "Triton prefill with load_dequantized")


EDGE_TILE = """
import ctypes, mmap, sys
sys.path[:0] = {path!r}
import torch
from kernel_device import launched
from test_phase3_hidden import _tile_kernel
page = mmap.PAGESIZE
memory = mmap.mmap(-1, 2 * page)
libc = ctypes.CDLL(None, use_errno=True)
start = ctypes.addressof(ctypes.c_char.from_buffer(memory))
assert libc.mprotect(ctypes.c_void_p(start + page), page, 0) == 0  # the next page faults
for bits, per_channel in {kinds!r}:
    width = 6 * bits // 8  # head_dim 6: a row of 6 or 3 bytes, the plane's last
    codes = torch.frombuffer(memory, dtype=torch.uint8, count=width, offset=page - width)
    codes.fill_(0x11)
    print(bits, per_channel, flush=True)  # the kind being read, should the read fault
    out = torch.full((1, 16), -7.0)
    launched(
        _tile_kernel[(1,)], codes, torch.full((6,), 0.5), torch.full((6,), 1.0),
        torch.tensor([0]), torch.tensor([0]), torch.tensor([1], dtype=torch.int32), out,
        BLOCK_N=1, BLOCK_D=16, BITS=bits, PER_CHANNEL=per_channel, HEAD_DIM=6,
    )
    print(out[0].tolist(), flush=True)
"""


@pytest.mark.skipif(DEVICE != "cpu", reason="a guard page faults on the CPU's reads only")
def test_part8_a_real_tokens_padding_channels_are_not_read_either():
    """A real token whose codes end a plane, the next page unmapped: a load that reads the
    padding channels' bytes too (head_dim 6 of a 16-wide tile) faults there, so the tile is
    made in a child process. Padding lanes are masked lanes: nothing is read for them."""
    kinds = [(8, False), (4, False), (8, True), (4, True)]
    source = EDGE_TILE.format(path=sys.path, kinds=kinds)
    child = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True)
    lines = child.stdout.split("\n")[:-1]
    reading = lines[-1] if len(lines) % 2 else "(outside the tiles)"
    assert child.returncode == 0, (
        f"reading a real token whose row ends the codes plane (head_dim 6, BLOCK_D 16; the "
        f"page after it unmapped), the process exited with {child.returncode} at (bits, per "
        f"channel) = {reading}: the bytes of channels >= head_dim were read (INT4: a row is "
        f"head_dim / 2 bytes). {child.stderr.strip()[-300:]}"
    )
    for (bits, per_channel), row in zip(kinds, lines[1::2], strict=True):
        real = [(17 if bits == 8 else 1) * 0.5 + 1.0] * 3
        assert row == str((real + [0.0] * 5) * 2), (
            f"INT{bits}{' per channel' if per_channel else ''}: got {row}"
        )


@triton.jit
def _tile_kernel(
    codes_ptr, scale_ptr, zero_ptr, rows_ptr, scales_ptr, valid_ptr, out_ptr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BITS: tl.constexpr, PER_CHANNEL: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):  # fmt: skip
    tokens = tl.arange(0, BLOCK_N)
    lanes = tl.arange(0, BLOCK_D // 2)  # the halves side by side in out: lane j, BLOCK_D/2 + j
    rows_at = tl.load(rows_ptr + tokens).to(tl.int64)
    scales_at = tl.load(scales_ptr + tokens).to(tl.int64)
    mask = (tl.load(valid_ptr + tokens) != 0)[:, None] & (lanes < HEAD_DIM // 2)[None, :]
    first, second = load_dequantized(
        codes_ptr, scale_ptr, zero_ptr, rows_at, scales_at, lanes, mask, BITS, PER_CHANNEL, HEAD_DIM
    )
    at = out_ptr + tokens[:, None] * BLOCK_D + lanes[None, :]
    tl.store(at, first)
    tl.store(at + BLOCK_D // 2, second)


def channel_at(lane: int, block_d: int, head_dim: int) -> int | None:
    """The channel ``_tile_kernel`` writes at ``lane`` of a row of ``out`` (None: padding)."""
    half, j = divmod(lane, block_d // 2)
    return half * head_dim // 2 + j if j < head_dim // 2 else None


@seeded
def test_part8_drawn_tiles_are_read_lane_by_lane(rng):
    for trial in range(4):  # scales and zeros in float32, then float16 (the engine's on a GPU)
        dtype = torch.float16 if trial % 2 else torch.float32
        bits, per_channel = rng.choice([8, 4]), rng.random() < 0.5
        dim, tokens, block_d = 2 * rng.randint(1, 8), rng.choice([2, 4, 8]), 16
        width = dim * bits // 8
        rows = rng.randint(tokens, 2 * tokens)
        codes = [rng.randrange(256) for _ in range(rows * width)]
        per_row = dim if per_channel else 1
        planes = rows * per_row + block_d  # room past the last row for unmasked lanes
        scale = torch.tensor([rng.uniform(0.01, 2.0) for _ in range(planes)], dtype=dtype)
        zero = torch.tensor([rng.uniform(-5.0, 5.0) for _ in range(planes)], dtype=dtype)
        picked = rng.sample(range(rows), tokens)  # distinct rows, out of order
        valid = [int(rng.random() < 0.7) for _ in range(tokens)]
        valid[rng.randrange(tokens)] = 1
        for t in range(tokens):  # a masked token's planes hold NaN: nothing may read them
            if not valid[t]:
                for i in range(per_row):
                    scale[picked[t] * per_row + i] = float("nan")
        out = torch.full((tokens, block_d), -7.0, device=DEVICE)
        launched(
            _tile_kernel[(1,)],
            torch.tensor(codes, dtype=torch.uint8, device=DEVICE),
            scale.to(DEVICE), zero.to(DEVICE),
            torch.tensor([p * width for p in picked], device=DEVICE),
            torch.tensor([p * per_row for p in picked], device=DEVICE),
            torch.tensor(valid, dtype=torch.int32, device=DEVICE), out,
            BLOCK_N=tokens, BLOCK_D=block_d, BITS=bits, PER_CHANNEL=per_channel, HEAD_DIM=dim,
        )  # fmt: skip
        got = out.cpu().double()
        for t in range(tokens):
            row = codes[picked[t] * width : (picked[t] + 1) * width]
            unpacked = row if bits == 8 else [b & 15 for b in row] + [b >> 4 for b in row]
            for lane in range(block_d):
                expected, i = 0.0, channel_at(lane, block_d, dim)
                if valid[t] and i is not None:
                    at = picked[t] * per_row + (i if per_channel else 0)
                    expected = unpacked[i] * float(scale[at]) + float(zero[at])
                value = float(got[t, lane])
                assert abs(value - expected) <= 1e-5 * max(1.0, abs(expected)), (
                    f"INT{bits}{' per channel' if per_channel else ''}, head_dim {dim}, scales "
                    f"in {dtype} (the multiply-add in float32): token {t}, lane {lane % 8} of "
                    f"the {('first', 'second')[lane // 8]} half (channel {i}) is {value}, "
                    f"expected {expected} "
                    f"({'code * scale + zero' if valid[t] and i is not None else 'masked: 0.0'})"
                )
