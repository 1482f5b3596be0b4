"""The quantized paged KV cache in PyTorch: store on write, dequantize on read (Phase 3, graded).

``vkv.kernels.reference`` (the torch backend) hands every ``QuantizedCache`` to this module: a
16-bit cache never comes here. A cache is one layer's keys or values in three planes whose first
dimension is the block (``cache_engine.py`` makes them):

- ``codes [num_blocks, block_size, kv_heads, head_dim * bits / 8]`` (uint8; INT4: two codes a
  byte, the even one in the low nibble, ``pack_int4``'s order);
- ``scale`` and ``zero``, in the model's dtype, either per token ``[num_blocks, block_size,
  groups, 1]``, with ``groups`` the KV heads (one group per head: LMDeploy's) or 1 (one group
  per token over all its heads: ``quant_group="token"``), or, for keys per channel (KIVI's),
  ``[num_blocks, 1, kv_heads, head_dim]``: one per (head, channel), shared by the block.

Token slot ``s`` lives in block ``s // block_size`` at offset ``s % block_size``: ``cache.codes
.view(-1, kv_heads, stored)[s]`` is its row, and so for the per-token planes. A token's values
are ``codes * scale + zero`` broadcast over its group.

Contracts (the parts' tests check each):

- ``store_quantized`` (part 3.5) writes a step's tokens into their slots, quantized per token
  (``Quantizer``); a slot of -1 (padding) is skipped; if any key or value is NaN or infinite,
  it raises ``ValueError`` and writes nothing, neither keys nor values; keys per channel go to
  ``store_keys_per_channel`` (part 3.3) instead, values stay per token.
- ``store_keys_per_channel`` (part 3.3) writes a step's keys per channel as the step's plan of
  the key residual says: partial blocks' keys in full precision to the residual, filled blocks
  quantized per channel into their planes.
- ``dequantize_blocks`` (part 3.6) returns blocks as float32 values; for keys per channel, a
  block with a residual slot (``residual_slot[block] >= 0``) is read from the residual instead
  of its codes (its grid does not exist yet).
- ``quantized_decode_attention`` and ``quantized_prefill_attention`` (part 3.6) have the
  contracts of ``reference.paged_decode_attention`` and ``paged_prefill_attention``: the same
  results as attention over the dequantized keys and values, in float32, returned in the
  query's dtype. How they read the blocks (all of a sequence's blocks at once, or block by
  block with an online softmax) is yours to choose: ``assignment/phase3.md`` weighs the two.
"""

import torch

from vkv.engine.quantizer import QuantizedTensor, Quantizer


