"""Every Triton launch of the GPU path compiles for an H200 (sm_90) here, without a GPU
(``scripts/compile_for_gpu.py``): the interpreter that runs the kernels in the other tests accepts
code that the compiler refuses, and a kernel that fails to compile costs a lent GPU's minutes.
"""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU compiles and runs them for real")
def test_every_launch_of_the_gpu_path_compiles_for_sm_90():
    environment = os.environ | {
        "PYTHONPATH": str(ROOT),
        # Triton's cache keys a kernel by its source (and what it calls), the launch's
        # specialization, the target and Triton's version: a kernel found there compiled as is
        "TRITON_CACHE_DIR": str(Path(tempfile.gettempdir()) / "vkv-triton-sm90"),
        "TRITON_DEFAULT_FP_FUSION": "1",
    }
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts/compile_for_gpu.py"), "--anatomy"],
        capture_output=True,
        text=True,
        env=environment,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "35 launches compiled for sm_90, 0 failed" in run.stdout, run.stdout[-2000:]
    assert "_attention_kernel(DECODE=True, BITS=16" in run.stdout and "registers" in run.stdout
