"""Paged KV kernels: Triton and the PyTorch reference, each against dense attention.

Random block tables (shuffled, non-contiguous physical blocks), block sizes 1, 16 and a
non-power of two, GQA ratios 1 and 4, fp32, fp16 and bf16, ragged lengths. The reference runs
on each of ``DEVICES``, Triton on ``KERNEL_DEVICE`` (``devices.py``); on a CPU the Triton
kernels run under the interpreter, so the shapes stay tiny and the tiles large (and bf16 is
left out there: the interpreter computes none). Dense attention is computed on the CPU in
float64 from the same rounded inputs; ``assert_within_rounding`` derives what the dtype allows.
"""

import threading
from dataclasses import replace

import pytest
import torch
from devices import BACKENDS, KERNEL_DEVICE

from vkv.engine.cache_engine import QuantizedCache
from vkv.kernels import reference, triton_attention

DTYPES = pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"]
)
FLOAT32_SLACK = 2e-5  # float32 scores, softmax and sums over a few dozen tokens, against float64


def assert_within_rounding(got, expected, dtype, weighted_abs=None):
    """``got`` (in ``dtype``) against float64 ``expected``, element by element: within half a
    unit in the last place of ``dtype`` of the output (rounded to ``dtype`` when stored), plus
    float32's accumulation. With ``weighted_abs`` (the attention of the values' magnitudes), also
    half a unit of that: the Triton kernel rounds the softmax weights to ``dtype`` for its
    ``tl.dot`` with the values, which moves an output by up to half a unit of each weight times
    its value. The reference computes in float32 throughout and gets no such allowance."""
    half = torch.finfo(dtype).eps / 2
    error = (got.cpu().double() - expected).abs()
    bound = half * expected.abs() + FLOAT32_SLACK
    if weighted_abs is not None:
        bound = bound + half * weighted_abs
    worst = int((error - bound).argmax())
    assert (error <= bound).all(), (
        f"{dtype}: element {worst} is {got.flatten()[worst].item()}, float64 says "
        f"{expected.flatten()[worst].item()}: off by {error.flatten()[worst].item():.3g}, more "
        f"than the {bound.flatten()[worst].item():.3g} that {dtype}'s rounding allows"
    )


def no_bf16_in_the_interpreter(backend, device, dtype):
    if backend == "triton" and device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("the Triton interpreter computes no bf16 (a GPU runs this case)")


def build_cache(lengths, num_kv_heads, head_dim, block_size, dtype, device, seed=0):
    """Fill a paged cache on ``device`` through the reference's store with shuffled tables;
    also return the dense K/V (on the CPU)."""
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in lengths]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=generator)
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    k_cache = k_cache.to(device)
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
        reference.store_kvcache(
            keys.to(device), values.to(device), k_cache, v_cache, slots.to(device)
        )
        dense.append((keys, values))
    return k_cache, v_cache, tables.to(device), dense


def dense_decode(query, dense, group, scale):
    outs = []
    for i, (keys, values) in enumerate(dense):
        k = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)
        v = values.double().repeat_interleave(group, dim=1).transpose(0, 1)
        q = query[i].double()[:, None]
        outs.append(torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)[:, 0])
    return torch.stack(outs)


@DTYPES
def test_store_kvcache_matches_the_reference_and_skips_padding(dtype):
    generator = torch.Generator().manual_seed(1)
    key = torch.randn(6, 2, 32, generator=generator).to(dtype)
    value = torch.randn(6, 2, 32, generator=generator).to(dtype)
    slots = torch.tensor([5, 0, -1, 17, 9, -1])
    expected = [torch.zeros(4, 6, 2, 32, dtype=dtype) for _ in range(2)]
    reference.store_kvcache(key, value, *expected, slots)
    caches = [torch.zeros(4, 6, 2, 32, dtype=dtype, device=KERNEL_DEVICE) for _ in range(2)]
    on = [tensor.to(KERNEL_DEVICE) for tensor in (key, value, slots)]
    triton_attention.store_kvcache(on[0], on[1], *caches, on[2])
    assert all(torch.equal(got.cpu(), want) for got, want in zip(caches, expected, strict=True))
    assert caches[0].flatten(0, 1)[[1, 2, 3, 4]].abs().sum() == 0, "untouched slots stay zero"


def decode(backend, query, k_cache, v_cache, tables, context, scale):
    """Decode attention on ``backend``; Triton in two splits of tiles of 32 (several tiles and
    splits a sequence)."""
    if backend == "triton":
        return triton_attention.paged_decode_attention(
            query, k_cache, v_cache, tables, context, scale, num_splits=2, block_n=32
        )
    return reference.paged_decode_attention(query, k_cache, v_cache, tables, context, scale)


