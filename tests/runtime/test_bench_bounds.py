"""The bounds benchmark: each what-if takes out what it says and nothing else, and leaves the
engine as it was and the schedule as it would be."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_bounds
import pytest
from bench_scheduler import run_once

from vkv.bench import Workload
from vkv.engine.llm_engine import LLMEngine
from vkv.models.loader import DEFAULT_MODEL
from vkv.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(DEFAULT_MODEL, max_num_seqs=4, device="cpu")


def test_every_step_way_runs_and_the_engine_keeps_its_own_methods(engine):
    workload = Workload.mixed(
        lambda text: engine.tokenizer.encode(text).ids,
        num_requests=4,
        prompt_lens=(8, 16),
        output_lens=(12, 16),
    )
    figures = bench_bounds.measure_steps(engine, workload, rounds=1)
    assert list(figures) == list(bench_bounds.STEP_WAYS)
    for way, [(share, step_us, host_us)] in figures.items():
        assert 0 < share < 1 and 0 < host_us < step_us, way
    assert "_record" not in vars(engine) and "new_text" not in vars(engine.outputs.detokenizer)


def test_without_detokenization_no_text_comes_and_no_metric_moves(engine):
    with bench_bounds.step_way(engine, "no detokenization, no metrics"):
        engine.add_request(
            engine.tokenizer.encode("The paged KV cache").ids,
            SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
        )
        before = engine.metrics.value("generation_tokens_total")
        outputs = [output for _ in range(6) for output in engine.step()]
        after = engine.metrics.value("generation_tokens_total")
    assert sum(len(output.new_token_ids) for output in outputs) == 6
    assert all(output.new_text == "" for output in outputs) and outputs[-1].finished
    assert after == before


def test_the_free_hash_makes_the_same_schedule_as_the_real_one():
    real = run_once(16, 40_960, bench_bounds.NUM_SEQS, enable_prefix_caching=True)
    free = bench_bounds.run_free_hash(16, 40_960)
    assert (free["steps"], free["preemptions"]) == (real["steps"], real["preemptions"])
    assert free["preemptions"] > 0, "the 40K pool preempts: the tree is matched against"
