"""Scheduler + ModelRunner + paged model generate exactly what the model generates without a
cache (transformers recomputing every sequence), also when a tiny pool forces preemption by
recompute or by swap, and with chunked prefill. Each attention backend runs where it runs
(``devices.py``), in float32, as transformers."""

import copy
import warnings

import pytest
import torch
from devices import BACKENDS, DEVICES
from tiny_checkpoints import greedy_by_recompute, paired

from vkv.config import Config
from vkv.engine.cache_engine import CacheEngine, CacheShape
from vkv.engine.llm_engine import LLMEngine
from vkv.engine.model_runner import ModelRunner, greedy_tokens, sample
from vkv.engine.scheduler import Scheduler
from vkv.engine.sequence import Sequence
from vkv.kernels import reference, triton_attention
from vkv.sampling_params import SamplingParams

PROMPTS = [
    [5, 17, 3, 88, 41, 9, 60],
    [1, 2, 3],
    [70, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80, 81],
    [(7 * i) % 96 for i in range(60)],  # one block of 64 for the prompt, two at the end
]
NEW_TOKENS = [9, 12, 6, 10]
FINAL_LENS = [len(p) + n for p, n in zip(PROMPTS, NEW_TOKENS, strict=True)]
BLOCK_SIZES = [1, 16, 64]
ON_BACKENDS = pytest.mark.parametrize(("backend", "device"), BACKENDS)
KERNELS = {"torch": reference, "triton": triton_attention}


@pytest.fixture(scope="module")
def models():
    """Our model on each of ``DEVICES``, and transformers' greedy tokens (on the CPU)."""
    hf, ours = paired("qwen3")
    expected = [greedy_by_recompute(hf, p, n) for p, n in zip(PROMPTS, NEW_TOKENS, strict=True)]
    return {device: copy.deepcopy(ours).to(device) for device in DEVICES}, expected


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def generate(model, backend, block_size, num_gpu_blocks, decode_sizes=None, **options):
    """Every prompt's tokens through the engine's parts, on ``model``'s device with ``backend``
    (a kernels module), and the number of preemptions. With ``decode_sizes``, decode steps run
    on the static buffers of CUDA graphs, padded to those batch sizes (eagerly)."""
    config = Config(
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks,
        max_model_len=128,
        max_num_seqs=4,
        watermark=0.0,
        **options,
    )
    scheduler = Scheduler(config)
    shape = CacheShape(2, config.block_size, 2, 16, torch.float32)
    device = next(model.parameters()).device
    cache = CacheEngine(shape, config.num_gpu_blocks, config.num_cpu_blocks, device)
    runner = ModelRunner(model, cache, scheduler.block_manager, backend)
    if decode_sizes:
        runner.use_decode_graphs(decode_sizes, blocks_for(128, block_size), capture=False)
    seqs = [
        Sequence(i, p, config.block_size, SamplingParams(temperature=0.0, max_tokens=n))
        for i, (p, n) in enumerate(zip(PROMPTS, NEW_TOKENS, strict=True))
    ]
    for seq in seqs:
        scheduler.add(seq)
    for _ in range(400):
        if scheduler.is_finished():
            break
        out = scheduler.schedule()
        runner.apply_block_maps(out, scheduler.running, scheduler.swapped)
        scheduler.postprocess(out.scheduled, runner.execute(out.scheduled))
    assert scheduler.is_finished()
    assert not decode_sizes or runner.decode_graphs.steps > 0, "no decode step was padded"
    return [seq.completion_token_ids for seq in seqs], scheduler.num_preemptions


def ample_pool(block_size: int) -> int:
    return sum(blocks_for(length, block_size) for length in FINAL_LENS)


def tight_pool(block_size: int) -> int:
    """Room for every prompt (and for the longest sequence), not for every completion."""
    prompts = sum(blocks_for(len(p), block_size) for p in PROMPTS)
    return max(prompts, blocks_for(max(FINAL_LENS), block_size))


@ON_BACKENDS
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_paged_engine_generates_what_recomputation_generates(models, backend, device, block_size):
    model, expected = models
    outputs, preemptions = generate(
        model[device], KERNELS[backend], block_size, ample_pool(block_size)
    )
    assert outputs == expected and preemptions == 0


