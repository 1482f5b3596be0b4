"""Runtime tests run the Triton kernels under the interpreter when no GPU is present."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
