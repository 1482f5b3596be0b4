"""What a request gains each step (``RequestOutput``), and its text, made incrementally from its
tokens (``Detokenizer``, vLLM's incremental detokenization) and cut at a stop string.

A sequence's ``Detokenized`` records what it has returned so far; each step the engine asks the
``Detokenizer`` for the text its new tokens add, looks for a stop string from where one could
begin (``first_stop``), and hands out only text that can no longer change.
"""

from dataclasses import dataclass

from tokenizers import Tokenizer

from vkv.engine.model_runner import TokenLogprobs
from vkv.engine.sequence import Sequence, SequenceStatus

INCOMPLETE_CHARACTER = "\ufffd"  # what a decoder makes of a UTF-8 character cut short
FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH_CAPPED: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_IGNORED: "ignored",
}


@dataclass(slots=True)
class RequestOutput:
    request_id: int
    index: int  # which of the request's n samples (0 for n = 1)
    new_text: str
    new_token_ids: list[int]
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    error: str | None = None  # why a request with finish_reason "error" failed
    text: str = ""  # all the text returned so far: the new_text of every output, joined
    logprobs: list[TokenLogprobs] | None = None  # new_token_ids' (params.logprobs set)


@dataclass(slots=True)
class Detokenized:
    """What a sequence has returned: tokens (``sent``), the text decoded from its tokens
    (through ``read_offset``; ``text``, cut before a stop string) and how much of it went out
    (``returned`` characters); ``hold``, how many of the text's last characters wait while it
    runs (``held_back`` of its stop strings); ``counted``, its tokens the metrics have seen."""

    sent: int = 0
    counted: int = 0
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""
    returned: int = 0
    hold: int = 0


class Detokenizer:
    """Token ids to text with the checkpoint's tokenizer (none: every text is empty)."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids) if self.tokenizer is not None else ""

    def new_text(self, state: Detokenized, tokens: list[int], finished: bool) -> str:
        """The text the tokens past ``state.read_offset`` add: decode a window from
        ``prefix_offset`` (a few tokens of context, so that a tokenizer's spacing comes out as
        in the whole) with and without them, and return the difference. While the sequence
        runs, text that ends in U+FFFD waits: a character's last bytes are still to come.
        Costs O(new tokens) a step, not O(all tokens); nothing without a tokenizer."""
        if self.tokenizer is None:  # every text is empty: no window to copy and decode
            return ""
        before = self.decode(tokens[state.prefix_offset : state.read_offset])
        after = self.decode(tokens[state.prefix_offset :])
        if len(after) <= len(before) or (after.endswith(INCOMPLETE_CHARACTER) and not finished):
            return ""
        state.prefix_offset, state.read_offset = state.read_offset, len(tokens)
        return after[len(before) :]


def first_stop(text: str, stop: tuple[str, ...], start: int = 0) -> int | None:
    """Where the earliest stop string begins in ``text`` at or after ``start``, or None."""
    found = [i for i in (text.find(s, start) for s in stop) if i >= 0]
    return min(found) if found else None


def held_back(stop: tuple[str, ...]) -> int:
    """How many of a running sequence's last characters wait: a stop string may begin there."""
    return max(map(len, stop), default=1) - 1


class OutputProcessor:
    """What each sequence has returned and will return: which request and sample it is, the
    text streamed so far (``Detokenized``), the error that failed it and its tokens' logprobs.

    The engine ``track``s a sequence when it is made, and after each step asks, for each
    sequence the step touched, whether its text reached a stop string (``reaches_stop``:
    the engine then finishes it) and then for its ``output``, both given one copy of the
    sequence's completion tokens (a copy a step, not one each); ``forget`` drops a sequence.
    """

    def __init__(self, detokenizer: Detokenizer) -> None:
        self.detokenizer = detokenizer
        self.sample_of: dict[int, tuple[int, int]] = {}  # sequence id -> (request id, index)
        self.streamed: dict[int, Detokenized] = {}  # what each sequence has returned
        self.errors: dict[int, str] = {}  # sequence id -> why it failed
        self.logprobs: dict[int, list[TokenLogprobs]] = {}  # sequence id -> its tokens'

    def track(self, seq: Sequence, request_id: int, index: int) -> None:
        self.sample_of[seq.seq_id] = (request_id, index)
        self.streamed[seq.seq_id] = Detokenized(hold=held_back(seq.sampling_params.stop))

    def forget(self, seq_id: int) -> None:
        for records in (self.sample_of, self.streamed, self.errors, self.logprobs):
            records.pop(seq_id, None)

    def took_tokens(self, seq: Sequence) -> bool:
        """Whether the sequence's completion grew since the last call (each step's count of
        tokens gained, whichever outputs it returns)."""
        state = self.streamed[seq.seq_id]
        count = seq.num_completion_tokens
        grew, state.counted = count > state.counted, count
        return grew

    def keep_logprobs(self, seq: Sequence, entry: TokenLogprobs) -> None:
        """Keep the logprobs of the token a step appended: one entry per completion token (a
        prefill chunk that stopped short appended none)."""
        kept = self.logprobs.setdefault(seq.seq_id, [])
        if len(kept) < seq.num_completion_tokens:
            kept.append(entry)

    def reaches_stop(self, seq: Sequence, completion: list[int]) -> bool:
        """Decode what the sequence's new tokens (the end of ``completion``, its completion
        tokens) add to its text; True when the text now holds a stop string
        (``SamplingParams.stop``), cut before it (the tokens stay, the one that completed the
        string included): the caller finishes the sequence as stopped."""
        state = self.streamed[seq.seq_id]
        stop = seq.sampling_params.stop
        searched = max(0, len(state.text) - state.hold)  # a stop may begin in held text
        state.text += self.detokenizer.new_text(state, completion, seq.is_finished)
        cut = first_stop(state.text, stop, searched) if stop else None
        if cut is None:
            return False
        state.text = state.text[:cut]
        return True

    def output(self, seq: Sequence, completion: list[int]) -> RequestOutput:
        """What the sequence gained since its last output (its text decoded by
        ``reaches_stop``; ``completion``, its completion tokens, a copy the output keeps).
        While it runs, the text's last ``hold`` characters wait."""
        state = self.streamed[seq.seq_id]
        finished = seq.is_finished
        ready = len(state.text) if finished else max(state.returned, len(state.text) - state.hold)
        new_text, state.returned = state.text[state.returned : ready], ready
        sent, state.sent = state.sent, len(completion)
        request_id, index = self.sample_of[seq.seq_id]
        error, reason = self.errors.get(seq.seq_id), None
        if finished:
            reason = "error" if error else FINISH_REASONS[seq.status]
        logprobs = None
        if seq.sampling_params.logprobs is not None:
            logprobs = self.logprobs.get(seq.seq_id, [])[sent:]
        return RequestOutput(
            request_id,
            index,
            new_text,
            completion[sent:],
            completion,
            finished,
            reason,
            error,
            state.text[:ready],
            logprobs,
        )
