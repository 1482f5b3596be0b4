"""Parallel sampling (``SamplingParams.n``): the prompt is computed once and its blocks shared
by the n samples, which are preempted and swapped as a group. The tests that compare two runs'
tokens run on each device in float32 (``devices.py``)."""

import pytest
from devices import EXACT_DTYPE

from vkv import LLM, SamplingParams
from vkv.engine.llm_engine import LLMEngine

PROMPT = "def read_config(path):\n    with open(path) as f:\n"
SAMPLED = dict(temperature=0.9, max_tokens=40, ignore_eos=True, seed=11)


def run(engine: LLMEngine) -> list[dict]:
    stats = []
    while engine.has_unfinished_requests():
        engine.step()
        stats.append({**engine.stats, "shared_blocks": engine.shared_blocks()})
    return stats


@pytest.mark.parametrize("n", [0, -1, 1.5, True])
def test_n_must_be_a_positive_integer(n):
    with pytest.raises(ValueError, match=r"^n must be"):
        SamplingParams(n=n)


def test_n_over_max_num_seqs_is_refused_and_nothing_is_queued():
    engine = LLMEngine(num_gpu_blocks=32, max_num_seqs=4)
    with pytest.raises(ValueError, match=r"^n \(5\) is more than max_num_seqs \(4\)"):
        engine.add_request(PROMPT, SamplingParams(n=5))
    assert not engine.has_unfinished_requests()
    engine.add_request(PROMPT, SamplingParams(n=4, max_tokens=2))
    run(engine)


def test_the_prompt_is_computed_once_and_its_blocks_shared():
    engine = LLMEngine(num_gpu_blocks=64, block_size=16)
    request = engine.add_request(PROMPT, SamplingParams(n=4, **SAMPLED))
    prompt_len = engine.sequence(request).num_prompt_tokens
    stats = run(engine)
    samples = engine.samples(request)
    assert len(samples) == 4 and all(len(s.completion_token_ids) == 40 for s in samples)
    computed = sum(step["batched_tokens"] for step in stats)
    assert computed == prompt_len + 4 * 39, (
        "the prompt once (its logits give all four first tokens), then 39 decodes each: got "
        f"{computed} tokens"
    )
    assert max(step["shared_blocks"] for step in stats) >= 3 * (prompt_len // 16)
    assert sum(step["blocks_copied"] for step in stats) >= 1, "the shared last block is copied"
    assert len({tuple(s.completion_token_ids) for s in samples}) == 4, "four different samples"


def test_samples_are_reproducible_and_greedy_samples_equal_one_greedy_completion(device):
    llm = LLM(num_gpu_blocks=64, device=device, dtype=EXACT_DTYPE)
    first = llm.generate([PROMPT], SamplingParams(n=3, **SAMPLED), use_progress=False)[0]
    again = llm.generate([PROMPT], SamplingParams(n=3, **SAMPLED), use_progress=False)[0]
    assert [o["token_ids"] for o in first["outputs"]] == [o["token_ids"] for o in again["outputs"]]
    assert first["token_ids"] == first["outputs"][0]["token_ids"]
    greedy = dict(temperature=0.0, max_tokens=24, ignore_eos=True)
    one = llm.generate([PROMPT], SamplingParams(**greedy), use_progress=False)[0]
    four = llm.generate([PROMPT], SamplingParams(n=4, **greedy), use_progress=False)[0]
    assert [o["token_ids"] for o in four["outputs"]] == [one["token_ids"]] * 4


@pytest.mark.parametrize("mode", ["swap", "recompute", "auto"])
def test_a_group_under_preemption_gives_the_samples_of_an_ample_pool(mode, device):
    prompts = [PROMPT, "class Stack:\n    def push(self, item):\n"]
    params = SamplingParams(n=3, **SAMPLED)
    on = {"device": device, "dtype": EXACT_DTYPE}
    ample = LLM(num_gpu_blocks=256, **on).generate(prompts, params, use_progress=False)
    small = LLM(num_gpu_blocks=14, num_cpu_blocks=64, preemption_mode=mode, **on)
    tight = small.generate(prompts, params, use_progress=False)
    for got, expected in zip(tight, ample, strict=True):
        assert [o["token_ids"] for o in got["outputs"]] == [
            o["token_ids"] for o in expected["outputs"]
        ]
    assert small.engine.scheduler.num_preemptions > 0, "the pool is meant to be too small"


def test_auto_mode_swaps_a_group_together():
    engine = LLMEngine(num_gpu_blocks=14, num_cpu_blocks=64, preemption_mode="auto")
    engine.add_request(PROMPT, SamplingParams(n=3, **SAMPLED))
    engine.add_request("class Stack:\n    def push(self, item):\n", SamplingParams(n=3, **SAMPLED))
    stats = run(engine)
    assert sum(step["blocks_swapped_out"] for step in stats) > 0, "groups are swapped"


def test_aborting_a_request_aborts_every_sample():
    engine = LLMEngine(num_gpu_blocks=64)
    request = engine.add_request(PROMPT, SamplingParams(n=3, **SAMPLED))
    engine.step()
    assert len(engine.samples(request)) == 3
    engine.abort(request)
    assert all(s.is_finished and s.block_table == [] for s in engine.samples(request))
    assert not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="abort: no unfinished sequence has id 0"):
        engine.abort(request)


def test_samples_of_one_token_are_new_requests_after_the_first_finishes():
    llm = LLM(num_gpu_blocks=64)
    result = llm.generate([PROMPT], SamplingParams(n=3, max_tokens=1, seed=5), use_progress=False)
    assert [len(o["token_ids"]) for o in result[0]["outputs"]] == [1, 1, 1]
    assert {o["finish_reason"] for o in result[0]["outputs"]} == {"length"}


def test_a_request_ignored_before_its_prompt_is_computed_reports_n_ignored_samples():
    llm = LLM(num_gpu_blocks=2, block_size=4, max_model_len=64)
    result = llm.generate([PROMPT], SamplingParams(n=2), use_progress=False)[0]
    assert [o["finish_reason"] for o in result["outputs"]] == ["ignored", "ignored"]
