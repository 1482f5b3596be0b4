"""The recording benchmark on 4 short requests (instead of ``vkv bench e2e``'s 64), 2 pairs so
that both orders run: its figures, a recording of a header and a line a step, and the engine
left without a recorder between runs."""

import json
import sys
from pathlib import Path
from typing import ClassVar

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_record
from test_bench_tp import SmallWorkload


class CountedFile(bench_record.RecordingFile):
    """A recording file that counts its lines (each file's count, in order)."""

    lines: ClassVar[list[int]] = []

    def __init__(self, path) -> None:
        super().__init__(path)
        self.lines.append(0)

    def __call__(self, line: str) -> None:
        super().__call__(line)
        self.lines[-1] += 1


def test_two_pairs_of_a_small_workload_give_every_figure(monkeypatch, tmp_path):
    monkeypatch.setattr(bench_record, "Workload", SmallWorkload)
    monkeypatch.setattr(SmallWorkload, "made", [])
    monkeypatch.setattr(bench_record, "RecordingFile", CountedFile)
    monkeypatch.setattr(CountedFile, "lines", [])
    recorders = []
    run_once = bench_record.run_once

    def watched(engine, workload, record):
        recorders.append(engine.recorder)
        result = run_once(engine, workload, record)
        recorders.append(engine.recorder)
        return result

    monkeypatch.setattr(bench_record, "run_once", watched)
    monkeypatch.setattr(sys, "argv", ["bench_record.py", "--pairs", "2", "--out", str(tmp_path)])
    bench_record.main()
    summary = json.loads((tmp_path / "bench_record.json").read_text())
    assert summary["pairs"] == 2 and len(summary["ratios"]) == 2
    assert all(ratio > 0 for ratio in summary["ratios"])
    assert min(summary["ratios"]) <= summary["ratio_median"] <= max(summary["ratios"])
    assert 0 < summary["recording_share_median"] < 1, "Recorder.record is timed inside the run"
    assert summary["seconds_without"] > 0 and summary["seconds_with"] > 0
    assert summary["gpu_blocks"] > 0
    assert len(CountedFile.lines) == 2, "one recorded run a pair"
    [workload] = SmallWorkload.made
    for lines in CountedFile.lines:
        assert lines > max(workload.output_lens), f"a header and a line a step: {lines} lines"
    assert summary["recording_bytes"] > 0
    assert recorders == [None] * 8, "the recorder is set for a run and taken off after it"
