"""``scripts/gpu_check.sh`` where there is no GPU (one line, exit 2), and its summary of a run
(``scripts/gpu_summary.py``) on the reports a run leaves: failures, files not run, stages cut
short."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="4">
<testcase classname="" name="tests.runtime.test_server" time="0.0">
  <error message="collection failure">ModuleNotFoundError</error></testcase>
<testcase classname="tests.runtime.test_kernels" name="test_store[fp16]" time="0.1"/>
<testcase classname="tests.runtime.test_kernels" name="test_decode[fp32]" time="0.1">
  <failure message="AssertionError: tensors differ&#10;second line">trace</failure></testcase>
<testcase classname="tests.runtime.test_model" name="test_cuda_only" time="0.0">
  <skipped message="no CUDA"/></testcase>
</testsuite></testsuites>
"""
LOG = """____________ ERROR collecting tests/runtime/test_server.py ____________
tests/runtime/test_server.py:12: in <module>
    import fastapi
E   ModuleNotFoundError: No module named 'fastapi'
=========================== short test summary info ============================
"""


def summary_module():
    spec = importlib.util.spec_from_file_location("gpu_summary", ROOT / "scripts/gpu_summary.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_without_cuda_it_says_so_in_one_line_and_exits_2(tmp_path):
    environment = os.environ | {"PYTHON": sys.executable}
    run = subprocess.run(
        ["bash", str(ROOT / "scripts/gpu_check.sh"), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env=environment,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines() == [
        f"gpu_check: no CUDA GPU here ({sys.executable}'s torch sees none): nothing to check"
    ]
    assert not (tmp_path / "out").exists(), "nothing is written"


def test_the_summary_counts_failures_names_files_not_run_and_stages_cut_short(tmp_path, capsys):
    (tmp_path / "tests.xml").write_text(JUNIT)
    (tmp_path / "tests.log").write_text(LOG)
    (tmp_path / "stages.txt").write_text("tests 1 150\ndecode_kernel 0 20\ne2e 124 200\n")
    (tmp_path / "startup.json").write_text(json.dumps({"llm_startup_seconds": 2.5}))
    swept = [  # fastest first, as bench_decode_kernel.py --sweep writes them
        {"format": "16-bit", "block_n": 32, "num_warps": 8, "num_stages": 2, "ms": 0.3},
        {"format": "16-bit", "block_n": 64, "num_warps": 4, "num_stages": 3, "ms": 0.36},
        {"format": "int8 KV, keys per channel", "block_n": 64, "num_warps": 4, "num_stages": 3},
    ]
    swept[2] |= {"fold_keys": False, "fold_scales": True, "ms": 0.18}
    for row in swept:
        row["speedup_over_defaults"] = 0.36 / row["ms"]
    (tmp_path / "decode_sweep.json").write_text(json.dumps({"device": "H200", "rows": swept}))
    phases = {"schedule": 150.0, "forward": 20.0, "sample": 3000.0, "metrics": 230.0}
    host = {"batch": 128, "step_us": 5000.0, "phases_us": phases}
    (tmp_path / "bench_step_overhead.json").write_text(json.dumps(host))
    assert summary_module().main(tmp_path) == 1
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    tests = result["tests"]
    assert (tests["passed"], tests["failed"], tests["skipped"]) == (1, 1, 1)
    assert tests["failed_tests"] == [
        "tests.runtime.test_kernels::test_decode[fp32]: AssertionError: tensors differ"
    ]
    assert tests["not_run"] == {
        "tests/runtime/test_server.py": "ModuleNotFoundError: No module named 'fastapi'"
    }
    assert result["unclean"] == ["tests", "e2e"], "a failed test, and a stage that timed out"
    assert result["e2e"] is None and result["startup"] == {"llm_startup_seconds": 2.5}
    printed = capsys.readouterr().out
    assert "not run: tests/runtime/test_server.py: ModuleNotFoundError" in printed
    assert (
        "host (128 sequences): a full decode step 5,000 us, 3,000 us of it in sample (the wait "
        "for the GPU), 2,000 us the host's work\n  schedule 150, forward 20, metrics 230"
    ) in printed
    assert "16-bit: fastest at block_n 32, 8 warps, 2 stages: 0.300 ms (1.20x the defaults)" in (
        printed
    )
    assert (
        "channel: fastest at block_n 64, 4 warps, 3 stages, keys not folded, scales folded: 0.180"
        in printed
    )


def test_a_run_whose_only_trouble_is_a_file_it_cannot_import_is_clean(tmp_path):
    junit = JUNIT.replace('<failure message="AssertionError: tensors differ&#10;second line">', "")
    (tmp_path / "tests.xml").write_text(junit.replace("trace</failure>", ""))
    (tmp_path / "tests.log").write_text(LOG)
    (tmp_path / "stages.txt").write_text("tests 1 150\ndecode_kernel 0 20\ne2e 0 190\n")
    assert summary_module().main(tmp_path) == 0
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["unclean"] == [] and result["tests"]["passed"] == 2
