"""The sampling benchmark runs on a CPU and prints a row per batch size."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_sampling


def test_it_times_each_kind_against_greedy(monkeypatch, capsys):
    argv = ["bench_sampling.py", "--device", "cpu", "--vocab", "300", "--batches", "1", "3"]
    monkeypatch.setattr(sys, "argv", [*argv, "--repeat", "2"])
    bench_sampling.main()
    out = capsys.readouterr().out
    assert "vocabulary 300" in out and "seeded" in out
    rows = [line for line in out.splitlines() if line.startswith("│")]
    assert [row.split("│")[1].strip() for row in rows] == ["1", "3"]
    assert all(row.count("x)") == len(bench_sampling.KINDS) for row in rows)
