"""Config: one validated set of options for the KV cache and the scheduler.

Defaults follow vLLM v0 where it has them (a 1 % watermark, 256 sequences a step,
``max_num_batched_tokens = max(max_model_len, 2048)`` without chunked prefill and 2048 with it).
A bad value raises ``ValueError`` naming the option and what is allowed, at construction.
"""

from dataclasses import dataclass
from enum import Enum

KV_CACHE_DTYPES = {"auto": 16, "int8": 8, "int4": 4}  # bits per stored element (Phase 3)
GRANULARITIES = ("per_token", "per_channel")  # how quantized keys are grouped (Phase 3)
QUANT_GROUPS = ("head", "token")  # what a per-token scale covers: one head, or every KV head
MODEL_DTYPES = ("auto", "float32", "float16", "bfloat16")  # auto: fp16 on CUDA, fp32 on a CPU
LOAD_FORMATS = ("auto", "dummy")  # weights from the folder, or random ones of its config's shape
WATERMARK = 0.01  # the share of the GPU pool the block manager keeps free (vLLM v0's)


def check_kv_cache_dtype(name: object) -> None:
    if name not in KV_CACHE_DTYPES:
        allowed = ", ".join(KV_CACHE_DTYPES)
        raise ValueError(f"kv_cache_dtype must be one of {allowed}, got {name!r}")


def check_key_granularity(name: object, kv_cache_dtype: str) -> None:
    """A quantized cache's keys are grouped per token or per channel (KIVI's; Phase 3)."""
    if name not in GRANULARITIES:
        allowed = ", ".join(GRANULARITIES)
        raise ValueError(f"key_granularity must be one of {allowed}, got {name!r}")
    if name == "per_channel" and kv_cache_dtype == "auto":
        raise ValueError("keys per channel need a quantized KV cache (kv_cache_dtype int8 or int4)")


def check_quant_group(name: object, kv_cache_dtype: str) -> None:
    """A per-token scale and zero cover one KV head (LMDeploy's) or all of a token's KV heads."""
    if name not in QUANT_GROUPS:
        raise ValueError(f"kv_quant_group must be one of {', '.join(QUANT_GROUPS)}, got {name!r}")
    if name == "token" and kv_cache_dtype == "auto":
        raise ValueError("a quantization group needs a quantized KV cache (int8 or int4)")


class PreemptionMode(Enum):
    """How the scheduler frees GPU blocks when a running sequence cannot grow."""

    RECOMPUTE = "recompute"  # drop the blocks; prefill again later (prompt + generated tokens)
    SWAP = "swap"  # move the blocks to the CPU pool; copy them back later
    AUTO = "auto"  # vLLM v0: recompute a lone sequence, swap a group that shares blocks


@dataclass(slots=True)
class Config:
    """Options of the KV cache and the scheduler (the model's options come with the runtime)."""

    block_size: int = 16
    num_gpu_blocks: int = 1024
    num_cpu_blocks: int = 0
    watermark: float = WATERMARK
    max_model_len: int = 4096
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = False
    enable_prefix_caching: bool = False  # share computed blocks through a RadixCache (Phase 4)
    preemption_mode: PreemptionMode | str = PreemptionMode.AUTO
    eos_token_id: int | None = None
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype), "int8" or "int4" (Phase 3)
    key_granularity: str = "per_token"  # quantized keys "per_token" or "per_channel" (KIVI)
    kv_quant_group: str = "head"  # a per-token scale covers one KV head, or a "token"'s all
    tensor_parallel_size: int = 1  # processes the heads and each block's KV are split over

    def __post_init__(self) -> None:
        positive = ("block_size", "num_gpu_blocks", "max_model_len", "max_num_seqs")
        for name in (*positive, "tensor_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {self.num_cpu_blocks}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        try:
            self.preemption_mode = PreemptionMode(self.preemption_mode)
        except ValueError:
            allowed = ", ".join(mode.value for mode in PreemptionMode)
            raise ValueError(
                f"preemption_mode must be one of {allowed}, got {self.preemption_mode!r}"
            ) from None
        check_kv_cache_dtype(self.kv_cache_dtype)
        check_key_granularity(self.key_granularity, self.kv_cache_dtype)
        check_quant_group(self.kv_quant_group, self.kv_cache_dtype)
        if self.max_num_batched_tokens is None:
            default = 2048 if self.enable_chunked_prefill else max(self.max_model_len, 2048)
            self.max_num_batched_tokens = max(default, self.max_num_seqs)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}): every running sequence decodes one token a step"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than "
                f"max_model_len ({self.max_model_len}): without chunked prefill the longest "
                "prompt could never be scheduled; raise it or enable chunked prefill"
            )

    @property
    def token_budget(self) -> int:
        """``max_num_batched_tokens``, resolved (construction replaces None by the default)."""
        return int(self.max_num_batched_tokens or 0)
