"""What a scheduler step hands the model runner, and the budgets it fills (vLLM v1 keeps these in
``sched/output.py``).

Token accounting. ``seq.num_computed_tokens`` counts the leading tokens whose K/V are in the
cache. A scheduled sequence computes tokens ``[num_computed_tokens, num_computed_tokens + n)``:
a *prefill* computes a whole prompt (or a chunk of it), a *decode* computes the one token the
last step appended. When a step computes a sequence's last token, it yields logits for the next
one, which ``postprocess`` appends; a prefill chunk that stops short yields nothing.

Prefill or decode. ``seq.is_prefill`` is True from a sequence's admission until every token it
was admitted with is computed (``postprocess`` turns it off when it appends a token; a
preemption by recompute turns it back on). A scheduled sequence in its prefill is a prefill
(also a last chunk of one token); otherwise it is a decode of its newest token.
"""

from dataclasses import dataclass, field

from vkv.engine.sequence import Sequence


@dataclass(slots=True, frozen=True)
class ScheduledSequence:
    """One sequence of a step: it computes ``num_tokens`` tokens from ``num_computed_tokens``.

    Frozen: a decode's item is the same every step, so one may serve many steps."""

    seq: Sequence
    num_tokens: int
    is_prefill: bool


@dataclass(slots=True)
class IgnoredSequence:
    """A request that can never run, and why."""

    seq: Sequence
    reason: str


@dataclass(slots=True)
class SchedulerOutput:
    """What one step runs, and the block copies the cache must make before it runs."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    blocks_to_swap_in: dict[int, int] = field(default_factory=dict)  # {cpu: gpu}
    blocks_to_swap_out: dict[int, int] = field(default_factory=dict)  # {gpu: cpu}
    blocks_to_copy: dict[int, list[int]] = field(default_factory=dict)  # {src: [dst, ...]}
    ignored: list[IgnoredSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def seqs(self) -> list[Sequence]:
        return [item.seq for item in self.scheduled]

    @property
    def num_batched_tokens(self) -> int:
        return sum(item.num_tokens for item in self.scheduled)

    @property
    def num_prefills(self) -> int:
        return sum(item.is_prefill for item in self.scheduled)

    @property
    def kind(self) -> str:
        """``prefill``, ``decode``, ``mixed`` (chunked prefill) or ``idle`` (nothing runs)."""
        prefills = self.num_prefills
        if not self.scheduled:
            return "idle"
        if prefills == len(self.scheduled):
            return "prefill"
        return "decode" if prefills == 0 else "mixed"


@dataclass(slots=True)
class SchedulingBudget:
    """What is left of one step's budgets (vLLM's name)."""

    token_budget: int
    max_num_seqs: int
    num_batched_tokens: int = 0
    num_seqs: int = 0

    @property
    def remaining_tokens(self) -> int:
        return self.token_budget - self.num_batched_tokens

    def can_schedule(self, num_tokens: int, num_seqs: int) -> bool:
        return (
            self.num_batched_tokens + num_tokens <= self.token_budget
            and self.num_seqs + num_seqs <= self.max_num_seqs
        )

    def add(self, num_tokens: int, num_seqs: int) -> None:
        self.num_batched_tokens += num_tokens
        self.num_seqs += num_seqs
