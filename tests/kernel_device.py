"""Where Phase 3's Triton tests run, shared by the visible and the hidden graded tests.

Triton either interprets its kernels on the CPU (``TRITON_INTERPRET=1``, CPU tensors) or
compiles them for CUDA, and decides which when it is imported and when a kernel is defined.
The graded tests run without a conftest, so a test module imports this one before anything
imports Triton (``import kernel_device`` sorts before ``import triton``): without a GPU it sets
the variable. ``DEVICE`` is where the kernels' tensors go; ``launched`` runs a kernel so that
an exception of the code under test comes out as itself; ``compile_for_gpu`` compiles the
kernels for a GPU without one (``scripts/compile_for_gpu.py``).
"""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from triton.runtime.errors import InterpreterError

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def launched(kernel, *args, **kwargs):
    """``kernel(*args, **kwargs)``; an exception raised in the tested Triton code comes out as
    itself (the interpreter wraps it in one ``InterpreterError`` per nested call)."""
    try:
        return kernel(*args, **kwargs)
    except InterpreterError as wrapped:
        error = wrapped
        while isinstance(error, InterpreterError) and error.__cause__ is not None:
            error = error.__cause__
        raise error from None


def compile_for_gpu(*options: str) -> subprocess.CompletedProcess:
    """``scripts/compile_for_gpu.py`` with ``options``, in a child process (Triton's compiler,
    not this process's interpreter), its output captured. Triton's cache is kept under the
    temporary folder: it keys a kernel by its source (and what it calls), the launch's
    specialization, the target and Triton's version, so a kernel found there compiled as it
    is, and the same source compiles once."""
    root = Path(__file__).resolve().parents[1]
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    environment |= {
        "PYTHONPATH": str(root),
        "TRITON_CACHE_DIR": str(Path(tempfile.gettempdir()) / "vkv-triton-sm90"),
        "TRITON_DEFAULT_FP_FUSION": "1",
    }
    script = str(root / "scripts/compile_for_gpu.py")
    return subprocess.run(
        [sys.executable, script, *options],
        capture_output=True,
        text=True,
        env=environment,
        timeout=600,
    )
