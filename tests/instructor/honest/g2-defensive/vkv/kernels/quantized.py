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
    for name, tensor in (("key", key), ("value", value), ("slot_mapping", slot_mapping)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor for {name}, got {type(tensor).__name__}")
    if key.dim() != 3 or value.dim() != 3:
        raise ValueError(
            "key and value must be [num_tokens, kv_heads, head_dim], got {} and {}".format(
                tuple(key.shape), tuple(value.shape)
            )
        )
    if key.shape[0] != slot_mapping.shape[0] or value.shape[0] != slot_mapping.shape[0]:
        raise ValueError(
            "{} slots for {} keys and {} values".format(
                slot_mapping.shape[0], key.shape[0], value.shape[0]
            )
        )

    # all or nothing: refuse the whole step before any plane changes
    if not bool(torch.isfinite(key).all()) or not bool(torch.isfinite(value).all()):
        raise ValueError("cannot quantize NaN or infinite values: nothing was written")

    per_channel_keys = bool(getattr(k_cache, "per_channel", False))
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].to(torch.long)
    num_kept = int(slots.numel())

    def _quantize_rows(rows: torch.Tensor, cache) -> tuple:
        # one token's channels cut into the cache's groups, quantized per token
        num_rows, heads, head_dim = rows.shape
        groups = cache.scale.shape[2]
        if (heads * head_dim) % groups != 0:
            raise ValueError(f"{heads * head_dim} channels do not split into {groups} groups")
        grouped = rows.reshape(num_rows, groups, heads * head_dim // groups)
        quantized = Quantizer(cache.bits, "per_token").quantize(grouped)
        stored = cache.codes.shape[-1]
        codes = quantized.codes.reshape(num_rows, heads, stored)
        return codes, quantized.scale, quantized.zero

    def _write(cache, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> None:
        # views of the planes, indexed by slot: the cache itself is written, never a copy
        heads, stored = cache.codes.shape[2], cache.codes.shape[3]
        groups = cache.scale.shape[2]
        cache.codes.view(-1, heads, stored)[slots] = codes
        cache.scale.view(-1, groups, 1)[slots] = scale.to(cache.scale.dtype)
        cache.zero.view(-1, groups, 1)[slots] = zero.to(cache.zero.dtype)

    # quantize everything first, then write
    value_parts = None
    key_parts = None
    if num_kept > 0:
        value_parts = _quantize_rows(value[keep], v_cache)
        if not per_channel_keys:
            key_parts = _quantize_rows(key[keep], k_cache)

    if per_channel_keys:
        store_keys_per_channel(key, k_cache)
    elif key_parts is not None:
        _write(k_cache, *key_parts)
    if value_parts is not None:
        _write(v_cache, *value_parts)
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
    if not isinstance(key, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor of keys, got {type(key).__name__}")
    if key.dim() != 3:
        raise ValueError("keys must be [num_tokens, kv_heads, head_dim], got shape {}".format(tuple(key.shape)))
    plan = getattr(k_cache, "plan", None)
    residual = getattr(k_cache, "residual", None)
    if plan is None or residual is None:
        raise ValueError("keys per channel need the step's plan and the key residual")

    num_slots, block_size, kv_heads, head_dim = residual.shape
    rows = residual.view(num_slots * block_size, kv_heads, head_dim)

    # 1. the new rows, as they are, into the residual
    if plan.residual_tokens.numel() > 0:
        rows[plan.residual_rows] = key[plan.residual_tokens].to(residual.dtype)

    # 2. every filled block, quantized per channel over its block_size tokens
    quantizer = Quantizer(k_cache.bits, "per_channel")
    from_residual = len(plan.fill_slots)
    for index in range(len(plan.fill_blocks)):
        block = int(plan.fill_blocks[index])
        if index < from_residual:
            block_keys = residual[int(plan.fill_slots[index])]
        else:
            block_keys = key[plan.fill_tokens[index - from_residual]]
        assert block_keys.shape[0] == block_size, "a filled block holds block_size keys"
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
    from vkv.engine.quantizer import unpack_int4

    if not isinstance(blocks, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor of block numbers, got {type(blocks).__name__}")
    if blocks.dim() != 1:
        raise ValueError("blocks must be a 1-D tensor, got shape {}".format(tuple(blocks.shape)))
    blocks = blocks.to(device=cache.codes.device, dtype=torch.long)
    num_blocks, block_size, heads, head_dim = cache.shape
    count = int(blocks.numel())

    codes = cache.codes[blocks]
    quantized = QuantizedTensor(codes, cache.scale[blocks], cache.zero[blocks], cache.bits)
    if cache.per_channel:
        # scale and zero [count, 1, heads, head_dim] broadcast over the block's tokens
        values = Quantizer(cache.bits, "per_channel").dequantize(quantized)
    else:
        groups = cache.scale.shape[2]
        if cache.bits == 4:
            codes = unpack_int4(codes)
        grouped = codes.reshape(count, block_size, groups, heads * head_dim // groups)
        scale = cache.scale[blocks].to(torch.float32)
        zero = cache.zero[blocks].to(torch.float32)
        values = grouped.to(torch.float32) * scale + zero
    values = values.reshape(count, block_size, heads, head_dim).to(torch.float32)

    residual_slot = getattr(cache, "residual_slot", None)
    residual = getattr(cache, "residual", None)
    if residual_slot is not None and residual is not None and count > 0:
        slots_of = residual_slot.to(blocks.device)[blocks].to(torch.long)
        partial = slots_of >= 0
        if bool(partial.any()):
            # partial blocks: their codes mean nothing yet, the keys wait in the residual
            values = values.clone()
            values[partial] = residual[slots_of[partial]].to(torch.float32)
    assert values.shape == (count, block_size, heads, head_dim), "unexpected dequantized shape"
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
    import torch.nn.functional as F

    if not isinstance(query, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor query, got {type(query).__name__}")
    if query.dim() != 3:
        raise ValueError("query must be [batch, num_heads, head_dim], got {}".format(tuple(query.shape)))
    batch, num_heads, head_dim = query.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if num_heads % kv_heads != 0:
        raise ValueError(f"{num_heads} query heads cannot share {kv_heads} KV heads evenly")
    per_kv = num_heads // kv_heads

    def _blocks_for(row: int, length: int) -> torch.Tensor:
        # only the blocks the context covers: padding entries (-1) are never reached
        needed = (length + block_size - 1) // block_size
        return block_tables[row, :needed].to(torch.long)

    out = torch.zeros(batch, num_heads, head_dim, dtype=torch.float32, device=query.device)
    for i in range(batch):
        length = int(context_lens[i])
        assert length >= 0, "a context length is never negative"
        if length == 0:
            continue
        table = _blocks_for(i, length)
        keys = dequantize_blocks(k_cache, table).reshape(-1, kv_heads, head_dim)[:length]
        values = dequantize_blocks(v_cache, table).reshape(-1, kv_heads, head_dim)[:length]
        keys = keys.repeat_interleave(per_kv, dim=1)  # [length, num_heads, head_dim]
        values = values.repeat_interleave(per_kv, dim=1)
        q = query[i].to(torch.float32)  # [num_heads, head_dim]
        scores = torch.einsum("hd,thd->ht", q, keys) * scale
        weights = F.softmax(scores, dim=-1)
        out[i] = torch.einsum("ht,thd->hd", weights, values)
    return out.to(query.dtype)
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
    import torch.nn.functional as F

    if not isinstance(query, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor query, got {type(query).__name__}")
    if query.dim() != 3:
        raise ValueError("query must be [tokens, num_heads, head_dim], got {}".format(tuple(query.shape)))
    total, num_heads, head_dim = query.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if num_heads % kv_heads != 0:
        raise ValueError(f"{num_heads} query heads cannot share {kv_heads} KV heads evenly")
    per_kv = num_heads // kv_heads
    bounds = [int(b) for b in cu_seqlens_q]
    if len(bounds) - 1 != len(context_lens):
        raise ValueError(
            "{} query ranges for {} context lengths".format(len(bounds) - 1, len(context_lens))
        )

    out = torch.zeros(total, num_heads, head_dim, dtype=torch.float32, device=query.device)
    for i in range(len(bounds) - 1):
        start, end = bounds[i], bounds[i + 1]
        new = end - start
        length = int(context_lens[i])
        if new == 0:
            continue
        if new > length:
            raise ValueError(f"sequence {i} has {new} new tokens but a context of only {length}")
        needed = (length + block_size - 1) // block_size
        table = block_tables[i, :needed].to(torch.long)
        keys = dequantize_blocks(k_cache, table).reshape(-1, kv_heads, head_dim)[:length]
        values = dequantize_blocks(v_cache, table).reshape(-1, kv_heads, head_dim)[:length]
        keys = keys.repeat_interleave(per_kv, dim=1)
        values = values.repeat_interleave(per_kv, dim=1)
        q = query[start:end].to(torch.float32)  # [new, num_heads, head_dim]
        scores = torch.einsum("nhd,thd->hnt", q, keys) * scale
        # causal: new token j at position length - new + j sees positions up to its own
        positions = torch.arange(length - new, length, device=query.device)
        allowed = torch.arange(length, device=query.device)[None, :] <= positions[:, None]
        scores = scores.masked_fill(~allowed[None, :, :], float("-inf"))
        weights = F.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hnt,thd->nhd", weights, values)
    return out.to(query.dtype)
    ### END SOLUTION
