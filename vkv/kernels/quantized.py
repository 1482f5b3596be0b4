"""The quantized paged KV cache in PyTorch: store on write, dequantize on read (Phase 3, graded).

``vkv.kernels.reference`` (the torch backend) hands every ``QuantizedCache`` to this module: a
16-bit cache never comes here. A cache is one layer's keys or values in three planes whose first
dimension is the block (``cache_engine.py`` makes them):

- ``codes [num_blocks, block_size, kv_heads, head_dim * bits / 8]`` (uint8; INT4: two codes a
  byte by halves, channel ``i`` in the low nibble and ``head_dim / 2 + i`` in the high one,
  ``pack_int4``'s order);
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
    if not bool(torch.isfinite(key).all()) or not bool(torch.isfinite(value).all()):
        raise ValueError("cannot quantize NaN or infinite values: nothing was written")
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    pairs = [(v_cache, value)]
    if k_cache.per_channel:
        store_keys_per_channel(key, k_cache)
    else:
        pairs.insert(0, (k_cache, key))
    if not len(slots):  # a step of padding only: nothing to quantize (nor any group to do it)
        return
    for cache, x in pairs:
        rows = x[keep]
        groups = cache.scale.shape[2]
        grouped = rows.reshape(rows.shape[0], groups, -1)
        q = Quantizer(cache.bits).quantize(grouped, head_dim=x.shape[-1])
        codes = cache.codes.view(-1, *cache.codes.shape[2:])
        scales = cache.scale.view(-1, *cache.scale.shape[2:])
        zeros = cache.zero.view(-1, *cache.zero.shape[2:])
        codes[slots] = q.codes.reshape(rows.shape[0], *codes.shape[1:])
        scales[slots] = q.scale.to(scales.dtype)
        zeros[slots] = q.zero.to(zeros.dtype)
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
    plan, residual = k_cache.plan, k_cache.residual
    rows = residual.view(-1, *residual.shape[2:])
    rows[plan.residual_rows] = key[plan.residual_tokens].to(rows.dtype)
    if not len(plan.fill_blocks):
        return
    full = torch.cat((residual[plan.fill_slots].float(), key[plan.fill_tokens].float()))
    q = Quantizer(k_cache.bits, "per_channel").quantize(full.transpose(0, 1))  # tokens first
    for plane, part in ((k_cache.codes, q.codes), (k_cache.scale, q.scale), (k_cache.zero, q.zero)):
        plane[plan.fill_blocks] = part.transpose(0, 1).to(plane.dtype)
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
    codes = cache.codes.index_select(0, blocks)
    scale = cache.scale.index_select(0, blocks)  # broadcasts over a group's heads and channels
    zero = cache.zero.index_select(0, blocks)
    values = Quantizer(cache.bits).dequantize(QuantizedTensor(codes, scale, zero, cache.bits))
    if cache.per_channel:
        slots = cache.residual_slot.index_select(0, blocks)
        partial = (slots >= 0).nonzero().squeeze(1)
        values[partial] = cache.residual[slots[partial].long()].float()
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
    batch, num_heads, head_dim = query.shape
    width = block_tables.shape[1]
    _, block_size, num_kv_heads, _ = k_cache.codes.shape
    group = num_heads // num_kv_heads
    blocks = block_tables.clamp(min=0).long().flatten()  # a -1 reads block 0: masked below
    shape = (batch, width * block_size, num_kv_heads, head_dim)
    keys = dequantize_blocks(k_cache, blocks).view(shape)
    values = dequantize_blocks(v_cache, blocks).view(shape)
    q = query.float().view(batch, num_kv_heads, group, head_dim)
    scores = torch.matmul(q, keys.permute(0, 2, 3, 1)) * scale  # [batch, kv_heads, group, slots]
    cached = torch.arange(width * block_size, device=query.device)[None, :] < context_lens[:, None]
    scores = scores.masked_fill(~cached[:, None, None, :], float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    out = torch.matmul(weights, values.transpose(1, 2))  # [batch, kv_heads, group, head_dim]
    return out.reshape(batch, num_heads, head_dim).to(query.dtype)
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
    total, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.codes.shape
    group = num_heads // num_kv_heads
    out = torch.empty(total, num_heads, head_dim, dtype=torch.float32, device=query.device)
    for i in range(len(context_lens)):
        start, end, context = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1]), int(context_lens[i])
        new = end - start
        blocks = block_tables[i, : (context + block_size - 1) // block_size].long()
        keys = dequantize_blocks(k_cache, blocks).reshape(-1, num_kv_heads, head_dim)[:context]
        values = dequantize_blocks(v_cache, blocks).reshape(-1, num_kv_heads, head_dim)[:context]
        q = query[start:end].float().reshape(new, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        scores = torch.matmul(q, keys.permute(1, 2, 0)[:, None]) * scale  # [kv, group, new, ctx]
        positions = torch.arange(context - new, context, device=query.device)
        hidden = torch.arange(context, device=query.device)[None, :] > positions[:, None]
        weights = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
        rows = torch.matmul(weights, values.transpose(0, 1)[:, None])  # [kv, group, new, dim]
        out[start:end] = rows.permute(2, 0, 1, 3).reshape(new, num_heads, head_dim)
    return out.to(query.dtype)
    ### END SOLUTION
