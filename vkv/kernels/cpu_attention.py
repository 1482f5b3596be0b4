"""The torch backend on a CPU: the reference, with decode attention read in place and the KV
store in one call (given).

``vkv.kernels.reference.paged_decode_attention`` defines decode attention by gathering every
block of every sequence into one padded tensor, then masking the padding: simple, and what the
Triton kernels are checked against, but on a CPU the gather is the larger part of attention's
time (each layer and step copies the whole batch's K/V, padding included, then reads the copy).
Here ``paged_decode_attention`` runs ``paged_decode.c`` instead: a loop over each sequence's
block table that reads its blocks where they lie, with an online softmax, one sequence per
OpenMP thread at a time. ``store_kvcache`` writes a step's keys and values with one C call
(``layer_ops.c``), skipping padding (slot -1) without reading the slots back to the host, as
the reference's check does. Prefill attention is the reference's.

What it buys (``benchmarks/bench_cpu_attention.py``, 2 cores, 2026-12-06): a fifth to a third
of the reference's time for one call whose blocks are in the CPU's caches (0.22x on a 0.6B
model's shape, 0.31x on vkv-tiny's); inside a ``vkv bench e2e`` run, where each layer's K/V come
from memory, about three eighths (0.37x; the blocks are fetched a few ahead, since no hardware
prefetcher follows a block table).

The C library is ``cpu_library``'s. Without it, or for a cache it does not handle (not float32,
quantized, not contiguous), these fall back to the reference, with the same results up to float
rounding (``tests/runtime/test_cpu_attention.py`` compares the two). A block table that does not
cover its context with blocks of the cache is refused (``ValueError``) before anything is read:
the reference would read block 0 for a -1. A context of 0 (a padded row of a captured batch)
attends to nothing: its output is 0, as the reference's and Triton's.
"""

from pathlib import Path

import torch

from vkv.kernels import cpu_library, reference
from vkv.kernels.reference import paged_prefill_attention

__all__ = ["kernel_path", "paged_decode_attention", "paged_prefill_attention", "store_kvcache"]


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``reference.paged_decode_attention``'s contract; computed in place when it can be."""
    kernel = _kernel()
    if kernel is None or not _handles(query, k_cache, v_cache, block_tables, context_lens):
        return reference.paged_decode_attention(
            query, k_cache, v_cache, block_tables, context_lens, scale
        )
    batch, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(query)
    tables, lens = block_tables.contiguous(), context_lens.contiguous()
    with cpu_library.labelled("vkv::paged_decode_attention"):
        status = kernel(
            query.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            tables.data_ptr(),
            lens.data_ptr(),
            out.data_ptr(),
            batch,
            num_heads,
            num_kv_heads,
            head_dim,
            block_size,
            tables.shape[1],
            k_cache.shape[0],
            query.stride(0),
            scale,
        )
    if status != 0:
        raise ValueError(
            "paged_decode_attention: a context is longer than its block table, or a "
            f"table names a block outside the cache of {k_cache.shape[0]} blocks"
        )
    return out


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """``reference.store_kvcache``'s contract (slot -1 skipped); one C call when it can be.
    ``IndexError`` for a slot past the cache (the reference's error): nothing past it is
    written, the slots before it are."""
    library = cpu_library.library()
    if library is None or not _stores(key, value, k_cache, v_cache, slot_mapping):
        reference.store_kvcache(key, value, k_cache, v_cache, slot_mapping)
        return
    tokens, num_kv_heads, head_dim = key.shape
    with cpu_library.labelled("vkv::store_kvcache"):
        status = library.vkv_store_kv_f32(
            key.data_ptr(),
            value.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            slot_mapping.data_ptr(),
            tokens,
            num_kv_heads,
            head_dim,
            key.stride(0),
            value.stride(0),
            head_dim,
            k_cache.shape[0] * k_cache.shape[1],
        )
    if status != 0:
        raise IndexError(f"store_kvcache: a slot lies past the cache's {k_cache.shape[0]} blocks")


def kernel_path() -> Path | None:
    """The compiled library in use, or None when decode attention falls back to the reference."""
    return cpu_library.library_path()


def _stores(key, value, k_cache, v_cache, slot_mapping) -> bool:
    """Whether the C store applies: float32 on the CPU, contiguous caches, each token's heads
    contiguous in ``key`` and ``value`` (a token's rows may lie apart: slices of a projection)."""
    caches = (k_cache, v_cache)
    return (
        all(type(t) is torch.Tensor and t.dtype == torch.float32 for t in (key, value, *caches))
        and all(t.device.type == "cpu" and t.is_contiguous() for t in caches)
        and all(t.device.type == "cpu" and t.stride()[1:] == (t.shape[2], 1) for t in (key, value))
        and key.shape == value.shape == (len(slot_mapping), *k_cache.shape[2:])
        and k_cache.shape == v_cache.shape
        and slot_mapping.dtype == torch.int64
        and slot_mapping.device.type == "cpu"
    )


def _handles(query, k_cache, v_cache, block_tables, context_lens) -> bool:
    """Whether the C loop applies: float32 tensors on the CPU, contiguous caches, each
    sequence's query heads contiguous (its rows may lie apart: slices of a projection), int32
    tables."""
    tensors = (query, k_cache, v_cache)
    return (
        all(type(t) is torch.Tensor and t.dtype == torch.float32 for t in tensors)
        and all(t.device.type == "cpu" for t in tensors)
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and query.stride()[1:] == (query.shape[2], 1)
        and block_tables.dtype == torch.int32
        and context_lens.dtype == torch.int32
        and query.shape[1] % k_cache.shape[2] == 0
    )


def _kernel():
    """The C decode loop, or None when the library cannot be had."""
    library = cpu_library.library()
    return None if library is None else library.vkv_paged_decode_f32
