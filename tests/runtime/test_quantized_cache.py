"""The quantized paged KV cache (Phase 3 in the runtime): INT8 and INT4, per token and head.

Stored tokens read back as the Quantizer's dequantized values; paged attention on a quantized
cache equals dense attention on those dequantized values (both in float32, so to 1e-5); swaps
and copies move each block's scales with its codes; with INT8 KV, preemption by swap or by
recompute leaves the greedy tokens of a request unchanged (a recomputed token quantizes to the
same codes; a swapped block keeps them); the Triton kernels (under the interpreter on a CPU)
store and read what the reference does; bad input changes nothing.
"""

import pytest
import torch

from vkv import LLM, SamplingParams
from vkv.cli import main
from vkv.engine.cache_engine import CacheEngine, CacheShape
from vkv.engine.llm_engine import LLMEngine
from vkv.engine.quantizer import Quantizer, bytes_per_token
from vkv.kernels import reference, triton_attention

HEADS, DIM, BLOCK = 2, 8, 4


def quantized_engine(bits: int, blocks: int = 6, cpu_blocks: int = 4) -> CacheEngine:
    shape = CacheShape(2, BLOCK, HEADS, DIM, torch.float32, f"int{bits}")
    return CacheEngine(shape, blocks, cpu_blocks, torch.device("cpu"))


def round_trip(x: torch.Tensor, bits: int) -> torch.Tensor:
    quantizer = Quantizer(bits)
    return quantizer.dequantize(quantizer.quantize(x))


@pytest.mark.parametrize("bits", [8, 4])
def test_stored_tokens_read_back_as_their_dequantized_values(bits):
    k_cache, v_cache = quantized_engine(bits).layer(1)
    keys, values = torch.randn(5, HEADS, DIM) * 3, torch.randn(5, HEADS, DIM)
    slots = torch.tensor([0, 1, -1, 9, 5])  # -1: padding, skipped
    reference.store_kvcache(keys, values, k_cache, v_cache, slots)
    table = torch.tensor([[0, 1, 2]])
    got = reference.gather_blocks(k_cache, table, into="keys")[0].transpose(0, 1)  # [12, H, D]
    expected = round_trip(keys, bits)
    for row, slot in ((0, 0), (1, 1), (3, 9), (4, 5)):
        assert torch.equal(got[slot], expected[row]), f"slot {slot} holds token {row}"
    assert torch.equal(got[2], torch.zeros(HEADS, DIM)), "the padded token wrote nothing"
    values_back = reference.gather_blocks(v_cache, table, into="values")[0].transpose(0, 1)
    assert torch.equal(values_back[9], round_trip(values, bits)[3])


def test_a_token_that_cannot_be_quantized_leaves_the_cache_as_it_was():
    engine = quantized_engine(8)
    before = [plane.clone() for plane in engine.gpu_planes]
    k_cache, v_cache = engine.layer(0)
    values = torch.randn(2, HEADS, DIM)
    values[1, 0, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or infinite"):
        reference.store_kvcache(
            torch.randn(2, HEADS, DIM), values, k_cache, v_cache, torch.tensor([0, 1])
        )
    assert all(torch.equal(a, b) for a, b in zip(engine.gpu_planes, before, strict=True)), (
        "nothing may be half-written: the keys were not stored either"
    )


def dense(query, keys, values, scale, causal_from=None):
    """Softmax attention of ``query [n, heads, D]`` over ``keys/values [ctx, kv_heads, D]``."""
    group = query.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1)
    v = values.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = query.transpose(0, 1) @ k.transpose(1, 2) * scale
    if causal_from is not None:
        positions = torch.arange(causal_from, causal_from + query.shape[0])
        scores = scores.masked_fill(
            torch.arange(keys.shape[0])[None, :] > positions[:, None], -1e30
        )
    return (scores.softmax(-1) @ v).transpose(0, 1)


