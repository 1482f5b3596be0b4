"""Every Triton launch of the GPU path compiles for an H200 (sm_90) here, without a GPU
(``scripts/compile_for_gpu.py``): the interpreter that runs the kernels in the other tests accepts
code that the compiler refuses, and a kernel that fails to compile costs a lent GPU's minutes.
"""

import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: kernel_device

from kernel_device import compile_for_gpu


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU compiles and runs them for real")
def test_every_launch_of_the_gpu_path_compiles_for_sm_90():
    run = compile_for_gpu("--anatomy")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "53 launches compiled for sm_90, 0 failed" in run.stdout, run.stdout[-2000:]
    assert "_attention_kernel(DECODE=True, BITS=16" in run.stdout and "registers" in run.stdout
    # the tile loop found in each attention kernel's SASS, and what a cached token costs in it
    per_token = {}
    for line in run.stdout.splitlines():
        if line.startswith("compiled _attention_kernel"):
            loop = re.search(r"\((\d+) in the longest loop, \d warps x \d+ / \d+ tokens", line)
            total = re.search(r"(\d+) instructions", line)
            assert loop and 0 < int(loop[1]) < int(total[1]), line
            options = re.search(r"\((DECODE=.*?)\)", line)[1]
            per_token[options] = float(re.search(r"= ([\d.]+) a cached token", line)[1])
    for bits in (8, 4):  # scales out of the tile: fewer instructions a token (46 against 68)
        decode = f"DECODE=True, BITS={bits}, KEYS_PER_CHANNEL=False, FOLD_KEYS=False"
        folded = per_token[f"{decode}, FOLD_SCALES=True, BLOCK_N=64"]
        assert folded < 0.85 * per_token[f"{decode}, FOLD_SCALES=False, BLOCK_N=64"], bits
