"""CacheEngine: the KV-cache tensors themselves, and the block copies the scheduler asks for.

The BlockManager only does bookkeeping; this class owns the memory. The device cache holds every
layer's keys and values in one tensor ``[2, num_layers, num_blocks, block_size, kv_heads,
head_dim]`` (index 0 keys, 1 values), so that ``cache[0, layer]`` is the
``[num_blocks, block_size, kv_heads, head_dim]`` layout the attention kernels read; the CPU swap
pool has the same layout (pinned memory on CUDA, for fast copies).

Each step, before the model runs, the engine applies the step's maps, in this order:
``swap_out {gpu: cpu}``, ``swap_in {cpu: gpu}``, ``copy {src: [dst, ...]}`` (copy-on-write).

With ``kv_cache_dtype`` ``"int8"`` or ``"int4"`` (Phase 3) a block holds codes instead of
values: three tensors, each with the same leading ``[2, num_layers, num_blocks, block_size,
kv_heads]``: the codes (uint8, ``head_dim`` bytes for INT8, ``head_dim / 2`` for INT4), and one
scale and one zero per token and head (LMDeploy's granularity, in the model's dtype). The same
block tables address all three, and every swap and copy moves all three: a block's scales
travel with its codes. ``layer(i)`` then hands the kernels a ``QuantizedCache`` for the keys and
one for the values; storing quantizes each token as it is written, attention dequantizes what
it reads. Keys per channel (KIVI) are not stored this way yet: they need a whole block's tokens
before its grid is known.
"""

from dataclasses import dataclass

import torch

from vkv.config import KV_CACHE_DTYPES, check_kv_cache_dtype
from vkv.engine.quantizer import bytes_per_token


@dataclass(slots=True, frozen=True)
class QuantizedCache:
    """One layer's keys or values, quantized per token: ``codes [num_blocks, block_size,
    kv_heads, head_dim * bits / 8]`` (uint8) and ``scale``, ``zero`` ``[num_blocks,
    block_size, kv_heads, 1]``: a token's values are ``codes * scale + zero``."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The logical ``[num_blocks, block_size, kv_heads, head_dim]``, as an unquantized cache."""
        blocks, block_size, heads, stored = self.codes.shape
        return blocks, block_size, heads, stored * 8 // self.bits


@dataclass(slots=True, frozen=True)
class CacheShape:
    """What one block holds: every layer's K and V for ``block_size`` tokens."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.kv_cache_dtype == "int4" and self.head_dim % 2:
            raise ValueError(f"an int4 KV cache needs an even head_dim, got {self.head_dim}")

    @property
    def quantized(self) -> bool:
        return self.kv_cache_dtype != "auto"

    @property
    def bits(self) -> int:
        return KV_CACHE_DTYPES[self.kv_cache_dtype]

    @property
    def block_bytes(self) -> int:
        """A block's bytes, codes and scales counted (``bytes_per_token``, Phase 3.4)."""
        element = torch.empty((), dtype=self.dtype).element_size()
        if not self.quantized:
            return (
                2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element
            )
        per_token = bytes_per_token(
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            self.kv_cache_dtype,
            "per_token",
            self.block_size,
            scale_bytes=element,
        )
        return int(per_token * self.block_size)

    def planes(self, num_blocks: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """The shape and dtype of each tensor of a pool of ``num_blocks`` blocks."""
        lead = (2, self.num_layers, num_blocks, self.block_size, self.num_kv_heads)
        if not self.quantized:
            return [((*lead, self.head_dim), self.dtype)]
        codes = ((*lead, self.head_dim * self.bits // 8), torch.uint8)
        return [codes, ((*lead, 1), self.dtype), ((*lead, 1), self.dtype)]

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
        self.shape = shape
        self.device = device
        pinned = device.type == "cuda"
        self.gpu_planes = [
            torch.zeros(size, dtype=dtype, device=device)
            for size, dtype in shape.planes(num_gpu_blocks)
        ]
        self.cpu_planes = [
            torch.zeros(size, dtype=dtype, pin_memory=pinned)
            for size, dtype in shape.planes(num_cpu_blocks)
        ]

    @property
    def gpu_cache(self) -> torch.Tensor:
        """The device pool's values (or, quantized, its codes)."""
        return self.gpu_planes[0]

    @property
    def cpu_cache(self) -> torch.Tensor:
        """The swap pool's values (or, quantized, its codes)."""
        return self.cpu_planes[0]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor] | tuple[QuantizedCache, ...]:
        """Layer ``index``'s key and value caches, ``[num_blocks, block_size, heads, dim]``
        (quantized: a ``QuantizedCache`` each)."""
        if not self.shape.quantized:
            return self.gpu_cache[0, index], self.gpu_cache[1, index]
        codes, scale, zero = self.gpu_planes
        bits = self.shape.bits
        return tuple(
            QuantizedCache(codes[kv, index], scale[kv, index], zero[kv, index], bits)
            for kv in (0, 1)
        )

    def swap_out(self, mapping: dict[int, int]) -> None:
        """Copy GPU blocks to CPU blocks: ``{gpu_block: cpu_block}``."""
        self._copy(self.gpu_planes, self.cpu_planes, list(mapping.items()))

    def swap_in(self, mapping: dict[int, int]) -> None:
        """Copy CPU blocks to GPU blocks: ``{cpu_block: gpu_block}``."""
        self._copy(self.cpu_planes, self.gpu_planes, list(mapping.items()))

    def copy(self, blocks_to_copy: dict[int, list[int]]) -> None:
        """Copy GPU blocks within the GPU cache: ``{src: [dst, ...]}`` (copy-on-write)."""
        pairs = [(src, dst) for src, dsts in blocks_to_copy.items() for dst in dsts]
        self._copy(self.gpu_planes, self.gpu_planes, pairs)

    @staticmethod
    def _copy(
        sources: list[torch.Tensor], targets: list[torch.Tensor], pairs: list[tuple[int, int]]
    ) -> None:
        for source, target in zip(sources, targets, strict=True):
            _copy_blocks(source, target, pairs)

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
