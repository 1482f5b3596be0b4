"""LLM: offline batch generation, as in vLLM and nano-vLLM: ``LLM(path).generate(prompts)``.

``LLM()`` serves the built-in ``vkv-tiny``; the options are ``LLMEngine``'s. With
``tensor_parallel_size`` > 1, ``close()`` (or ``with LLM(...) as llm:``) stops the other
processes.
"""

from pathlib import Path

from rich.progress import Progress

from vkv.engine.llm_engine import LLMEngine
from vkv.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | Path | None = None, **options) -> None:
        self.engine = LLMEngine(model, **options)

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_progress: bool = True,
    ) -> list[dict]:
        """Generate for every prompt, in prompt order: ``[{"text", "token_ids", "finish_reason",
        "error", "outputs"}]``.

        ``finish_reason`` is ``stop`` (EOS, or a stop string), ``length`` (``max_tokens`` or
        ``max_model_len``), ``ignored``: the request could never fit the KV cache (its prompt,
        or the tokens it grew to, need more blocks than the pool has), or ``error``: running
        the model for it raised, and ``error`` says what (it is None otherwise). The text is
        what the request generated until it finished (cut before a stop string,
        ``SamplingParams.stop``). ``outputs`` holds the ``n`` completions of a request
        (``SamplingParams.n``), each such a dict; the other keys are the first one's. A request
        that ends before its prompt is computed (ignored, or failed) has ``n`` copies of it.

        ``sampling_params`` is one ``SamplingParams`` for all (None: the defaults) or a list of
        one per prompt. Raises ``ValueError`` for a single string (pass ``[prompt]``), a list
        of params of another length, or any prompt ``LLMEngine.check_request`` refuses: the
        whole batch is checked first, so on an error nothing of it is queued.
        """
        if isinstance(prompts, str):
            raise ValueError("prompts is a list of prompts: for one prompt, pass [prompt]")
        prompts = list(prompts)
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"{len(sampling_params)} sampling params for {len(prompts)} prompts: give one "
                "SamplingParams for all, or one per prompt"
            )
        batch = list(zip(prompts, sampling_params, strict=True))
        for prompt, params in batch:  # the whole batch, before any of it is queued
            self.engine.check_request(prompt, params)
        ids = [self.engine.add_request(prompt, params) for prompt, params in batch]
        done: dict[tuple[int, int], dict] = {}
        budget = {
            request_id: (params or SamplingParams()).max_tokens
            for request_id, (_, params) in zip(ids, batch, strict=True)
        }
        with Progress(disable=not use_progress, transient=True) as progress:
            # in tokens, so that the bar moves while a long completion is generated
            task = progress.add_task("generating", total=sum(budget.values()))
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.index == 0:  # the first sample's tokens; the rest when it ends
                        gained = len(output.new_token_ids)
                        left = budget[output.request_id] - len(output.token_ids)
                        progress.advance(task, gained + (max(left, 0) if output.finished else 0))
                    if output.finished:
                        done[output.request_id, output.index] = {
                            "text": output.text,
                            "token_ids": output.token_ids,
                            "finish_reason": output.finish_reason,
                            "error": output.error,
                        }
        results = []
        for request_id, (_, params) in zip(ids, batch, strict=True):
            n = 1 if params is None else params.n
            first = done[request_id, 0]
            outputs = [done.get((request_id, index), first) for index in range(n)]
            results.append({**first, "outputs": outputs})
            self.engine.forget(request_id)
        return results
