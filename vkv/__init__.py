"""vkv-engine: a small paged-KV LLM inference engine, and an assignment built on it."""

from vkv.sampling_params import SamplingParams

__all__ = ["SamplingParams"]