@pytest.mark.parametrize(("backend", "device"), BACKENDS)
@DTYPES
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (8, 2)], ids=["mha", "gqa4"])
@pytest.mark.parametrize("block_size", [1, 16, 12])
def test_paged_decode_matches_dense_attention(
    backend, device, dtype, num_heads, num_kv_heads, block_size
):
    no_bf16_in_the_interpreter(backend, device, dtype)
    lengths = [1, 37, 20]
    head_dim, scale = 32, 32**-0.5
    k_cache, v_cache, tables, dense = build_cache(
        lengths, num_kv_heads, head_dim, block_size, dtype, device
    )
    query = torch.randn(
        len(lengths), num_heads, head_dim, generator=torch.Generator().manual_seed(2)
    )
    query = query.to(dtype)
    context = torch.tensor(lengths, dtype=torch.int32, device=device)
    expected = dense_decode(query, dense, num_heads // num_kv_heads, scale)
    got = decode(backend, query.to(device), k_cache, v_cache, tables, context, scale)
    magnitudes = [(keys, values.abs()) for keys, values in dense]
    weighted_abs = dense_decode(query, magnitudes, num_heads // num_kv_heads, scale)
    assert_within_rounding(got, expected, dtype, weighted_abs if backend == "triton" else None)


@pytest.mark.parametrize("head_dim", [40, 8])
def test_a_head_dim_that_leaves_padding_lanes_in_each_half(head_dim):
    """The kernels split ``head_dim`` in two halves of ``BLOCK_D / 2`` lanes: 40 channels are
    halves of 20 in 32 lanes, 8 are halves of 4 in 16."""
    lengths, group, scale = [5, 19], 2, head_dim**-0.5
    k_cache, v_cache, tables, dense = build_cache(
        lengths, 2, head_dim, 4, torch.float32, KERNEL_DEVICE
    )
    query = torch.randn(2, 4, head_dim, generator=torch.Generator().manual_seed(3))
    context = torch.tensor(lengths, dtype=torch.int32, device=KERNEL_DEVICE)
    got = triton_attention.paged_decode_attention(
        query.to(KERNEL_DEVICE), k_cache, v_cache, tables, context, scale
    )
    assert_within_rounding(got, dense_decode(query, dense, group, scale), torch.float32)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "said"),
    [(4, 3, 32, "do not group over 3 KV heads"), (2, 2, 5, "must be even, got 5")],
    ids=["heads-that-do-not-group", "odd-head-dim"],
)
def test_paged_decode_refuses_what_the_kernel_cannot_split(num_heads, num_kv_heads, head_dim, said):
    cache = torch.zeros(2, 4, num_kv_heads, head_dim, device=KERNEL_DEVICE)
    with pytest.raises(ValueError, match=said):
        triton_attention.paged_decode_attention(
            torch.zeros(1, num_heads, head_dim, device=KERNEL_DEVICE),
            cache,
            cache,
            torch.zeros(1, 1, dtype=torch.int32, device=KERNEL_DEVICE),
            torch.ones(1, dtype=torch.int32, device=KERNEL_DEVICE),
            1.0,
        )


def quantized_cache(per_channel: bool) -> QuantizedCache:
    """An INT8 cache on the CPU: 4 blocks of 4 slots, 2 KV heads of 8 channels; keys per
    channel carry a residual of one slot."""
    codes = torch.zeros(4, 4, 2, 8, dtype=torch.uint8)
    if not per_channel:
        return QuantizedCache(codes, torch.ones(4, 4, 2, 1), torch.zeros(4, 4, 2, 1), 8)
    residual, slots = torch.zeros(1, 4, 2, 8), torch.full((4,), -1, dtype=torch.int32)
    return QuantizedCache(
        codes, torch.ones(4, 1, 2, 8), torch.zeros(4, 1, 2, 8), 8, residual, slots
    )


def call_with_one_on_meta(function: str, moved: str) -> None:
    """``triton_attention.<function>`` on CPU arguments but the one named ``moved`` (or the plane
    ``moved`` names, as in ``k_cache.scale``: then the caches are quantized), on ``meta``."""
    name, _, plane = moved.partition(".")
    keys, values = torch.zeros(2, 4, 4, 2, 8).unbind(0)
    if plane:
        keys, values = (
            quantized_cache(per_channel=plane.startswith("residual")),
            quantized_cache(False),
        )
    caches = {"k_cache": keys, "v_cache": values}
    tables = {"block_tables": torch.zeros(2, 1, dtype=torch.int32)}
    tables["context_lens"] = torch.ones(2, dtype=torch.int32)
    arguments = {
        "store_kvcache": {
            "key": torch.zeros(3, 2, 8),
            "value": torch.zeros(3, 2, 8),
            **caches,
            "slot_mapping": torch.arange(3),
        },
        "paged_decode_attention": {"query": torch.zeros(2, 4, 8), **caches, **tables, "scale": 1.0},
        "paged_prefill_attention": {
            "query": torch.zeros(3, 4, 8),
            **caches,
            "cu_seqlens_q": torch.tensor([0, 1, 3], dtype=torch.int32),
            **tables,
            "scale": 1.0,
        },
    }[function]
    value = arguments[name]
    if plane:
        arguments[name] = replace(value, **{plane: getattr(value, plane).to("meta")})
    else:
        arguments[name] = value.to("meta")
    getattr(triton_attention, function)(**arguments)


