"""Whatever the options, an engine's greedy tokens are transformers': vkv-tiny in float32 on
the CPU, through the whole engine (the C decode loop where it compiled, as ``vkv`` runs), at
block sizes 1, 16 and 64, with each option alone and with all of them at once. transformers
recomputes every sequence without a cache (``greedy_by_recompute``): the independent reference.

Each case also checks that its option did what it is there for (a preemption, a swap, a prompt
split into chunks, a prefix-cache hit, a step padded to a captured batch size, two samples),
so that a run which never took the path cannot pass for one that did.

The padded cases run the decode steps on the static buffers of the CUDA-graph path, eagerly:
``graph_plan`` is made to return a plan on the CPU, as it does on a GPU, so the engine (and,
with tensor parallelism, every worker, which receives the plan with its shard) runs its decode
steps padded to 3 or 8 rows (one or two sequences decoding get padding rows too: the
two-rank case's pool holds two).
"""

import pytest
import torch
from tiny_checkpoints import greedy_by_recompute
from transformers import AutoModelForCausalLM

from vkv.engine import llm_engine
from vkv.engine.llm_engine import LLMEngine
from vkv.models.loader import DEFAULT_MODEL
from vkv.sampling_params import SamplingParams

SHARED = "# utilities shared by every request of this test: they begin alike\nimport os\n\n"
ENDINGS = [
    "def read(path):\n    with open(path) as f:\n",
    "class Stack:\n    def push(self, x):\n",
    "for i in range(10):\n    print(i)\n",
    "def add(a, b):\n    return a + b\n",
]
PROMPTS = [SHARED + ending for ending in ENDINGS]
NEW_TOKENS = 16
MAX_MODEL_LEN = 256
CHUNK = 48  # max_num_batched_tokens with chunked prefill: every prompt is longer
PADDED_SIZES = [3, 8]


def blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def tight_pool(block_size: int) -> int:
    """Room for the first two prompts, not for them to grow: the second one's growth preempts
    (and the longest sequence fits alone)."""
    lengths = [len(prompt.encode()) for prompt in PROMPTS]
    two_prompts = blocks(lengths[0], block_size) + blocks(lengths[1], block_size)
    return max(two_prompts, max(blocks(n + NEW_TOKENS, block_size) for n in lengths))


def options(block_size: int) -> dict[str, dict]:
    """Each case's engine options at ``block_size``."""
    tight = tight_pool(block_size)
    preempted = {"num_gpu_blocks": tight, "num_cpu_blocks": 4 * tight}
    return {
        "plain": {},
        "preempted by recompute": preempted | {"preemption_mode": "recompute"},
        "preempted by swap": preempted | {"preemption_mode": "swap"},
        "chunked prefill": {"enable_chunked_prefill": True, "max_num_batched_tokens": CHUNK},
        "prefix caching": {"enable_prefix_caching": True, "max_num_seqs": 2},
        "two samples": {},
        "padded decode": {},
        "two ranks, padded, swapped": preempted
        | {"preemption_mode": "swap", "tensor_parallel_size": 2},
        "all at once": preempted
        | {
            "preemption_mode": "recompute",
            "enable_chunked_prefill": True,
            "max_num_batched_tokens": CHUNK,
            "enable_prefix_caching": True,
        },
    }


SAMPLES = {"two samples": 2, "all at once": 2}
PADDED = {"padded decode", "two ranks, padded, swapped", "all at once"}


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    hf = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    return [greedy_by_recompute(hf, list(prompt.encode()), NEW_TOKENS) for prompt in PROMPTS]


def run(engine: LLMEngine, n: int) -> tuple[list[list[list[int]]], dict]:
    """Every prompt's samples' tokens, and what the run did (summed or final counts)."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, n=n)
    ids = [engine.add_request(prompt, params) for prompt in PROMPTS]
    did = {"swapped": 0, "largest step": 0, "padding rows": 0}
    graphs = engine.runner.decode_graphs
    if graphs is not None:  # rank 0's; a worker's padding must match it, or its forward fails
        run_padded = graphs.run

        def counted(tokens: list[int], *inputs):
            did["padding rows"] += graphs.padded_size(len(tokens)) - len(tokens)
            return run_padded(tokens, *inputs)

        graphs.run = counted
    while engine.has_unfinished_requests():
        engine.step()
        did["swapped"] += engine.stats["blocks_swapped_out"]
        did["largest step"] = max(did["largest step"], engine.stats["batched_tokens"])
    did["preemptions"] = engine.scheduler.num_preemptions
    did["hits"] = engine.stats["prefix_cache_hits"]
    tokens = [[s.completion_token_ids for s in engine.samples(i)] for i in ids]
    return tokens, did


@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("case", list(options(1)))
def test_greedy_tokens_are_transformers_with_every_option(
    case, block_size, expected, monkeypatch, capsys
):
    monkeypatch.setenv("VKV_DEVICE", "cpu")  # the tensor-parallel workers too
    if case in PADDED:
        plan = (PADDED_SIZES, blocks(MAX_MODEL_LEN, block_size))
        monkeypatch.setattr(llm_engine, "graph_plan", lambda *args: plan)
    n, settings = SAMPLES.get(case, 1), options(block_size)[case]
    with LLMEngine(
        block_size=block_size,
        max_model_len=MAX_MODEL_LEN,
        device="cpu",
        dtype="float32",
        **{"max_num_seqs": 8, "num_gpu_blocks": 64 * 256 // block_size} | settings,
    ) as engine:
        tokens, did = run(engine, n)
    assert tokens == [[completion] * n for completion in expected]
    if "preemption_mode" in settings:
        assert did["preemptions"] > 0, "the pool is meant to be too small for every sequence"
    if settings.get("preemption_mode") == "swap":
        assert did["swapped"] > 0
    if settings.get("enable_chunked_prefill"):
        assert did["largest step"] <= CHUNK < min(len(p.encode()) for p in PROMPTS)
    if settings.get("enable_prefix_caching"):
        assert did["hits"] >= len(SHARED) // block_size * block_size > 0
    if case in PADDED:
        assert did["padding rows"] > 0, "no decode step ran with padding rows"
        assert "decode padded to 2 batch sizes 3-8" in capsys.readouterr().err
