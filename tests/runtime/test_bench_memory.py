"""The memory benchmark's bars, on its default workload (deterministic: simulated time only)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_memory
from workloads import mean_lengths, sharegpt_like

from vkv.engine.simulator import CostModel


@pytest.fixture(scope="module")
def sharegpt_results():
    requests = sharegpt_like(1000, rate=20.0, max_model_len=bench_memory.MAX_MODEL_LEN)
    budget, cost = bench_memory.OPT_13B_KV_TOKENS, CostModel()
    results = {
        name: bench_memory.simulate_static(requests, budget, reserve, cost)
        for name, reserve in bench_memory.SYSTEMS.items()
    }
    results["paged"] = bench_memory.simulate_paged(requests, budget, cost)
    return requests, results


def test_workload_has_the_papers_mean_lengths(sharegpt_results):
    requests, _ = sharegpt_results
    prompt, output = mean_lengths(requests)
    assert 140 < prompt < 180 and 290 < output < 380, (prompt, output)


def test_paged_kv_utilization_is_at_least_96_percent(sharegpt_results):
    _, results = sharegpt_results
    assert results["paged"]["kv_utilization"] >= 0.96


def test_paged_batches_more_than_every_static_scheme(sharegpt_results):
    _, results = sharegpt_results
    paged = results["paged"]["mean_running"]
    for name in bench_memory.SYSTEMS:
        assert paged > results[name]["mean_running"], name
    assert paged >= 4.3 * results["Orca (Max)"]["mean_running"], "the paper's 4.3x over Orca (Max)"


def test_orca_max_batches_as_many_requests_as_max_length_reservations_fit(sharegpt_results):
    _, results = sharegpt_results
    assert results["Orca (Max)"]["mean_running"] <= bench_memory.OPT_13B_KV_TOKENS // 2048
