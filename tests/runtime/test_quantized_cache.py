"""The quantized paged KV cache (Phase 3 in the runtime): INT8 and INT4, per token and head,
and keys per channel (KIVI) with their full-precision residual.

Stored tokens read back as the Quantizer's dequantized values; paged attention on a quantized
cache equals dense attention on those dequantized values (both in float32, so to 1e-5); swaps
and copies move each block's scales with its codes; with INT8 KV, preemption by swap or by
recompute leaves the greedy tokens of a request unchanged (a recomputed token quantizes to the
same codes; a swapped block keeps them); the Triton kernels (under the interpreter on a CPU)
store and read what the reference does; bad input changes nothing. Keys per channel: a partial
block's keys read back exactly (the residual), a filled block's as the per-channel round trip of
its tokens; the residual follows its block through swaps and copies and gives its slots back.

Devices (``devices.py``): the reference runs on each of ``DEVICES``, its expected values made on
the same device; the Triton kernels on ``KERNEL_DEVICE``; engines that compare tokens in
``EXACT_DTYPE``.
"""

import dataclasses

import pytest
import torch
from devices import BACKENDS, EXACT_DTYPE, KERNEL_DEVICE

from vkv import LLM, SamplingParams
from vkv.cli import main
from vkv.engine.cache_engine import CacheEngine, CacheShape
from vkv.engine.llm_engine import LLMEngine
from vkv.engine.quantizer import Quantizer, bytes_per_token
from vkv.kernels import reference, triton_attention

HEADS, DIM, BLOCK = 2, 8, 4
PLANES = ("codes", "key scale", "key zero", "value scale", "value zero")


def quantized_engine(
    bits: int,
    device: str,
    blocks: int = 6,
    cpu_blocks: int = 4,
    group: str = "head",
    dim: int = DIM,
) -> CacheEngine:
    shape = CacheShape(2, BLOCK, HEADS, dim, torch.float32, f"int{bits}", quant_group=group)
    return CacheEngine(shape, blocks, cpu_blocks, torch.device(device))


def round_trip(x: torch.Tensor, bits: int, group: str = "head") -> torch.Tensor:
    """Per token: one group per KV head, or (``group="token"``) one for all of a token's."""
    quantizer = Quantizer(bits)
    grouped = x if group == "head" else x.reshape(x.shape[0], 1, -1)
    return quantizer.dequantize(quantizer.quantize(grouped, head_dim=x.shape[-1])).view_as(x)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_group_over_a_tokens_heads_dequantizes_to_what_it_quantized(bits):
    """A token-wide group packs INT4 a head at a time (``quantize(x, head_dim)``, as the store
    does); ``dequantize`` unpacks it the same way: within half a step of ``x``."""
    x = torch.randn(6, 1, 3 * DIM) * 3
    quantized = Quantizer(bits).quantize(x, head_dim=DIM)
    error = (Quantizer(bits).dequantize(quantized) - x).abs()
    assert bool((error <= quantized.scale / 2 + 1e-6).all())


@pytest.mark.parametrize("group", ["head", "token"])
@pytest.mark.parametrize("bits", [8, 4])
def test_stored_tokens_read_back_as_their_dequantized_values(bits, group, device):
    k_cache, v_cache = quantized_engine(bits, device, group=group).layer(1)
    keys = torch.randn(5, HEADS, DIM, device=device) * 3
    values = torch.randn(5, HEADS, DIM, device=device)
    slots = torch.tensor([0, 1, -1, 9, 5], device=device)  # -1: padding, skipped
    reference.store_kvcache(keys, values, k_cache, v_cache, slots)
    table = torch.tensor([[0, 1, 2]], device=device)
    got = reference.gather_blocks(k_cache, table, into="keys")[0].transpose(0, 1)  # [12, H, D]
    expected = round_trip(keys, bits, group)
    for row, slot in ((0, 0), (1, 1), (3, 9), (4, 5)):
        assert torch.equal(got[slot], expected[row]), f"slot {slot} holds token {row}"
    assert not got[2].any(), "the padded token wrote nothing"
    values_back = reference.gather_blocks(v_cache, table, into="values")[0].transpose(0, 1)
    assert torch.equal(values_back[9], round_trip(values, bits, group)[3])


