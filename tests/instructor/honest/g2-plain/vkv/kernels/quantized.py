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
    # all or nothing: refuse the whole step before touching any plane
    if not torch.isfinite(key).all() or not torch.isfinite(value).all():
        raise ValueError("cannot quantize NaN or infinite values: nothing was written")

    # padding rows (slot -1) write nothing
    valid_rows = []
    for row, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            valid_rows.append(row)

    def store_per_token(x, cache):
        if len(valid_rows) == 0:
            return
        num_tokens, kv_heads, head_dim = x.shape
        groups = cache.scale.shape[2]
        group_size = kv_heads * head_dim // groups
        rows = torch.tensor(valid_rows, dtype=torch.long, device=x.device)
        slots = slot_mapping.to(torch.long)[rows]

        # one group of channels per row of the last dimension
        grouped = x[rows].reshape(len(valid_rows), groups, group_size)
        quantizer = Quantizer(cache.bits, "per_token")
        quantized = quantizer.quantize(grouped)

        stored = cache.codes.shape[-1]
        codes = quantized.codes.reshape(len(valid_rows), kv_heads, stored)
        codes_by_slot = cache.codes.view(-1, kv_heads, stored)
        scale_by_slot = cache.scale.view(-1, groups, 1)
        zero_by_slot = cache.zero.view(-1, groups, 1)
        codes_by_slot[slots] = codes
        scale_by_slot[slots] = quantized.scale.to(cache.scale.dtype)
        zero_by_slot[slots] = quantized.zero.to(cache.zero.dtype)

    if k_cache.per_channel:
        store_keys_per_channel(key, k_cache)
    else:
        store_per_token(key, k_cache)
    store_per_token(value, v_cache)
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
    num_slots, block_size, kv_heads, head_dim = residual.shape

    # partial blocks' keys wait in full precision in the residual
    if len(plan.residual_tokens) > 0:
        residual_as_rows = residual.view(num_slots * block_size, kv_heads, head_dim)
        new_rows = key[plan.residual_tokens].to(residual.dtype)
        residual_as_rows[plan.residual_rows] = new_rows

    # filled blocks are quantized per channel over their tokens
    quantizer = Quantizer(k_cache.bits, "per_channel")
    fill_blocks = plan.fill_blocks.tolist()
    fill_slots = plan.fill_slots.tolist()
    num_from_residual = len(fill_slots)
    for i, block in enumerate(fill_blocks):
        if i < num_from_residual:
            block_keys = residual[fill_slots[i]]
        else:
            rows = plan.fill_tokens[i - num_from_residual]
            block_keys = key[rows]
        quantized = quantizer.quantize(block_keys)
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
    blocks = blocks.to(torch.long)
    num_blocks = len(blocks)
    _, block_size, kv_heads, head_dim = cache.shape
    codes = cache.codes[blocks]
    scale = cache.scale[blocks]
    zero = cache.zero[blocks]
    quantizer = Quantizer(cache.bits, "per_token")

    if cache.per_channel:
        # one scale per (head, channel) of the block: it broadcasts over the tokens
        quantized = QuantizedTensor(codes, scale.float(), zero.float(), cache.bits)
        values = quantizer.dequantize(quantized)
        # partial blocks are read from the residual, as stored
        block_list = blocks.tolist()
        for i in range(num_blocks):
            slot = int(cache.residual_slot[block_list[i]])
            if slot >= 0:
                values[i] = cache.residual[slot].float()
        return values

    # per token: view the codes so that the last dimension is one group
    groups = scale.shape[2]
    stored = codes.shape[-1]
    group_bytes = kv_heads * stored // groups
    grouped_codes = codes.reshape(num_blocks, block_size, groups, group_bytes)
    quantized = QuantizedTensor(grouped_codes, scale.float(), zero.float(), cache.bits)
    values = quantizer.dequantize(quantized)
    return values.reshape(num_blocks, block_size, kv_heads, head_dim)
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
    batch, num_heads, head_dim = query.shape
    _, block_size, kv_heads, _ = k_cache.shape
    heads_per_kv = num_heads // kv_heads
    output = torch.zeros(batch, num_heads, head_dim, dtype=torch.float32, device=query.device)

    for i in range(batch):
        context = int(context_lens[i])
        if context == 0:
            continue
        num_blocks = (context + block_size - 1) // block_size
        blocks = block_tables[i, :num_blocks].to(torch.long)

        # gather the sequence's keys and values, then cut the unwritten tail
        keys = dequantize_blocks(k_cache, blocks).reshape(-1, kv_heads, head_dim)[:context]
        values = dequantize_blocks(v_cache, blocks).reshape(-1, kv_heads, head_dim)[:context]
        keys = keys.repeat_interleave(heads_per_kv, dim=1)
        values = values.repeat_interleave(heads_per_kv, dim=1)

        q = query[i].float()
        scores = torch.einsum("hd,thd->ht", q, keys) * scale
        weights = torch.softmax(scores, dim=-1)
        output[i] = torch.einsum("ht,thd->hd", weights, values)

    return output.to(query.dtype)
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
    total_tokens, num_heads, head_dim = query.shape
    _, block_size, kv_heads, _ = k_cache.shape
    heads_per_kv = num_heads // kv_heads
    output = torch.zeros(total_tokens, num_heads, head_dim, dtype=torch.float32, device=query.device)
    num_seqs = len(context_lens)

    for i in range(num_seqs):
        start = int(cu_seqlens_q[i])
        end = int(cu_seqlens_q[i + 1])
        num_new = end - start
        context = int(context_lens[i])
        if num_new == 0:
            continue
        num_blocks = (context + block_size - 1) // block_size
        blocks = block_tables[i, :num_blocks].to(torch.long)

        keys = dequantize_blocks(k_cache, blocks).reshape(-1, kv_heads, head_dim)[:context]
        values = dequantize_blocks(v_cache, blocks).reshape(-1, kv_heads, head_dim)[:context]
        keys = keys.repeat_interleave(heads_per_kv, dim=1)
        values = values.repeat_interleave(heads_per_kv, dim=1)

        q = query[start:end].float()
        scores = torch.einsum("nhd,thd->hnt", q, keys) * scale

        # causal: new token j sits at position context - num_new + j
        query_positions = torch.arange(num_new, device=query.device) + (context - num_new)
        key_positions = torch.arange(context, device=query.device)
        future = key_positions[None, :] > query_positions[:, None]
        scores = scores.masked_fill(future[None, :, :], float("-inf"))

        weights = torch.softmax(scores, dim=-1)
        output[start:end] = torch.einsum("hnt,thd->nhd", weights, values)

    return output.to(query.dtype)
    ### END SOLUTION
