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
from vkv.engine import model_runner
from vkv.engine.cache_engine import CacheEngine, CacheShape
from vkv.engine.llm_engine import LLMEngine
from vkv.engine.model_runner import Draw, ModelRunner, draw_tokens, greedy_tokens, top_p_cut
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


def test_seeded_draws_are_reproducible_and_do_not_depend_on_the_batch():
    logits = torch.tensor([[0.0, 5.0, 4.0, -3.0], [1.0, 1.0, 1.0, 1.0], [2.0, 0.0, 0.0, 9.0]])
    seeded = SamplingParams(temperature=1.0, top_k=2, seed=7)
    alone = [draw_tokens(logits[:1], [Draw(0, seeded, [], step)])[0] for step in range(50)]
    assert set(alone) == {1, 2}, "top_k 2 keeps tokens 1 and 2, and both come up in 50 draws"
    others = SamplingParams(temperature=0.8)
    for step in range(50):
        batch = [Draw(1, others, [], 3), Draw(0, seeded, [], step), Draw(2, others, [], 9)]
        assert draw_tokens(logits, batch)[1] == alone[step], "the seeded row, in a batch"


def test_each_draw_of_a_batch_follows_its_own_params():
    """Greedy, top-k and top-p rows in one batch; a draw may read any row (parallel samples
    read their sequence's), and a logit bias moves a greedy row's token."""
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0]])
    draws = [
        Draw(0, SamplingParams(temperature=0.0), [], 1),
        Draw(1, SamplingParams(temperature=0.0, logit_bias={2: 5.0}), [], 1),
        Draw(0, SamplingParams(temperature=1.0, top_k=1), [], 1),
        Draw(1, SamplingParams(temperature=5.0, top_p=0.3), [], 1),
        Draw(0, SamplingParams(temperature=1.0, top_k=2, seed=3), [], 1),
    ]
    for _ in range(20):
        tokens = draw_tokens(logits, draws)
        assert tokens[:4] == [3, 2, 3, 0] and tokens[4] in (2, 3)
        assert all(type(token) is int for token in tokens)


@pytest.mark.parametrize("top_k", [-1, 4], ids=["vocabulary sorted", "top-k sorted"])
def test_top_p_keeps_every_token_as_likely_as_the_least_likely_it_keeps(top_k):
    """Probabilities 0.687, 0.093 three times, 0.034 (top-k 4: 0.711, 0.096 three times): top-p
    0.72 keeps the first and, with it, one of the three equal ones (the mass before it is within
    0.72): all three then, not whichever a sort puts first; never the last."""
    logits = torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.0]])
    params = SamplingParams(temperature=1.0, top_p=0.72, top_k=top_k)
    tokens = draw_tokens(logits, [Draw(0, params, [], step) for step in range(400)])
    assert set(tokens) == {0, 1, 2, 3}


def test_seeded_rows_draw_alike_alone_and_in_batches_that_sort_the_vocabulary_or_the_top_k():
    """Where every row that cuts by top-p has a top-k, only the top-k candidates are sorted; a
    row that cuts without one makes the batch sort the vocabulary. Neither changes a seeded
    row's token: one cut by top-k and top-p, one cut by neither."""
    logits = torch.randn(2, 1000, generator=torch.Generator().manual_seed(1))
    for step in range(40):
        both = SamplingParams(temperature=1.5, top_k=50, top_p=0.8, seed=step)
        cuts, plain = Draw(0, both, [], step), Draw(1, SamplingParams(seed=step), [], step)
        wide = Draw(1, SamplingParams(temperature=1.0, top_p=0.5), [], step)
        alone = draw_tokens(logits, [cuts]) + draw_tokens(logits, [plain])
        assert draw_tokens(logits, [cuts, plain]) == alone, "the top-k candidates sorted"
        assert draw_tokens(logits, [cuts, plain, wide])[:2] == alone, "the vocabulary sorted"


def kept_by_top_p(row: list[float], top_p: float) -> list[float]:
    """The row cut by top-p, by the definition: sorted, most likely first, a token is kept when
    the probabilities before it sum to at most ``top_p``, and so is every token as likely."""
    ordered, before, least = sorted(row, reverse=True), 0.0, None
    for value in ordered:
        if before > top_p:
            break
        least, before = value, before + value
    return [value if value >= least else 0.0 for value in row]


