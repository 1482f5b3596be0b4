"""LLM: offline batch generation, as in vLLM and nano-vLLM: ``LLM(path).generate(prompts)``.

``LLM()`` serves the built-in ``vkv-tiny``; the options are ``LLMEngine``'s.
"""

from pathlib import Path

from rich.progress import Progress

from vkv.engine.llm_engine import LLMEngine
from vkv.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | Path | None = None, **options) -> None:
        self.engine = LLMEngine(model, **options)

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_progress: bool = True,
    ) -> list[dict]:
        """Generate for every prompt, in prompt order: ``[{"text", "token_ids", "finish_reason"}]``.

        ``finish_reason`` is ``stop`` (EOS), ``length`` (``max_tokens`` or ``max_model_len``),
        or ``ignored``: the request could never fit the KV cache (its prompt, or the tokens it
        grew to, need more blocks than the pool has); its text is what it generated until then.
        """
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        ids = [self.engine.add_request(p, s) for p, s in zip(prompts, sampling_params, strict=True)]
        results: dict[int, dict] = {}
        with Progress(disable=not use_progress, transient=True) as progress:
            task = progress.add_task("generating", total=len(ids))
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        results[output.request_id] = {
                            "text": self.engine.decode(output.token_ids),
                            "token_ids": output.token_ids,
                            "finish_reason": output.finish_reason,
                        }
                        progress.advance(task)
        return [results[i] for i in ids]
