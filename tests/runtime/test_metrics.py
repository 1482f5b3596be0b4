"""The engine's metrics on a scripted workload: counters equal what the client saw, and the
exposition passes ``promtool check metrics`` (Debian's prometheus; ``.ci/run`` installs it)."""

import shutil
import subprocess
from collections import Counter

import pytest
from metrics_fakes import FakeSequence
from prometheus_client import generate_latest

from vkv import LLM, SamplingParams
from vkv.engine.sequence import Sequence

PROMPTS = ["def read(path):\n", "class Stack:\n", "import os\n"] * 3


@pytest.fixture(scope="module")
def served():
    """Nine prompts (repeated: prefix hits), one with n = 2, in a pool small enough to preempt."""
    llm = LLM(
        num_gpu_blocks=6,
        num_cpu_blocks=8,
        block_size=4,
        max_model_len=24,
        enable_prefix_caching=True,
    )
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)] * len(PROMPTS)
    params[1] = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, n=2, seed=3)
    results = llm.generate(PROMPTS, params, use_progress=False)
    return llm.engine, results


def value(engine, name: str, **labels) -> float:
    return engine.metrics.value(name, **labels)


def test_token_and_request_counters_equal_what_the_client_got(served):
    engine, results = served
    outputs = [o for result in results for o in result["outputs"]]
    prompt_tokens = sum(len(engine.tokenizer.encode(prompt).ids) for prompt in PROMPTS)
    assert value(engine, "prompt_tokens_total") == prompt_tokens
    assert value(engine, "generation_tokens_total") == sum(len(o["token_ids"]) for o in outputs)
    reasons = Counter(o["finish_reason"] for o in outputs)
    for reason, count in reasons.items():
        assert value(engine, "request_success_total", finished_reason=reason) == count
    assert value(engine, "time_to_first_token_seconds_count") == len(outputs)
    assert value(engine, "e2e_request_latency_seconds_count") == len(outputs)


def test_scheduler_and_cache_counters_equal_the_engines_own(served):
    engine, _ = served
    manager = engine.scheduler.block_manager
    assert engine.scheduler.num_preemptions > 0, "the pool is meant to preempt"
    assert value(engine, "num_preemptions_total") == engine.scheduler.num_preemptions
    assert value(engine, "prefix_cache_hits_total") == manager.num_hit_tokens > 0
    assert value(engine, "prefix_cache_queries_total") == manager.num_query_tokens
    assert value(engine, "cow_copies_total") >= 1, "the two samples share a last block"
    assert value(engine, "num_requests_running") == value(engine, "num_requests_waiting") == 0


def test_an_aborted_request_counts_as_aborted():
    llm = LLM(num_gpu_blocks=32)
    engine = llm.engine
    request = engine.add_request("import os\n", SamplingParams(max_tokens=50, n=2))
    engine.step()
    engine.abort(request)
    assert value(engine, "request_success_total", finished_reason="abort") == 2


def test_an_abort_refreshes_the_gauges_and_stats_without_a_step():
    engine = LLM(num_gpu_blocks=32).engine
    request = engine.add_request("import os\n", SamplingParams(max_tokens=50))
    engine.step()
    engine.step()
    assert engine.stats["running"] == value(engine, "num_requests_running") == 1
    assert value(engine, "gpu_cache_usage_perc") > 0
    steps = value(engine, "generation_tokens_total")
    engine.abort(request)
    assert engine.stats["running"] == engine.stats["waiting"] == 0
    assert engine.stats["gpu_kv_usage"] == 0, "the aborted request's blocks are free"
    for gauge in ("num_requests_running", "num_requests_waiting", "gpu_cache_usage_perc"):
        assert value(engine, gauge) == 0, f"{gauge} still describes the engine before the abort"
    assert value(engine, "generation_tokens_total") == steps, "an abort generates nothing"
    assert value(engine, "num_preemptions_total") == 0


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool: apt-get install prometheus")
def test_the_exposition_passes_promtool(served):
    engine, _ = served
    text = generate_latest(engine.metrics.registry)
    check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True)
    assert check.returncode == 0, check.stdout.decode() + check.stderr.decode()


def test_phase5s_fake_sequence_has_every_public_attribute_of_a_sequence():
    """A correct logger may read any public attribute of a Sequence: the graded tests' fake
    (``tests/metrics_fakes.py``, for the visible and the hidden tests) carries them all, with
    the values a real sequence would have, or correct code fails."""
    fake = FakeSequence(3, 5, 1, 100.0)
    real = Sequence(3, [5, 6, 7, 8, 9], 4, arrival_time=100.0)
    real.append_token(11)
    public = sorted(name for name in dir(real) if not name.startswith("_"))
    missing = [name for name in public if not hasattr(fake, name)]
    assert not missing, f"the fake sequence lacks {missing}"
    values = ("num_prompt_tokens", "num_tokens", "num_completion_tokens", "num_blocks", "seq_id")
    values += ("last_block_num_tokens", "arrival_time", "group_id", "block_size")
    assert {n: getattr(fake, n) for n in values} == {n: getattr(real, n) for n in values}
    assert len(fake) == len(real) and len(fake.prompt_token_ids) == len(real.prompt_token_ids)
    with pytest.raises(AttributeError, match=r"read seq\.prompt_len, which a Sequence does not"):
        _ = fake.prompt_len