def store_quantized(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache,
    v_cache,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ``[num_tokens, kv_heads, head_dim]`` into their slots of the
    quantized caches ``k_cache``/``v_cache`` (``QuantizedCache``), quantized per token over each
    group of the caches' scale planes (``scale.shape[2]`` groups a token: a group is
    ``kv_heads * head_dim / groups`` consecutive channels of the token's heads).

    ``slot_mapping [num_tokens]`` (int) gives each token's slot; -1 is padding, skipped (a step
    may be all padding: then nothing is written). A NaN
    or an infinity in ``key`` or ``value`` raises ``ValueError`` ("cannot quantize NaN or
    infinite values: nothing was written") before any plane changes. With keys per channel
    (``k_cache.per_channel``), the keys go to ``store_keys_per_channel(key, k_cache)`` (which
    follows the step's plan, part 3.3) and only the values are quantized here.
    """
    ### BEGIN SOLUTION part3.5
    if not all(torch.isfinite(x).all() for x in (key, value)):
        raise ValueError("cannot quantize NaN or infinite values: nothing was written")

    def store(x: torch.Tensor, cache, slots: torch.Tensor) -> None:
        num_tokens, heads, _ = x.shape
        groups = cache.scale.shape[2]
        quantized = Quantizer(cache.bits).quantize(x.reshape(num_tokens, groups, -1))
        stored = cache.codes.shape[-1]
        cache.codes.view(-1, heads, stored)[slots] = quantized.codes.view(num_tokens, heads, stored)
        cache.scale.view(-1, groups, 1)[slots] = quantized.scale.to(cache.scale.dtype)
        cache.zero.view(-1, groups, 1)[slots] = quantized.zero.to(cache.zero.dtype)

    if k_cache.per_channel:
        store_keys_per_channel(key, k_cache)
        pending = [(value, v_cache)]
    else:
        pending = [(key, k_cache), (value, v_cache)]

    real = slot_mapping >= 0  # -1 is padding, and a valid (wrong) index to PyTorch
    if not real.any():
        return
    slots = slot_mapping[real].long()
    for x, cache in pending:
        store(x[real], cache, slots)
    ### END SOLUTION


def store_keys_per_channel(key: torch.Tensor, k_cache) -> None:
    """Keys per channel (both backends call this): carry out the step's plan, ``k_cache.plan``
    (a ``KeyPlan``, made by ``KeyResidual.plan``).

    First, each batch row ``plan.residual_tokens[i]`` of ``key [num_tokens, kv_heads,
    head_dim]`` is written, as it is (in the residual's dtype), to row ``plan.residual_rows[i]``
    of ``k_cache.residual [num_slots, block_size, kv_heads, head_dim]`` seen as rows. Then every
    block of ``plan.fill_blocks`` is quantized per channel over its ``block_size`` tokens (a
    scale and a zero per head and channel, ``Quantizer(bits, "per_channel")``): the first
    ``len(plan.fill_slots)`` blocks from those residual slots (which now hold the step's new
    keys too), the others from the batch rows ``plan.fill_tokens [blocks, block_size]``; their
    codes, scale and zero go to the block's entries of ``k_cache.codes``, ``scale`` and
    ``zero``. Nothing else changes.
    """
    ### BEGIN SOLUTION part3.3
    plan = k_cache.plan
    residual = k_cache.residual
    rows = residual.view(-1, *residual.shape[2:])
    rows[plan.residual_rows] = key[plan.residual_tokens].to(residual.dtype)

    # the filled blocks' tokens: from their residual slots first, then straight from the batch
    filled = torch.cat((residual[plan.fill_slots].float(), key[plan.fill_tokens].float()))
    quantizer = Quantizer(k_cache.bits, "per_channel")
    for block, tokens in zip(plan.fill_blocks.tolist(), filled):
        quantized = quantizer.quantize(tokens)
        k_cache.codes[block] = quantized.codes
        k_cache.scale[block] = quantized.scale.to(k_cache.scale.dtype)
        k_cache.zero[block] = quantized.zero.to(k_cache.zero.dtype)
    ### END SOLUTION


def dequantize_blocks(cache, blocks: torch.Tensor) -> torch.Tensor:
    """The values of ``blocks`` (a 1-D int64 tensor of block numbers, repeats allowed) of the
    quantized ``cache``: ``[len(blocks), block_size, kv_heads, head_dim]`` float32, a new tensor.

    Per token, each group of a token's channels is ``codes * scale + zero`` with its own scale
    and zero; keys per channel, each (head, channel) of a block with the block's. For keys per
    channel, a block whose ``cache.residual_slot[block]`` is a slot ``r >= 0`` is read from
    ``cache.residual[r]`` (full precision) instead: it is partial, its codes mean nothing yet.
    """
    ### BEGIN SOLUTION part3.6
    blocks = blocks.long()
    codes = cache.codes[blocks]
    num_blocks, block_size, heads, _ = codes.shape
    groups = cache.scale.shape[2]  # KV heads, 1 (a group per token), or heads per channel
    quantized = QuantizedTensor(
        codes.view(num_blocks, block_size, groups, -1),
        cache.scale[blocks],
        cache.zero[blocks],
        cache.bits,
    )
    values = Quantizer(cache.bits).dequantize(quantized).view(num_blocks, block_size, heads, -1)

    if cache.per_channel:
        # a partial block's grid does not exist yet: its keys wait in the residual
        slots = cache.residual_slot[blocks].long()
        if (partial := slots >= 0).any():
            values[partial] = cache.residual[slots[partial]].float()
    return values
    ### END SOLUTION


def quantized_decode_attention(
    query: torch.Tensor,
    k_cache,
    v_cache,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``reference.paged_decode_attention`` over quantized caches: one new token per sequence
    attends to its ``context_lens[i]`` cached tokens (its own included).

    ``query [batch, num_heads, head_dim]``; ``block_tables [batch, width]`` (int32, -1 past a
    sequence's blocks); query head ``h`` reads KV head ``h // (num_heads // kv_heads)``.
    Softmax attention in float32 with scores ``scale * q . k``; returns ``[batch, num_heads,
    head_dim]`` in the query's dtype. Slots at or past a context length are never read into
    the result, whatever they hold.
    """
    ### BEGIN SOLUTION part3.6
    # a decode step is a prefill of one new token per sequence
    cu_seqlens_q = torch.arange(query.shape[0] + 1, device=query.device)
    return quantized_prefill_attention(
        query, k_cache, v_cache, cu_seqlens_q, block_tables, context_lens, scale
    )
    ### END SOLUTION


def quantized_prefill_attention(
    query: torch.Tensor,
    k_cache,
    v_cache,
    cu_seqlens_q: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``reference.paged_prefill_attention`` over quantized caches: new tokens attend causally
    to themselves and to the context already cached.

    ``query [total_new_tokens, num_heads, head_dim]``; sequence i's new tokens are rows
    ``cu_seqlens_q[i]:cu_seqlens_q[i + 1]``, the last ``n_i`` of its ``context_lens[i]`` cached
    tokens (their K/V already stored); new token j sits at position ``context_lens[i] - n_i + j``
    and attends to every position up to its own. Returns ``[total_new_tokens, num_heads,
    head_dim]`` in the query's dtype.
    """
    ### BEGIN SOLUTION part3.6
    import itertools

    import torch.nn.functional as F

    # gather, then attend: each sequence's blocks are dequantized into one dense tensor
    out = torch.zeros_like(query)
    num_heads = query.shape[1]
    _, block_size, kv_heads, _ = k_cache.shape
    per_kv_head = num_heads // kv_heads
    bounds = cu_seqlens_q.tolist()
    for i, (start, end) in enumerate(itertools.pairwise(bounds)):
        if (new := end - start) == 0:
            continue
        context = int(context_lens[i])
        blocks = block_tables[i, : -(-context // block_size)]
        keys, values = (
            dequantize_blocks(cache, blocks)
            .flatten(0, 1)[:context]
            .repeat_interleave(per_kv_head, dim=1)
            for cache in (k_cache, v_cache)
        )
        scores = torch.einsum("nhd,chd->hnc", query[start:end].float(), keys) * scale
        positions = torch.arange(context, device=query.device)
        own = positions[context - new :]
        scores.masked_fill_(positions[None, :] > own[:, None], float("-inf"))
        weights = F.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hnc,chd->nhd", weights, values).to(query.dtype)
    return out
    ### END SOLUTION