def test_a_token_that_cannot_be_quantized_leaves_the_cache_as_it_was(device):
    engine = quantized_engine(8, device)
    before = [plane.clone() for plane in engine.gpu_planes]
    k_cache, v_cache = engine.layer(0)
    keys, values = torch.randn(2, 2, HEADS, DIM, device=device).unbind(0)
    values[1, 0, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or infinite"):
        reference.store_kvcache(keys, values, k_cache, v_cache, torch.tensor([0, 1], device=device))
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
        positions = torch.arange(causal_from, causal_from + query.shape[0], device=query.device)
        after = torch.arange(keys.shape[0], device=query.device)[None, :] > positions[:, None]
        scores = scores.masked_fill(after, -1e30)
    return (scores.softmax(-1) @ v).transpose(0, 1)


@pytest.mark.parametrize("group", ["head", "token"])
@pytest.mark.parametrize("bits", [8, 4])
def test_paged_attention_equals_dense_attention_on_the_dequantized_values(bits, group, device):
    torch.manual_seed(bits)
    k_cache, v_cache = quantized_engine(bits, device, blocks=8, group=group).layer(0)
    tables = torch.tensor([[3, 0, 5], [6, 1, -1]], device=device)
    lengths = [11, 6]
    stored = []
    for table, length in zip(tables.tolist(), lengths, strict=True):
        keys = torch.randn(length, HEADS, DIM, device=device) * 2
        values = torch.randn(length, HEADS, DIM, device=device)
        slots = [table[i // BLOCK] * BLOCK + i % BLOCK for i in range(length)]
        reference.store_kvcache(keys, values, k_cache, v_cache, torch.tensor(slots, device=device))
        stored.append((round_trip(keys, bits, group), round_trip(values, bits, group)))
    scale = DIM**-0.5
    query = torch.randn(2, 4, DIM, device=device)
    context_lens = torch.tensor(lengths, device=device)
    out = reference.paged_decode_attention(query, k_cache, v_cache, tables, context_lens, scale)
    for i, (keys, values) in enumerate(stored):
        expected = dense(query[i : i + 1], keys, values, scale)[0]
        assert torch.allclose(out[i], expected, atol=1e-5), f"decode, sequence {i}"
    new = [3, 2]
    prefill_query = torch.randn(sum(new), 4, DIM, device=device)
    cu_seqlens = torch.tensor([0, 3, 5], device=device)
    out = reference.paged_prefill_attention(
        prefill_query, k_cache, v_cache, cu_seqlens, tables, context_lens, scale
    )
    for i, ((keys, values), start, count) in enumerate(zip(stored, (0, 3), new, strict=True)):
        rows = prefill_query[start : start + count]
        expected = dense(rows, keys, values, scale, causal_from=lengths[i] - count)
        assert torch.allclose(out[start : start + count], expected, atol=1e-5), f"prefill {i}"


def assert_same_stores(ours: CacheEngine, theirs: CacheEngine) -> None:
    """Triton rounds halves up where torch rounds them to even: codes at most one apart."""
    for name, a, b in zip(PLANES, ours.gpu_planes, theirs.gpu_planes, strict=True):
        steps = (a.float() - b.float()).abs().max()
        assert steps <= (1 if name == "codes" else 1e-6), f"{name}: the stores differ by {steps}"


def assert_triton_reads_as_the_reference(
    caches, tables: list, lengths: list[int], **options
) -> None:
    """Decode and prefill attention over ``caches`` (on ``KERNEL_DEVICE``): Triton, launched
    with ``options``, against the reference."""
    tables = torch.tensor(tables, dtype=torch.int32, device=KERNEL_DEVICE)
    lengths = torch.tensor(lengths, dtype=torch.int32, device=KERNEL_DEVICE)
    dim = caches[0].codes.shape[-1] * 8 // caches[0].bits
    query, scale = torch.randn(2, 4, dim, device=KERNEL_DEVICE), dim**-0.5
    expected = reference.paged_decode_attention(query, *caches, tables, lengths, scale)
    got = triton_attention.paged_decode_attention(query, *caches, tables, lengths, scale, **options)
    assert torch.allclose(got, expected, atol=2e-5), "decode: triton against the reference"
    rows = torch.randn(5, 4, dim, device=KERNEL_DEVICE)
    cu_seqlens = torch.tensor([0, 3, 5], dtype=torch.int32, device=KERNEL_DEVICE)
    expected = reference.paged_prefill_attention(rows, *caches, cu_seqlens, tables, lengths, scale)
    got = triton_attention.paged_prefill_attention(
        rows, *caches, cu_seqlens, tables, lengths, scale, **options
    )
    assert torch.allclose(got, expected, atol=2e-5), "prefill: triton against the reference"


@pytest.mark.parametrize(
    ("group", "dim"),
    [("head", DIM), ("token", DIM), ("head", 32), ("token", 40)],
    ids=["head", "token", "head-full-halves", "token-dim-40"],
)
@pytest.mark.parametrize("bits", [8, 4])
def test_the_triton_kernels_store_and_read_what_the_reference_does(bits, group, dim):
    """Triton quantizes on store and dequantizes on load (on a CPU under the interpreter). The
    kernels split a head's channels in halves of ``BLOCK_D / 2`` lanes: 8 channels leave lanes
    4..15 of each half as padding, 32 fill both halves (no padding lane), 40 leave 12."""
    torch.manual_seed(10 + bits)
    ours = quantized_engine(bits, KERNEL_DEVICE, blocks=8, group=group, dim=dim)
    theirs = quantized_engine(bits, KERNEL_DEVICE, blocks=8, group=group, dim=dim)
    keys = torch.randn(20, HEADS, dim, device=KERNEL_DEVICE) * 2
    values = torch.randn(20, HEADS, dim, device=KERNEL_DEVICE)
    slots = torch.tensor([*range(19), -1], device=KERNEL_DEVICE)
    reference.store_kvcache(keys, values, *theirs.layer(1), slots)
    triton_attention.store_kvcache(keys, values, *ours.layer(1), slots)
    assert_same_stores(ours, theirs)
    tables = [[0, 1, 2, 3, 4], [5, 6, 7, -1, -1]]
    assert_triton_reads_as_the_reference(theirs.layer(1), tables, [19, 10])


def test_the_triton_store_refuses_nan_before_writing():
    """A cache without a step flag: the store raises before writing anything."""
    engine = quantized_engine(4, KERNEL_DEVICE)
    keys = torch.randn(2, HEADS, DIM, device=KERNEL_DEVICE)
    keys[0, 1, 2] = float("inf")
    slots = torch.tensor([0, 1], device=KERNEL_DEVICE)
    unflagged = [dataclasses.replace(c, refused=None) for c in engine.layer(0)]
    with pytest.raises(ValueError, match="NaN or infinite"):
        triton_attention.store_kvcache(keys, keys.clone(), *unflagged, slots)
    assert all(plane.abs().sum() == 0 for plane in engine.gpu_planes), "nothing written"


def test_the_engines_step_flag_refuses_on_the_device_for_the_rest_of_the_step():
    """The engine's caches quantized per token share a step flag (``refused``): the store sets
    it instead of raising (no wait for the device), no store writes while it is set (later
    layers included), the engine raises once the step is over, and clears it for the next."""
    engine = quantized_engine(8, KERNEL_DEVICE)
    assert engine.layer(0)[0].refused is engine.layer(1)[1].refused is engine.refused
    keys = torch.randn(2, HEADS, DIM, device=KERNEL_DEVICE)
    slots = torch.tensor([0, 1], device=KERNEL_DEVICE)
    poisoned = keys.clone()
    poisoned[1, 0, 2] = float("nan")
    engine.plan_step([0, 1])
    triton_attention.store_kvcache(poisoned, keys, *engine.layer(0), slots)  # no raise here
    triton_attention.store_kvcache(keys, keys, *engine.layer(1), slots)
    assert all(plane.abs().sum() == 0 for plane in engine.gpu_planes), "nothing written"
    engine.fetch_refusal()
    with pytest.raises(ValueError, match="NaN or infinite"):
        engine.raise_if_refused()
    engine.plan_step([0, 1])
    triton_attention.store_kvcache(keys, keys, *engine.layer(1), slots)
    engine.fetch_refusal()
    engine.raise_if_refused()
    assert engine.gpu_planes[0].abs().sum() > 0, "the next step writes"
    per_channel = channel_engine(8, KERNEL_DEVICE)
    assert per_channel.refused is None and per_channel.layer(0)[0].refused is None
    with pytest.raises(ValueError, match="per token only"):
        dataclasses.replace(per_channel.layer(0)[0], refused=engine.refused)


@pytest.mark.parametrize(
    ("keys", "group", "block_size"),
    [
        ("per_token", "head", 4),
        ("per_channel", "head", 4),
        ("per_token", "token", 4),
        ("per_channel", "head", 16),  # Triton's tiles of 64 tokens span blocks of 16
    ],
)
def test_int8_kv_generates_the_same_tokens_on_both_backends(keys, group, block_size):
    """Each backend on each device it runs on (``BACKENDS``) gives the same tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = ["def fibonacci(n):\n", "import os\n"]
    tokens = {}
    for backend, device in BACKENDS:
        llm = LLM(
            backend=backend,
            device=device,
            dtype=EXACT_DTYPE,
            kv_cache_dtype="int8",
            key_granularity=keys,
            kv_quant_group=group,
            block_size=block_size,
            num_gpu_blocks=16,
        )
        outputs = llm.generate(prompts, params, use_progress=False)
        tokens[f"{backend} on {device}"] = [output["token_ids"] for output in outputs]
    assert len(set(map(str, tokens.values()))) == 1, tokens


def test_swaps_and_copies_move_the_scales_with_the_codes(device):
    engine = quantized_engine(4, device, blocks=6, cpu_blocks=5)
    for plane in engine.gpu_planes:
        plane.copy_(torch.randint(0, 200, plane.shape).to(plane.dtype))
    before = [plane.clone() for plane in engine.gpu_planes]
    engine.swap_out({4: 0, 1: 3})
    for plane in engine.gpu_planes:
        plane.zero_()
    engine.swap_in({0: 2, 3: 5})
    engine.copy({2: [0]})
    for name, plane, old in zip(PLANES, engine.gpu_planes, before, strict=True):
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


@pytest.mark.parametrize(("kv", "ratio"), [("int8", 256 / 132), ("int4", 256 / 68)])
def test_one_scale_per_token_meets_the_capacity_bars_at_head_dim_32(kv, ratio):
    """A group of all 4 heads (128 values) per token: 1.94x and 3.76x the blocks of fp16."""
    plain = CacheShape(4, 16, 4, 32, torch.float16)
    grouped = CacheShape(4, 16, 4, 32, torch.float16, kv, quant_group="token")
    assert grouped.block_bytes == 16 * bytes_per_token(4, 1, 128, kv, scale_bytes=2)
    assert grouped.num_blocks_for(1000 * plain.block_bytes) == int(1000 * ratio)
    assert ratio >= (1.9 if kv == "int8" else 3.5)


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
def test_preemption_with_int8_kv_gives_the_tokens_of_an_ample_pool(mode, device):
    prompts = ["def fibonacci(n):\n", "import os\nimport sys\n", "class Stack:\n    def"]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    options = {"kv_cache_dtype": "int8", "block_size": 4, "device": device, "dtype": EXACT_DTYPE}
    ample = LLM(num_gpu_blocks=128, **options)
    tight = LLM(num_gpu_blocks=16, num_cpu_blocks=32, preemption_mode=mode, **options)
    expected = [o["token_ids"] for o in ample.generate(prompts, params, use_progress=False)]
    got = [o["token_ids"] for o in tight.generate(prompts, params, use_progress=False)]
    assert tight.engine.scheduler.num_preemptions > 0, "the tight pool must preempt"
    assert got == expected, f"preemption by {mode} changed the tokens"


def test_generate_takes_a_kv_cache_dtype(capsys):
    argv = ["generate", "def", "--max-tokens", "4", "--temperature", "0"]
    assert main([*argv, "--kv-cache-dtype", "int4"]) == 0
    line = capsys.readouterr().err
    assert "int4, float32 scales: a block 2.67x smaller than 16-bit" in line, (
        "the startup line names the format, the scales' dtype and the gain"
    )
    with pytest.raises(SystemExit) as refused:  # argparse: a choice outside the list
        main([*argv, "--kv-cache-dtype", "fp8"])
    assert refused.value.code == 2 and "invalid choice: 'fp8'" in capsys.readouterr().err


# Keys per channel (KIVI): the residual holds a partial block's keys until the block fills.


def channel_engine(
    bits: int,
    device: str,
    blocks: int = 8,
    cpu_blocks: int = 4,
    slots: int = 4,
    group: str = "head",
) -> CacheEngine:
    shape = CacheShape(2, BLOCK, HEADS, DIM, torch.float32, f"int{bits}", "per_channel", group)
    return CacheEngine(shape, blocks, cpu_blocks, torch.device(device), residual_slots=slots)


def store(engine: CacheEngine, keys, values, slots: list[int], backend=reference) -> None:
    """One step: plan the key writes for ``slots``, then store every layer."""
    engine.plan_step(slots)
    slot_mapping = torch.tensor(slots, device=engine.device)
    for layer in range(2):
        backend.store_kvcache(keys, values, *engine.layer(layer), slot_mapping)


def read_keys(engine: CacheEngine, table: list[int], layer: int = 1) -> torch.Tensor:
    """The keys attention reads through ``table``: ``[tokens, heads, dim]``."""
    tables = torch.tensor([table], device=engine.device)
    keys = reference.gather_blocks(engine.layer(layer)[0], tables, into="keys")
    return keys[0].transpose(0, 1)


def channel_round_trip(keys: torch.Tensor, bits: int) -> torch.Tensor:
    quantizer = Quantizer(bits, "per_channel")
    return quantizer.dequantize(quantizer.quantize(keys))


def slots_of(table: list[int], start: int, end: int) -> list[int]:
    return [table[i // BLOCK] * BLOCK + i % BLOCK for i in range(start, end)]


@pytest.mark.parametrize("bits", [8, 4])
def test_keys_per_channel_wait_in_full_precision_until_their_block_fills(bits, device):
    engine = channel_engine(bits, device)
    table = [3, 1, 6]
    keys = torch.randn(10, HEADS, DIM, device=device) * 3
    values = torch.randn(10, HEADS, DIM, device=device)
    store(engine, keys[:3], values[:3], slots_of(table, 0, 3))  # block 3 partial
    assert torch.equal(read_keys(engine, table)[:3], keys[:3]), "a partial block reads exactly"
    store(engine, keys[3:4], values[3:4], slots_of(table, 3, 4))  # fills block 3
    expected = channel_round_trip(keys[:4], bits)
    assert torch.equal(read_keys(engine, table)[:4], expected), (
        "a filled block reads as the per-channel round trip of its four tokens"
    )
    engine.apply({}, {}, {}, partial_gpu=set())
    assert engine.residual.num_used == 0, "the filled block gave its slot back at the next step"
    store(engine, keys[4:10], values[4:10], slots_of(table, 4, 10))  # fills 1, leaves 6 partial
    read = read_keys(engine, table)
    assert torch.equal(read[4:8], channel_round_trip(keys[4:8], bits)), "filled straight away"
    assert torch.equal(read[8:10], keys[8:10]), "the new partial block reads exactly"
    assert torch.equal(read[:4], expected), "earlier blocks are unchanged"
    values_back = reference.gather_blocks(
        engine.layer(1)[1], torch.tensor([table], device=device), "values"
    )
    assert torch.equal(values_back[0].transpose(0, 1)[:10], round_trip(values, bits)), (
        "values stay per token"
    )
    assert engine.residual.num_used == 1


def test_a_step_that_runs_again_reads_the_same_keys(device):
    """``LLMEngine`` re-runs a failed batch: planning and storing twice changes nothing."""
    engine = channel_engine(8, device)
    table = [2, 5]
    keys = torch.randn(7, HEADS, DIM, device=device)
    values = torch.randn(7, HEADS, DIM, device=device)
    store(engine, keys[:3], values[:3], slots_of(table, 0, 3))
    engine.apply({}, {}, {}, partial_gpu={2})
    store(engine, keys[3:7], values[3:7], slots_of(table, 3, 7))
    once = read_keys(engine, table)[:7].clone()
    store(engine, keys[3:7], values[3:7], slots_of(table, 3, 7))
    assert torch.equal(read_keys(engine, table)[:7], once)


def test_a_block_written_past_offset_zero_without_a_residual_is_an_error(device):
    engine = channel_engine(8, device)
    with pytest.raises(RuntimeError, match="block 2 is written from offset 1 but holds no key"):
        engine.plan_step([9])


def test_a_freed_partial_block_gives_its_slot_back_even_when_already_given_to_another(device):
    """The scheduler may hand a freed block to a new sequence before the step's maps are
    applied (a chunked prefill writes it steps later): what is no running sequence's partial
    block gives its slot back, whoever holds the block now."""
    engine = channel_engine(8, device, slots=2)
    keys = torch.randn(6, HEADS, DIM, device=device)
    values = torch.randn(6, HEADS, DIM, device=device)
    store(engine, keys[:2], values[:2], [4, 5])  # block 1, partial
    store(engine, keys[2:4], values[2:4], [8, 9])  # block 2, partial
    assert engine.residual.gpu_blocks == {1, 2}
    engine.apply({}, {}, {}, partial_gpu={2})  # block 1's owner finished; 1 now has a new owner
    assert engine.residual.gpu_blocks == {2}
    store(engine, keys[4:5], values[4:5], [12])  # block 3 takes the slot given back
    store(engine, keys[5:6], values[5:6], [8])  # block 2 rewritten from offset 0: no stale rows
    assert torch.equal(read_keys(engine, [2])[0], keys[5])
    assert engine.residual.num_used == 2


@pytest.mark.parametrize("bits", [8, 4])
def test_the_residual_follows_its_block_through_swaps_and_copies(bits, device):
    engine = channel_engine(bits, device, blocks=8, cpu_blocks=4)
    keys = torch.randn(6, HEADS, DIM, device=device) * 2
    values = torch.randn(6, HEADS, DIM, device=device)
    store(engine, keys, values, slots_of([4, 5], 0, 6))  # block 4 full, block 5 partial
    engine.apply({4: 0, 5: 1}, {}, {}, partial_cpu={1})  # swapped out: 5 is the partial one
    assert engine.residual.num_used == 0 and engine.residual.cpu_blocks == {1}
    other_keys, other_values = torch.randn(2, 4, HEADS, DIM, device=device).unbind(0)
    store(engine, other_keys, other_values, [20, 21, 22, 23])
    engine.apply({}, {0: 6, 1: 7}, {}, partial_gpu={7})  # back into other blocks
    assert engine.residual.gpu_blocks == {7} and engine.residual.cpu_blocks == set()
    engine.plan_step(slots_of([6, 7], 6, 7))  # the next token goes to block 7, offset 2
    expected = torch.cat((channel_round_trip(keys[:4], bits), keys[4:6]))
    assert torch.equal(read_keys(engine, [6, 7])[:6], expected), (
        "a swapped block came back with its codes, scales and residual rows"
    )
    engine.apply({}, {}, {7: [2]}, partial_gpu={7, 2})  # copy-on-write of the partial block
    engine.plan_step(slots_of([6, 2], 6, 7))
    assert torch.equal(read_keys(engine, [6, 2])[4:6], keys[4:6]), "the copy has the rows too"
    engine.apply({6: 3, 2: 2}, {}, {}, partial_gpu={7}, partial_cpu=set())
    assert engine.residual.cpu_blocks == set(), "a block swapped out whole takes no rows"
    assert engine.residual.gpu_blocks == {7}


def test_slots_are_given_back_before_a_swap_in_takes_one(device):
    """Two slots, both held by blocks that filled last step: a swap-in still finds one."""
    engine = channel_engine(8, device, slots=2)
    keys = torch.randn(10, HEADS, DIM, device=device)
    values = torch.randn(10, HEADS, DIM, device=device)
    store(engine, keys[8:10], values[8:10], [8, 9])  # block 2, partial
    engine.apply({2: 3}, {}, {}, partial_cpu={3})  # swapped out with its rows
    store(engine, keys[:3], values[:3], [0, 1, 2])
    store(engine, keys[3:6], values[3:6], [4, 5, 6])
    engine.apply({}, {}, {}, partial_gpu={0, 1}, partial_cpu={3})  # block 3 stays swapped
    store(engine, keys[6:8], values[6:8], [3, 7])  # both blocks fill: their slots stay a step
    engine.apply({}, {3: 5}, {}, partial_gpu={5})
    assert engine.residual.gpu_blocks == {5} and engine.residual.cpu_blocks == set()
    engine.plan_step([22])
    assert torch.equal(read_keys(engine, [5])[:2], keys[8:10]), "the swapped-in rows"


@pytest.mark.parametrize("bits", [8, 4])
def test_paged_attention_with_keys_per_channel_equals_dense_attention(bits, device):
    torch.manual_seed(20 + bits)
    engine = channel_engine(bits, device, blocks=8)
    tables, lengths = [[3, 0, 5], [6, 1, -1]], [11, 6]
    stored = []
    for table, length in zip(tables, lengths, strict=True):
        keys = torch.randn(length, HEADS, DIM, device=device) * 2
        values = torch.randn(length, HEADS, DIM, device=device)
        store(engine, keys, values, slots_of(table, 0, length))
        full = length // BLOCK * BLOCK
        expected_keys = torch.cat(
            (
                channel_round_trip(keys[:full].view(-1, BLOCK, HEADS, DIM).transpose(0, 1), bits)
                .transpose(0, 1)
                .reshape(full, HEADS, DIM),
                keys[full:],
            )
        )
        stored.append((expected_keys, round_trip(values, bits)))
    engine.plan_step(slots_of(tables[0], 10, 11) + slots_of(tables[1], 5, 6))  # both partial
    k_cache, v_cache = engine.layer(1)
    scale, query = DIM**-0.5, torch.randn(2, 4, DIM, device=device)
    table_rows = torch.tensor(tables, device=device)
    context_lens = torch.tensor(lengths, device=device)
    out = reference.paged_decode_attention(query, k_cache, v_cache, table_rows, context_lens, scale)
    for i, (keys, values) in enumerate(stored):
        expected = dense(query[i : i + 1], keys, values, scale)[0]
        assert torch.allclose(out[i], expected, atol=1e-5), f"decode, sequence {i}"
    rows, cu_seqlens = torch.randn(5, 4, DIM, device=device), torch.tensor([0, 3, 5], device=device)
    out = reference.paged_prefill_attention(
        rows, k_cache, v_cache, cu_seqlens, table_rows, context_lens, scale
    )
    for i, ((keys, values), start, count) in enumerate(zip(stored, (0, 3), (3, 2), strict=True)):
        expected = dense(rows[start : start + count], keys, values, scale, lengths[i] - count)
        assert torch.allclose(out[start : start + count], expected, atol=1e-5), f"prefill {i}"


@pytest.mark.parametrize("group", ["head", "token"])
@pytest.mark.parametrize("bits", [8, 4])
def test_the_triton_kernels_handle_keys_per_channel_as_the_reference_does(bits, group):
    """Values grouped per head or per token (all heads), keys per channel with a residual."""
    torch.manual_seed(30 + bits)
    ours = channel_engine(bits, KERNEL_DEVICE, group=group)
    theirs = channel_engine(bits, KERNEL_DEVICE, group=group)
    keys = torch.randn(18, HEADS, DIM, device=KERNEL_DEVICE) * 2
    values = torch.randn(18, HEADS, DIM, device=KERNEL_DEVICE)
    slots = slots_of([0, 1, 2], 0, 11) + slots_of([5, 6], 0, 7)
    store(theirs, keys, values, slots)
    store(ours, keys, values, slots, backend=triton_attention)
    assert_same_stores(ours, theirs)
    assert torch.equal(ours.residual.keys, theirs.residual.keys)
    assert_triton_reads_as_the_reference(theirs.layer(0), [[0, 1, 2], [5, 6, -1]], [11, 7])


@pytest.mark.parametrize(("backend", "device"), BACKENDS)
def test_a_nan_key_per_channel_leaves_cache_and_residual_as_they_were(backend, device):
    engine = channel_engine(8, device)
    keys, values = torch.randn(2, 5, HEADS, DIM, device=device).unbind(0)
    keys[4, 0, 1] = float("nan")
    kernels = triton_attention if backend == "triton" else reference
    with pytest.raises(ValueError, match="NaN or infinite"):
        store(engine, keys, values, list(range(5)), kernels)
    assert all(plane.abs().sum() == 0 for plane in engine.gpu_planes)
    assert engine.residual.keys.abs().sum() == 0


@pytest.mark.parametrize("block_size", [16, 48, 64])
@pytest.mark.parametrize("bits", [8, 4])
def test_triton_folds_a_blocks_channel_scales_into_the_query_as_the_reference_reads(
    bits, block_size
):
    """Blocks of a multiple of 16 tokens, asked to fold (``fold_keys``): a tile inside one block,
    its keys' scales folded into the query (``FOLD_KEYS``: tiles of 16, 16 and 64 here), full
    blocks and a partial one in the residual, one split or several (a split is whole tiles);
    and the default, each lane its own scale, in tiles across blocks."""
    torch.manual_seed(40 + bits)
    shape = CacheShape(2, block_size, HEADS, DIM, torch.float32, f"int{bits}", "per_channel")
    engine = CacheEngine(shape, 8, 0, torch.device(KERNEL_DEVICE), residual_slots=4)
    tables, lengths = [[3, 1, 6], [5, 2, -1]], [2 * block_size + 5, block_size + 3]
    slots = [
        table[i // block_size] * block_size + i % block_size
        for table, length in zip(tables, lengths, strict=True)
        for i in range(length)
    ]
    keys = torch.randn(len(slots), HEADS, DIM, device=KERNEL_DEVICE) * 3
    store(engine, keys, torch.randn_like(keys), slots)
    assert_triton_reads_as_the_reference(engine.layer(1), tables, lengths, fold_keys=True)
    assert_triton_reads_as_the_reference(engine.layer(1), tables, lengths)
    query = torch.randn(2, 4, DIM, device=KERNEL_DEVICE)
    args = (*engine.layer(0), torch.tensor(tables, device=KERNEL_DEVICE).int())
    args += (torch.tensor(lengths, device=KERNEL_DEVICE).int(), DIM**-0.5)
    expected = reference.paged_decode_attention(query, *args)
    for splits in (2, 5):
        got = triton_attention.paged_decode_attention(
            query, *args, num_splits=splits, fold_keys=True
        )
        assert torch.allclose(got, expected, atol=2e-5), f"{splits} splits"
    # the default, at another tile the GPU sweep times: every lane its own scale, tiles of 32
    got = triton_attention.paged_decode_attention(query, *args, block_n=32)
    assert torch.allclose(got, expected, atol=2e-5), "not folded"


def tokens_engine(bits: int, keys: str, dim: int) -> tuple[CacheEngine, list, list[int]]:
    """A cache of 16-token blocks in ``KERNEL_DEVICE`` holding two sequences (37 and 19 tokens:
    full blocks and partial ones), its tables and lengths; keys and values off zero."""
    shape = CacheShape(2, 16, HEADS, dim, torch.float32, f"int{bits}", keys)
    engine = CacheEngine(shape, 8, 0, torch.device(KERNEL_DEVICE), residual_slots=4)
    tables, lengths = [[3, 1, 6], [5, 2, -1]], [37, 19]
    slots = [
        t[i // 16] * 16 + i % 16 for t, n in zip(tables, lengths, strict=True) for i in range(n)
    ]
    keys = torch.randn(len(slots), HEADS, dim, device=KERNEL_DEVICE) * 3 + 1
    store(engine, keys, torch.randn_like(keys) - 0.5, slots)
    return engine, tables, lengths


@pytest.mark.parametrize(
    ("kv", "fold_scales"),
    [("auto", False), ("int8", False), ("int8", True), ("int4", False), ("int4", True)],
)
def test_a_padded_row_of_a_captured_batch_reads_nothing_and_gives_zeros(kv, fold_scales):
    """A CUDA graph's padding row (``decode_graphs.py``): a context of 0 and a table of -1.
    Triton's decode gives 0 for it, in every cache format that graphs capture, also where the
    table points at a block of large values (its context, not its table, keeps it from reading
    them), and the real rows beside it get what they get unpadded."""
    torch.manual_seed(7)
    shape = CacheShape(2, 16, HEADS, 64, torch.float32, kv)
    engine = CacheEngine(shape, 8, 0, torch.device(KERNEL_DEVICE))
    tables, lengths = [[3, 1, 6], [5, 2, -1]], [37, 19]
    slots = [
        t[i // 16] * 16 + i % 16 for t, n in zip(tables, lengths, strict=True) for i in range(n)
    ]
    keys = torch.randn(len(slots), HEADS, 64, device=KERNEL_DEVICE)
    store(engine, keys, torch.randn_like(keys), slots)
    for cache in engine.layer(1):  # block 7, which no sequence holds, reads as 1,000s
        (cache if kv == "auto" else cache.zero)[7] = 1000.0

    def decode(tables: list, lengths: list[int], query: torch.Tensor) -> torch.Tensor:
        tables = torch.tensor(tables, dtype=torch.int32, device=KERNEL_DEVICE)
        lengths = torch.tensor(lengths, dtype=torch.int32, device=KERNEL_DEVICE)
        return triton_attention.paged_decode_attention(
            query, *engine.layer(1), tables, lengths, 0.125, fold_scales=fold_scales
        )

    query = torch.randn(4, 4, 64, device=KERNEL_DEVICE)
    padded = decode([*tables, [-1, -1, -1], [7, 7, 7]], [*lengths, 0, 0], query)
    assert torch.equal(padded[2:], torch.zeros_like(padded[2:])), "a context of 0 reads nothing"
    assert torch.allclose(padded[:2], decode(tables, lengths, query[:2]), atol=1e-6)


@pytest.mark.parametrize("dim", [64, 72], ids=["full-quarters", "padding-lanes"])
@pytest.mark.parametrize("keys", ["per_token", "per_channel"])
@pytest.mark.parametrize("bits", [8, 4])
def test_triton_takes_the_per_token_scales_out_of_the_tile_as_the_reference_reads(bits, keys, dim):
    """``fold_scales``: a tile's codes read as 16-bit words and split into four quarters (each
    half's even and odd channels), its per-token scales and zeros applied to the scores
    (``s (q · c) + z Σq``) and to the weights (``(p ∘ s) · c + Σ p z``) instead of to every
    value: the reference's output, decode (one split and three) and prefill. Keys per channel
    fold their values' scales only; 72 channels leave padding lanes (18 of a quarter's 32). A
    float16 query's output (codes and weights in float16) is as near as the unfolded kernel's."""
    torch.manual_seed(50 + bits)
    engine, tables, lengths = tokens_engine(bits, keys, dim)
    assert_triton_reads_as_the_reference(engine.layer(1), tables, lengths, fold_scales=True)
    query = torch.randn(2, 4, dim, device=KERNEL_DEVICE)
    args = (*engine.layer(1), torch.tensor(tables, device=KERNEL_DEVICE).int())
    args += (torch.tensor(lengths, device=KERNEL_DEVICE).int(), dim**-0.5)
    expected = reference.paged_decode_attention(query, *args)
    got = triton_attention.paged_decode_attention(query, *args, num_splits=3, fold_scales=True)
    assert torch.allclose(got, expected, atol=2e-5), "3 splits"
    for fold in (False, True):
        got = triton_attention.paged_decode_attention(query.half(), *args, fold_scales=fold)
        assert torch.allclose(got.float(), expected, atol=5e-3), f"float16, folded: {fold}"


@pytest.mark.skipif(KERNEL_DEVICE == "cpu", reason="bfloat16 and PTX: the interpreter runs neither")
@pytest.mark.parametrize("bits", [8, 4])
def test_a_bfloat16_query_past_float16s_range_folds_its_scales_as_it_reads_them(bits):
    """A GPU folds in float16 (its codes split by PTX); a bfloat16 query larger than float16's
    largest value (65,504) is scaled down by a power of two a row, and its scores back up."""
    torch.manual_seed(60 + bits)
    engine, tables, lengths = tokens_engine(bits, "per_token", 128)
    query = (torch.randn(2, 4, 128, device=KERNEL_DEVICE) * 2e5).bfloat16()
    args = (*engine.layer(1), torch.tensor(tables, device=KERNEL_DEVICE).int())
    args += (torch.tensor(lengths, device=KERNEL_DEVICE).int(), 128**-0.5)
    expected = reference.paged_decode_attention(query.float(), *args)
    got = triton_attention.paged_decode_attention(query, *args, fold_scales=True)
    assert got.isfinite().all() and torch.allclose(got.float(), expected, atol=2e-2)


@pytest.mark.parametrize("bits", [8, 4])
def test_swap_preemption_with_keys_per_channel_gives_the_tokens_of_an_ample_pool(bits, device):
    """A swap moves codes, scales and residual rows exactly. (Recompute is not exact with keys
    per channel: a recomputed token attends to its own block quantized, where it first read it
    in full precision; it must still serve every request and hand every slot back.)"""
    prompts = ["def fibonacci(n):\n", "import os\nimport sys\n", "class Stack:\n    def"]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    options = {"kv_cache_dtype": f"int{bits}", "key_granularity": "per_channel", "block_size": 4}
    options |= {"device": device, "dtype": EXACT_DTYPE}
    ample = LLM(num_gpu_blocks=128, **options)
    expected = [o["token_ids"] for o in ample.generate(prompts, params, use_progress=False)]
    for mode in ("swap", "recompute"):
        tight = LLM(num_gpu_blocks=16, num_cpu_blocks=32, preemption_mode=mode, **options)
        got = [o["token_ids"] for o in tight.generate(prompts, params, use_progress=False)]
        assert tight.engine.scheduler.num_preemptions > 0, "the tight pool must preempt"
        assert all(len(tokens) == 40 for tokens in got)
        if mode == "swap":
            assert got == expected, "preemption by swap changed the tokens"
        cache = tight.engine.cache_engine
        cache.apply({}, {}, {})  # every request is done: no block is partial
        assert cache.residual.num_used == 0


def test_a_block_freed_partial_and_reused_by_a_chunked_prefill_keeps_no_slot():
    """One slot-pair pool (max_num_seqs 1): the first request's partial block goes, unwritten,
    to the second request's chunked prefill; its stale slot must not exhaust the pool."""
    llm = LLM(
        kv_cache_dtype="int8",
        key_granularity="per_channel",
        block_size=4,
        num_gpu_blocks=8,
        max_num_seqs=1,
        enable_chunked_prefill=True,
        max_num_batched_tokens=5,
    )
    engine, params = llm.engine, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.add_request(list(range(1, 3)), params)
    engine.add_request(list(range(10, 40)), params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert output.error is None, output.error


def test_keys_per_channel_are_an_option_of_the_cli_and_of_the_budget(capsys):
    argv = ["generate", "def", "--max-tokens", "4", "--temperature", "0"]
    assert main([*argv, "--kv-cache-dtype", "int8", "--key-granularity", "per_channel"]) == 0
    assert "int8, keys per channel, float32 scales: a block" in capsys.readouterr().err
    assert main([*argv, "--key-granularity", "per_channel"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: keys per channel need a quantized KV cache (kv_cache_dtype int8 or int4)"
    ], err
    shape = CacheShape(4, 16, 4, 32, torch.float16, "int4", "per_channel")
    assert shape.block_bytes == 16 * bytes_per_token(4, 4, 32, "int4", "per_channel", 16)
    assert shape.residual_bytes(3) == 3 * 16 * 4 * 4 * 32 * 2, "full-precision keys, every layer"
    with pytest.raises(ValueError, match="key_granularity must be one of per_token, per_channel"):
        CacheShape(1, 4, 1, 8, torch.float32, "int8", "per_block")
    with pytest.raises(ValueError, match="kv_quant_group must be one of head, token, got 'layer'"):
        CacheShape(1, 4, 1, 8, torch.float32, "int8", quant_group="layer")
    with pytest.raises(ValueError, match="a quantization group needs a quantized KV cache"):
        CacheShape(1, 4, 1, 8, torch.float32, quant_group="token")
    assert main([*argv, "--kv-cache-dtype", "int4", "--kv-quant-group", "token"]) == 0
    assert "int4, one scale per token, float32 scales: a block" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"the key residual .* fills the KV budget"):
        LLMEngine(kv_cache_dtype="int8", key_granularity="per_channel", kv_cache_bytes=4096)


@pytest.mark.parametrize(("backend", "device"), BACKENDS[:1] + BACKENDS[-1:])
def test_a_request_whose_keys_cannot_be_quantized_fails_alone(backend, device):
    """A prompt token whose embedding is NaN: the batch's step is refused (torch: the store
    raises in it; Triton: the step flag, read once the step's tokens are on the host), each
    sequence runs again alone, and that request fails with the store's error while the others
    gain the tokens they gain without it."""
    llm = LLM(kv_cache_dtype="int8", backend=backend, device=device, dtype=EXACT_DTYPE)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    prompts = [[100, 101, 102], [120, 7, 121], [130, 131]]
    healthy = [prompts[0], prompts[2]]
    alone = [o["token_ids"] for o in llm.generate(healthy, params, use_progress=False)]
    embed = llm.engine.runner.model.model.embed_tokens
    poisoned = embed.weight.detach().clone()  # the input's table only (vkv-tiny ties lm_head)
    poisoned[7, 0] = float("nan")
    embed.weight = torch.nn.Parameter(poisoned, requires_grad=False)
    outputs = llm.generate(prompts, params, use_progress=False)
    assert [outputs[0]["token_ids"], outputs[2]["token_ids"]] == alone
    failed = outputs[1]
    assert failed["finish_reason"] == "error" and failed["token_ids"] == [], failed
    assert failed["error"].startswith("ValueError: cannot quantize NaN or infinite values")
