"""Prefix caching in the engine: the scheduler charges only the uncached rest of a prompt, and
greedy output with caching on equals output with it off in pools small enough to preempt and
evict in every run (on each device, in float32: ``devices.py``). The PrefixCachingBlockManager's
own rules, and the state machine over it with a model of each slot's prefix, are graded:
``tests/test_phase4.py``, parts 4.5-4.9."""

import pytest
from devices import EXACT_DTYPE

from vkv import LLM, SamplingParams
from vkv.config import Config
from vkv.engine.scheduler import Scheduler
from vkv.engine.sequence import Sequence

BS = 4


def prompt(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def test_the_scheduler_charges_only_the_uncached_rest():
    s = Scheduler(
        Config(BS, num_gpu_blocks=32, watermark=0.0, max_model_len=64, enable_prefix_caching=True)
    )
    first = Sequence(0, prompt(12), BS, SamplingParams(max_tokens=1))
    s.add(first)
    s.postprocess(s.schedule().scheduled, [7])  # computed, finished, cached
    again = Sequence(1, [*prompt(12), 3, 4], BS, SamplingParams(max_tokens=1))
    s.add(again)
    out = s.schedule()
    assert [(item.seq.seq_id, item.num_tokens) for item in out.scheduled] == [(1, 2)]
    assert again.num_computed_tokens == 12


PROMPTS = [
    "You are a careful Python programmer. Answer with code only.\n" * 2 + f"def task_{i}(x):\n"
    for i in range(6)
] + ["You are a careful Python programmer. Answer with code only.\n" * 2 + "def task_2(x):\n"] * 2


CASES = [(1, "recompute", 260, 24), (1, "swap", 260, 24), (16, "recompute", 18, 24)]
CASES += [(16, "swap", 18, 24), (64, "recompute", 7, 64), (64, "swap", 7, 64)]


@pytest.mark.parametrize(("block_size", "mode", "num_gpu_blocks", "max_tokens"), CASES)
def test_greedy_output_is_the_same_with_prefix_caching_on_and_off(
    block_size, mode, num_gpu_blocks, max_tokens, device
):
    """Pools far smaller than the working set: preemption and eviction in every run."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs, engines = {}, {}
    for caching in (False, True):
        llm = LLM(
            block_size=block_size,
            num_gpu_blocks=num_gpu_blocks,
            num_cpu_blocks=4 * num_gpu_blocks,
            preemption_mode=mode,
            max_model_len=num_gpu_blocks * block_size,
            enable_prefix_caching=caching,
            device=device,
            dtype=EXACT_DTYPE,
        )
        results = llm.generate(PROMPTS, params, use_progress=False)
        outputs[caching] = [result["token_ids"] for result in results]
        engines[caching] = llm.engine
    assert outputs[True] == outputs[False]
    cached = engines[True]
    assert cached.stats["prefix_cache_hits"] > 0, cached.stats
    assert cached.scheduler.num_preemptions > 0, "the pool is meant to be too small"