def test_top_p_alone_sorts_the_likeliest_first_on_a_cpu_and_cuts_as_the_whole_sort_does(
    monkeypatch,
):
    """Top-p without top-k: a CPU sorts the 8 likeliest (``TOP_P_CANDIDATES``, 8 here) of 64
    tokens first, and only a row whose 8 sum to no more than its top-p sorts all 64. Peaked
    rows (covered), flat ones (not) and a row that does not cut, in one batch: each cut as the
    definition cuts it."""
    monkeypatch.setattr(model_runner, "TOP_P_CANDIDATES", 8)
    sorted_widths = []
    topk = torch.Tensor.topk

    def counted_topk(self, k, *args, **kwargs):
        sorted_widths.append((len(self), k))
        return topk(self, k, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "topk", counted_topk)
    generator = torch.Generator().manual_seed(3)
    spreads = torch.tensor([[8.0], [0.1], [6.0], [0.5], [8.0]])  # peaked, flat, ..., no cut
    probs = (torch.randn(5, 64, generator=generator) * spreads).softmax(-1)
    top_p = [0.9, 0.5, 0.95, 0.3, 1.0]
    cut = top_p_cut(probs.clone(), top_p, [0] * 5, lambda values: torch.tensor(values)[:, None])
    for row, p, got in zip(probs.tolist(), top_p, cut.tolist(), strict=True):
        assert got == (row if p == 1.0 else kept_by_top_p(row, p))
    assert sorted_widths == [(5, 8), (2, 64)], "the 8 likeliest of every row, then 2 rows whole"


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"temperature": 1.0}, [0.0321, 0.0871, 0.2369, 0.6439]),
        ({"temperature": 0.5}, [0.0021, 0.0158, 0.1171, 0.8650]),
        ({"temperature": 1.0, "top_p": 0.7}, [0.0, 0.0, 0.2689, 0.7311]),
        ({"temperature": 1.0, "top_k": 3, "seed": 5}, [0.0, 0.0900, 0.2447, 0.6652]),
    ],
)
def test_draws_follow_the_softmax_of_the_scores_over_the_kept_tokens(options, expected):
    """20,000 draws of one row: each token's share is its probability, within 0.015 (4 standard
    deviations; seeded, so the test draws the same every run). Seeded draws differ by step. A
    greedy draw and a top-k one of another row share the batch (their cuts are theirs alone)."""
    torch.manual_seed(0)
    params = SamplingParams(**options)
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [9.0, 0.0, 0.0, 0.0]])
    draws = [Draw(0, params, [], step) for step in range(20_000)]
    others = [Draw(1, SamplingParams(temperature=0.0), [], 0)]
    others.append(Draw(1, SamplingParams(temperature=1.0, top_k=1), [], 0))
    tokens = draw_tokens(logits, others + draws)
    assert tokens[:2] == [0, 0]
    shares = torch.bincount(torch.tensor(tokens[2:]), minlength=4) / len(draws)
    assert torch.allclose(shares, torch.tensor(expected), atol=0.015), shares


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
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_a_step_waits_for_the_gpu_once_for_its_sampled_tokens(enforce_eager):
    """The host waits for the GPU once a step, for the sampled tokens: torch's sync debug mode
    warns at each wait (a device or stream synchronize, a copy to pageable host memory:
    ``.item()``, ``.tolist()``, ``bool()`` of a GPU tensor). Decode steps replayed from graphs or
    eager, with prefills joining them (the prefill kernel's grid from the host's lengths), on
    an INT8 cache (whose NaN refusal is read after the tokens; a 16-bit step does a subset of
    its work), greedy and sampled requests in one batch (drawn together, penalties and all)."""
    engine = LLMEngine(
        max_num_seqs=8,
        max_model_len=256,
        kv_cache_dtype="int8",
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
            for prompt, asked in (
                ("def add(a, b):\n", params),
                ("import os\n", SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12)),
                ("class Stack:\n", SamplingParams(top_k=20, seed=3, presence_penalty=0.5)),
            ):
                engine.add_request(prompt, asked)
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
