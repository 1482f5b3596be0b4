"""Plain-PyTorch paged KV-cache operations: the definitions the Triton kernels must match.

Layout (vLLM's and nano-vLLM's): each layer's cache is a pair of tensors
``[num_blocks, block_size, num_kv_heads, head_dim]``. Token slot ``s`` lives in block
``s // block_size`` at offset ``s % block_size``. A sequence's ``block_table`` lists its physical
blocks in logical order, padded with -1 to the batch's widest table.

A quantized cache (Phase 3: ``QuantizedCache``, INT8 or INT4) is read and written through the
same functions, which hand it to ``vkv.kernels.quantized`` (the student's, parts 3.5 and 3.6):
storing quantizes the new tokens (a token that cannot be quantized, NaN or infinite, is refused
before anything is written: the cache stays as it was), and attention dequantizes the blocks it
reads. A 16-bit cache never reaches that module.
"""

import threading

import torch

from vkv.engine.cache_engine import QuantizedCache
from vkv.kernels import quantized


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
    if isinstance(k_cache, QuantizedCache):  # contiguous: the student's code may view any rows
        quantized.store_quantized(
            key.contiguous(), value.contiguous(), k_cache, v_cache, slot_mapping
        )
        return
    keep = slice(None)  # every token: no padding (the engine's steps), no mask to apply
    if len(slot_mapping) and int(slot_mapping.min()) < 0:
        keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    _slots(k_cache)[slots] = key[keep]  # in the cache's dtype: assigning casts
    _slots(v_cache)[slots] = value[keep]


def _slots(cache: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, block_size, ...]`` seen as ``[num_slots, ...]``."""
    return cache.view(-1, *cache.shape[2:])


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor, into: str) -> torch.Tensor:
    """Each sequence's cached tokens in logical order: ``[batch, kv_heads, width, head_dim]``.

    ``width`` is the table width times the block size; a -1 (padding) entry reads block 0, so
    callers mask every position at or past a sequence's context length. The result is a view of
    the reusable buffer named ``into``: the next gather into the same name overwrites it. A
    quantized cache is dequantized (float32) into a new tensor.
    """
    batch, num_blocks = block_tables.shape
    _, block_size, num_kv_heads, head_dim = cache.shape
    if isinstance(cache, QuantizedCache):  # dequantized (Phase 3) into a new tensor
        values = quantized.dequantize_blocks(cache, block_tables.clamp(min=0).long().flatten())
        return values.view(batch, num_blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)
    rows = batch * num_blocks
    out = _reusable(into, rows * cache[0].numel(), cache.dtype, cache.device)
    out = out.view(rows, block_size, num_kv_heads, head_dim)
    torch.index_select(cache, 0, block_tables.clamp(min=0).long().flatten(), out=out)
    return out.view(batch, num_blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)


class _Buffers(threading.local):
    def __init__(self) -> None:
        self.tensors: dict[tuple[str, torch.device, torch.dtype], torch.Tensor] = {}


_buffers = _Buffers()


def _reusable(name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``numel`` elements of a flat buffer kept between calls (per thread; it only grows).

    Gathering the blocks of a batch makes a tensor of megabytes per layer and step; allocated
    afresh each time, it costs page faults (the C allocator hands large freed blocks back to the
    operating system), which made decode steps 10-20 % slower on a CPU. The buffer is made
    outside inference mode, so that calls in and out of ``torch.inference_mode`` can share it.
    """
    buffers = _buffers.tensors
    key = (name, device, dtype)
    if key not in buffers or buffers[key].numel() < numel:
        with torch.inference_mode(False):
            buffers[key] = torch.empty(numel, dtype=dtype, device=device)
    return buffers[key][:numel]


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
    The whole batch at once: each sequence's blocks are read whole and the slots past its
    context masked out, so those slots must hold finite numbers (the CacheEngine zero-fills the
    cache; a NaN there would survive the mask as 0 * NaN).
    """
    if isinstance(k_cache, QuantizedCache):
        return quantized.quantized_decode_attention(
            query.contiguous(), k_cache, v_cache, block_tables, context_lens, scale
        )
    batch, num_heads, head_dim = query.shape
    keys = gather_blocks(k_cache, block_tables, into="keys")
    values = gather_blocks(v_cache, block_tables, into="values")
    num_kv_heads, width = keys.shape[1], keys.shape[2]
    cached = torch.arange(width, device=query.device)[None, :] < context_lens[:, None]
    grouped = query.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = _attention(grouped, keys, values, cached[:, None, None, :], scale)
    return out.reshape(batch, num_heads, head_dim).to(query.dtype)


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """New tokens attend causally to themselves and to the context already cached.

    ``query``: ``[total_new_tokens, num_heads, head_dim]``; sequence i's new tokens are rows
    ``cu_seqlens_q[i]:cu_seqlens_q[i + 1]``, the last ``n_i`` of its ``context_lens[i]`` cached
    tokens (their K/V already stored). New token j sits at position ``context_lens[i] - n_i + j``
    and attends to every position up to its own. Returns ``[total_new_tokens, heads, head_dim]``.
    ``max_query_len``, the largest ``n_i`` where the caller knows it on the host, sizes a
    kernel's grid without a wait for the GPU (this loop reads each ``n_i`` itself).
    """
    if isinstance(k_cache, QuantizedCache):
        return quantized.quantized_prefill_attention(
            query.contiguous(), k_cache, v_cache, cu_seqlens_q, block_tables, context_lens, scale
        )
    out = torch.empty_like(query)
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    for i in range(len(context_lens)):
        start, end, context = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1]), int(context_lens[i])
        new = end - start
        keys = gather_blocks(k_cache, block_tables[i : i + 1], into="keys")[0, :, :context]
        values = gather_blocks(v_cache, block_tables[i : i + 1], into="values")[0, :, :context]
        if new == context:  # a whole prompt: plain causal attention, each head its KV head's
            heads = query[start:end].transpose(0, 1)
            rows = _attention(
                heads,
                keys.repeat_interleave(group, 0),
                values.repeat_interleave(group, 0),
                None,
                scale,
            )
            out[start:end] = rows.transpose(0, 1).to(query.dtype)
            continue
        positions = torch.arange(context - new, context, device=query.device)
        visible = torch.arange(context, device=query.device)[None, :] <= positions[:, None]
        # per KV head, the rows of the query heads that read it: head after head, token rows
        grouped = query[start:end].transpose(0, 1).reshape(num_kv_heads, group * new, head_dim)
        rows = _attention(grouped, keys, values, visible.repeat(group, 1), scale)
        out[start:end] = rows.view(num_heads, new, head_dim).transpose(0, 1).to(query.dtype)
    return out


def _attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Softmax attention in fp32; ``visible`` (boolean) says which keys each query row reads.
    None: causal, row i reads keys 0..i, by SDPA's own mask, which its fused kernels apply
    without a mask tensor (half the time of a mask tensor's, for a long prompt on a CPU)."""
    return torch.nn.functional.scaled_dot_product_attention(
        query.float(),
        keys.float(),
        values.float(),
        attn_mask=visible,
        is_causal=visible is None,
        scale=scale,
    )
