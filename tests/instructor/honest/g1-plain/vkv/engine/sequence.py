"""Sequence: one request's tokens, and the block table that maps them to KV-cache blocks.

A sequence's tokens are cut into *logical blocks* of ``block_size`` tokens: logical block i
holds the token positions ``[i * block_size, (i + 1) * block_size)``. The *block table* maps
each logical block to a *physical block* of the KV cache, which the BlockManager hands out:

    block_size = 4
    token ids     [ 12  7 93  4 | 55 61  8 20 | 17  3  .  . ]
    positions       0  1  2  3    4  5  6  7    8  9
    logical block        0             1             2        (the last one is partly full)
    block_table   [      7      ,      2      ,      9      ] (physical block ids)

    position 9 lives in logical block 9 // 4 = 2, at offset 9 % 4 = 1,
    so its K/V sit in physical block block_table[2] = 9, slot 9 * 4 + 1 = 37.

Contract
- The tokens are the prompt followed by the completion; tokens are only ever appended.
- ``block_size`` is a per-sequence parameter (the BlockManager's), at least 1.
- A sequence owns its block table, but only the BlockManager writes it.
- A finished sequence (any FINISHED_* status) takes no more tokens.

Invariants
- ``num_tokens == num_prompt_tokens + num_completion_tokens``.
- ``num_blocks == ceil(num_tokens / block_size)``; the concatenation of ``block(0)``, ...,
  ``block(num_blocks - 1)`` equals ``token_ids``.
- ``1 <= last_block_num_tokens <= block_size``.
"""

from enum import Enum, auto

from vkv.sampling_params import SamplingParams


class SequenceStatus(Enum):
    """Where a sequence is in its life (the names are vLLM's)."""

    WAITING = auto()  # queued, holds no KV blocks
    RUNNING = auto()  # its KV blocks are on the GPU
    SWAPPED = auto()  # its KV blocks were moved to the CPU pool
    FINISHED_STOPPED = auto()  # produced the end-of-sequence token
    FINISHED_LENGTH_CAPPED = auto()  # reached max_tokens or max_model_len
    FINISHED_ABORTED = auto()  # the client gave up
    FINISHED_IGNORED = auto()  # could never run (too long for the model or the pool)

    def __init__(self, value: int) -> None:
        # Whether this status is one of the FINISHED_* states: worked out once per member, so
        # that the check every token makes is an attribute read, not string work.
        self.is_finished = self.name.startswith("FINISHED_")


