"""Triton kernels for paged attention, with the signatures of ``reference.py``.

One kernel, ``_attention_kernel``, serves decode and prefill: a program takes a tile of query
rows that read the same KV head, walks the cached context of their sequence through the block
table, ``BLOCK_N`` tokens a tile, and keeps an online softmax (a running maximum, sum and
output per row). Only which rows a program takes, and which part of the context it walks,
differ (``DECODE``):

- ``paged_decode_attention``: flash-decoding in two stages. Stage 1 runs one program per
  (sequence, KV head, split of the context): its rows are the query heads that share the KV head
  (GQA), packed into the rows of one ``tl.dot`` (padded to 16, the GPU's minimum); it writes each
  split's output and log-sum-exp. Stage 2 (``_decode_merge_kernel``) merges the splits of each
  (sequence, head) with log-sum-exp weights.
- ``paged_prefill_attention``: one program per (sequence, query head, tile of ``BLOCK_M`` new
  tokens); its rows are those tokens, each seeing the context up to its own position (causal);
  the context before the new tokens is visible to all.

A decode's row sits at the last position of its context: it sees every cached token, so only
prefill masks by position (causal), and decode's tiles skip that comparison.

A head's channels are handled in two halves: lane ``j`` of a half tile is channel ``j`` in the
first half and channel ``head_dim / 2 + j`` in the second. The query, each tile of keys or
values and the output are two tiles of ``BLOCK_D / 2`` lanes, and each dot product is two
half-width ones, summed: INT4 codes, packed by halves (``pack_int4``), then split into the two
tiles with a mask and a shift and nothing to reorder (the SASS loop of an INT4 tile is about a
quarter shorter than with neighbours packed in a byte and interleaved back into channel order).
``head_dim`` must be even.

A quantized cache (``QuantizedCache``, Phase 3) goes through the same kernel: a tile loads codes,
scales and zeros and dequantizes them in registers before the dot products (``_load_rows`` calls
``triton_quantized.load_dequantized``, part 3.8), so a quantized block is read as bytes, never
expanded in memory. Keys per channel have a scale per (block, head, channel), and a partial
block's keys are read from the residual. Each lane loads its channel's scale and zero, or, asked
to (``fold_keys``) where a tile can lie inside one block (``FOLD_KEYS``: the block size a
multiple of 16, tiles of a power of two that divides it), the block's channel scales fold into
the query, as KIVI does: ``q · (c ∘ s + z) = (q ∘ s) · c + q · z``. The tile's codes then come
through ``load_dequantized`` with a unit scale, and its scale and zero rows are one load each a
tile instead of one a lane. Storing is ``triton_store.py``'s.

Asked to (``fold_scales``; ``head_dim`` a multiple of 4 above 32), the kernel takes a per-token
scale and zero out of the tile instead, as the field's INT8 and INT4 kernels do: the scores are
``s (q · c) + z Σq`` and the weighted sum ``(p ∘ s) · c + Σ p z``, so a value costs no
multiply-add and no rounding, only its way from a byte into the dot (keys per channel: the
values alone). A tile's codes are read as 16-bit words, two neighbouring bytes each, and split
into four quarters, each half's even and odd channels (``_code_quarters``; the query too, once):
the values' tile then reaches the tensor cores with tokens paired in a register, as 16 bits do,
where a byte tile is gathered a byte at a time (an sm_90's ``ldmatrix`` transposes 16-bit
elements, not bytes). On a GPU the split is PTX, about an instruction a code: a byte permute
puts two bytes under float16's exponent of 1,024, one subtraction takes 1,024 off both (the
interpreter runs the same arithmetic in Triton). By the SASS (``compile_for_gpu.py --anatomy``,
``head_dim`` 128, Triton 3.9 / the GPU image's 3.6) the decode tile loop issues 46.4 / 49.4 warp
instructions a cached token in INT8 per token against 67.5 / 69.4 unfolded, 49.8 / 52.9 in INT4
against 76.4 / 75.3 (16 bits: 23.2 / 25.8), and with keys per channel 86.1 / 90.3 against 92.9 /
96.4 (INT8), 92.6 / 96.2 against 102.8 / 103.8 (INT4). Not the default until a GPU times it
(``bench_decode_kernel.py``, its sweep included): folded, part 3.8's load is not called for a
per-token cache.

A split of the context is a whole number of tiles, so that tiles start where blocks do.

On a CPU the kernels run under the Triton interpreter (``TRITON_INTERPRET=1``, fp32 and fp16;
bf16 is broken there). Tile sizes respect the GPU's minimum ``tl.dot`` shapes (16), so what
passes on the CPU also compiles for an H200; fp32 dots use IEEE precision, not TF32. Scores,
softmax and the weighted sum are float32 whatever the query's dtype.
"""

