"""What an engine settles once, as it starts: its device, the parts of the assignment its options
need done, its metrics, and what its start-up line says of the KV pool."""

import os
import sys
from pathlib import Path

import torch

from vkv.assignment import progress
from vkv.config import KV_CACHE_DTYPES, Config
from vkv.engine.cache_engine import CacheShape, PoolSize, free_device_bytes, sixteen_bit_ratio
from vkv.metrics.registry import EngineMetrics
from vkv.metrics.stats import StatLogger

CPU_KV_BYTES = 256 << 20  # the KV budget on a CPU
TRITON_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
METRICS_FILE = "vkv/metrics/stats.py"  # StatLogger, Phase 5's parts that the engine calls
# Phase 3's files that a quantized cache runs on the torch backend; the Triton backend also
# runs part 3.8's dequantizing load (vkv/kernels/triton_quantized.py).
QUANTIZED_TORCH_FILES = {
    "vkv/engine/quantizer.py",
    "vkv/kernels/quantized.py",
    "vkv/engine/key_residual.py",
}


def default_device() -> torch.device:
    """``$VKV_DEVICE`` when set (``cpu`` on a machine with a GPU; under torchrun, the same on
    every rank), else CUDA where there is one, else the CPU."""
    chosen = os.environ.get("VKV_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(chosen)


def chosen_backend(
    backend: str | None, device: torch.device, kv_cache_dtype: str, enable_prefix_caching: bool
) -> str:
    """The engine's attention backend (default: Triton on CUDA, torch elsewhere), after the
    parts its options need are found done; ``ValueError`` for one that cannot run here."""
    backend = backend or ("triton" if device.type == "cuda" else "torch")
    if backend not in ("torch", "triton"):
        raise ValueError(f"backend must be torch or triton, got {backend!r}")
    needs_done_parts(kv_cache_dtype, enable_prefix_caching, backend)
    if backend == "triton" and device.type != "cuda" and not TRITON_INTERPRETED:
        raise ValueError(
            "the triton backend needs a CUDA GPU, or TRITON_INTERPRET=1 in the environment "
            "(Triton's interpreter, for tests); on a CPU use --backend torch"
        )
    return backend


def needs_done_parts(kv_cache_dtype: str, enable_prefix_caching: bool, backend: str) -> None:
    """Refuse, naming the part, an engine whose options run a part not done yet."""
    progress.needed("the engine (its Sequence, BlockManager and Scheduler)", {1, 2})
    if KV_CACHE_DTYPES.get(kv_cache_dtype, 16) < 16:
        progress.needed(
            f"a quantized KV cache (--kv-cache-dtype {kv_cache_dtype}) on the {backend} backend",
            {3},
            None if backend == "triton" else QUANTIZED_TORCH_FILES,
        )
    if enable_prefix_caching:
        progress.needed("prefix caching (--enable-prefix-caching)", {4})


def metrics_logger(metrics: EngineMetrics) -> StatLogger | None:
    """The engine's StatLogger; None, said once on stderr, while Phase 5's logger is a stub."""
    unfinished = progress.first_unfinished({5}, {METRICS_FILE})
    if unfinished is None:
        return StatLogger(metrics)
    part, qualname = unfinished
    print(f"vkv: metrics off until part {part} ({qualname}) is done", file=sys.stderr)
    return None


def model_label(model: str | Path | None) -> str:
    """The ``model_name`` label of the metrics: the checkpoint folder's name, or vkv-tiny."""
    return "vkv-tiny" if model is None else Path(model).name


def kv_budget(device: torch.device, kv_cache_bytes: int | None, fraction: float) -> int:
    """The bytes the device pool may take: ``kv_cache_bytes`` if given, else ``fraction`` of
    the free CUDA memory, else (a CPU) ``CPU_KV_BYTES``."""
    if kv_cache_bytes is not None:
        return kv_cache_bytes
    return free_device_bytes(device, fraction) if device.type == "cuda" else CPU_KV_BYTES


def engine_metrics(model_name: str, config: Config, shape: CacheShape) -> EngineMetrics:
    """The engine's metrics, with the gauges that describe its cache set once."""
    metrics = EngineMetrics(config.max_model_len, model_name=model_name)
    metrics.kv_cache_bytes_per_token.labels(model_name=model_name).set(
        shape.block_bytes / config.block_size
    )
    metrics.cache_config_info.labels(
        model_name=model_name,
        kv_cache_dtype=config.kv_cache_dtype,
        key_granularity=config.key_granularity,
        kv_quant_group=config.kv_quant_group,
        block_size=str(config.block_size),
    ).set(1)
    return metrics


def startup_line(
    config: Config, shape: CacheShape, device: torch.device, attention: str, notes: str
) -> str:
    """What the engine prints as it starts: its pool in blocks and MiB (per rank with tensor
    parallelism), the cache's format, the device, the attention kernels, and ``notes``."""
    per_rank = " per rank" if config.tensor_parallel_size > 1 else ""
    mib = config.num_gpu_blocks * shape.block_bytes / 2**20
    return (
        f"vkv: KV cache of {config.num_gpu_blocks} blocks x {config.block_size} tokens "
        f"({mib:.1f} MiB{per_rank}{capacity_note(shape)}) on {device}, {attention}{notes}"
    )


def capacity_note(shape: CacheShape) -> str:
    """For a quantized cache: its format, and how many times fewer bytes a block takes than a
    16-bit one, with the scales' dtype that sets it (the model's: float32 on a CPU, which gives
    INT8 1.60x where 16-bit scales give 1.78x). The pool's block count is the same either way."""
    if not shape.quantized:
        return ""
    keys = ", keys per channel" if shape.per_channel_keys else ""
    keys += ", one scale per token" if shape.quant_group == "token" else ""
    ratio = sixteen_bit_ratio(shape)
    scales = str(shape.dtype).removeprefix("torch.")
    return (
        f", {shape.kv_cache_dtype}{keys}, {scales} scales: a block {ratio:.2f}x smaller than 16-bit"
    )


def pool_note(pool: PoolSize | None, config: Config) -> str:
    """When the engine's bound, not the memory budget, set the pool's size: what it was."""
    if pool is None or not pool.bounded:
        return ""
    return (
        f"; sized for {config.max_num_seqs} sequences of {config.max_model_len} tokens, all "
        f"this engine can use (the memory budget holds {pool.memory_blocks:,} blocks)"
    )
