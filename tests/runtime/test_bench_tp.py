"""The tensor-parallel benchmark on 4 short requests (instead of ``vkv bench e2e``'s 64), one
round, on the CPU: both sides generate every token asked for, rank 0 sends at least a message a
step, and no worker process is left. One of the two engines spawns a worker (a Python that
imports torch: a few seconds)."""

import json
import multiprocessing
import sys
from pathlib import Path
from typing import ClassVar

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_tp

from vkv.bench import Workload

NUM_REQUESTS = 4


class SmallWorkload(Workload):
    """``Workload.mixed`` with 4 requests of 8 to 16 prompt and 8 to 12 output tokens (each one
    made kept in ``made``; ``test_bench_record`` uses it too)."""

    made: ClassVar[list[Workload]] = []

    @classmethod
    def mixed(cls, tokenize, **_):
        workload = Workload.mixed(
            tokenize, num_requests=NUM_REQUESTS, prompt_lens=(8, 16), output_lens=(8, 12)
        )
        cls.made.append(workload)
        return workload


@pytest.fixture
def threads():
    """The benchmark sets torch's thread count for each side: put it back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_one_round_on_two_processes_gives_every_figure(monkeypatch, tmp_path, threads):
    monkeypatch.setenv("VKV_DEVICE", "cpu")  # the worker process too
    monkeypatch.setattr(bench_tp, "Workload", SmallWorkload)
    monkeypatch.setattr(SmallWorkload, "made", [])
    argv = ["bench_tp.py", "--size", "2", "--rounds", "1", "--device", "cpu"]
    monkeypatch.setattr(sys, "argv", [*argv, "--out", str(tmp_path)])
    bench_tp.main()
    s = json.loads((tmp_path / "bench_tp.json").read_text())
    assert (s["size"], s["device"], s["rounds"]) == (2, "cpu", 1)
    [workload] = SmallWorkload.made
    assert s["tokens"] == workload.output_tokens, "greedy, ignore_eos: every token asked for"
    for figure in ("tokens_per_s", "step_ms"):
        assert set(s[figure]) == {"1", "2"} and all(v > 0 for v in s[figure].values()), figure
    assert len(s["time_ratios"]) == 1 and s["time_ratio_median"] == s["time_ratios"][0] > 0
    assert s["messages_per_step"] >= 1 and s["message_bytes_per_step"] > 0, "a batch a step"
    assert 1 <= s["sequences_per_run"] <= NUM_REQUESTS, "a batch holds at most every request"
    assert s["sequences_per_run"] <= s["tokens_per_run"], "a token at least a sequence"
    assert s["all_reduce_bytes_per_run"] > 0 and s["gather_bytes_per_run"] > 0
    assert not multiprocessing.active_children(), "both engines are closed, the worker ended"
