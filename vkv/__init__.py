"""vkv-engine: a small paged-KV LLM inference engine, and an assignment built on it."""

from vkv.threads import prefer_short_spin

prefer_short_spin()  # before anything imports torch: see vkv/threads.py

from vkv.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # LLM pulls in torch: imported on first use, so that the graded modules and the grader
    # (whose comment job has only Python's standard library) stay light.
    if name == "LLM":
        from vkv.llm import LLM

        return LLM
    raise AttributeError(f"module 'vkv' has no attribute {name!r}")