@ON_BACKENDS
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_does_not_change_the_output(models, backend, device, block_size, mode):
    model, expected = models
    outputs, preemptions = generate(
        model[device],
        KERNELS[backend],
        block_size,
        tight_pool(block_size),
        num_cpu_blocks=ample_pool(block_size),
        preemption_mode=mode,
    )
    assert preemptions > 0, "the pool is meant to be too small for all four completions"
    assert outputs == expected


@pytest.mark.parametrize(
    ("backend", "device", "block_size"),
    [(b, d, size) for b, d in BACKENDS for size in BLOCK_SIZES if b == "torch" or size == 16],
)  # Triton interpreted at one block size: its padded rows are the kernel's, whatever the size
def test_decode_padded_to_a_graphs_batch_size_generates_the_same_tokens(
    models, backend, device, block_size
):
    """The inputs of the CUDA-graph path, run eagerly: 2 to 4 sequences decoding are padded to
    8 rows (slot -1, context 0), one to 1; the padding must change no token."""
    model, expected = models
    outputs, _ = generate(
        model[device], KERNELS[backend], block_size, ample_pool(block_size), decode_sizes=[1, 8]
    )
    assert outputs == expected


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_padded_decode_under_preemption_generates_the_same_tokens(models, device, mode):
    model, expected = models
    outputs, preemptions = generate(
        model[device],
        reference,
        16,
        tight_pool(16),
        decode_sizes=[2, 4],
        num_cpu_blocks=ample_pool(16),
        preemption_mode=mode,
    )
    assert preemptions > 0 and outputs == expected


def test_chunked_prefill_does_not_change_the_output(models, device):
    model, expected = models
    outputs, _ = generate(
        model[device], reference, 4, 64, enable_chunked_prefill=True, max_num_batched_tokens=5
    )
    assert outputs == expected


def test_seeded_sampling_is_reproducible_and_respects_top_k():
    logits = torch.tensor([0.0, 5.0, 4.0, -3.0])
    params = SamplingParams(temperature=1.0, top_k=2, seed=7)
    draws = [sample(logits, params, step) for step in range(50)]
    assert draws == [sample(logits, params, step) for step in range(50)]
    assert set(draws) <= {1, 2} and len(set(draws)) == 2
    assert sample(logits, SamplingParams(temperature=0.0), 0) == 1
    assert sample(logits, SamplingParams(temperature=1.0, top_p=0.5, seed=1), 0) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_greedy_tokens_are_each_rows_first_highest_score(dtype):
    logits = torch.randn(9, 257, generator=torch.Generator().manual_seed(0)).to(dtype)
    logits[3, [7, 40]] = 50.0  # a tie: the first one wins
    logits[5] = 0.0
    tokens = greedy_tokens(logits)
    assert tokens == logits.float().argmax(-1).tolist()
    assert tokens[3] == 7 and tokens[5] == 0
    assert all(type(token) is int for token in tokens)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="counts the host's waits for a GPU")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_a_step_waits_for_the_gpu_once_for_its_sampled_tokens(kv_cache_dtype, enforce_eager):
    """The host waits for the GPU once a step, for the sampled tokens: torch's sync debug mode
    warns at each wait (a device or stream synchronize, a copy to pageable host memory:
    ``.item()``, ``.tolist()``, ``bool()`` of a GPU tensor). Decode steps replayed from graphs or
    eager, with prefills joining them (the prefill kernel's grid from the host's lengths),
    16-bit or INT8 (whose NaN refusal is read after the tokens)."""
    engine = LLMEngine(
        max_num_seqs=8,
        max_model_len=256,
        kv_cache_dtype=kv_cache_dtype,
        enforce_eager=enforce_eager,
    )
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.add_request("def warm_up():\n", params)
    while engine.has_unfinished_requests():  # Triton compiles each kernel at its first launch
        engine.step()
    steps = 0
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for prompt in ("def add(a, b):\n", "import os\n", "class Stack:\n"):
                engine.add_request(prompt, params)
                for _ in range(3):
                    engine.step()
                    steps += 1
            while engine.has_unfinished_requests():
                engine.step()
                steps += 1
    finally:
        torch.cuda.set_sync_debug_mode(0)
    waits = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert len(waits) == steps, f"{len(waits)} waits in {steps} steps: {waits[:3]}"
