"""Triton kernels for the paged KV cache, with the signatures of ``reference.py``.

- ``store_kvcache``: one program per token writes its K and V rows into their slots.
- ``paged_prefill_attention``: one program per (sequence, query head, tile of ``BLOCK_M`` new
  tokens) walks the cached context through the block table with an online softmax, masking the
  positions after each token (causal); the context before the new tokens is visible to all.
- ``paged_decode_attention``: flash-decoding in two stages. Stage 1 runs one program per
  (sequence, KV head, split of the context): the query heads that share the KV head (GQA) are
  packed into the rows of one ``tl.dot`` (padded to 16, the GPU's minimum), KV tokens are
  gathered through the block table in tiles of ``BLOCK_N``, and an online softmax keeps a running
  maximum, sum and output. It writes each split's output and log-sum-exp. Stage 2 merges the
  splits of each (sequence, head) with log-sum-exp weights.

A quantized cache (``QuantizedCache``, Phase 3) goes through the same kernels: storing
quantizes each (token, KV head) row in its program (minimum, scale, codes; INT4 packs code
``2i`` in the low nibble of byte ``i``), and the attention tiles load codes, scales and zeros and
dequantize them in registers before the dot products (``_load_rows`` calls
``triton_quantized.load_dequantized``, part 3.8), so a quantized block is read as bytes, never
expanded in memory. Keys per channel: storing sends keys to the residual
and quantizes the blocks a step fills with ``quantized.store_keys_per_channel`` (torch; a few
blocks a step, shared with the reference); the tiles read a scale per (block, head, channel)
and a partial block's keys from the residual.

On a CPU the kernels run under the Triton interpreter (``TRITON_INTERPRET=1``, fp32 and fp16;
bf16 is broken there). Tile sizes respect the GPU's minimum ``tl.dot`` shapes (16), so what
passes on the CPU also compiles for an H200; fp32 dots use IEEE precision, not TF32.

The kernels read every tensor through a raw pointer, so the wrappers first check that all of
them are on one device (``_check_devices``): a tensor elsewhere is a ``ValueError`` naming it,
not a crash or garbage.
"""

import torch
import triton
import triton.language as tl

from vkv.engine.cache_engine import QuantizedCache
from vkv.kernels.quantized import store_keys_per_channel
from vkv.kernels.reference import refuse_non_finite
from vkv.kernels.triton_quantized import load_dequantized

MIN_DOT = 16
UNQUANTIZED = 16  # the kernels' BITS for a cache of values
PLANES = ("codes", "scale", "zero", "residual", "residual_slot")  # a QuantizedCache's tensors


@triton.jit
def _store_kvcache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    key_stride,
    value_stride,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    mask = (offsets < ROW) & (offsets * 0 + slot >= 0)
    target = tl.maximum(slot, 0) * ROW + offsets
    k = tl.load(key_ptr + token * key_stride + offsets, mask=mask)
    v = tl.load(value_ptr + token * value_stride + offsets, mask=mask)
    tl.store(k_cache_ptr + target, k, mask=mask)
    tl.store(v_cache_ptr + target, v, mask=mask)


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ``[tokens, kv_heads, head_dim]`` into their slots (-1: skip);
    a ``QuantizedCache`` gets each (token, head) row quantized on the fly. ``ValueError`` for an
    argument on another device than ``key`` (``_check_devices``: "value is on cpu, the key on
    cuda:0")."""
    _check_devices(
        "key", key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping
    )
    num_tokens, num_kv_heads, head_dim = key.shape
    row = num_kv_heads * head_dim
    if key.stride(-1) != 1 or key.stride(1) != head_dim or value.stride(1) != head_dim:
        raise ValueError("key and value must be contiguous in their last two dimensions")
    if isinstance(k_cache, QuantizedCache):
        refuse_non_finite(key, value)  # before any write
        pairs = [(key, k_cache), (value, v_cache)]
        if k_cache.per_channel:
            store_keys_per_channel(key, k_cache)
            pairs = pairs[1:]
        for rows, cache in pairs:
            groups = cache.scale.shape[2]  # per KV head, or one group for all of a token's
            codes = cache.codes.view(*cache.codes.shape[:2], groups, -1)
            rows = rows.view(num_tokens, groups, -1)
            width = row // groups
            _store_quantized_kernel[(num_tokens, groups)](
                rows,
                codes,
                cache.scale,
                cache.zero,
                slot_mapping,
                rows.stride(0),
                rows.stride(1),
                codes.stride(1),
                codes.stride(2),
                cache.scale.stride(1),
                cache.scale.stride(2),
                HEAD_DIM=width,
                BLOCK_D=max(2, triton.next_power_of_2(width)),
                BITS=cache.bits,
            )
        return
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the caches must be contiguous")
    _store_kvcache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        value.stride(0),
        ROW=row,
        BLOCK=triton.next_power_of_2(row),
    )


