"""Where Phase 3's Triton tests run, shared by the visible and the hidden graded tests.

Triton either interprets its kernels on the CPU (``TRITON_INTERPRET=1``, CPU tensors) or
compiles them for CUDA, and decides which when it is imported and when a kernel is defined.
The graded tests run without a conftest, so a test module imports this one before anything
imports Triton (``import kernel_device`` sorts before ``import triton``): without a GPU it sets
the variable. ``DEVICE`` is where the kernels' tensors go; ``launched`` runs a kernel so that
an exception of the code under test comes out as itself.
"""

import os

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
