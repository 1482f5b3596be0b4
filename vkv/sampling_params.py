"""SamplingParams: how one request chooses its next tokens and when it stops.

Validated at construction, so a bad option fails when the request is made, with a message
naming the option and what is allowed, and never later inside a running batch: types too (a
``max_tokens`` of 2.5, a NaN or infinite temperature, a seed of 1.5 or 2**64 are refused, as is
``True`` for a number).
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass
from numbers import Integral, Real

MAX_SEED = 2**63  # a torch.Generator seed is a 64-bit signed integer
SAMPLING_EPS = 1e-5  # a temperature below it samples greedily (vLLM's bound)
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2] (OpenAI's range)
MAX_BIAS = 100.0  # a logit bias lies in [-100, 100] (OpenAI's range)
MAX_LOGPROBS = 20  # the most alternatives a token's logprobs list (OpenAI chat's top_logprobs)
OUTPUT_KINDS = ("cumulative", "final_only")  # vLLM's RequestOutputKind, less DELTA


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """Per-request sampling options (the names follow vLLM and nano-vLLM).

    - ``temperature``: 0 means greedy (argmax); otherwise logits are divided by it. Below
      ``SAMPLING_EPS`` (1e-5) it is greedy too: dividing by 1e-300 overflows the logits.
    - ``top_k``: keep the k most likely tokens; -1 keeps all.
    - ``top_p``: keep the smallest set of tokens whose probability reaches p (and every token as
      likely as the least likely of them); in (0, 1].
    - ``max_tokens``: the most tokens to generate (the completion, not the prompt).
    - ``ignore_eos``: keep generating past the end-of-sequence token (benchmarks use it).
    - ``seed``: a per-request seed, so a sampled completion can be reproduced.
    - ``n``: how many completions to sample for the prompt (parallel sampling); the prompt is
      computed once and its blocks shared by the n samples.
    - ``presence_penalty``, ``frequency_penalty``: in [-2, 2]; each token's logit is lowered
      by ``presence_penalty`` if it was generated before and by ``frequency_penalty`` times
      the number of times it was (OpenAI's formula; the counts are over the generated tokens,
      not the prompt, as in vLLM). Negative values encourage repeats.
    - ``logit_bias``: token id -> a bias in [-100, 100] added to that token's logit (a mapping,
      kept as a tuple of ``(token id, bias)`` pairs in id order). The penalties and the bias
      apply before the temperature, to greedy decoding too.
    - ``logprobs``: None, or how many most likely alternatives (0 to 20) to return with each
      generated token besides the token's own log-probability. The log-probabilities are the
      log-softmax of the model's raw logits, before penalties, bias, temperature, top-k and
      top-p (vLLM's default, ``logprobs_mode="raw_logprobs"``).
    - ``stop``: strings that end the completion (a string or a sequence of non-empty strings;
      kept as a tuple): the engine checks the text each step, and a sequence whose text
      contains one finishes with ``finish_reason`` "stop", its text cut before the string.
    - ``output_kind``: which outputs ``LLMEngine.step`` returns for the request (vLLM's
      ``RequestOutputKind``): "cumulative", one each step that touches it, with everything so
      far and what is new; "final_only", one, when it finishes, with everything. A final-only
      request costs a step no copy of its tokens and no output; its text is decoded once, at
      the end (each step where a stop string needs it). ``vkv.bench`` serves its requests so,
      as vLLM's ``LLM.generate`` does.
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    output_kind: str = "cumulative"

    def __post_init__(self) -> None:
        _require(_is_real(self.temperature), "temperature", "a finite number", self.temperature)
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        _require(_is_int(self.top_k), "top_k", "an integer", self.top_k)
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (all tokens) or >= 1, got {self.top_k}")
        _require(_is_real(self.top_p), "top_p", "a finite number", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _require(_is_int(self.max_tokens), "max_tokens", "an integer", self.max_tokens)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        _require(isinstance(self.ignore_eos, bool), "ignore_eos", "True or False", self.ignore_eos)
        _require(_is_int(self.n), "n", "an integer", self.n)
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        _require(
            isinstance(stop, list | tuple) and all(isinstance(s, str) and s for s in stop),
            "stop",
            "a string or a list of non-empty strings",
            self.stop,
        )
        object.__setattr__(self, "stop", tuple(stop))  # frozen: set once, as a tuple
        if self.seed is not None:
            _require(_is_int(self.seed), "seed", "an integer or None", self.seed)
            if not 0 <= self.seed < MAX_SEED:
                raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(_is_real(value), name, "a finite number", value)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if self.logprobs is not None:
            _require(_is_int(self.logprobs), "logprobs", "an integer or None", self.logprobs)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        kinds = " or ".join(map(repr, OUTPUT_KINDS))
        _require(self.output_kind in OUTPUT_KINDS, "output_kind", kinds, self.output_kind)

    @property
    def greedy(self) -> bool:
        """Whether sampling reduces to argmax: a temperature below ``SAMPLING_EPS``."""
        return self.temperature < SAMPLING_EPS

    @property
    def adjusts_logits(self) -> bool:
        """Whether penalties or a logit bias change the logits before sampling."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)


def _logit_bias(bias: object) -> tuple[tuple[int, float], ...]:
    """A logit bias (a mapping, or ``(token id, bias)`` pairs) as pairs in id order; raises
    ``ValueError`` naming ``logit_bias`` for a token id that is not an integer >= 0, a bias
    outside [-100, 100], or a token given twice."""
    pairs = list(bias.items()) if isinstance(bias, Mapping) else bias
    _require(
        isinstance(pairs, list | tuple)
        and all(isinstance(pair, tuple | list) and len(pair) == 2 for pair in pairs),
        "logit_bias",
        "a mapping of token ids to biases",
        bias,
    )
    for token, value in pairs:
        if not _is_int(token) or token < 0:
            raise ValueError(f"logit_bias token ids must be integers >= 0, got {token!r}")
        if not _is_real(value) or not -MAX_BIAS <= value <= MAX_BIAS:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {value!r}")
    if len({token for token, _ in pairs}) < len(pairs):
        raise ValueError("logit_bias gives a token id twice")
    return tuple(sorted((int(token), float(value)) for token, value in pairs))


def _is_int(value: object) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)


def _require(ok: bool, name: str, allowed: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
