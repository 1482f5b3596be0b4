"""The decode step on the static buffers of CUDA graphs (``decode_graphs.py``), run eagerly on a
CPU: what a replay computes, without a GPU to capture one.

A step of n sequences padded to a captured size must give the logits the eager step gives and
write the cache slots of its n tokens and no other (a padded row has slot -1 and a context of
0); the trained vkv-tiny (whose tokens follow its inputs, unlike a random model's, which repeat
one token) must complete prompts the same with and without the padding, at block sizes 1 and
16. Which engines capture graphs at all (``graph_plan``) and which batch sizes are checked here;
the capture itself runs only on a GPU (``scripts/gpu_check.sh``).
"""

import copy
import dataclasses
import re

import pytest
import torch
from devices import EXACT_DTYPE, KERNEL_DEVICE
from tiny_checkpoints import paired

from vkv.config import Config
from vkv.engine.cache_engine import CacheEngine, CacheShape
from vkv.engine.decode_graphs import graph_batch_sizes, graph_plan
from vkv.engine.llm_engine import LLMEngine
from vkv.engine.model_runner import ModelRunner, StepBatch
from vkv.kernels import cpu_attention, triton_attention
from vkv.sampling_params import SamplingParams


def test_batch_sizes_are_powers_of_two_to_8_then_multiples_of_16():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_batch_sizes(50) == [1, 2, 4, 8, 16, 32, 48, 50]


def test_a_cuda_engine_on_triton_captures_unless_keys_are_per_channel():
    config = Config(block_size=16, max_model_len=100, max_num_seqs=20)
    plain = CacheShape(2, 16, 2, 16, torch.float16)
    per_token = CacheShape(2, 16, 2, 16, torch.float16, "int8")
    per_channel = CacheShape(2, 16, 2, 16, torch.float16, "int8", "per_channel")
    cuda = torch.device("cuda")
    for shape in (plain, per_token):
        assert graph_plan(cuda, "triton", shape, False, config) == ([1, 2, 4, 8, 16, 20], 7)
    assert graph_plan(cuda, "triton", plain, True, config) is None, "enforce_eager"
    assert graph_plan(torch.device("cpu"), "triton", plain, False, config) is None
    assert graph_plan(cuda, "torch", plain, False, config) is None
    assert graph_plan(cuda, "triton", per_channel, False, config) is None, "a host plan a step"