@triton.jit
def _store_quantized_kernel(
    x_ptr,
    codes_ptr,
    scale_ptr,
    zero_ptr,
    slot_ptr,
    stride_x_token,
    stride_x_head,
    stride_code_slot,
    stride_code_head,
    stride_scale_slot,
    stride_scale_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BITS: tl.constexpr,
):
    """One (token, KV head) row: its minimum, scale and codes (``quantizer.py``'s formulas,
    halves rounded up rather than to even), written to the token's slot unless it is -1."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    given = tl.load(slot_ptr + token).to(tl.int64)
    slot = tl.maximum(given, 0)
    row_ptr = x_ptr + token * stride_x_token + head * stride_x_head
    dims = tl.arange(0, BLOCK_D)
    write = (dims * 0 + given) >= 0  # -1: padding, nothing written (as a vector mask)
    in_row = dims < HEAD_DIM
    x = tl.load(row_ptr + dims, mask=in_row, other=0.0).to(tl.float32)
    low = tl.min(tl.where(in_row, x, float("inf")), 0)
    high = tl.max(tl.where(in_row, x, float("-inf")), 0)
    levels = (1 << BITS) - 1
    step_size = (high - low) / levels
    step = tl.where(step_size > 0, step_size, 1.0)
    codes_at = codes_ptr + slot * stride_code_slot + head * stride_code_head
    if BITS == 8:
        codes = tl.minimum(tl.maximum(tl.floor((x - low) / step + 0.5), 0.0), levels)
        tl.store(codes_at + dims, codes.to(tl.uint8), mask=in_row & write)
    else:
        pairs = tl.arange(0, BLOCK_D // 2)
        in_pairs = pairs < HEAD_DIM // 2
        even = tl.load(row_ptr + 2 * pairs, mask=in_pairs, other=0.0).to(tl.float32)
        odd = tl.load(row_ptr + 2 * pairs + 1, mask=in_pairs, other=0.0).to(tl.float32)
        low_codes = tl.minimum(tl.maximum(tl.floor((even - low) / step + 0.5), 0.0), levels)
        high_codes = tl.minimum(tl.maximum(tl.floor((odd - low) / step + 0.5), 0.0), levels)
        packed = low_codes.to(tl.int32) | (high_codes.to(tl.int32) << 4)
        tl.store(codes_at + pairs, packed.to(tl.uint8), mask=in_pairs & ((pairs * 0 + given) >= 0))
    first = dims < 1  # the scale and the zero, stored through the row's first lane
    scales_at = scale_ptr + slot * stride_scale_slot + head * stride_scale_head + dims
    zeros_at = zero_ptr + slot * stride_scale_slot + head * stride_scale_head + dims
    tl.store(scales_at, (x * 0 + step_size).to(scale_ptr.dtype.element_ty), mask=first & write)
    tl.store(zeros_at, (x * 0 + low).to(zero_ptr.dtype.element_ty), mask=first & write)


@triton.jit
def _attend_tile(
    q,
    k_ptr,
    v_ptr,
    k_scale_ptr,
    k_zero_ptr,
    v_scale_ptr,
    v_zero_ptr,
    residual_ptr,
    residual_slot_ptr,
    table_ptr,
    positions,
    pos_mask,
    visible,
    dims,
    dim_mask,
    kv_head,
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
    running_max,
    running_sum,
    acc,
    scale,
    BLOCK_SIZE: tl.constexpr,
    BITS: tl.constexpr,
    KEYS_PER_CHANNEL: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One tile of cached tokens for the query rows ``q``: gather K and V through the block
    table (dequantizing them if ``BITS`` is 8 or 4), score the ``visible`` pairs, fold them into
    the online softmax. Codes and their scales have strides of their own (``_cache_args``);
    keys per channel have a scale per (block, head, channel), and a partial block's keys are
    read from the residual."""
    blocks = tl.load(table_ptr + positions // BLOCK_SIZE, mask=pos_mask, other=0).to(tl.int64)
    slots = positions % BLOCK_SIZE
    rows_at = blocks * stride_block + slots * stride_slot + kv_head * stride_head
    scales_at = blocks * scale_block + slots * scale_slot + kv_head * scale_head
    k_scales_at = blocks * k_scale_block + slots * k_scale_slot + kv_head * k_scale_head
    kv_mask = pos_mask[:, None] & dim_mask[None, :]
    k = _load_rows(
        k_ptr, k_scale_ptr, k_zero_ptr, rows_at, k_scales_at, dims, kv_mask, BITS, KEYS_PER_CHANNEL
    )
    if KEYS_PER_CHANNEL:
        held = tl.load(residual_slot_ptr + blocks, mask=pos_mask, other=-1).to(tl.int64)
        in_residual = (held >= 0)[:, None]
        residual_at = held * residual_block + slots * residual_slot + kv_head * residual_head
        residual = tl.load(
            residual_ptr + residual_at[:, None] + dims[None, :],
            mask=kv_mask & in_residual,
            other=0.0,
        )
        k = tl.where(in_residual, residual.to(tl.float32), k)
    k = k.to(q.dtype)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    scores = tl.where(visible, scores, float("-inf"))
    new_max = tl.maximum(running_max, tl.max(scores, 1))
    correction = tl.exp(running_max - new_max)
    probs = tl.exp(scores - new_max[:, None])
    running_sum = running_sum * correction + tl.sum(probs, 1)
    v = _load_rows(v_ptr, v_scale_ptr, v_zero_ptr, rows_at, scales_at, dims, kv_mask, BITS, False)
    v = v.to(q.dtype)
    acc = acc * correction[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=PRECISION)
    return new_max, running_sum, acc


@triton.jit
def _load_rows(
    cache_ptr,
    scale_ptr,
    zero_ptr,
    rows_at,
    scales_at,
    dims,
    mask,
    BITS: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
):
    """Cached rows ``[tokens, dims]``: as stored (``BITS`` 16), or dequantized in registers by
    ``triton_quantized.load_dequantized`` (8 or 4 bits; part 3.8)."""
    if BITS == 16:  # UNQUANTIZED
        rows = tl.load(cache_ptr + rows_at[:, None] + dims[None, :], mask=mask, other=0.0)
    else:
        rows = load_dequantized(
            cache_ptr, scale_ptr, zero_ptr, rows_at, scales_at, dims, mask, BITS, PER_CHANNEL
        )
    return rows


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    k_scale_ptr,
    k_zero_ptr,
    v_scale_ptr,
    v_zero_ptr,
    residual_ptr,
    residual_slot_ptr,
    block_tables_ptr,
    context_lens_ptr,
    mid_out_ptr,
    mid_lse_ptr,
    scale,
    stride_qb,
    stride_qh,
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
    stride_mid_b,
    stride_mid_h,
    stride_mid_s,
    stride_lse_b,
    stride_lse_h,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BITS: tl.constexpr,
    KEYS_PER_CHANNEL: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context = tl.load(context_lens_ptr + seq)
    split_len = tl.cdiv(context, NUM_SPLITS)
    start = split * split_len
    end = tl.minimum(start + split_len, context)

    rows = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + rows
    row_mask = rows < GROUP
    dim_mask = dims < HEAD_DIM
    q = tl.load(
        q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    running_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    table_ptr = block_tables_ptr + seq * stride_table
    for tile in range(start, end, BLOCK_N):
        positions = tile + tl.arange(0, BLOCK_N)
        pos_mask = positions < end
        running_max, running_sum, acc = _attend_tile(
            q,
            k_ptr,
            v_ptr,
            k_scale_ptr,
            k_zero_ptr,
            v_scale_ptr,
            v_zero_ptr,
            residual_ptr,
            residual_slot_ptr,
            table_ptr,
            positions,
            pos_mask,
            pos_mask[None, :],
            dims,
            dim_mask,
            kv_head,
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
            running_max,
            running_sum,
            acc,
            scale,
            BLOCK_SIZE,
            BITS,
            KEYS_PER_CHANNEL,
            PRECISION,
        )

    has_tokens = running_sum > 0
    out = tl.where(has_tokens[:, None], acc / tl.where(has_tokens, running_sum, 1.0)[:, None], 0.0)
    lse = tl.where(
        has_tokens, running_max + tl.log(tl.where(has_tokens, running_sum, 1.0)), float("-inf")
    )
    tl.store(
        mid_out_ptr
        + seq * stride_mid_b
        + heads[:, None] * stride_mid_h
        + split * stride_mid_s
        + dims[None, :],
        out,
        mask=row_mask[:, None] & dim_mask[None, :],
    )
    tl.store(mid_lse_ptr + seq * stride_lse_b + heads * stride_lse_h + split, lse, mask=row_mask)


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
    weights = tl.exp(lse - tl.max(lse, 0))
    weights = weights / tl.sum(weights, 0)
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


def _check_devices(anchor: str, tensor: torch.Tensor, **arguments: object) -> None:
    """``ValueError`` naming the first of ``arguments`` (tensors, or ``QuantizedCache``s, whose
    ``PLANES`` count one by one) that is not on ``tensor``'s device, e.g. "block_tables is on
    cpu, the query on cuda:0" or "k_cache.scale is on cpu, the query on cuda:0". A device
    comparison per tensor: it runs on every call."""
    device = tensor.device
    for name, value in arguments.items():
        for plane in PLANES if isinstance(value, QuantizedCache) else (None,):
            part = value if plane is None else getattr(value, plane)
            if part is not None and part.device != device:
                label = name if plane is None else f"{name}.{plane}"
                raise ValueError(f"{label} is on {part.device}, the {anchor} on {device}")


def _check_layout(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """The GQA group size; ``ValueError`` unless heads group and layouts suit the kernels."""
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
    if query.stride(-1) != 1 or k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("query and caches must be contiguous in head_dim, caches alike")
    return num_heads // num_kv_heads


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    block_n: int = 64,
) -> torch.Tensor:
    """See ``reference.paged_decode_attention``; ``num_splits`` splits each context (split-K).
    ``ValueError`` for a tensor on another device than the query (``_check_devices``)."""
    _check_devices(
        "query",
        query,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables,
        context_lens=context_lens,
    )
    batch, num_heads, head_dim = query.shape
    caches, cache_strides, bits, keys_per_channel = _cache_args(k_cache, v_cache)
    _, block_size, num_kv_heads, _ = caches[0].shape
    group = _check_layout(query, caches[0], caches[1])
    if num_splits is None:
        num_splits = max(1, min(16, triton.cdiv(int(context_lens.max()), 512)))
    block_d = max(MIN_DOT, triton.next_power_of_2(head_dim))
    mid_out = torch.empty(
        batch, num_heads, num_splits, block_d, dtype=torch.float32, device=query.device
    )
    mid_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=query.device)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        query,
        *caches,
        block_tables,
        context_lens,
        mid_out,
        mid_lse,
        scale,
        query.stride(0),
        query.stride(1),
        block_tables.stride(0),
        *cache_strides,
        mid_out.stride(0),
        mid_out.stride(1),
        mid_out.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        GROUP=group,
        BLOCK_H=max(MIN_DOT, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        BLOCK_N=max(MIN_DOT, block_n),
        NUM_SPLITS=num_splits,
        BITS=bits,
        KEYS_PER_CHANNEL=keys_per_channel,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )
    out = torch.empty_like(query)
    _decode_merge_kernel[(batch, num_heads)](
        mid_out,
        mid_lse,
        out,
        mid_out.stride(0),
        mid_out.stride(1),
        mid_out.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        NUM_SPLITS=num_splits,
        BLOCK_S=triton.next_power_of_2(num_splits),
    )
    return out


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    k_scale_ptr,
    k_zero_ptr,
    v_scale_ptr,
    v_zero_ptr,
    residual_ptr,
    residual_slot_ptr,
    cu_seqlens_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
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
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BITS: tl.constexpr,
    KEYS_PER_CHANNEL: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_tile = tl.program_id(2)
    q_start = tl.load(cu_seqlens_ptr + seq)
    num_new = tl.load(cu_seqlens_ptr + seq + 1) - q_start
    context = tl.load(context_lens_ptr + seq)
    kv_head = head // GROUP

    rows = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_mask = rows < num_new
    dim_mask = dims < HEAD_DIM
    q_positions = context - num_new + rows
    q = tl.load(
        q_ptr + (q_start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    last_visible = tl.minimum(context, context - num_new + (q_tile + 1) * BLOCK_M)
    kv_end = tl.where(q_tile * BLOCK_M < num_new, last_visible, 0)
    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table_ptr = block_tables_ptr + seq * stride_table
    for tile in range(0, kv_end, BLOCK_N):
        positions = tile + tl.arange(0, BLOCK_N)
        pos_mask = positions < kv_end
        visible = pos_mask[None, :] & (positions[None, :] <= q_positions[:, None])
        running_max, running_sum, acc = _attend_tile(
            q,
            k_ptr,
            v_ptr,
            k_scale_ptr,
            k_zero_ptr,
            v_scale_ptr,
            v_zero_ptr,
            residual_ptr,
            residual_slot_ptr,
            table_ptr,
            positions,
            pos_mask,
            visible,
            dims,
            dim_mask,
            kv_head,
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
            running_max,
            running_sum,
            acc,
            scale,
            BLOCK_SIZE,
            BITS,
            KEYS_PER_CHANNEL,
            PRECISION,
        )

    out = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]
    tl.store(
        out_ptr + (q_start + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & dim_mask[None, :],
    )


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    block_m: int = 16,
    block_n: int = 64,
) -> torch.Tensor:
    """See ``reference.paged_prefill_attention``. ``ValueError`` for a tensor on another device
    than the query (``_check_devices``)."""
    _check_devices(
        "query",
        query,
        k_cache=k_cache,
        v_cache=v_cache,
        cu_seqlens_q=cu_seqlens_q,
        block_tables=block_tables,
        context_lens=context_lens,
    )
    _, num_heads, head_dim = query.shape
    caches, cache_strides, bits, keys_per_channel = _cache_args(k_cache, v_cache)
    block_size = caches[0].shape[1]
    group = _check_layout(query, caches[0], caches[1])
    num_seqs = len(context_lens)
    longest = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    block_m = max(MIN_DOT, block_m)
    out = torch.empty_like(query)
    _prefill_kernel[(num_seqs, num_heads, triton.cdiv(longest, block_m))](
        query,
        *caches,
        cu_seqlens_q,
        block_tables,
        context_lens,
        out,
        scale,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        *cache_strides,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=max(MIN_DOT, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=max(MIN_DOT, block_n),
        BITS=bits,
        KEYS_PER_CHANNEL=keys_per_channel,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )
    return out
