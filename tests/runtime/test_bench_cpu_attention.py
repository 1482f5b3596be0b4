"""The CPU attention benchmark on a small workload: both sides run and are timed, the loop's
side calls the loop and the reference's does not, and the engine's loop is restored after."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_cpu_attention
from test_cpu_attention import needs_kernel

from vkv.kernels import cpu_attention


@needs_kernel
def test_the_engine_runs_once_with_the_loop_and_once_with_the_reference(monkeypatch):
    loop, calls, per_run = cpu_attention._kernel, {"loop": 0}, []

    def counted():
        calls["loop"] += 1
        return loop()

    def run_counted(engine, workload):  # the loop's calls during each run
        before = calls["loop"]
        run = run_vkv(engine, workload)
        per_run.append(calls["loop"] - before)
        return run

    run_vkv = bench_cpu_attention.run_vkv
    monkeypatch.setattr(cpu_attention, "_kernel", counted)
    monkeypatch.setattr(bench_cpu_attention, "run_vkv", run_counted)
    result = bench_cpu_attention.in_the_engine(rounds=1, num_requests=3, lens=(8, 12))
    assert result["identical_completions"] is True
    for side in ("reference", "in place"):
        assert result[side]["run_s"] > result[side]["decode_attention_s"] > 0, result
    _warm_up, reference_run, loop_run = per_run
    assert reference_run == 0, "the reference's side never calls the loop"
    assert loop_run > 0, "the loop's side runs the loop"
    assert cpu_attention._kernel is counted, "the benchmark put the engine's loop back"


@needs_kernel
def test_a_single_request_warms_up_too():
    result = bench_cpu_attention.in_the_engine(rounds=1, num_requests=1, lens=(8, 8))
    assert result["identical_completions"] is True


@needs_kernel
def test_the_kernels_alone_agree_with_the_reference(monkeypatch):
    monkeypatch.setattr(
        bench_cpu_attention,
        "SHAPES",
        {"small": dict(batch=3, heads=4, kv_heads=2, head_dim=16, contexts=(5, 40))},
    )
    result = bench_cpu_attention.kernels_alone(rounds=1)["small"]
    assert result["max_abs_difference"] < 1e-5
    assert result["reference_ms"] > 0 and result["in_place_ms"] > 0
