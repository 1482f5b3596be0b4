"""The step-overhead benchmark: its phases account for the whole step, on a small workload."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_step_overhead
import pytest

from vkv.bench import WORKLOADS, Workload, run_vkv
from vkv.engine import model_runner
from vkv.engine.llm_engine import LLMEngine
from vkv.models.loader import DEFAULT_MODEL


@pytest.fixture(scope="module")
def summary():
    engine = LLMEngine(DEFAULT_MODEL, max_num_seqs=4, device="cpu")
    workload = Workload.mixed(
        lambda text: engine.tokenizer.encode(text).ids,
        num_requests=4,
        prompt_lens=(8, 16),
        output_lens=(12, 16),
    )
    return bench_step_overhead.measure(engine, workload, rounds=2), engine


def test_every_phase_is_timed_and_they_add_up_to_the_step(summary):
    result, _ = summary
    phases = result["phases_us"]
    assert list(phases) == bench_step_overhead.PHASES
    assert result["steps"] >= 10, "4 requests of at least 12 tokens decode as a full batch"
    for phase in (
        "schedule",
        "prepare",
        "forward",
        "sample",
        "postprocess",
        "detokenize",
        "metrics",
    ):
        assert phases[phase] > 0, f"{phase} was not timed"
    assert phases["execute rest"] >= 0 and abs(phases["other"]) < 0.2 * result["step_us"], (
        f"the timed phases cover most of the step: {phases}, step {result['step_us']:.0f} us"
    )
    assert phases["forward"] > max(v for k, v in phases.items() if k != "forward")


def test_the_engine_is_left_as_it_was(summary):
    _, engine = summary
    assert "step" not in vars(engine), "the timed step is removed after each round"
    for owner, name in [
        (engine, "_output"),
        (engine.runner, "execute"),
        (engine.runner.model, "forward"),
    ]:
        assert name not in vars(owner), f"{name}'s timer is removed"
    assert model_runner.draw_tokens.__module__ == "vkv.engine.model_runner", "put back"
    assert model_runner.draw_tokens.__name__ == "draw_tokens"


def test_the_script_runs_a_batch_of_the_size_asked(monkeypatch, tmp_path, capsys):
    argv = ["bench_step_overhead.py", "--rounds", "1", "--batch", "4", "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    bench_step_overhead.main()
    result = json.loads((tmp_path / "bench_step_overhead.json").read_text())
    assert result["rounds"] == 1 and result["steps"] > 0
    assert list(result["phases_us"]) == bench_step_overhead.PHASES
    assert "Decode steps of 4 sequences" in capsys.readouterr().out


def test_the_gpu_path_decodes_nano_vllm_lengths_on_the_padded_buffers():
    engine, workload = bench_step_overhead.gpu_path(4)
    shape = WORKLOADS["nano-vllm"]
    assert len(workload.prompts) == 4
    assert all(shape.prompt_lens[0] <= len(p) <= shape.prompt_lens[1] for p in workload.prompts)
    assert all(shape.output_lens[0] <= n <= shape.output_lens[1] for n in workload.output_lens)
    short = Workload(workload.prompts, [12] * 4)  # the whole lengths take minutes on a CPU
    result = bench_step_overhead.measure(engine, short, rounds=1)
    assert result["steps"] >= 10 and engine.runner.decode_graphs.steps >= result["steps"]
    assert len(run_vkv(engine, Workload(workload.prompts[:1], [3])).completions[0]) == 3
    assert engine.scheduler.block_manager.num_free_gpu_blocks == engine.config.num_gpu_blocks
