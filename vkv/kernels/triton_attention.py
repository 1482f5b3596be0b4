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

On a CPU the kernels run under the Triton interpreter (``TRITON_INTERPRET=1``, fp32 and fp16;
bf16 is broken there). Tile sizes respect the GPU's minimum ``tl.dot`` shapes (16), so what
passes on the CPU also compiles for an H200; fp32 dots use IEEE precision, not TF32.
"""

import torch
import triton
import triton.language as tl

MIN_DOT = 16


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
    """Write ``key``/``value`` ``[tokens, kv_heads, head_dim]`` into their slots (-1: skip)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    row = num_kv_heads * head_dim
    if key.stride(-1) != 1 or key.stride(1) != head_dim or value.stride(1) != head_dim:
        raise ValueError("key and value must be contiguous in their last two dimensions")
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
def _attend_tile(
    q,
    k_cache_ptr,
    v_cache_ptr,
    table_ptr,
    positions,
    pos_mask,
    visible,
    dims,
    dim_mask,
    head_offset,
    stride_cache_block,
    stride_cache_slot,
    running_max,
    running_sum,
    acc,
    scale,
    BLOCK_SIZE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One tile of cached tokens for the query rows ``q``: gather K and V through the block
    table, score the ``visible`` pairs, fold them into the online softmax."""
    blocks = tl.load(table_ptr + positions // BLOCK_SIZE, mask=pos_mask, other=0)
    rows_at = (
        blocks.to(tl.int64) * stride_cache_block
        + (positions % BLOCK_SIZE) * stride_cache_slot
        + head_offset
    )
    kv_mask = pos_mask[:, None] & dim_mask[None, :]
    k = tl.load(k_cache_ptr + rows_at[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    scores = tl.where(visible, scores, float("-inf"))
    new_max = tl.maximum(running_max, tl.max(scores, 1))
    correction = tl.exp(running_max - new_max)
    probs = tl.exp(scores - new_max[:, None])
    running_sum = running_sum * correction + tl.sum(probs, 1)
    v = tl.load(v_cache_ptr + rows_at[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    acc = acc * correction[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=PRECISION)
    return new_max, running_sum, acc


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    mid_out_ptr,
    mid_lse_ptr,
    scale,
    stride_qb,
    stride_qh,
    stride_table,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
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
            k_cache_ptr,
            v_cache_ptr,
            table_ptr,
            positions,
            pos_mask,
            pos_mask[None, :],
            dims,
            dim_mask,
            kv_head * stride_cache_head,
            stride_cache_block,
            stride_cache_slot,
            running_max,
            running_sum,
            acc,
            scale,
            BLOCK_SIZE,
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
    """See ``reference.paged_decode_attention``; ``num_splits`` splits each context (split-K)."""
    batch, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = _check_layout(query, k_cache, v_cache)
    if num_splits is None:
        num_splits = max(1, min(16, triton.cdiv(int(context_lens.max()), 512)))
    block_d = max(MIN_DOT, triton.next_power_of_2(head_dim))
    mid_out = torch.empty(
        batch, num_heads, num_splits, block_d, dtype=torch.float32, device=query.device
    )
    mid_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=query.device)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        query,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        mid_out,
        mid_lse,
        scale,
        query.stride(0),
        query.stride(1),
        block_tables.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
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
    k_cache_ptr,
    v_cache_ptr,
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
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
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
            k_cache_ptr,
            v_cache_ptr,
            table_ptr,
            positions,
            pos_mask,
            visible,
            dims,
            dim_mask,
            kv_head * stride_cache_head,
            stride_cache_block,
            stride_cache_slot,
            running_max,
            running_sum,
            acc,
            scale,
            BLOCK_SIZE,
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
    """See ``reference.paged_prefill_attention``."""
    _, num_heads, head_dim = query.shape
    block_size = k_cache.shape[1]
    group = _check_layout(query, k_cache, v_cache)
    num_seqs = len(context_lens)
    longest = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    block_m = max(MIN_DOT, block_m)
    out = torch.empty_like(query)
    _prefill_kernel[(num_seqs, num_heads, triton.cdiv(longest, block_m))](
        query,
        k_cache,
        v_cache,
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
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=max(MIN_DOT, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=max(MIN_DOT, block_n),
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )
    return out
