"""The decode-step benchmark on a CPU: each variant runs the same requests, the padded buffers
of the CUDA-graph path give the plain run's completions, and the JSON holds every figure."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_decode_step
import pytest
import torch

from vkv.bench import Workload, WorkloadShape, gpu_busy_share
from vkv.engine.llm_engine import LLMEngine
from vkv.models.loader import DEFAULT_MODEL


def test_every_variant_runs_and_padding_changes_no_completion(tmp_path, monkeypatch, capsys):
    argv = ["bench_decode_step.py", "--device", "cpu", "--requests", "6", "--max-num-seqs", "4"]
    monkeypatch.setattr(sys, "argv", [*argv, "--out", str(tmp_path)])
    small = WorkloadShape(6, (16, 48), (8, 12))
    monkeypatch.setitem(bench_decode_step.WORKLOADS, "mixed", small)
    assert bench_decode_step.main() == 0
    results = json.loads((tmp_path / "decode_step.json").read_text())
    assert list(results) == list(bench_decode_step.variants("cpu"))
    assert results["16-bit, padded buffers"]["same_completions_as_first"] == 6
    for row in results.values():
        assert row["tokens_per_s"] > 0 and row["gpu_busy_share"] is None
    assert "16-bit, padded buffers" in capsys.readouterr().out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU's busy share needs a GPU")
def test_the_gpu_busy_share_of_a_full_batch_is_a_share_and_leaves_no_request():
    engine = LLMEngine(DEFAULT_MODEL, max_num_seqs=4, device="cuda")
    prompts = Workload.mixed(lambda text: engine.tokenizer.encode(text).ids, num_requests=4)
    share = gpu_busy_share(engine, prompts, 4)
    assert share is not None and 0.0 < share <= 1.0
    assert not engine.has_unfinished_requests()
    assert gpu_busy_share(engine, prompts, 5) is None  # fewer prompts than the batch
