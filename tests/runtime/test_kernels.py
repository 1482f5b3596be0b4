"""Paged KV kernels: Triton against the PyTorch reference, and both against dense attention.

Random block tables (shuffled, non-contiguous physical blocks), block sizes 1, 16 and a
non-power of two, GQA ratios 1 and 4, fp32 and fp16, ragged lengths. On a CPU the Triton
kernels run under the interpreter, so the shapes stay tiny and the tiles large.
"""

import threading

import pytest
import torch

from vkv.kernels import reference, triton_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3}


def build_cache(lengths, num_kv_heads, head_dim, block_size, dtype, seed=0):
    """Fill a paged cache through store_kvcache with shuffled tables; also return dense K/V."""
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in lengths]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=generator)
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    tables = torch.full((len(lengths), max(blocks_per_seq)), -1, dtype=torch.int32)
    dense, used = [], 0
    for i, (n, count) in enumerate(zip(lengths, blocks_per_seq, strict=True)):
        tables[i, :count] = order[used : used + count].int()
        used += count
        keys = torch.randn(n, num_kv_heads, head_dim, generator=generator).to(dtype)
        values = torch.randn(n, num_kv_heads, head_dim, generator=generator).to(dtype)
        slots = torch.tensor(
            [int(tables[i, p // block_size]) * block_size + p % block_size for p in range(n)]
        )
        reference.store_kvcache(keys, values, k_cache, v_cache, slots)
        dense.append((keys, values))
    return k_cache, v_cache, tables, dense


def dense_decode(query, dense, group, scale):
    outs = []
    for i, (keys, values) in enumerate(dense):
        k = keys.float().repeat_interleave(group, dim=1).transpose(0, 1)
        v = values.float().repeat_interleave(group, dim=1).transpose(0, 1)
        q = query[i].float()[:, None]
        outs.append(torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)[:, 0])
    return torch.stack(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_store_kvcache_matches_the_reference_and_skips_padding(dtype):
    generator = torch.Generator().manual_seed(1)
    key = torch.randn(6, 2, 32, generator=generator).to(dtype)
    value = torch.randn(6, 2, 32, generator=generator).to(dtype)
    slots = torch.tensor([5, 0, -1, 17, 9, -1])
    caches = [torch.zeros(4, 6, 2, 32, dtype=dtype) for _ in range(4)]
    reference.store_kvcache(key, value, caches[0], caches[1], slots)
    triton_attention.store_kvcache(key.to(DEVICE), value.to(DEVICE), caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].flatten(0, 1)[[1, 2, 3, 4]].abs().sum() == 0, "untouched slots stay zero"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (8, 2)], ids=["mha", "gqa4"])
@pytest.mark.parametrize("block_size", [1, 16, 12])
def test_paged_decode_matches_reference_and_dense(dtype, num_heads, num_kv_heads, block_size):
    lengths = [1, 37, 20]
    head_dim, scale = 32, 32**-0.5
    k_cache, v_cache, tables, dense = build_cache(
        lengths, num_kv_heads, head_dim, block_size, dtype
    )
    query = torch.randn(
        len(lengths), num_heads, head_dim, generator=torch.Generator().manual_seed(2)
    )
    query = query.to(dtype)
    context = torch.tensor(lengths, dtype=torch.int32)
    expected = dense_decode(query, dense, num_heads // num_kv_heads, scale)
    ours = reference.paged_decode_attention(query, k_cache, v_cache, tables, context, scale)
    torch.testing.assert_close(ours.float(), expected, atol=TOLERANCE[dtype], rtol=0)
    kernel = triton_attention.paged_decode_attention(
        query.to(DEVICE),
        k_cache.to(DEVICE),
        v_cache.to(DEVICE),
        tables.to(DEVICE),
        context.to(DEVICE),
        scale,
        num_splits=2,
        block_n=32,
    )
    torch.testing.assert_close(kernel.cpu().float(), expected, atol=TOLERANCE[dtype], rtol=0)


def test_paged_decode_rejects_heads_that_do_not_group():
    cache = torch.zeros(2, 4, 3, 32)
    with pytest.raises(ValueError, match="group"):
        triton_attention.paged_decode_attention(
            torch.zeros(1, 4, 32),
            cache,
            cache,
            torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32),
            1.0,
        )


def dense_prefill(query_rows, keys, values, group, scale, num_new):
    """Causal attention of the last ``num_new`` positions over all of them, no cache."""
    k = keys.float().repeat_interleave(group, dim=1).transpose(0, 1)
    v = values.float().repeat_interleave(group, dim=1).transpose(0, 1)
    context = keys.shape[0]
    positions = torch.arange(context - num_new, context)
    allowed = torch.arange(context)[None, :] <= positions[:, None]
    q = query_rows.float().transpose(0, 1)
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=allowed, scale=scale
    ).transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (8, 2)], ids=["mha", "gqa4"])
@pytest.mark.parametrize("block_size", [1, 16, 12])
def test_paged_prefill_matches_reference_and_dense(dtype, num_heads, num_kv_heads, block_size):
    lengths, new = [1, 37, 20], [1, 21, 20]  # a one-token prompt, a chunk after context, a prompt
    head_dim, scale = 32, 32**-0.5
    k_cache, v_cache, tables, dense = build_cache(
        lengths, num_kv_heads, head_dim, block_size, dtype
    )
    generator = torch.Generator().manual_seed(3)
    query = torch.randn(sum(new), num_heads, head_dim, generator=generator).to(dtype)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    context = torch.tensor(lengths, dtype=torch.int32)
    group = num_heads // num_kv_heads
    expected = torch.cat(
        [
            dense_prefill(query[cu[i] : cu[i + 1]], keys, values, group, scale, new[i])
            for i, (keys, values) in enumerate(dense)
        ]
    )
    ours = reference.paged_prefill_attention(query, k_cache, v_cache, cu, tables, context, scale)
    torch.testing.assert_close(ours.float(), expected, atol=TOLERANCE[dtype], rtol=0)
    kernel = triton_attention.paged_prefill_attention(
        query.to(DEVICE),
        k_cache.to(DEVICE),
        v_cache.to(DEVICE),
        cu.to(DEVICE),
        tables.to(DEVICE),
        context.to(DEVICE),
        scale,
        block_n=32,
    )
    torch.testing.assert_close(kernel.cpu().float(), expected, atol=TOLERANCE[dtype], rtol=0)


def test_reference_works_in_and_out_of_inference_mode():
    """The reference reuses its gather buffers (one set per thread). One made under inference
    mode must not break a later call outside it (the model under no_grad after the engine ran);
    a fresh thread starts with no buffers, so the first call below makes them."""
    k_cache, v_cache = torch.randn(2, 64, 4, 2, 16).unbind(0)
    tables = torch.arange(64).view(4, 16).int()
    query = torch.randn(4, 4, 16)
    lens = torch.tensor([60, 3, 64, 17], dtype=torch.int32)
    results = []

    def run() -> None:
        with torch.inference_mode():
            results.append(
                reference.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.25)
            )
        with torch.no_grad():
            results.append(
                reference.paged_decode_attention(
                    query[:2], k_cache, v_cache, tables[:2], lens[:2], 0.25
                )
            )

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert len(results) == 2, "the call outside inference mode raised"
    torch.testing.assert_close(results[1], results[0][:2].clone())
