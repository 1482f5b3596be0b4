"""Plain-PyTorch paged KV-cache operations: the definitions the Triton kernels must match.

Layout (vLLM's and nano-vLLM's): each layer's cache is a pair of tensors
``[num_blocks, block_size, num_kv_heads, head_dim]``. Token slot ``s`` lives in block
``s // block_size`` at offset ``s % block_size``. A sequence's ``block_table`` lists its physical
blocks in logical order, padded with -1 to the batch's widest table.
"""

import torch


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into their slots.

    A slot of -1 (padding) is skipped.
    """
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache[slots // block_size, slots % block_size] = key[keep].to(k_cache.dtype)
    v_cache[slots // block_size, slots % block_size] = value[keep].to(v_cache.dtype)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The first ``num_tokens`` cached tokens of one sequence: ``[num_tokens, kv_heads, dim]``."""
    block_size = cache.shape[1]
    positions = torch.arange(num_tokens, device=cache.device)
    blocks = block_table[positions // block_size].long()
    return cache[blocks, positions % block_size]


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One new token per sequence attends to all of its cached tokens (its own included).

    ``query``: ``[batch, num_heads, head_dim]``; ``context_lens[i]``: tokens cached for sequence
    i, the new one included. Query head h reads KV head ``h // (num_heads // num_kv_heads)``
    (grouped-query attention). Returns ``[batch, num_heads, head_dim]`` in the query's dtype.
    """
    one_each = torch.arange(query.shape[0] + 1, device=query.device)
    return paged_prefill_attention(
        query, k_cache, v_cache, one_each, block_tables, context_lens, scale
    )


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """New tokens attend causally to themselves and to the context already cached.

    ``query``: ``[total_new_tokens, num_heads, head_dim]``; sequence i's new tokens are rows
    ``cu_seqlens_q[i]:cu_seqlens_q[i + 1]``, the last ``n_i`` of its ``context_lens[i]`` cached
    tokens (their K/V already stored). New token j sits at position ``context_lens[i] - n_i + j``
    and attends to every position up to its own. Returns ``[total_new_tokens, heads, head_dim]``.
    """
    out = torch.empty_like(query)
    group = query.shape[1] // k_cache.shape[2]
    for i in range(len(context_lens)):
        start, end, context = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1]), int(context_lens[i])
        keys = gather_kv(k_cache, block_tables[i], context).float().repeat_interleave(group, dim=1)
        values = gather_kv(v_cache, block_tables[i], context).float().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,nhd->hqn", query[start:end].float(), keys) * scale
        positions = torch.arange(context - (end - start), context, device=query.device)
        future = torch.arange(context, device=query.device)[None, :] > positions[:, None]
        scores = scores.masked_fill(future, float("-inf"))
        out[start:end] = torch.einsum("hqn,nhd->qhd", scores.softmax(-1), values).to(query.dtype)
    return out
