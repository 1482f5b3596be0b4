"""Which attention kernels an engine runs: Triton's, or on a CPU the torch references with the
C decode loop where it compiled (``cpu_attention``), or the plain references."""

from types import ModuleType

import torch

from vkv.kernels import cpu_attention, reference


def attention_kernels(backend: str, device: torch.device) -> tuple[ModuleType, str]:
    """The attention kernels' module for ``backend`` on ``device``, and how to describe it."""
    if backend == "triton":
        from vkv.kernels import triton_attention

        return triton_attention, "triton attention"
    if device.type == "cpu":
        compiled = cpu_attention.kernel_path() is not None
        return cpu_attention, "torch attention" + (", decode in place (C)" if compiled else "")
    return reference, "torch attention"
