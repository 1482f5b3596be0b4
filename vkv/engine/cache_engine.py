"""CacheEngine: the KV-cache tensors themselves, and the block copies the scheduler asks for.

The BlockManager only does bookkeeping; this class owns the memory. The device cache holds every
layer's keys and values in one tensor ``[2, num_layers, num_blocks, block_size, kv_heads,
head_dim]`` (index 0 keys, 1 values), so that ``cache[0, layer]`` is the
``[num_blocks, block_size, kv_heads, head_dim]`` layout the attention kernels read; the CPU swap
pool has the same layout (pinned memory on CUDA, for fast copies).

Each step, before the model runs, the engine applies the step's maps, in this order:
``swap_out {gpu: cpu}``, ``swap_in {cpu: gpu}``, ``copy {src: [dst, ...]}`` (copy-on-write).

With ``kv_cache_dtype`` ``"int8"`` or ``"int4"`` (Phase 3) a block holds codes instead of
values, in five tensors (*planes*) whose third dimension is the block:

- the codes ``[2, num_layers, num_blocks, block_size, kv_heads, head_dim * bits / 8]`` (uint8);
- the keys' scale and zero ``[1, num_layers, num_blocks, block_size, kv_heads, 1]`` per token
  and head (LMDeploy's granularity), or, with ``key_granularity="per_channel"`` (KIVI's),
  ``[1, num_layers, num_blocks, 1, kv_heads, head_dim]``: one per channel, shared by the block;
- the values' scale and zero ``[1, num_layers, num_blocks, block_size, kv_heads, 1]``.

With ``quant_group="token"`` a per-token scale and zero cover all of a token's KV heads (their
planes are ``[..., block_size, 1, 1]``): fewer scales, so more blocks a byte (with head_dim 32,
1.94x and 3.76x the blocks of 16-bit KV instead of 1.78x and 3.2x).

Scales and zeros are in the model's dtype. The same block tables address every plane, and every
swap and copy moves every plane: a block's scales travel with its codes. ``layer(i)`` hands the
kernels a ``QuantizedCache`` for the keys and one for the values; storing quantizes each token
as it is written, attention dequantizes what it reads. Keys per channel need a whole block before
its grid is known: a partial block's keys wait in full precision in a ``KeyResidual``
(``key_residual.py``), which the same swaps and copies keep with their blocks.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from vkv.config import (
    KV_CACHE_DTYPES,
    check_key_granularity,
    check_kv_cache_dtype,
    check_quant_group,
)
from vkv.engine.key_residual import KeyPlan, KeyResidual
from vkv.engine.quantizer import bytes_per_token
from vkv.engine.upload import upload


@dataclass(slots=True, frozen=True)
class QuantizedCache:
    """One layer's keys or values: ``codes [num_blocks, block_size, kv_heads, head_dim * bits /
    8]`` (uint8) and ``scale``, ``zero``, either ``[num_blocks, block_size, kv_heads, 1]`` (per
    token) or ``[num_blocks, 1, kv_heads, head_dim]`` (keys per channel): a token's values are
    ``codes * scale + zero``, broadcast.

    Keys per channel also carry the residual: ``residual [num_slots, block_size, kv_heads,
    head_dim]`` (full precision), ``residual_slot [num_blocks]`` (where the step's partial blocks
    are, -1 elsewhere: read those from the residual) and ``plan``, the step's writes.

    ``refused``, a step flag (int32, one element, on the cache's device) shared by every layer's
    caches: given, the Triton store refuses NaN and infinities by setting it and writing nothing
    while it is set, instead of raising there (which waits for the device: a CUDA graph cannot,
    and an eager step would wait once a layer). Its owner, the ``CacheEngine``, clears it before
    each step (``plan_step``) and raises after the step's sampled tokens are on the host
    (``raise_if_refused``). Per token only: keys per channel plan their writes on the host each
    step and check there.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    residual: torch.Tensor | None = None
    residual_slot: torch.Tensor | None = None
    plan: KeyPlan | None = None
    refused: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.refused is not None and self.per_channel:
            raise ValueError("a step flag (refused) serves caches quantized per token only")

    @property
    def per_channel(self) -> bool:
        return self.residual is not None

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
    key_granularity: str = "per_token"
    quant_group: str = "head"

    def __post_init__(self) -> None:
        check_kv_cache_dtype(self.kv_cache_dtype)
        check_key_granularity(self.key_granularity, self.kv_cache_dtype)
        check_quant_group(self.quant_group, self.kv_cache_dtype)
        if self.kv_cache_dtype == "int4" and self.head_dim % 2:
            raise ValueError(f"an int4 KV cache needs an even head_dim, got {self.head_dim}")

    @property
    def quantized(self) -> bool:
        return self.kv_cache_dtype != "auto"

    @property
    def per_channel_keys(self) -> bool:
        return self.key_granularity == "per_channel"

    @property
    def groups_per_token(self) -> int:
        """Per-token scales per token: one per KV head, or one for all of them."""
        return 1 if self.quant_group == "token" else self.num_kv_heads

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def bits(self) -> int:
        return KV_CACHE_DTYPES[self.kv_cache_dtype]

    @property
    def block_bytes(self) -> int:
        """A block's bytes, codes and scales counted (``bytes_per_token``, Phase 3.4)."""
        if not self.quantized:
            return 2 * self.block_size * self._layer_token_elements * self.element_size
        groups = self.groups_per_token  # a group of all heads costs as one head of all channels
        per_token = bytes_per_token(
            self.num_layers,
            groups,
            self.num_kv_heads * self.head_dim // groups,
            self.kv_cache_dtype,
            self.key_granularity,
            self.block_size,
            scale_bytes=self.element_size,
        )
        return int(per_token * self.block_size)

    @property
    def _layer_token_elements(self) -> int:
        """One token's keys (or values) in every layer."""
        return self.num_layers * self.num_kv_heads * self.head_dim

    def residual_bytes(self, num_slots: int) -> int:
        """The bytes of a key residual of ``num_slots`` blocks (keys per channel; else 0)."""
        if not self.per_channel_keys:
            return 0
        return num_slots * self.block_size * self._layer_token_elements * self.element_size

    def planes(self, num_blocks: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """The shape and dtype of each tensor of a pool of ``num_blocks`` blocks."""
        block = (self.num_layers, num_blocks, self.block_size, self.num_kv_heads)
        if not self.quantized:
            return [((2, *block, self.head_dim), self.dtype)]
        codes = ((2, *block, self.head_dim * self.bits // 8), torch.uint8)
        per_token = ((1, *block[:3], self.groups_per_token, 1), self.dtype)
        keys = per_token
        if self.per_channel_keys:
            keys = (
                (1, self.num_layers, num_blocks, 1, self.num_kv_heads, self.head_dim),
                self.dtype,
            )
        return [codes, keys, keys, per_token, per_token]

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


def blocks_ever_used(
    max_num_seqs: int,
    max_model_len: int,
    block_size: int,
    watermark: float,
    prefix_caching: bool,
) -> int:
    """The most device blocks an engine with these options can ever put to use: a pool of more
    only costs memory and start-up time (one ``Block`` object each in the allocator).

    - At most ``max_num_seqs`` sequences run, each of at most ``max_model_len`` tokens, so at
      most ``ceil(max_model_len / block_size)`` blocks each. A shared block (a common prefix, a
      parallel sample's prompt, the source of a copy-on-write) only lowers the count; a swapped
      sequence holds none on the device.
    - The block manager keeps ``int(watermark * num_gpu_blocks)`` blocks free: ``N`` blocks
      with ``N * (1 - watermark) >= running`` leave room for the running blocks above it.
    - Prefix caching keeps the blocks of finished sequences as a cache for later prompts: the
      pool gets twice the running bound, room for as many cached prefixes as running ones.
    """
    running = max_num_seqs * -(-max_model_len // block_size)
    if prefix_caching:
        running *= 2
    return math.ceil(running / (1.0 - watermark))


@dataclass(slots=True, frozen=True)
class PoolSize:
    """The device pool's blocks, and how many the memory budget would have held."""

    blocks: int
    memory_blocks: int

    @property
    def bounded(self) -> bool:
        """Whether the engine's bound, not the memory, set the size."""
        return self.blocks < self.memory_blocks


def size_device_pool(
    shape: CacheShape, budget_bytes: int, residual_slots: int, bound: int
) -> PoolSize:
    """The blocks of ``shape`` that ``budget_bytes`` holds after a key residual of
    ``residual_slots`` blocks (keys per channel), capped at ``bound`` (``blocks_ever_used``).

    ``ValueError`` when the residual alone fills the budget, or no block fits beside it.
    """
    residual_bytes = shape.residual_bytes(residual_slots)
    if residual_bytes and residual_bytes >= budget_bytes:
        raise ValueError(
            f"the key residual ({residual_bytes:,} bytes: {residual_slots} blocks of "
            f"full-precision keys) fills the KV budget of {budget_bytes:,} bytes"
        )
    memory_blocks = shape.num_blocks_for(budget_bytes - residual_bytes)
    return PoolSize(min(memory_blocks, bound), memory_blocks)


class CacheEngine:
    """The device KV cache and the CPU swap pool of ``shape``, and the copies between them.

    With keys per channel, ``residual_slots`` full-precision blocks hold the keys of partial
    blocks (``KeyResidual``; ``shape.residual_bytes`` says what they cost).
    """

    def __init__(
        self,
        shape: CacheShape,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        device: torch.device,
        residual_slots: int = 0,
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
        # the step flag of caches quantized per token (QuantizedCache.refused), and its copy
        # on the host, read after the step (pinned on CUDA: the copy is queued, not waited for)
        self.refused: torch.Tensor | None = None
        if shape.quantized and not shape.per_channel_keys:
            self.refused = torch.zeros((), dtype=torch.int32, device=device)
            self._refused_on_host = torch.zeros((), dtype=torch.int32, pin_memory=pinned)
        self._plain_layers = None  # a plain cache's per-layer views never change: made once
        if not shape.quantized:
            self._plain_layers = tuple(
                (self.gpu_cache[0, index], self.gpu_cache[1, index])
                for index in range(shape.num_layers)
            )
        self.residual: KeyResidual | None = None
        if shape.per_channel_keys:
            if residual_slots < 1:
                raise ValueError("keys per channel need at least one residual slot")
            self.residual = KeyResidual(
                shape.num_layers,
                shape.block_size,
                shape.num_kv_heads,
                shape.head_dim,
                shape.dtype,
                num_gpu_blocks,
                residual_slots,
                device,
            )

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
        (quantized: a ``QuantizedCache`` each; keys per channel with the step's residual plan)."""
        if self._plain_layers is not None:
            return self._plain_layers[index]
        codes, k_scale, k_zero, v_scale, v_zero = (plane[:, index] for plane in self.gpu_planes)
        bits = self.shape.bits
        residual = self.residual
        if residual is None:
            keys = QuantizedCache(codes[0], k_scale[0], k_zero[0], bits, refused=self.refused)
            return keys, QuantizedCache(codes[1], v_scale[0], v_zero[0], bits, refused=self.refused)
        values = QuantizedCache(codes[1], v_scale[0], v_zero[0], bits)
        keys = QuantizedCache(
            codes[0],
            k_scale[0],
            k_zero[0],
            bits,
            residual.keys[index],
            residual.slot_of_block,
            residual.current,
        )
        return keys, values

    def layers(self) -> Sequence[tuple[torch.Tensor, torch.Tensor] | tuple[QuantizedCache, ...]]:
        """Every layer's caches (``layer``), in order."""
        if self._plain_layers is not None:
            return self._plain_layers
        return [self.layer(index) for index in range(self.shape.num_layers)]

    def plan_step(self, slots: list[int]) -> None:
        """Before the model runs over tokens stored at ``slots``: clear the step flag (caches
        quantized per token) or plan the key residual's writes (keys per channel)."""
        if self.refused is not None:
            self.refused.zero_()
        if self.residual is not None:
            self.residual.plan(slots)

    def fetch_refusal(self) -> None:
        """After the step's forward is queued: queue the step flag's copy to the host (on a
        GPU it lands when the step ends; nothing waits for it here)."""
        if self.refused is not None:
            self._refused_on_host.copy_(self.refused, non_blocking=True)

    def raise_if_refused(self) -> None:
        """Once the host has waited for the step (its sampled tokens read): ``ValueError`` if a
        store refused it (a NaN or an infinity in its keys or values: nothing written from that
        layer on), as the eager store raises."""
        if self.refused is not None and bool(self._refused_on_host):
            raise ValueError("cannot quantize NaN or infinite values")

    def swap_out(self, mapping: dict[int, int]) -> None:
        """Copy GPU blocks to CPU blocks: ``{gpu_block: cpu_block}``."""
        self._copy(self.gpu_planes, self.cpu_planes, list(mapping.items()))

    def swap_in(self, mapping: dict[int, int]) -> None:
        """Copy CPU blocks to GPU blocks: ``{cpu_block: gpu_block}``."""
        self._copy(self.cpu_planes, self.gpu_planes, list(mapping.items()))

    def copy(self, blocks_to_copy: dict[int, list[int]]) -> None:
        """Copy GPU blocks within the GPU cache: ``{src: [dst, ...]}`` (copy-on-write)."""
        self._copy(self.gpu_planes, self.gpu_planes, _pairs(blocks_to_copy))

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
        partial_gpu: set[int] = frozenset(),
        partial_cpu: set[int] = frozenset(),
    ) -> None:
        """A step's block operations, in the order the module docstring gives. With keys per
        channel the residual follows them (``KeyResidual.apply``): ``partial_gpu`` and
        ``partial_cpu`` are the blocks holding the partial tails of the running and of the
        swapped sequences' stored tokens."""
        self.swap_out(swap_out)
        self.swap_in(swap_in)
        self.copy(blocks_to_copy)
        if self.residual is not None:
            pairs = _pairs(blocks_to_copy)
            self.residual.apply(swap_out, swap_in, pairs, partial_gpu, partial_cpu)


def _pairs(blocks_to_copy: dict[int, list[int]]) -> list[tuple[int, int]]:
    return [(src, dst) for src, dsts in blocks_to_copy.items() for dst in dsts]


def _copy_blocks(source: torch.Tensor, target: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    """Copy block ``src`` of ``source`` to block ``dst`` of ``target``, in every layer, K and V.

    A copy to the GPU may be asynchronous: the GPU's stream runs it before any later kernel that
    reads it. A copy to the CPU may not: the CPU writes its result into ``target`` at once, and
    an asynchronous device-to-host copy could still be in flight then (a swap-out would store a
    block half copied)."""
    if not pairs:
        return
    src = upload(torch.tensor([s for s, _ in pairs]), source.device)
    dst = upload(torch.tensor([d for _, d in pairs]), target.device)
    to_gpu = target.device.type == "cuda"
    target[:, :, dst] = source[:, :, src].to(target.device, non_blocking=to_gpu)


def sixteen_bit_ratio(shape: CacheShape) -> float:
    """How many blocks of ``shape`` fit in the bytes of one 16-bit block (the README's baseline,
    whatever dtype the model runs in: float32 on a CPU)."""
    sixteen = replace(
        shape,
        dtype=torch.float16,
        kv_cache_dtype="auto",
        key_granularity="per_token",
        quant_group="head",
    )
    return sixteen.block_bytes / shape.block_bytes
