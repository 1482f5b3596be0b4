"""The decode-step benchmark on a CPU: each variant runs the same requests, the padded buffers
of the CUDA-graph path give the plain run's completions, and the JSON holds every figure."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_decode_step

from vkv.bench import WorkloadShape


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