def decode_batch(runner: ModelRunner, lengths: list[int], block_size: int) -> StepBatch:
    """A decode step of sequences of ``lengths`` cached tokens (the last one new), each in its
    own blocks, numbered from 1 (block 0 stays unused: a stray write there is seen too)."""
    tokens, positions, slots, tables, next_block = [], [], [], [], 1
    for index, length in enumerate(lengths):
        table = list(range(next_block, next_block + -(-length // block_size)))
        next_block += len(table)
        tokens.append(7 * index + 3)
        positions.append(length - 1)
        slots.append(table[-1] * block_size + (length - 1) % block_size)
        tables.append(table)
    cu = list(range(len(lengths) + 1))
    return StepBatch(tokens, positions, slots, cu, list(lengths), tables, False)


@pytest.mark.parametrize("block_size", [1, 16])
def test_a_padded_step_gives_the_eager_logits_and_writes_only_its_slots(block_size):
    _, model = paired("qwen3")
    shape = CacheShape(2, block_size, 2, 16, torch.float32)
    lengths = [5, 17, 2]
    blocks = 1 + sum(-(-n // block_size) for n in lengths)
    runners = []
    for _ in range(2):
        cache = CacheEngine(shape, blocks, 0, torch.device("cpu"))
        torch.manual_seed(1)
        for layer in cache.layers():
            for plane in layer:
                plane.copy_(torch.randn_like(plane))  # what earlier steps left, and a marker
        runners.append(ModelRunner(copy.deepcopy(model), cache, None, cpu_attention))
    eager, padded = runners
    graphs = padded.use_decode_graphs([1, 8], max_blocks=20, capture=False)
    before = [plane.clone() for layer in padded.cache_engine.layers() for plane in layer]
    batch = decode_batch(eager, lengths, block_size)
    with torch.inference_mode():
        expected = eager.forward(batch)
        got = padded.forward(batch)
    assert graphs.steps == 1, "the decode step ran on the padded buffers"
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    written = torch.zeros(blocks * block_size, dtype=torch.bool)
    written[batch.slots] = True
    after = [plane for layer in padded.cache_engine.layers() for plane in layer]
    for old, new in zip(before, after, strict=True):
        old, new = old.view(-1, *old.shape[2:]), new.view(-1, *new.shape[2:])
        assert torch.equal(old[~written], new[~written]), "padding wrote a slot"
        assert not torch.equal(old[written], new[written]), "the step's own tokens were stored"


def quantized_runners(bits: int) -> tuple[ModelRunner, ModelRunner]:
    """Two runners of one random model over INT caches on the Triton kernels, the second on
    the padded buffers (sizes 1 and 4)."""
    _, model = paired("qwen3")
    shape = CacheShape(2, 4, 2, 16, torch.float32, f"int{bits}")
    runners = []
    for _ in range(2):
        cache = CacheEngine(shape, 8, 0, torch.device(KERNEL_DEVICE))
        runner = ModelRunner(copy.deepcopy(model).to(KERNEL_DEVICE), cache, None, triton_attention)
        runners.append(runner)
    runners[1].use_decode_graphs([1, 4], max_blocks=4, capture=False)
    return runners[0], runners[1]


@pytest.mark.parametrize("padded", [False, True], ids=["eager", "padded"])
@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_cache_refuses_a_non_finite_step_on_the_device(bits, padded):
    """A cache quantized per token decodes on the padded buffers as it does eagerly; a step
    whose keys hold NaN writes nothing in any layer and raises the eager store's error once the
    step is over (``raise_if_refused``, after the sampled tokens), and the next step is free to
    write (the step flag is cleared before each)."""
    eager, on_buffers = quantized_runners(bits)
    runner = on_buffers if padded else eager
    batch = decode_batch(eager, [5, 3], block_size=4)
    with torch.inference_mode():
        torch.testing.assert_close(on_buffers.forward(batch), eager.forward(batch))
        assert on_buffers.decode_graphs.steps == 1
        planes = runner.cache_engine.gpu_planes
        before = [plane.clone() for plane in planes]
        poisoned = dataclasses.replace(batch, tokens=[batch.tokens[0], 11])
        runner.model.model.embed_tokens.weight[11, 3] = float("nan")
        runner.forward(poisoned)  # no raise inside the step: the GPU is not waited for
        with pytest.raises(ValueError, match="NaN or infinite"):
            runner.cache_engine.raise_if_refused()
        assert all(torch.equal(a, b) for a, b in zip(planes, before, strict=True)), (
            "a refused step writes nothing, in no layer"
        )
        runner.forward(dataclasses.replace(batch, tokens=[batch.tokens[0], 12]))
        runner.cache_engine.raise_if_refused()
        assert not all(torch.equal(a, b) for a, b in zip(planes, before, strict=True))


@pytest.mark.parametrize("block_size", [1, 16])
def test_vkv_tiny_completes_prompts_the_same_with_padding(block_size):
    prompts = ["def add(a, b):\n", "import os\n", "class Stack:\n", "for i in range(", "# a"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def complete(padded: bool) -> list[str]:
        engine = LLMEngine(
            block_size=block_size,
            max_num_seqs=8,
            max_model_len=128,
            dtype=EXACT_DTYPE,
            enforce_eager=True,
        )
        if padded:
            engine.runner.use_decode_graphs(
                [1, 2, 8], max_blocks=-(-128 // block_size), capture=False
            )
        ids = [engine.add_request(prompt, params) for prompt in prompts]
        while engine.has_unfinished_requests():
            engine.step()
        assert not padded or engine.runner.decode_graphs.steps >= 23
        return [engine.sequence(i).completion_token_ids for i in ids]

    assert complete(padded=True) == complete(padded=False)


def test_prefills_and_decodes_larger_than_every_size_run_eagerly_beside_padded_ones():
    """With sizes 1 and 2 and five prompts, the decodes of three to five sequences (and every
    prefill) run outside the padded buffers, those of one or two on them: the same tokens as
    an engine without them."""
    prompts = ["def add(a, b):\n", "import os\n", "class Stack:\n", "for i in range(", "# a"]

    def complete(sizes: list[int] | None) -> tuple[list[list[int]], list[tuple[int, int]]]:
        engine = LLMEngine(
            max_num_seqs=8, max_model_len=128, dtype=EXACT_DTYPE, enforce_eager=True
        )  # on a GPU too: no captured graphs beside the buffers under test
        if sizes:
            engine.runner.use_decode_graphs(sizes, max_blocks=8, capture=False)
        params = [
            SamplingParams(temperature=0.0, max_tokens=6 * (1 + i), ignore_eos=True)
            for i in range(len(prompts))
        ]  # they finish one after another: 5 decoding, then 4, ... 1
        steps = []  # (sequences, a prefill, whether the step ran on the buffers)
        forward, graphs = engine.runner.forward, engine.runner.decode_graphs

        def watched(batch: StepBatch):
            before = graphs.steps if graphs else 0
            logits = forward(batch)
            padded = bool(graphs) and graphs.steps > before
            steps.append((len(batch.context_lens), batch.is_prefill, padded))
            return logits

        engine.runner.forward = watched
        ids = [engine.add_request(p, s) for p, s in zip(prompts, params, strict=True)]
        while engine.has_unfinished_requests():
            engine.step()
        return [engine.sequence(i).completion_token_ids for i in ids], steps

    tokens, steps = complete([1, 2])
    assert tokens == complete(None)[0]
    assert {n for n, prefill, _ in steps if not prefill} == {1, 2, 3, 4, 5}
    assert all(padded == (not prefill and n <= 2) for n, prefill, padded in steps), steps


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_replayed_graphs_complete_prompts_as_eager_steps_do(kv_cache_dtype, capsys):
    """On a GPU: the engine captures its graphs at start and says so with their time and
    memory, and replaying them gives the tokens that eager steps give (float32: the two differ
    by rounding only), 16-bit or INT8."""
    prompts = ["def add(a, b):\n", "import os\n", "class Stack:\n"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def complete(enforce_eager: bool) -> tuple[list[list[int]], int]:
        engine = LLMEngine(
            max_num_seqs=8,
            max_model_len=128,
            dtype="float32",
            kv_cache_dtype=kv_cache_dtype,
            enforce_eager=enforce_eager,
        )
        ids = [engine.add_request(prompt, params) for prompt in prompts]
        while engine.has_unfinished_requests():
            engine.step()
        graphs = engine.runner.decode_graphs
        replays = 0 if graphs is None else graphs.steps
        return [engine.sequence(i).completion_token_ids for i in ids], replays

    replayed, replays = complete(enforce_eager=False)
    said = capsys.readouterr().err
    captured = r"decode replayed from CUDA graphs: 4 batch sizes 1-8 captured in [\d.]+ s, \d+ MiB"
    assert re.search(captured, said), said
    eager, none = complete(enforce_eager=True)
    assert "CUDA graphs" not in capsys.readouterr().err
    assert replays >= 23 and none == 0
    assert replayed == eager
