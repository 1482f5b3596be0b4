"""CacheEngine: the KV-cache tensors themselves, and the block copies the scheduler asks for.

The BlockManager only does bookkeeping; this class owns the memory. The device cache holds every
layer's keys and values in one tensor ``[2, num_layers, num_blocks, block_size, kv_heads,
head_dim]`` (index 0 keys, 1 values), so that ``cache[0, layer]`` is the
``[num_blocks, block_size, kv_heads, head_dim]`` layout the attention kernels read; the CPU swap
pool has the same layout (pinned memory on CUDA, for fast copies).

Each step, before the model runs, the engine applies the step's maps, in this order:
``swap_out {gpu: cpu}``, ``swap_in {cpu: gpu}``, ``copy {src: [dst, ...]}`` (copy-on-write).
"""

from dataclasses import dataclass

import torch


@dataclass(slots=True, frozen=True)
class CacheShape:
    """What one block holds: every layer's K and V for ``block_size`` tokens."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def block_bytes(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element

    def num_blocks_for(self, budget_bytes: int) -> int:
        """How many blocks fit in ``budget_bytes``; ``ValueError`` if not even one does."""
        blocks = budget_bytes // self.block_bytes
        if blocks < 1:
            raise ValueError(
                f"a KV budget of {budget_bytes:,} bytes holds no block "
                f"({self.block_bytes:,} bytes each)"
            )
        return blocks


def free_device_bytes(device: torch.device, fraction: float) -> int:
    """``fraction`` of the device's free memory (CUDA only)."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"the memory fraction must be in (0, 1], got {fraction}")
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * fraction)


class CacheEngine:
    """The device KV cache and the CPU swap pool of ``shape``, and the copies between them."""

    def __init__(
        self, shape: CacheShape, num_gpu_blocks: int, num_cpu_blocks: int, device: torch.device
    ) -> None:
        layout = (shape.num_layers, shape.block_size, shape.num_kv_heads, shape.head_dim)
        self.shape = shape
        self.device = device
        self.gpu_cache = torch.zeros(
            2, layout[0], num_gpu_blocks, *layout[1:], dtype=shape.dtype, device=device
        )
        self.cpu_cache = torch.zeros(
            2,
            layout[0],
            num_cpu_blocks,
            *layout[1:],
            dtype=shape.dtype,
            pin_memory=device.type == "cuda",
        )

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``index``'s key and value caches, ``[num_blocks, block_size, heads, dim]``."""
        return self.gpu_cache[0, index], self.gpu_cache[1, index]

    def swap_out(self, mapping: dict[int, int]) -> None:
        """Copy GPU blocks to CPU blocks: ``{gpu_block: cpu_block}``."""
        _copy_blocks(self.gpu_cache, self.cpu_cache, list(mapping.items()))

    def swap_in(self, mapping: dict[int, int]) -> None:
        """Copy CPU blocks to GPU blocks: ``{cpu_block: gpu_block}``."""
        _copy_blocks(self.cpu_cache, self.gpu_cache, list(mapping.items()))

    def copy(self, blocks_to_copy: dict[int, list[int]]) -> None:
        """Copy GPU blocks within the GPU cache: ``{src: [dst, ...]}`` (copy-on-write)."""
        pairs = [(src, dst) for src, dsts in blocks_to_copy.items() for dst in dsts]
        _copy_blocks(self.gpu_cache, self.gpu_cache, pairs)

    def apply(
        self,
        swap_out: dict[int, int],
        swap_in: dict[int, int],
        blocks_to_copy: dict[int, list[int]],
    ) -> None:
        """A step's block operations, in the order the module docstring gives."""
        self.swap_out(swap_out)
        self.swap_in(swap_in)
        self.copy(blocks_to_copy)


def _copy_blocks(source: torch.Tensor, target: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    """Copy block ``src`` of ``source`` to block ``dst`` of ``target``, in every layer, K and V."""
    if not pairs:
        return
    src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=source.device)
    dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=target.device)
    target[:, :, dst] = source[:, :, src].to(target.device, non_blocking=True)
