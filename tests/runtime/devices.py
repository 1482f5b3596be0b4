"""Where the runtime tests put their tensors, and in which dtype: one rule for tests/runtime.

- ``DEVICES``: the devices the torch code runs on under test (the reference kernels, the model
  on the torch backend, the CacheEngine's copies, an engine): the CPU always, and CUDA where
  there is one. The ``device`` fixture (``conftest.py``) runs a test on each; on a machine
  without a GPU that is the CPU alone, so a CUDA case costs a CPU-only run nothing.
- ``KERNEL_DEVICE``: the one device the Triton kernels run on in this process. Triton either
  interprets them (``TRITON_INTERPRET=1``, CPU tensors) or compiles them for CUDA (CUDA
  tensors), and decides which when it is imported; without a GPU this module sets the variable
  before anything imports Triton (``conftest.py`` imports it first). So this is the CPU where
  Triton interprets (no GPU, or the variable set by hand), else CUDA. ``BACKENDS`` pairs each
  attention backend with where it runs: torch on each of ``DEVICES``, Triton on this one.
- ``EXACT_DTYPE``: a test that compares the tokens or logits of two computations (an engine
  against transformers, a preempted run against an ample one, one backend against another, a
  batch against a request served alone) runs its engines in float32, where the Triton kernels
  dot in IEEE precision and two paths differ by rounding (about 1e-6). In fp16, an engine's
  default on CUDA, they differ by about 1e-3: enough to change a greedy token or a sample.
- An engine test whose assertions hold for any tokens runs on the engine's default device
  (CUDA where there is one) and dtype; one that needs the CPU says why.
"""

import os

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICES = ["cpu", "cuda"] if CUDA else ["cpu"]
KERNEL_DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
BACKENDS = [("torch", device) for device in DEVICES] + [("triton", KERNEL_DEVICE)]
EXACT_DTYPE = "float32"