@pytest.mark.parametrize(
    ("function", "moved", "said"),
    [
        ("paged_decode_attention", "block_tables", "block_tables is on meta, the query on cpu"),
        ("paged_decode_attention", "context_lens", "context_lens is on meta, the query on cpu"),
        ("paged_decode_attention", "v_cache", "v_cache is on meta, the query on cpu"),
        ("paged_decode_attention", "query", "k_cache is on cpu, the query on meta"),
        ("paged_decode_attention", "k_cache.scale", "k_cache.scale is on meta, the query on cpu"),
        (
            "paged_decode_attention",
            "k_cache.residual",
            "k_cache.residual is on meta, the query on cpu",
        ),
        ("paged_prefill_attention", "cu_seqlens_q", "cu_seqlens_q is on meta, the query on cpu"),
        ("paged_prefill_attention", "k_cache", "k_cache is on meta, the query on cpu"),
        ("paged_prefill_attention", "v_cache.zero", "v_cache.zero is on meta, the query on cpu"),
        (
            "paged_prefill_attention",
            "k_cache.residual_slot",
            "k_cache.residual_slot is on meta, the query on cpu",
        ),
        ("store_kvcache", "value", "value is on meta, the key on cpu"),
        ("store_kvcache", "k_cache", "k_cache is on meta, the key on cpu"),
        ("store_kvcache", "v_cache.codes", "v_cache.codes is on meta, the key on cpu"),
        ("store_kvcache", "slot_mapping", "slot_mapping is on meta, the key on cpu"),
    ],
)
def test_a_tensor_on_another_device_than_the_query_is_refused_naming_it(function, moved, said):
    """Every tensor a kernel reads (a quantized cache's planes and residual too) is on the
    query's device (the key's, for a store), checked before anything is read or launched."""
    with pytest.raises(ValueError) as refused:
        call_with_one_on_meta(function, moved)
    assert str(refused.value) == said


def dense_prefill(query_rows, keys, values, group, scale, num_new):
    """Causal attention of the last ``num_new`` positions over all of them, no cache."""
    k = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)
    v = values.double().repeat_interleave(group, dim=1).transpose(0, 1)
    context = keys.shape[0]
    positions = torch.arange(context - num_new, context)
    allowed = torch.arange(context)[None, :] <= positions[:, None]
    q = query_rows.double().transpose(0, 1)
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=allowed, scale=scale
    ).transpose(0, 1)


def prefill(backend, query, k_cache, v_cache, cu, tables, context, scale):
    """Prefill attention on ``backend``; Triton in tiles of 32 cached tokens."""
    if backend == "triton":
        return triton_attention.paged_prefill_attention(
            query, k_cache, v_cache, cu, tables, context, scale, block_n=32
        )
    return reference.paged_prefill_attention(query, k_cache, v_cache, cu, tables, context, scale)


@pytest.mark.parametrize(("backend", "device"), BACKENDS)
@DTYPES
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (8, 2)], ids=["mha", "gqa4"])
@pytest.mark.parametrize("block_size", [1, 16, 12])
def test_paged_prefill_matches_dense_attention(
    backend, device, dtype, num_heads, num_kv_heads, block_size
):
    no_bf16_in_the_interpreter(backend, device, dtype)
    lengths, new = [1, 37, 20], [1, 21, 20]  # a one-token prompt, a chunk after context, a prompt
    head_dim, scale = 32, 32**-0.5
    k_cache, v_cache, tables, dense = build_cache(
        lengths, num_kv_heads, head_dim, block_size, dtype, device
    )
    generator = torch.Generator().manual_seed(3)
    query = torch.randn(sum(new), num_heads, head_dim, generator=generator).to(dtype)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    context = torch.tensor(lengths, dtype=torch.int32, device=device)
    group = num_heads // num_kv_heads
    expected = torch.cat(
        [
            dense_prefill(query[cu[i] : cu[i + 1]], keys, values, group, scale, new[i])
            for i, (keys, values) in enumerate(dense)
        ]
    )
    got = prefill(
        backend, query.to(device), k_cache, v_cache, cu.to(device), tables, context, scale
    )
    weighted_abs = torch.cat(
        [
            dense_prefill(query[cu[i] : cu[i + 1]], keys, values.abs(), group, scale, new[i])
            for i, (keys, values) in enumerate(dense)
        ]
    )
    assert_within_rounding(got, expected, dtype, weighted_abs if backend == "triton" else None)


def test_reference_works_in_and_out_of_inference_mode(device):
    """The reference reuses its gather buffers (one set per thread). One made under inference
    mode must not break a later call outside it (the model under no_grad after the engine ran);
    a fresh thread starts with no buffers, so the first call below makes them."""
    k_cache, v_cache = torch.randn(2, 64, 4, 2, 16, device=device).unbind(0)
    tables = torch.arange(64, device=device).view(4, 16).int()
    query = torch.randn(4, 4, 16, device=device)
    lens = torch.tensor([60, 3, 64, 17], dtype=torch.int32, device=device)
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
