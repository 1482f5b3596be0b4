"""benchmarks/bench_prefix.py: the RadixCache finds exactly the offline optimum on its traces."""

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from bench_prefix import WORKLOADS, optimum, serve, simulate_trace


@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_the_tree_finds_every_reusable_block_of_the_trace(workload, block_size):
    trace = WORKLOADS[workload](random.Random(0))
    best = optimum(trace, block_size)
    assert sum(best) > 0, "each workload shares prefixes"
    assert serve(trace, block_size, capacity=None)["hits"] == best


def test_the_optimum_never_covers_a_prompt_s_last_token():
    trace = [([1, 2, 3, 4], [5]), ([1, 2, 3, 4], [6])]
    assert optimum(trace, 1) == [0, 3]
    assert optimum(trace, 2) == [0, 2]


def test_in_the_simulator_caching_computes_fewer_tokens_on_a_shared_system_prompt():
    trace = WORKLOADS["system prompt"](random.Random(0))
    prompts, outputs = [p for p, _ in trace], [len(o) for _, o in trace]
    off, on = (simulate_trace(prompts, outputs, caching) for caching in (False, True))
    assert on["computed_tokens"] < 0.6 * off["computed_tokens"], (off, on)
    assert on["mean_ttft_s"] < off["mean_ttft_s"]
