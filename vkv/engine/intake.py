"""Request intake: what a prompt and its sampling params must be before the engine queues them.

``check_prompt`` answers for ``LLMEngine.check_request`` (and so for ``add_request``,
``LLM.generate`` and the server); ``check_text`` is the part the CLI runs on its arguments
before a model loads.
"""

from numbers import Integral

from tokenizers import Tokenizer

from vkv.sampling_params import SamplingParams


def check_text(prompt: str) -> None:
    """Raise ``ValueError`` for a text prompt that is empty or not valid UTF-8 (a shell passes
    undecodable bytes as lone surrogates)."""
    if not prompt:
        raise ValueError("the prompt is empty")
    if prompt.isascii():
        return
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"the prompt is not valid UTF-8 text: {prompt!r}") from None


def is_token_id(value: object) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def check_prompt(
    prompt: str | list[int],
    params: SamplingParams | None,
    tokenizer: Tokenizer | None,
    vocab_size: int,
    max_model_len: int,
    max_num_seqs: int,
) -> tuple[list[int], SamplingParams]:
    """The prompt's token ids and its params (None: the defaults), checked.

    Raises ``ValueError`` for params that are not a ``SamplingParams``, text without a
    tokenizer or not valid UTF-8, a prompt that is neither text nor a list of integer token
    ids (``True`` and ``65.7`` are not token ids), ``n`` above ``max_num_seqs``, an empty
    prompt, one longer than ``max_model_len``, or an id outside the vocabulary (in the prompt
    or in ``params.logit_bias``). Other threads run while the text is tokenized.
    """
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling params must be a SamplingParams, got {params!r}")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer.json: pass token ids")
        check_text(prompt)
        # encode_batch lets go of the GIL while it runs (encode holds it: 1.5 s for a 1 MB
        # prompt, and the engine's thread would stop stepping all that time)
        prompt = tokenizer.encode_batch([prompt])[0].ids
    if not isinstance(prompt, list | tuple) or not all(map(is_token_id, prompt)):
        raise ValueError(f"a prompt is text or a list of integer token ids, got {prompt!r}")
    if params.n > max_num_seqs:
        raise ValueError(
            f"n ({params.n}) is more than max_num_seqs ({max_num_seqs}): the samples of a "
            "request run together"
        )
    if len(prompt) == 0:
        raise ValueError("the prompt is empty")
    if len(prompt) > max_model_len:
        raise ValueError(
            f"the prompt has {len(prompt)} tokens, more than max_model_len {max_model_len}"
        )
    if any(not 0 <= t < vocab_size for t in prompt):
        raise ValueError(f"token ids must be in [0, {vocab_size})")
    if any(token >= vocab_size for token, _ in params.logit_bias):
        raise ValueError(f"logit_bias token ids must be in [0, {vocab_size})")
    return [int(t) for t in prompt], params