import math
import os

import torch
import triton
import triton.language as tl

from vkv.engine.cache_engine import QuantizedCache
from vkv.kernels.triton_quantized import load_dequantized
from vkv.kernels.triton_store import check_devices, store_kvcache

__all__ = ["paged_decode_attention", "paged_prefill_attention", "store_kvcache"]

MIN_DOT = 16
# under the interpreter no PTX runs: _split_bytes and _split_nibbles take their Triton branch
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")
UNQUANTIZED = 16  # the kernels' BITS for a cache of values


@triton.jit
def _attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    k_scale_ptr,
    k_zero_ptr,
    v_scale_ptr,
    v_zero_ptr,
    residual_ptr,
    residual_slot_ptr,
    unit_ptr,
    cu_seqlens_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    lse_ptr,
    scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_os,
    stride_lse_t,
    stride_lse_h,
    stride_table,
    stride_block,
    stride_slot,
    stride_head,
    scale_block,
    scale_slot,
    scale_head,
    k_scale_block,
    k_scale_slot,
    k_scale_head,
    residual_block,
    residual_slot,
    residual_head,
    DECODE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BITS: tl.constexpr,
    KEYS_PER_CHANNEL: tl.constexpr,
    FOLD_KEYS: tl.constexpr,
    FOLD_SCALES: tl.constexpr,
    CODE_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """``BLOCK_M`` query rows of sequence ``program_id(0)`` against one KV head. Each row is a
    (token, head) pair at a context position; it sees the cached tokens up to that position in
    ``[start, end)``. Its normalized output goes to ``out`` (a split's slot for decode), and for
    decode its log-sum-exp to ``lse`` (-inf, and an output of 0, for a split with no token)."""
    seq = tl.program_id(0)
    context = tl.load(context_lens_ptr + seq)
    rows = tl.arange(0, BLOCK_M)
    if DECODE:  # rows: the query heads of KV head program_id(1); a split of the context
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        split_len = tl.cdiv(tl.cdiv(context, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = split * split_len
        end = tl.minimum(start + split_len, context)
        tokens = seq + rows * 0
        heads = kv_head * GROUP + rows
        row_mask = rows < GROUP
    else:  # rows: tile program_id(2) of the new tokens, for query head program_id(1)
        head = tl.program_id(1)
        q_tile = tl.program_id(2)
        kv_head = head // GROUP
        split = 0
        q_start = tl.load(cu_seqlens_ptr + seq)
        num_new = tl.load(cu_seqlens_ptr + seq + 1) - q_start
        new_rows = q_tile * BLOCK_M + rows
        tokens = q_start + new_rows
        heads = head + rows * 0
        row_mask = new_rows < num_new
        q_positions = context - num_new + new_rows
        start = 0
        last_visible = tl.minimum(context, context - num_new + (q_tile + 1) * BLOCK_M)
        end = tl.where(q_tile * BLOCK_M < num_new, last_visible, 0)
    lanes = tl.arange(0, BLOCK_D // 2)  # lane j: channel j, and HEAD_DIM / 2 + j
    lane_mask = lanes < HEAD_DIM // 2
    row_lanes = row_mask[:, None] & lane_mask[None, :]
    q_at = q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + lanes[None, :]
    q_first, q_second = _halves(q_at, row_lanes, 0.0, HEAD_DIM)
    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc_first = tl.zeros([BLOCK_M, BLOCK_D // 2], tl.float32)
    acc_second = tl.zeros([BLOCK_M, BLOCK_D // 2], tl.float32)
    if FOLD_SCALES:  # four quarters (_code_quarters), the query scaled to suit CODE_DTYPE
        q_row = q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh
        q_fe, q_fo, q_se, q_so, q_unit, q_sum = _query_quarters(
            q_row, row_mask, HEAD_DIM, BLOCK_D, CODE_DTYPE
        )
        acc_fe = tl.zeros([BLOCK_M, BLOCK_D // 4], tl.float32)
        acc_fo = tl.zeros([BLOCK_M, BLOCK_D // 4], tl.float32)
        acc_se = tl.zeros([BLOCK_M, BLOCK_D // 4], tl.float32)
        acc_so = tl.zeros([BLOCK_M, BLOCK_D // 4], tl.float32)
        zero_sum = tl.zeros([BLOCK_M], tl.float32)  # Σ p z: the same for every channel
        top = tl.max(zero_sum, 0) + 1e-30  # a scalar: the largest value scale so far, the
        # unit of acc_fe .. acc_so (weights over it lie in [0, 1], as probabilities do)
    table_ptr = block_tables_ptr + seq * stride_table
    for tile in range(start, end, BLOCK_N):
        positions = tile + tl.arange(0, BLOCK_N)
        pos_mask = positions < end
        blocks = tl.load(table_ptr + positions // BLOCK_SIZE, mask=pos_mask, other=0).to(tl.int64)
        slots = positions % BLOCK_SIZE
        rows_at = blocks * stride_block + slots * stride_slot + kv_head * stride_head
        scales_at = blocks * scale_block + slots * scale_slot + kv_head * scale_head
        k_scales_at = blocks * k_scale_block + slots * k_scale_slot + kv_head * k_scale_head
        kv_mask = pos_mask[:, None] & lane_mask[None, :]
        if KEYS_PER_CHANNEL:  # a partial block's keys are in the residual, as values
            held = tl.load(residual_slot_ptr + blocks, mask=pos_mask, other=-1).to(tl.int64)
            in_residual = (held >= 0)[:, None]
            residual_at = held * residual_block + slots * residual_slot + kv_head * residual_head
            residual_first, residual_second = _halves(
                residual_ptr + residual_at[:, None] + lanes[None, :],
                kv_mask & in_residual,
                0.0,
                HEAD_DIM,
            )
        if FOLD_KEYS:  # one block a tile: codes at a unit scale; the block's scales fold into q
            codes_first, codes_second = load_dequantized(
                k_ptr,
                unit_ptr,
                unit_ptr + 1,
                rows_at,
                positions * 0,
                lanes,
                kv_mask & (held < 0)[:, None],
                BITS,
                False,
                HEAD_DIM,
            )
            block = tl.load(table_ptr + tile // BLOCK_SIZE).to(tl.int64)
            channels_at = block * k_scale_block + kv_head * k_scale_head + lanes
            scaled = lane_mask & (lanes * 0 + tl.max(held, 0) < 0)  # residual: scale 1, zero 0
            s_first, s_second = _halves(k_scale_ptr + channels_at, scaled, 1.0, HEAD_DIM)
            z_first, z_second = _halves(k_zero_ptr + channels_at, scaled, 0.0, HEAD_DIM)
            scores = _dot_halves(
                (q_first.to(tl.float32) * s_first[None, :]).to(q_first.dtype),
                (q_second.to(tl.float32) * s_second[None, :]).to(q_first.dtype),
                tl.trans((codes_first + residual_first).to(q_first.dtype)),
                tl.trans((codes_second + residual_second).to(q_first.dtype)),
                PRECISION,
            )
            q_zero = q_first.to(tl.float32) * z_first[None, :]
            scores += tl.sum(q_zero + q_second.to(tl.float32) * z_second[None, :], 1)[:, None]
        elif FOLD_SCALES and not KEYS_PER_CHANNEL:  # per token: s (q · c) + z Σq
            k_fe, k_fo, k_se, k_so = _code_quarters(
                k_ptr, rows_at, pos_mask, BITS, HEAD_DIM, BLOCK_D, CODE_DTYPE
            )
            k_scale = tl.load(k_scale_ptr + k_scales_at, mask=pos_mask, other=0.0).to(tl.float32)
            k_zero = tl.load(k_zero_ptr + k_scales_at, mask=pos_mask, other=0.0).to(tl.float32)
            scores = tl.dot(q_fe, tl.trans(k_fe), input_precision=PRECISION)
            scores = tl.dot(q_fo, tl.trans(k_fo), scores, input_precision=PRECISION)
            scores = tl.dot(q_se, tl.trans(k_se), scores, input_precision=PRECISION)
            scores = tl.dot(q_so, tl.trans(k_so), scores, input_precision=PRECISION)
            scores = scores * q_unit[:, None] * k_scale[None, :] + q_sum[:, None] * k_zero[None, :]
        else:
            k_first, k_second = _load_rows(
                k_ptr,
                k_scale_ptr,
                k_zero_ptr,
                rows_at,
                k_scales_at,
                lanes,
                kv_mask,
                BITS,
                KEYS_PER_CHANNEL,
                HEAD_DIM,
            )
            if KEYS_PER_CHANNEL:
                k_first = tl.where(in_residual, residual_first, k_first)
                k_second = tl.where(in_residual, residual_second, k_second)
            scores = _dot_halves(
                q_first,
                q_second,
                tl.trans(k_first.to(q_first.dtype)),
                tl.trans(k_second.to(q_first.dtype)),
                PRECISION,
            )
        scores = scores * scale
        if DECODE:  # every cached token of the split precedes the one new token
            visible = pos_mask[None, :]
        else:  # causal: a new token sees the context up to its own position
            visible = pos_mask[None, :] & (positions[None, :] <= q_positions[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        correction = tl.exp(running_max - new_max)
        probs = tl.exp(scores - new_max[:, None])
        running_sum = running_sum * correction + tl.sum(probs, 1)
        if FOLD_SCALES:  # per token: Σ p (c s + z) = (p ∘ s) · c + Σ p z
            v_scale = tl.load(v_scale_ptr + scales_at, mask=pos_mask, other=0.0).to(tl.float32)
            v_zero = tl.load(v_zero_ptr + scales_at, mask=pos_mask, other=0.0).to(tl.float32)
            zero_sum = zero_sum * correction + tl.sum(probs * v_zero[None, :], 1)
            new_top = tl.maximum(top, tl.max(v_scale, 0))
            weights = (probs * (v_scale * (1.0 / new_top))[None, :]).to(CODE_DTYPE)
            rescale = (correction * (top / new_top))[:, None]
            top = new_top
            v_fe, v_fo, v_se, v_so = _code_quarters(
                v_ptr, rows_at, pos_mask, BITS, HEAD_DIM, BLOCK_D, CODE_DTYPE
            )
            acc_fe = tl.dot(weights, v_fe, acc_fe * rescale, input_precision=PRECISION)
            acc_fo = tl.dot(weights, v_fo, acc_fo * rescale, input_precision=PRECISION)
            acc_se = tl.dot(weights, v_se, acc_se * rescale, input_precision=PRECISION)
            acc_so = tl.dot(weights, v_so, acc_so * rescale, input_precision=PRECISION)
        else:
            v_first, v_second = _load_rows(
                v_ptr,
                v_scale_ptr,
                v_zero_ptr,
                rows_at,
                scales_at,
                lanes,
                kv_mask,
                BITS,
                False,
                HEAD_DIM,
            )
            probs = probs.to(q_first.dtype)
            acc_first = tl.dot(
                probs,
                v_first.to(q_first.dtype),
                acc_first * correction[:, None],
                input_precision=PRECISION,
            )
            acc_second = tl.dot(
                probs,
                v_second.to(q_first.dtype),
                acc_second * correction[:, None],
                input_precision=PRECISION,
            )
        running_max = new_max

    if FOLD_SCALES:  # the quarters back in channel order: even and odd channels alternate
        acc_first = tl.interleave(acc_fe, acc_fo) * top + zero_sum[:, None]
        acc_second = tl.interleave(acc_se, acc_so) * top + zero_sum[:, None]
    has_tokens = running_sum > 0
    safe_sum = tl.where(has_tokens, running_sum, 1.0)
    out_at = (
        out_ptr
        + tokens[:, None] * stride_ot
        + heads[:, None] * stride_oh
        + split * stride_os
        + lanes[None, :]
    )
    out_type = out_ptr.dtype.element_ty
    out_first = tl.where(has_tokens[:, None], acc_first / safe_sum[:, None], 0.0)
    out_second = tl.where(has_tokens[:, None], acc_second / safe_sum[:, None], 0.0)
    tl.store(out_at, out_first.to(out_type), mask=row_lanes)
    tl.store(out_at + HEAD_DIM // 2, out_second.to(out_type), mask=row_lanes)
    if DECODE:
        lse = tl.where(has_tokens, running_max + tl.log(safe_sum), float("-inf"))
        tl.store(lse_ptr + seq * stride_lse_t + heads * stride_lse_h + split, lse, mask=row_mask)


@triton.jit
def _query_quarters(q_row, row_mask, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CODE_DTYPE):
    """The query's four quarters as ``_code_quarters`` lays out a tile's codes, in
    ``CODE_DTYPE``; a 16-bit one is the query over ``unit``, a power of two a row that keeps it
    below float16's largest value (a bfloat16 query may lie above it; the scores are multiplied
    back); and ``Σq``, each row's sum, in float32."""
    lanes = tl.arange(0, BLOCK_D // 4)
    mask = row_mask[:, None] & (lanes < HEAD_DIM // 4)[None, :]
    at = q_row + 2 * lanes[None, :]
    fe = tl.load(at, mask=mask, other=0.0).to(tl.float32)
    fo = tl.load(at + 1, mask=mask, other=0.0).to(tl.float32)
    se = tl.load(at + HEAD_DIM // 2, mask=mask, other=0.0).to(tl.float32)
    so = tl.load(at + HEAD_DIM // 2 + 1, mask=mask, other=0.0).to(tl.float32)
    largest = tl.max(
        tl.maximum(tl.maximum(tl.abs(fe), tl.abs(fo)), tl.maximum(tl.abs(se), tl.abs(so))), 1
    )
    if tl.float32 == CODE_DTYPE:
        unit = largest * 0.0 + 1.0
    else:
        unit = tl.exp2(tl.ceil(tl.log2(tl.maximum(largest, 65504.0) / 65504.0)))
    per_unit = (1.0 / unit)[:, None]
    return (
        (fe * per_unit).to(CODE_DTYPE),
        (fo * per_unit).to(CODE_DTYPE),
        (se * per_unit).to(CODE_DTYPE),
        (so * per_unit).to(CODE_DTYPE),
        unit,
        tl.sum(fe + fo + se + so, 1),
    )


@triton.jit
def _code_quarters(
    codes_ptr,
    rows_at,
    tokens,
    BITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CODE_DTYPE: tl.constexpr,
):
    """A tile's codes, unscaled, as four ``[BLOCK_N, BLOCK_D / 4]`` quarters of ``CODE_DTYPE``:
    lane ``p`` holds channel ``2p`` (``fe``), ``2p + 1`` (``fo``), ``HEAD_DIM/2 + 2p`` (``se``)
    and ``HEAD_DIM/2 + 2p + 1`` (``so``), 0 for a token outside ``tokens`` or a lane past
    ``HEAD_DIM/4``. The codes are read as 16-bit words, two neighbouring bytes each (INT8: two
    channels of a half; INT4: four channels, part 3.2's order), so that a tile of values goes
    into the weighted sum as the tensor cores take it, tokens paired in a register, with no
    byte gathered alone (an sm_90's ``ldmatrix`` transposes 16-bit elements, not bytes)."""
    lanes = tl.arange(0, BLOCK_D // 4)
    mask = tokens[:, None] & (lanes < HEAD_DIM // 4)[None, :]
    at = codes_ptr.to(tl.pointer_type(tl.uint16)) + (rows_at // 2)[:, None] + lanes[None, :]
    words = tl.load(at, mask=mask, other=0)
    if BITS == 8:
        fe, fo = _split_bytes(words, CODE_DTYPE)
        se, so = _split_bytes(tl.load(at + HEAD_DIM // 4, mask=mask, other=0), CODE_DTYPE)
        return fe, fo, se, so
    return _split_nibbles(words, CODE_DTYPE)


@triton.jit
def _split_bytes(words, CODE_DTYPE: tl.constexpr):
    """The low and high bytes of 16-bit words, as numbers of ``CODE_DTYPE``. On a GPU in
    float16, two words at a time: ``prmt`` puts two bytes under float16's exponent of 1,024
    (the bits ``0x64XX`` are 1,024 + ``XX``), and one subtraction takes 1,024 off both: four
    instructions for four codes, where converting a code takes one or two. The trick is
    FasterTransformer's and Marlin's (Kim et al., "Who Says Elephants Can't Run", SustaiNLP
    2022, https://aclanthology.org/2022.sustainlp-1.6)."""
    if INTERPRETED or tl.float32 == CODE_DTYPE:
        return (words & 0xFF).to(CODE_DTYPE), (words >> 8).to(CODE_DTYPE)
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 t, offset;
        mov.b32 offset, 0x64006400;
        prmt.b32 t, $2, 0x64646464, 0x4240;
        sub.f16x2 $0, t, offset;
        prmt.b32 t, $2, 0x64646464, 0x4341;
        sub.f16x2 $1, t, offset;
        }""",
        "=r,=r,r",
        [words],
        dtype=(tl.float16, tl.float16),
        is_pure=True,
        pack=2,
    )


@triton.jit
def _split_nibbles(words, CODE_DTYPE: tl.constexpr):
    """The four nibbles of 16-bit words of INT4 codes packed by halves, as numbers of
    ``CODE_DTYPE``: bits 0-3 (channel ``2p`` of the first half), 8-11 (``2p + 1``), 4-7 and
    12-15 (the same channels of the second half). On a GPU as ``_split_bytes``: a byte under
    float16's 1,024, a mask a nibble (1,024 + low, or 1,024 + 16 · high, which one fused
    multiply-add brings back)."""
    if INTERPRETED or tl.float32 == CODE_DTYPE:
        return (
            (words & 0xF).to(CODE_DTYPE),
            ((words >> 8) & 0xF).to(CODE_DTYPE),
            ((words >> 4) & 0xF).to(CODE_DTYPE),
            (words >> 12).to(CODE_DTYPE),
        )
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 t, n, offset, sixteenth, back;
        mov.b32 offset, 0x64006400;
        mov.b32 sixteenth, 0x2C002C00;
        mov.b32 back, 0xD400D400;
        prmt.b32 t, $4, 0x64646464, 0x4240;
        and.b32 n, t, 0xFF0FFF0F;
        sub.f16x2 $0, n, offset;
        and.b32 n, t, 0xFFF0FFF0;
        fma.rn.f16x2 $2, n, sixteenth, back;
        prmt.b32 t, $4, 0x64646464, 0x4341;
        and.b32 n, t, 0xFF0FFF0F;
        sub.f16x2 $1, n, offset;
        and.b32 n, t, 0xFFF0FFF0;
        fma.rn.f16x2 $3, n, sixteenth, back;
        }""",
        "=r,=r,=r,=r,r",
        [words],
        dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
        is_pure=True,
        pack=2,
    )


@triton.jit
def _halves(at, mask, other, HEAD_DIM: tl.constexpr):
    """The two halves of rows whose first halves' elements are at ``at``: channels ``j`` and
    ``HEAD_DIM / 2 + j`` at lane ``j`` (``other`` where ``mask`` is false)."""
    first = tl.load(at, mask=mask, other=other)
    second = tl.load(at + HEAD_DIM // 2, mask=mask, other=other)
    return first, second


@triton.jit
def _dot_halves(a_first, a_second, b_first, b_second, PRECISION: tl.constexpr):
    """``a · b`` over a head's channels, from their two halves: two half-width dots."""
    partial = tl.dot(a_first, b_first, input_precision=PRECISION)
    return tl.dot(a_second, b_second, partial, input_precision=PRECISION)


@triton.jit
def _load_rows(
    cache_ptr,
    scale_ptr,
    zero_ptr,
    rows_at,
    scales_at,
    lanes,
    mask,
    BITS: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """Cached rows ``[tokens, dims]`` as their two halves: as stored (``BITS`` 16), or
    dequantized in registers by ``triton_quantized.load_dequantized`` (8 or 4 bits; part 3.8)."""
    if BITS == 16:  # UNQUANTIZED
        first, second = _halves(cache_ptr + rows_at[:, None] + lanes[None, :], mask, 0.0, HEAD_DIM)
    else:
        first, second = load_dequantized(
            cache_ptr,
            scale_ptr,
            zero_ptr,
            rows_at,
            scales_at,
            lanes,
            mask,
            BITS,
            PER_CHANNEL,
            HEAD_DIM,
        )
    return first, second


@triton.jit
def _decode_merge_kernel(
    mid_out_ptr,
    mid_lse_ptr,
    out_ptr,
    stride_mid_b,
    stride_mid_h,
    stride_mid_s,
    stride_lse_b,
    stride_lse_h,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    split_mask = splits < NUM_SPLITS
    lse = tl.load(
        mid_lse_ptr + seq * stride_lse_b + head * stride_lse_h + splits,
        mask=split_mask,
        other=float("-inf"),
    )
    # a split with no token (-inf) weighs 0; with none at all (a padded row) the output is 0
    top = tl.max(lse, 0)
    weights = tl.exp(lse - tl.where(top > float("-inf"), top, 0.0))
    weights = weights / tl.maximum(tl.sum(weights, 0), 1e-30)
    partial = tl.load(
        mid_out_ptr
        + seq * stride_mid_b
        + head * stride_mid_h
        + splits[:, None] * stride_mid_s
        + dims[None, :],
        mask=split_mask[:, None] & (dims[None, :] < HEAD_DIM),
        other=0.0,
    )
    out = tl.sum(weights[:, None] * partial, 0)
    tl.store(
        out_ptr + seq * stride_ob + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


def _cache_args(
    k_cache: torch.Tensor | QuantizedCache, v_cache: torch.Tensor | QuantizedCache
) -> tuple[list[torch.Tensor], list[int], int, bool]:
    """The kernels' cache arguments: the K and V tensors (values, or codes), the scales and zeros
    of K and V, the key residual and its slot of each block (unused ones: the K tensor again,
    never read); the strides of a block, a slot and a head in the codes, in the values' scales,
    in the keys' scales (a slot stride of 0 for keys per channel: one scale row per block) and in
    the residual; the bits (``UNQUANTIZED``: 16); whether keys are per channel."""
    if not isinstance(k_cache, QuantizedCache):
        return (
            [k_cache, v_cache] + [k_cache] * 6,
            [*k_cache.stride()[:3]] + [0] * 9,
            UNQUANTIZED,
            False,
        )
    pointers = [
        k_cache.codes,
        v_cache.codes,
        k_cache.scale,
        k_cache.zero,
        v_cache.scale,
        v_cache.zero,
    ]
    strides = [*k_cache.codes.stride()[:3], *_scale_strides(v_cache), *_scale_strides(k_cache)]
    if not k_cache.per_channel:
        pointers += [k_cache.codes] * 2
        return pointers, [*strides, 0, 0, 0], k_cache.bits, False
    pointers += [k_cache.residual, k_cache.residual_slot]
    return pointers, [*strides, *k_cache.residual.stride()[:3]], k_cache.bits, True


def _scale_strides(cache: QuantizedCache) -> list[int]:
    """The strides of a block, a slot and a KV head in ``cache``'s scales; 0 along a dimension
    of size 1 (keys per channel: one row per block; a group of all heads: one per token)."""
    return [
        stride if size > 1 else 0
        for size, stride in zip(cache.scale.shape[:3], cache.scale.stride()[:3], strict=True)
    ]


def _check_layout(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """The GQA group size; ``ValueError`` unless heads group and layouts suit the kernels."""
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
    if query.stride(-1) != 1 or k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("query and caches must be contiguous in head_dim, caches alike")
    if query.shape[-1] % 2:
        raise ValueError(
            f"the kernels split head_dim in halves: it must be even, got {query.shape[-1]}"
        )
    return num_heads // num_kv_heads


def _block_d(head_dim: int) -> int:
    """``BLOCK_D``: ``head_dim`` rounded up to a power of two, halves wide enough for a dot."""
    return max(2 * MIN_DOT, triton.next_power_of_2(head_dim))


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
    fold_keys: bool = False,
    fold_scales: bool = False,
) -> torch.Tensor:
    """See ``reference.paged_decode_attention``; ``num_splits`` splits each context (split-K;
    by default one per 512 tokens the block tables can reach, at most 16). ``block_n`` (tokens
    a tile), ``num_warps`` and ``num_stages`` (Triton's: warps a program, loads in flight) tune
    the launch on a GPU (``benchmarks/bench_decode_kernel.py --sweep``), and so does
    ``fold_keys`` and ``fold_scales`` (see ``_launch``: keys per channel read per lane, or
    folded into the query; per-token scales applied to every value, or to scores and weights).
    ``ValueError`` for a tensor on another device than the query (``check_devices``)."""
    check_devices(
        "query",
        query,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables,
        context_lens=context_lens,
    )
    batch, num_heads, head_dim = query.shape
    if num_splits is None:  # from the table's reach, known on the host: no wait for the GPU,
        # and fixed for a captured graph (its tables are max_model_len wide)
        reach = block_tables.shape[1] * k_cache.shape[1]
        num_splits = max(1, min(16, triton.cdiv(reach, 512)))
    block_d = _block_d(head_dim)
    mid_out = torch.empty(
        batch, num_heads, num_splits, block_d, dtype=torch.float32, device=query.device
    )
    mid_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=query.device)
    # no cu_seqlens (context_lens stands in, never read): a decode's one new token is its last
    _launch(
        query,
        k_cache,
        v_cache,
        context_lens,
        block_tables,
        context_lens,
        scale,
        block_n,
        outputs=(mid_out, mid_lse, *mid_out.stride()[:3], *mid_lse.stride()[:2]),
        rows=None,
        longest=1,
        num_splits=num_splits,
        fold_keys=fold_keys,
        fold_scales=fold_scales,
        tuning={"num_warps": num_warps, "num_stages": num_stages},
    )
    out = torch.empty_like(query)
    _decode_merge_kernel[(batch, num_heads)](
        mid_out,
        mid_lse,
        out,
        *mid_out.stride()[:3],
        *mid_lse.stride()[:2],
        *out.stride()[:2],
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        NUM_SPLITS=num_splits,
        BLOCK_S=triton.next_power_of_2(num_splits),
    )
    return out


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    block_m: int = 16,
    block_n: int = 64,
    fold_keys: bool = False,
    fold_scales: bool = False,
) -> torch.Tensor:
    """See ``reference.paged_prefill_attention``. The grid has a program per tile of
    ``block_m`` new tokens of the longest sequence: ``max_query_len`` where the caller knows it
    on the host (the engine does), else read from ``cu_seqlens_q`` (a wait for the GPU).
    ``block_n``, ``fold_keys`` and ``fold_scales`` as for decode.
    ``ValueError`` for a tensor on another device than the query (``check_devices``)."""
    check_devices(
        "query",
        query,
        k_cache=k_cache,
        v_cache=v_cache,
        cu_seqlens_q=cu_seqlens_q,
        block_tables=block_tables,
        context_lens=context_lens,
    )
    if max_query_len is None:
        max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    out = torch.empty_like(query)
    # one split, normalized in place: no log-sum-exp (out stands in, never written)
    _launch(
        query,
        k_cache,
        v_cache,
        cu_seqlens_q,
        block_tables,
        context_lens,
        scale,
        block_n,
        outputs=(out, out, *out.stride()[:2], 0, 0, 0),
        rows=max(MIN_DOT, block_m),
        longest=max_query_len,
        num_splits=1,
        fold_keys=fold_keys,
        fold_scales=fold_scales,
        tuning={},
    )
    return out


def _launch(
    query: torch.Tensor,
    k_cache: torch.Tensor | QuantizedCache,
    v_cache: torch.Tensor | QuantizedCache,
    cu_seqlens: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    block_n: int,
    outputs: tuple,
    rows: int | None,
    longest: int,
    num_splits: int,
    fold_keys: bool,
    fold_scales: bool,
    tuning: dict[str, int],
) -> None:
    """Run ``_attention_kernel`` for decode (``rows`` None: a program per (sequence, KV head,
    split), its rows the KV head's query heads) or prefill (a program per (sequence, query head,
    tile of ``rows`` new tokens), as many tiles as the ``longest`` sequence's new tokens fill).
    ``outputs``: the output and log-sum-exp tensors and their strides, as the kernel takes them;
    ``tuning``: Triton's launch options (warps, stages).

    ``fold_keys``: keys per channel in blocks of a multiple of 16 tokens may fold a block's
    scales into the query, a tile a block (``FOLD_KEYS``); else (the default) each lane loads
    its channel's scale and zero, in tiles of ``block_n`` across blocks, as blocks of any size
    can. Folding reads fewer bytes through the caches, but a tile of one 16-token block pays a
    tile's softmax and a rescaled query for 16 tokens: by the SASS (``compile_for_gpu.py
    --anatomy``, ``head_dim`` 128) it issues 206 warp instructions a cached token (INT8; INT4
    223) against 93 (103) per lane, 116 (125) at 32-token blocks and as many at 64. The GPU
    sweep times both.

    ``fold_scales``: a quantized cache's per-token scales and zeros (keys per channel: the
    values') applied to the tile's scores and weights rather than to each value (the module
    docstring), where ``head_dim`` is a multiple of 4 and its quarters fill a dot (``BLOCK_D /
    4`` of at least 16 lanes); elsewhere the tile is dequantized value by value."""
    caches, cache_strides, bits, keys_per_channel = _cache_args(k_cache, v_cache)
    block_size = caches[0].shape[1]
    block_n = max(MIN_DOT, block_n)
    fold_keys = fold_keys and keys_per_channel and block_size % MIN_DOT == 0
    unit = query  # the unit scale and zero of folded keys' codes (else never read)
    if fold_keys:  # a tile inside a block: the largest power of two up to block_n dividing it
        block_n = math.gcd(block_size, block_n)
        unit = torch.zeros(2, dtype=torch.float32, device=query.device)
        unit[0] = 1.0
    num_seqs, num_heads, head_dim = len(context_lens), query.shape[1], query.shape[2]
    fold_scales = fold_scales and bits != UNQUANTIZED and head_dim % 4 == 0
    fold_scales = fold_scales and _block_d(head_dim) >= 4 * MIN_DOT
    group = _check_layout(query, caches[0], caches[1])
    if rows is None:
        grid, block_m = (num_seqs, num_heads // group, num_splits), triton.next_power_of_2(group)
    else:
        grid, block_m = (num_seqs, num_heads, triton.cdiv(longest, rows)), rows
    _attention_kernel[grid](
        query,
        *caches,
        unit,
        cu_seqlens,
        block_tables,
        context_lens,
        *outputs[:2],
        scale,
        *query.stride()[:2],
        *outputs[2:],
        block_tables.stride(0),
        *cache_strides,
        DECODE=rows is None,
        GROUP=group,
        BLOCK_M=max(MIN_DOT, block_m),
        HEAD_DIM=head_dim,
        BLOCK_D=_block_d(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        BITS=bits,
        KEYS_PER_CHANNEL=keys_per_channel,
        FOLD_KEYS=fold_keys,
        FOLD_SCALES=fold_scales,
        CODE_DTYPE=tl.float32 if query.dtype == torch.float32 else tl.float16,
        # fp32 dots in IEEE precision: TF32 would lose bits that the float32 tests see
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        **tuning,
    )
