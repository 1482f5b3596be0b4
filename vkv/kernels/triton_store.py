"""Triton kernels that write the paged KV cache, with the signature of ``reference.store_kvcache``.

- ``_store_kvcache_kernel``: one program per token copies its K and V rows into their slots.
- ``_store_quantized_kernel``: one program per (token, KV head) row of a ``QuantizedCache``
  (Phase 3) quantizes the row where it stands (minimum, scale, codes; INT4 packs by halves,
  channel ``i`` in the low nibble of byte ``i`` and channel ``head_dim / 2 + i`` in its high
  nibble). Keys per channel go to the residual instead, and the blocks a
  step fills are quantized by ``quantized.store_keys_per_channel`` (torch: a few blocks a step,
  shared with the reference).

A slot of -1 (padding) is skipped. A quantized store writes nothing if any key or value of the
step is NaN or infinite (Phase 3's "all or nothing"). A cache without a step flag raises
before writing, after one wait for the GPU; the engine's caches quantized per token carry one
(``refused``: a CUDA graph cannot wait, and an eager step would wait once a layer), which the
kernels set and read instead, and the engine raises after the step
(``CacheEngine.raise_if_refused``).

Every kernel here and in ``triton_attention.py`` reads its tensors through raw pointers, so the
wrappers first check that all of them are on one device (``check_devices``): a tensor elsewhere
is a ``ValueError`` naming it, not a crash or garbage.
"""

import torch
import triton
import triton.language as tl

from vkv.engine.cache_engine import QuantizedCache
from vkv.kernels.quantized import store_keys_per_channel

PLANES = ("codes", "scale", "zero", "residual", "residual_slot")  # a QuantizedCache's tensors


def check_devices(anchor: str, tensor: torch.Tensor, **arguments: object) -> None:
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
    argument on another device than ``key`` (``check_devices``: "value is on cpu, the key on
    cuda:0")."""
    check_devices(
        "key", key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping
    )
    num_tokens, num_kv_heads, head_dim = key.shape
    row = num_kv_heads * head_dim
    if key.stride(-1) != 1 or key.stride(1) != head_dim or value.stride(1) != head_dim:
        raise ValueError("key and value must be contiguous in their last two dimensions")
    if isinstance(k_cache, QuantizedCache):
        refused = _refusal(key, value, k_cache)  # before any write
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
                refused,
                rows.stride(0),
                rows.stride(1),
                codes.stride(1),
                codes.stride(2),
                cache.scale.stride(1),
                cache.scale.stride(2),
                HEAD_DIM=width,
                HALF=head_dim // 2,
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
    refused_ptr,
    stride_x_token,
    stride_x_head,
    stride_code_slot,
    stride_code_head,
    stride_scale_slot,
    stride_scale_head,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BITS: tl.constexpr,
):
    """One (token, group) row of ``HEAD_DIM`` channels (a KV head's, or all of a token's heads'):
    its minimum, scale and codes (``quantizer.py``'s formulas, halves rounded up rather than to
    even; INT4 packs each head's channels by halves, ``HALF`` apiece), written to the token's
    slot unless it is -1 or the step is refused (``refused_ptr`` holds 1)."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    given = tl.load(slot_ptr + token).to(tl.int64)
    slot = tl.maximum(given, 0)
    row_ptr = x_ptr + token * stride_x_token + head * stride_x_head
    dims = tl.arange(0, BLOCK_D)
    # -1: padding, nothing written (as a vector mask); nor anything in a refused step
    writes = ((given >= 0) & (tl.load(refused_ptr) == 0)).to(tl.int32)
    write = (dims * 0 + writes) > 0
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
        firsts = pairs + pairs // HALF * HALF  # each head's halves: channels j and HALF + j
        first = tl.load(row_ptr + firsts, mask=in_pairs, other=0.0).to(tl.float32)
        second = tl.load(row_ptr + firsts + HALF, mask=in_pairs, other=0.0).to(tl.float32)
        low_codes = tl.minimum(tl.maximum(tl.floor((first - low) / step + 0.5), 0.0), levels)
        high_codes = tl.minimum(tl.maximum(tl.floor((second - low) / step + 0.5), 0.0), levels)
        packed = low_codes.to(tl.int32) | (high_codes.to(tl.int32) << 4)
        tl.store(codes_at + pairs, packed.to(tl.uint8), mask=in_pairs & ((pairs * 0 + writes) > 0))
    first = dims < 1  # the scale and the zero, stored through the row's first lane
    scales_at = scale_ptr + slot * stride_scale_slot + head * stride_scale_head + dims
    zeros_at = zero_ptr + slot * stride_scale_slot + head * stride_scale_head + dims
    tl.store(scales_at, (x * 0 + step_size).to(scale_ptr.dtype.element_ty), mask=first & write)
    tl.store(zeros_at, (x * 0 + low).to(zero_ptr.dtype.element_ty), mask=first & write)


def _refusal(key: torch.Tensor, value: torch.Tensor, k_cache: QuantizedCache) -> torch.Tensor:
    """The step's refusal flag (int32, one element, on the device): 1 if nothing may be written.
    A NaN or an infinity in ``key`` or ``value`` raises ``ValueError`` here, after one wait for
    the device, unless ``k_cache`` carries a step flag (``refused``): then it sets the flag,
    which stays set for the step's later layers, and the flag's owner raises after the step."""
    non_finite = ~(torch.isfinite(key).all() & torch.isfinite(value).all())
    if k_cache.refused is None:
        if bool(non_finite):
            raise ValueError("cannot quantize NaN or infinite values")
        return non_finite.to(torch.int32)
    return k_cache.refused.bitwise_or_(non_finite)