@pytest.mark.parametrize("bits", [8, 4])
def test_paged_attention_equals_dense_attention_on_the_dequantized_values(bits):
    torch.manual_seed(bits)
    k_cache, v_cache = quantized_engine(bits, blocks=8).layer(0)
    tables = torch.tensor([[3, 0, 5], [6, 1, -1]])
    lengths = [11, 6]
    stored = []
    for table, length in zip(tables.tolist(), lengths, strict=True):
        keys, values = torch.randn(length, HEADS, DIM) * 2, torch.randn(length, HEADS, DIM)
        slots = torch.tensor([table[i // BLOCK] * BLOCK + i % BLOCK for i in range(length)])
        reference.store_kvcache(keys, values, k_cache, v_cache, slots)
        stored.append((round_trip(keys, bits), round_trip(values, bits)))
    scale = DIM**-0.5
    query = torch.randn(2, 4, DIM)
    out = reference.paged_decode_attention(
        query, k_cache, v_cache, tables, torch.tensor(lengths), scale
    )
    for i, (keys, values) in enumerate(stored):
        expected = dense(query[i : i + 1], keys, values, scale)[0]
        assert torch.allclose(out[i], expected, atol=1e-5), f"decode, sequence {i}"
    new = [3, 2]
    prefill_query = torch.randn(sum(new), 4, DIM)
    out = reference.paged_prefill_attention(
        prefill_query,
        k_cache,
        v_cache,
        torch.tensor([0, 3, 5]),
        tables,
        torch.tensor(lengths),
        scale,
    )
    for i, ((keys, values), start, count) in enumerate(zip(stored, (0, 3), new, strict=True)):
        rows = prefill_query[start : start + count]
        expected = dense(rows, keys, values, scale, causal_from=lengths[i] - count)
        assert torch.allclose(out[start : start + count], expected, atol=1e-5), f"prefill {i}"


@pytest.mark.parametrize("bits", [8, 4])
def test_the_triton_kernels_store_and_read_what_the_reference_does(bits):
    """Triton quantizes on store and dequantizes on load (here under the interpreter)."""
    torch.manual_seed(10 + bits)
    ours, theirs = quantized_engine(bits, blocks=8), quantized_engine(bits, blocks=8)
    keys, values = torch.randn(20, HEADS, DIM) * 2, torch.randn(20, HEADS, DIM)
    slots = torch.tensor([*range(19), -1])
    reference.store_kvcache(keys, values, *theirs.layer(1), slots)
    triton_attention.store_kvcache(keys, values, *ours.layer(1), slots)
    for name, a, b in zip(
        ("codes", "scale", "zero"), ours.gpu_planes, theirs.gpu_planes, strict=True
    ):
        steps = (a.float() - b.float()).abs().max()
        assert steps <= (1 if name == "codes" else 1e-6), f"{name}: the stores differ by {steps}"
    tables = torch.tensor([[0, 1, 2, 3, 4], [5, 6, 7, -1, -1]], dtype=torch.int32)
    lengths = torch.tensor([19, 10], dtype=torch.int32)
    query, scale = torch.randn(2, 4, DIM), DIM**-0.5
    caches = theirs.layer(1)
    expected = reference.paged_decode_attention(query, *caches, tables, lengths, scale)
    got = triton_attention.paged_decode_attention(query, *caches, tables, lengths, scale)
    assert torch.allclose(got, expected, atol=2e-5), "decode: triton against the reference"
    rows, cu_seqlens = torch.randn(5, 4, DIM), torch.tensor([0, 3, 5], dtype=torch.int32)
    expected = reference.paged_prefill_attention(rows, *caches, cu_seqlens, tables, lengths, scale)
    got = triton_attention.paged_prefill_attention(
        rows, *caches, cu_seqlens, tables, lengths, scale
    )
    assert torch.allclose(got, expected, atol=2e-5), "prefill: triton against the reference"


def test_the_triton_store_refuses_nan_before_writing():
    engine = quantized_engine(4)
    keys = torch.randn(2, HEADS, DIM)
    keys[0, 1, 2] = float("inf")
    with pytest.raises(ValueError, match="NaN or infinite"):
        triton_attention.store_kvcache(keys, keys.clone(), *engine.layer(0), torch.tensor([0, 1]))
    assert all(plane.abs().sum() == 0 for plane in engine.gpu_planes), "nothing written"


def test_int8_kv_generates_the_same_tokens_on_both_backends():
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = ["def fibonacci(n):\n", "import os\n"]
    outputs = [
        LLM(backend=backend, kv_cache_dtype="int8", block_size=16, num_gpu_blocks=16).generate(
            prompts, params, use_progress=False
        )
        for backend in ("torch", "triton")
    ]
    assert [o["token_ids"] for o in outputs[0]] == [o["token_ids"] for o in outputs[1]]


def test_swaps_and_copies_move_the_scales_with_the_codes():
    engine = quantized_engine(4, blocks=6, cpu_blocks=5)
    for plane in engine.gpu_planes:
        plane.copy_(torch.randint(0, 200, plane.shape).to(plane.dtype))
    before = [plane.clone() for plane in engine.gpu_planes]
    engine.swap_out({4: 0, 1: 3})
    for plane in engine.gpu_planes:
        plane.zero_()
    engine.swap_in({0: 2, 3: 5})
    engine.copy({2: [0]})
    for name, plane, old in zip(("codes", "scale", "zero"), engine.gpu_planes, before, strict=True):
        assert torch.equal(plane[:, :, 2], old[:, :, 4]), f"{name} of block 4 came back to 2"
        assert torch.equal(plane[:, :, 5], old[:, :, 1]), f"{name} of block 1 came back to 5"
        assert torch.equal(plane[:, :, 0], old[:, :, 4]), f"{name} copied on write to 0"


@pytest.mark.parametrize(
    ("dtype", "kv", "ratio"),
    [
        (torch.float16, "int8", 128 / 72),
        (torch.float16, "int4", 128 / 40),
        (torch.float32, "int8", 256 / 80),
    ],
)
def test_a_byte_budget_holds_more_quantized_blocks(dtype, kv, ratio):
    """vkv-tiny's shape: 4 layers, 4 KV heads of 32; scales in the model's dtype."""
    plain = CacheShape(4, 16, 4, 32, dtype)
    quantized = CacheShape(4, 16, 4, 32, dtype, kv)
    element = 2 if dtype == torch.float16 else 4
    assert quantized.block_bytes == 16 * bytes_per_token(4, 4, 32, kv, scale_bytes=element)
    budget = 1000 * plain.block_bytes
    assert quantized.num_blocks_for(budget) == int(1000 * ratio)


def test_bad_quantized_options_are_refused():
    with pytest.raises(
        ValueError, match="kv_cache_dtype must be one of auto, int8, int4, got 'fp8'"
    ):
        CacheShape(1, 4, 1, 8, torch.float32, "fp8")
    with pytest.raises(ValueError, match="needs an even head_dim, got 5"):
        CacheShape(1, 4, 1, 5, torch.float32, "int4")
    with pytest.raises(ValueError, match="must be one of auto, int8, int4, got 'int2'"):
        LLMEngine(kv_cache_dtype="int2", num_gpu_blocks=8)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_with_int8_kv_gives_the_tokens_of_an_ample_pool(mode):
    prompts = ["def fibonacci(n):\n", "import os\nimport sys\n", "class Stack:\n    def"]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ample = LLM(kv_cache_dtype="int8", block_size=4, num_gpu_blocks=128)
    tight = LLM(
        kv_cache_dtype="int8",
        block_size=4,
        num_gpu_blocks=16,
        num_cpu_blocks=32,
        preemption_mode=mode,
    )
    expected = [o["token_ids"] for o in ample.generate(prompts, params, use_progress=False)]
    got = [o["token_ids"] for o in tight.generate(prompts, params, use_progress=False)]
    assert tight.engine.scheduler.num_preemptions > 0, "the tight pool must preempt"
    assert got == expected, f"preemption by {mode} changed the tokens"


def test_generate_takes_a_kv_cache_dtype(capsys):
    argv = ["generate", "def", "--max-tokens", "4", "--temperature", "0"]
    assert main([*argv, "--kv-cache-dtype", "int4"]) == 0
    assert "int4:" in capsys.readouterr().err, "the startup line names the format and its gain"
    with pytest.raises(SystemExit) as refused:  # argparse: a choice outside the list
        main([*argv, "--kv-cache-dtype", "fp8"])
    assert refused.value.code == 2 and "invalid choice: 'fp8'" in capsys.readouterr().err
