"""SamplingParams: how one request chooses its next tokens and when it stops.

Validated at construction, so a bad option fails when the request is made, with a message
naming the option and what is allowed, and never later inside a running batch.
"""

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """Per-request sampling options (the names follow vLLM and nano-vLLM).

    - ``temperature``: 0 means greedy (argmax); otherwise logits are divided by it.
    - ``top_k``: keep the k most likely tokens; -1 keeps all.
    - ``top_p``: keep the smallest set of tokens whose probability reaches p; in (0, 1].
    - ``max_tokens``: the most tokens to generate (the completion, not the prompt).
    - ``ignore_eos``: keep generating past the end-of-sequence token (benchmarks use it).
    - ``seed``: a per-request seed, so a sampled completion can be reproduced.
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (all tokens) or >= 1, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")

    @property
    def greedy(self) -> bool:
        """Whether sampling reduces to argmax."""
        return self.temperature == 0.0
