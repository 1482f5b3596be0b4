"""Host tensors onto the engine's device without the host waiting for the copy.

A copy from pageable host memory to a GPU makes the host wait until it is done (CUDA stages it);
from pinned (page-locked) memory it is queued on the stream like a kernel, and the kernels queued
after it read it. The engine's step waits for the GPU once, for its sampled tokens, so every
list it hands the GPU (a step's inputs, the key residual's plan, the blocks a copy moves) goes
through ``upload``.
"""

import torch


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device``: itself elsewhere than a GPU; on a GPU a copy queued
    from pinned memory (nothing waits; the pinned buffer lives until the copy is done)."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