class Sequence:
    """One request's token ids, status and block table.

    Attributes set by the constructor:
    - ``seq_id``: the caller's id for this sequence.
    - ``status``: ``SequenceStatus.WAITING``.
    - ``token_ids``: a copy of the prompt (a new list; the caller's list is never changed).
    - ``num_prompt_tokens``: the prompt's length.
    - ``num_tokens``: prompt plus completion tokens, the prompt's length to start with;
      ``append_token`` adds one. A counter, not a property that recounts ``token_ids``: the
      scheduler reads it several times per token (nano-vLLM keeps it so too).
    - ``block_size``: tokens per block.
    - ``block_table``: ``[]``, physical block ids, filled by the BlockManager.
    - ``sampling_params``: the given ones, or ``SamplingParams()``.
    - ``arrival_time``: when the request arrived (the scheduler serves oldest first); 0.0 by
      default.

    Set for you after your code, and kept up to date by the scheduler (Phase 2):
    ``num_computed_tokens = 0``, the number of leading tokens whose K/V are in the cache, and
    ``is_prefill = True``, whether the sequence is in its prefill: from its admission (or its
    re-admission after a preemption by recompute) until every token it had then is computed;
    ``group_id = seq_id``: the parallel samples of one request (``SamplingParams.n``) share
    their first sequence's id as ``group_id``, and are preempted and swapped as a group;
    ``block_hashes = []``: the chained hashes of its leading full blocks, which prefix caching
    (Phase 4) appends to as blocks fill.

    Raises ``ValueError`` for a ``block_size`` that is not a positive integer (``True`` and
    ``2.0`` are not; the message names ``block_size``), or for an empty prompt, with a message
    that names the sequence; for sequence 3 it is
    "sequence 3: the prompt must hold at least one token".
    """

    def __init__(
        self,
        seq_id: int,
        prompt_token_ids: list[int],
        block_size: int,
        sampling_params: SamplingParams | None = None,
        arrival_time: float = 0.0,
    ) -> None:
        ### BEGIN SOLUTION part1.1
        if isinstance(block_size, bool) or not isinstance(block_size, int):
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        if block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        if len(prompt_token_ids) == 0:
            raise ValueError(f"sequence {seq_id}: the prompt must hold at least one token")
        self.seq_id = seq_id
        self.status = SequenceStatus.WAITING
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_tokens = len(prompt_token_ids)
        self.block_size = block_size
        self.block_table = []
        if sampling_params is None:
            self.sampling_params = SamplingParams()
        else:
            self.sampling_params = sampling_params
        self.arrival_time = arrival_time
        ### END SOLUTION
        # Scheduler state (Phase 2): how many leading tokens have their K/V in the cache, and
        # whether those it was admitted with are still being computed (vLLM's prefill stage).
        self.num_computed_tokens = 0
        self.is_prefill = True
        # The parallel samples of one request share blocks and are preempted and swapped
        # together (Phase 2): a group, named by its first sequence's id.
        self.group_id = seq_id
        # Prefix caching (Phase 4): the chained hash of each full block, computed once when the
        # block fills (``radix_cache.hash_blocks``) and kept for the sequence's life (its tokens
        # are only appended), as vLLM v1's ``Request.block_hashes``.
        self.block_hashes: list[int] = []

    def __len__(self) -> int:
        return self.num_tokens

    def __repr__(self) -> str:
        """``Sequence(seq_id=3, status=RUNNING, tokens=17)``; while part 1.1 is a stub, the
        fields it has (none before ``__init__`` is written): a failing test's report names the
        sequence instead of an error raised in ``repr()``."""
        try:
            return f"Sequence(seq_id={self.seq_id}, status={self.status.name}, tokens={len(self)})"
        except (AttributeError, NotImplementedError):
            seq_id = getattr(self, "seq_id", None)
            return "Sequence(part 1.1 not done)" if seq_id is None else f"Sequence({seq_id=})"

    @property
    def num_completion_tokens(self) -> int:
        """Tokens generated so far."""
        ### BEGIN SOLUTION part1.1
        return self.num_tokens - self.num_prompt_tokens
        ### END SOLUTION

    @property
    def prompt_token_ids(self) -> list[int]:
        """A copy of the prompt's token ids."""
        ### BEGIN SOLUTION part1.1
        return self.token_ids[: self.num_prompt_tokens]
        ### END SOLUTION

    @property
    def completion_token_ids(self) -> list[int]:
        """A copy of the generated token ids."""
        ### BEGIN SOLUTION part1.1
        return self.token_ids[self.num_prompt_tokens :]
        ### END SOLUTION

    @property
    def last_token(self) -> int:
        """The most recent token id (the input of the next decode step)."""
        ### BEGIN SOLUTION part1.1
        return self.token_ids[-1]
        ### END SOLUTION

    @property
    def is_finished(self) -> bool:
        """Whether the status is one of the FINISHED_* states."""
        ### BEGIN SOLUTION part1.1
        return self.status.is_finished
        ### END SOLUTION

    @property
    def num_blocks(self) -> int:
        """Logical blocks the tokens span: ``ceil(num_tokens / block_size)``."""
        ### BEGIN SOLUTION part1.1
        return (self.num_tokens + self.block_size - 1) // self.block_size
        ### END SOLUTION

    @property
    def last_block_num_tokens(self) -> int:
        """Tokens in the last logical block: between 1 and ``block_size``."""
        ### BEGIN SOLUTION part1.1
        full_blocks = self.num_blocks - 1
        return self.num_tokens - full_blocks * self.block_size
        ### END SOLUTION

    def block(self, i: int) -> list[int]:
        """The token ids of logical block ``i`` (a copy), for ``0 <= i < num_blocks``.

        Raises ``IndexError`` naming the valid range for any other ``i``, negative ones
        included; for sequence 0, of 2 logical blocks, and ``i = 2`` the message is
        "sequence 0 has logical blocks 0..1, block 2 does not exist".
        """
        ### BEGIN SOLUTION part1.1
        num_blocks = self.num_blocks
        if i < 0 or i >= num_blocks:
            raise IndexError(
                f"sequence {self.seq_id} has logical blocks 0..{num_blocks - 1}, block {i} does not exist"
            )
        start = i * self.block_size
        end = start + self.block_size
        return self.token_ids[start:end]
        ### END SOLUTION

    def append_token(self, token_id: int) -> None:
        """Append one generated token (``num_tokens`` grows by one).

        Raises ``ValueError`` if the sequence is finished; it is left unchanged. The message
        names the sequence and its status, for sequence 3 in FINISHED_STOPPED:
        "sequence 3 is FINISHED_STOPPED: a finished sequence takes no tokens".
        """
        ### BEGIN SOLUTION part1.1
        if self.is_finished:
            raise ValueError(
                f"sequence {self.seq_id} is {self.status.name}: a finished sequence takes no tokens"
            )
        self.token_ids.append(token_id)
        self.num_tokens += 1
        ### END SOLUTION
