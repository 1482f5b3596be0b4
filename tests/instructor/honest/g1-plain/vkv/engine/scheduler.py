"""Scheduler: continuous batching over a paged KV cache (vLLM v0's policy, in small pieces).

Each engine step the scheduler picks the sequences that run and how many tokens each computes;
the model runs them; ``postprocess`` appends the sampled tokens. A sequence joins the batch as
soon as its blocks fit and leaves it the step it finishes (iteration-level scheduling, Orca):
there is no waiting for the slowest request of a batch.

Token accounting. ``seq.num_computed_tokens`` counts the leading tokens whose K/V are in the
cache. A scheduled sequence computes tokens ``[num_computed_tokens, num_computed_tokens + n)``:
a *prefill* computes a whole prompt (or a chunk of it), a *decode* computes the one token the
last step appended. When a step computes a sequence's last token, it yields logits for the next
one, which ``postprocess`` appends; a prefill chunk that stops short yields nothing.

Queues (every unfinished sequence is in exactly one):

    waiting  deque, FCFS      holds no blocks: new, or preempted by recompute (put in front)
    running  list, by arrival its blocks are on the GPU
    swapped  list, by arrival its blocks are in the CPU pool (preempted by swap)

The step policy (``schedule``, given; you write the pieces it calls):

    without chunked prefill (vLLM v0's default):
      1. if nothing is swapped: admit waiting prompts, oldest first, under the budgets
      2. if no prompt was admitted: decode every running sequence; when one needs a block
         and none is free, preempt the newest running sequence (itself if it is the newest);
         then, unless this step preempted, swap sequences back in, oldest first
    with chunked prefill:
      1. running: decodes first, then the unfinished prefills, in chunks that fit the budget
      2. unless this step preempted: swap back in; then, if nothing is swapped: admit prompts,
         the last one cut to fit the token budget

Budgets: at most ``max_num_seqs`` sequences run, and a step computes at most
``max_num_batched_tokens`` tokens. A prompt longer than ``max_model_len``, or one that could
never fit the GPU pool (``AllocStatus.NEVER``), finishes as FINISHED_IGNORED with a reason;
``LATER`` stops admission for this step (first come, first served: no overtaking). Swap-in
answers the same three ways (``can_swap_in``): a swapped sequence that could NEVER take its next
step on the GPU again is finished as FINISHED_IGNORED too, so both preemption modes end a
sequence that outgrew the pool the same way, and nobody waits behind it forever.

Prefill or decode. ``seq.is_prefill`` is True from a sequence's admission until every token it
was admitted with is computed (``postprocess`` turns it off when it appends a token; a
preemption by recompute turns it back on). A scheduled sequence in its prefill is a prefill
(also a last chunk of one token); otherwise it is a decode of its newest token.

Invariants
- Every unfinished sequence is in exactly one queue, with the matching status and blocks.
- A finished sequence (stopped, length-capped, aborted, ignored) is in no queue and holds no
  block: ``postprocess`` and ``abort`` free blocks at once.
- Each step respects both budgets; a swap-in and a swap-out never happen in one step.
"""

import bisect
from collections import deque
from dataclasses import dataclass, field

from vkv.config import Config, PreemptionMode
from vkv.engine.block import NoFreeBlocksError
from vkv.engine.block_manager import AllocStatus, BlockManager
from vkv.engine.prefix_caching import PrefixCachingBlockManager
from vkv.engine.sequence import Sequence, SequenceStatus


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


def _by_arrival(seq: Sequence) -> tuple[float, int, int]:
    """Arrival order; the members of a group (same arrival) next to each other."""
    return seq.arrival_time, seq.group_id, seq.seq_id


class Scheduler:
    """Continuous batching with preemption; see the module docstring for the policy."""

    def __init__(self, config: Config) -> None:
        self.config = config
        manager = PrefixCachingBlockManager if config.enable_prefix_caching else BlockManager
        self.block_manager = manager(
            config.block_size, config.num_gpu_blocks, config.num_cpu_blocks, config.watermark
        )
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self._unfinished: dict[int, Sequence] = {}
        # Sequence id -> its decode's item, ``ScheduledSequence(seq, 1, False)``: the same every
        # step, so the reference ``_schedule_running`` makes it once (building one per decode was
        # a fifth of the loop's time); ``_finish`` forgets it. Your code may leave this empty.
        self._decodes: dict[int, ScheduledSequence] = {}
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def is_finished(self) -> bool:
        return self.num_unfinished == 0

    def schedule(self) -> SchedulerOutput:
        """Decide this step's batch (the policy in the module docstring)."""
        out = SchedulerOutput()
        budget = SchedulingBudget(
            self.config.token_budget, self.config.max_num_seqs, num_seqs=len(self.running)
        )
        if self.config.enable_chunked_prefill:
            if self.running:
                self._schedule_running(out, budget)
            if self.swapped and not out.preempted:
                self._schedule_swapped(out, budget)
            if self.waiting and not self.swapped and not out.preempted:
                self._schedule_waiting(out, budget)
            return out
        if self.waiting and not self.swapped:
            self._schedule_waiting(out, budget)
        if not out.scheduled and self.running:
            self._schedule_running(out, budget)
        if self.swapped and not out.preempted:
            self._schedule_swapped(out, budget)
        return out

    # -- part 2.1: admission ------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence at the back of ``waiting``.

        Raises ``ValueError`` (and changes nothing) if a sequence with its id is unfinished here
        ("a sequence with id 3 is already scheduled"), if it is not a fresh WAITING sequence
        that holds no blocks ("sequence 3 is RUNNING with blocks [...]: only a new WAITING
        sequence that holds no blocks can be added"), or if its block size is not the
        scheduler's ("sequence 3 has block size 8, the scheduler 16").
        """
        ### BEGIN SOLUTION part2.1
        if seq.seq_id in self._unfinished:
            raise ValueError(f"a sequence with id {seq.seq_id} is already scheduled")
        holds_blocks = len(seq.block_table) > 0 or self.block_manager.device_of(seq) is not None
        if seq.status != SequenceStatus.WAITING or holds_blocks:
            raise ValueError(
                f"sequence {seq.seq_id} is {seq.status.name} with blocks {seq.block_table}: "
                f"only a new WAITING sequence that holds no blocks can be added"
            )
        if seq.block_size != self.config.block_size:
            raise ValueError(
                f"sequence {seq.seq_id} has block size {seq.block_size}, "
                f"the scheduler {self.config.block_size}"
            )
        self.waiting.append(seq)
        self._unfinished[seq.seq_id] = seq
        ### END SOLUTION

    def abort(self, seq_id: int) -> Sequence:
        """Finish an unfinished sequence as FINISHED_ABORTED, free its blocks, return it.

        Raises ``ValueError`` for an id that is not unfinished here ("abort: no unfinished
        sequence has id 42"); nothing changes then.
        """
        ### BEGIN SOLUTION part2.1
        seq = self._unfinished.get(seq_id)
        if seq is None:
            raise ValueError(f"abort: no unfinished sequence has id {seq_id}")
        if seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
        self._finish(seq, SequenceStatus.FINISHED_ABORTED)
        return seq
        ### END SOLUTION

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Add ``child`` as a parallel sample of the running ``parent``: a fresh sequence whose
        tokens are the parent's computed tokens and one more, its own newest token (sampled from
        the same logits as the parent's). It shares the parent's blocks (``block_manager.fork``),
        counts the same tokens computed, joins its group and ``running``, and decodes its newest
        token in its next step (the write copies a shared last block). Given.

        Raises ``ValueError`` unless the parent is running here, out of its prefill, and the
        child could be ``add``-ed with such tokens.
        """
        if self._unfinished.get(parent.seq_id) is not parent or parent.status is not (
            SequenceStatus.RUNNING
        ):
            raise ValueError(f"fork: sequence {parent.seq_id} is not running here")
        computed = parent.num_computed_tokens
        if (
            parent.is_prefill
            or child.num_tokens != computed + 1
            or child.token_ids[:computed] != parent.token_ids[:computed]
        ):
            raise ValueError(
                f"fork: sequence {child.seq_id} must hold the {computed} computed tokens of "
                f"sequence {parent.seq_id} and one of its own"
            )
        self.add(child)
        self.waiting.pop()
        self.block_manager.fork(parent, child)
        child.group_id, child.arrival_time = parent.group_id, parent.arrival_time
        child.num_computed_tokens, child.is_prefill = computed, False
        child.status = SequenceStatus.RUNNING
        bisect.insort(self.running, child, key=_by_arrival)

    def _schedule_waiting(self, out: SchedulerOutput, budget: SchedulingBudget) -> None:
        """Admit waiting sequences, oldest first, while their blocks and the budgets allow.

        Take out and ignore (``_ignore``) a sequence longer than ``max_model_len`` (the reason
        names ``max_model_len``) or that can NEVER be allocated (``_never_fits``); stop at the first
        one that must wait (LATER, or over a budget: its tokens, and ``_seats(seq)`` sequence
        places, n for a request of n parallel samples). An admitted sequence gets its blocks,
        becomes RUNNING, joins ``running`` in arrival order and is scheduled as a prefill of the
        tokens it must compute: all but the ``block_manager.num_cached_tokens(seq)`` that a
        prefix cache already holds (0 without one; ``allocate`` reuses their blocks and counts
        them computed), and with chunked prefill as many of those as the token budget leaves
        (none left: stop).
        """
        ### BEGIN SOLUTION part2.1
        max_model_len = self.config.max_model_len
        while len(self.waiting) > 0:
            seq = self.waiting[0]

            if seq.num_tokens > max_model_len:
                self.waiting.popleft()
                reason = (
                    f"sequence {seq.seq_id} has {seq.num_tokens} tokens, "
                    f"more than max_model_len ({max_model_len})"
                )
                self._ignore(seq, reason, out)
                continue

            status = self.block_manager.can_allocate(seq)
            if status == AllocStatus.NEVER:
                self.waiting.popleft()
                self._ignore(seq, self._never_fits(seq), out)
                continue
            if status == AllocStatus.LATER:
                break

            num_tokens = seq.num_tokens - self.block_manager.num_cached_tokens(seq)
            if self.config.enable_chunked_prefill:
                num_tokens = min(num_tokens, budget.remaining_tokens)
                if num_tokens <= 0:
                    break
            num_seats = self._seats(seq)
            if not budget.can_schedule(num_tokens, num_seats):
                break

            self.waiting.popleft()
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=_by_arrival)
            budget.add(num_tokens, num_seats)
            out.scheduled.append(ScheduledSequence(seq, num_tokens, True))
        ### END SOLUTION

    @staticmethod
    def _seats(seq: Sequence) -> int:
        """Sequence places an admission takes: ``sampling_params.n`` for a request that has not
        sampled yet (it is forked into n samples once its prompt is computed), else 1 (given)."""
        return seq.sampling_params.n if seq.num_completion_tokens == 0 else 1

    def _never_fits(self, seq: Sequence) -> str:
        """The reason given for a sequence whose blocks could NEVER fit the GPU pool."""
        ### BEGIN SOLUTION part2.1
        manager = self.block_manager
        return (
            f"sequence {seq.seq_id} needs {seq.num_blocks} blocks; the GPU pool has "
            f"{manager.num_gpu_blocks} with a watermark of {manager.watermark_blocks}"
        )
        ### END SOLUTION

    def _ignore(self, seq: Sequence, reason: str, out: SchedulerOutput) -> None:
        """Finish a sequence that can never run as FINISHED_IGNORED, and say why.

        The caller has taken it out of its queue (``waiting`` or ``swapped``). ``_finish`` frees
        any blocks it holds; ``IgnoredSequence(seq, reason)`` goes into ``out.ignored``.
        """
        ### BEGIN SOLUTION part2.1
        self._finish(seq, SequenceStatus.FINISHED_IGNORED)
        out.ignored.append(IgnoredSequence(seq, reason))
        ### END SOLUTION

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Give the sequence its finished status, free its blocks (if any), forget it.

        Its caller takes it out of its queue (or rebuilds the queue without it).
        """
        ### BEGIN SOLUTION part2.1
        seq.status = status
        if self.block_manager.device_of(seq) is not None:
            self.block_manager.free(seq)
        if seq.seq_id in self._unfinished:
            del self._unfinished[seq.seq_id]
        if seq.seq_id in self._decodes:
            del self._decodes[seq.seq_id]
        ### END SOLUTION

    # -- part 2.2: decode and postprocess -----------------------------------------------------

    def _schedule_running(self, out: SchedulerOutput, budget: SchedulingBudget) -> None:
        """Give every running sequence, oldest first, a slot for its newest token.

        When ``_append_slot`` finds no free block, preempt the newest group of running sequences
        not yet handled (``_pop_newest_group`` takes it from the back of what is left;
        ``_preempt``) and retry; if nothing is left but the sequence itself, preempt it
        (``[seq]``). Each decode takes one token of the budget. Sequences in their prefill
        (``seq.is_prefill``; only with chunked prefill can one be running) are not decoded: they
        stay in ``running`` and go, in order, to ``_schedule_prefill_chunks`` after the decodes.
        ``running`` stays in arrival order.
        """
        ### BEGIN SOLUTION part2.2
        not_handled = deque(self.running)
        new_running = []
        unfinished_prefills = []
        while len(not_handled) > 0:
            seq = not_handled.popleft()
            if seq.is_prefill:
                # only chunked prefill leaves one here: it gets its chunk after the decodes
                new_running.append(seq)
                unfinished_prefills.append(seq)
                continue

            got_slot = False
            while True:
                if self._append_slot(seq, out):
                    got_slot = True
                    break
                if len(not_handled) > 0:
                    victims = self._pop_newest_group(not_handled)
                    self._preempt(victims, out)
                else:
                    # nobody newer is left: the sequence gives up its own blocks
                    self._preempt([seq], out)
                    break

            if got_slot:
                new_running.append(seq)
                budget.add(1, 0)
                out.scheduled.append(ScheduledSequence(seq, 1, False))

        self.running = new_running
        if len(unfinished_prefills) > 0:
            self._schedule_prefill_chunks(unfinished_prefills, out, budget)
        ### END SOLUTION

    @staticmethod
    def _pop_newest_group(queue: deque[Sequence]) -> list[Sequence]:
        """Take the newest sequence from the back of ``queue``, and the members of its group
        before it; return them in arrival order (given)."""
        group = [queue.pop()]
        while queue and queue[-1].group_id == group[0].group_id:
            group.insert(0, queue.pop())
        return group

    def _append_slot(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Give the sequence the slot for its newest token (``block_manager.append_slot``) and
        return True; a copy-on-write it makes goes into ``out.blocks_to_copy``. Return False
        when no GPU block is free for it (``append_slot`` raised ``NoFreeBlocksError`` and
        changed nothing): one call both checks and does, as vLLM v1's ``allocate_slots``."""
        ### BEGIN SOLUTION part2.2
        try:
            copy = self.block_manager.append_slot(seq)
        except NoFreeBlocksError:
            return False
        if copy is not None:
            src, dst = copy
            if src in out.blocks_to_copy:
                out.blocks_to_copy[src].append(dst)
            else:
                out.blocks_to_copy[src] = [dst]
        return True
        ### END SOLUTION

    def postprocess(
        self, scheduled: list[ScheduledSequence], token_ids: list[int]
    ) -> list[Sequence]:
        """Record a step's results: one sampled token per scheduled sequence, in order.

        Each sequence's ``num_computed_tokens`` grows by what it computed; a sequence whose
        tokens are now all computed ends its prefill (``is_prefill = False``) and appends its
        token (a prefill chunk that stopped short ignores it). Only then, with the token in
        ``token_ids``, ``_stop_status`` decides whether it finishes; if so its blocks are freed
        at once and it leaves ``running``. Returns the sequences that finished. Sequences
        aborted since ``schedule`` are skipped. Raises ``ValueError`` if the two lists differ in
        length ("postprocess got 1 tokens for 2 sequences"; nothing changes).
        """
        ### BEGIN SOLUTION part2.2
        if len(scheduled) != len(token_ids):
            raise ValueError(
                f"postprocess got {len(token_ids)} tokens for {len(scheduled)} sequences"
            )
        finished = []
        for i in range(len(scheduled)):
            item = scheduled[i]
            token_id = token_ids[i]
            seq = item.seq
            if seq.is_finished:
                # aborted since schedule()
                continue
            seq.num_computed_tokens += item.num_tokens
            if seq.num_computed_tokens < seq.num_tokens:
                # a prefill chunk that stopped short: no token yet
                continue
            seq.is_prefill = False
            seq.append_token(token_id)
            stop_status = self._stop_status(seq, token_id)
            if stop_status is not None:
                self._finish(seq, stop_status)
                finished.append(seq)

        if len(finished) > 0:
            still_running = []
            for seq in self.running:
                if not seq.is_finished:
                    still_running.append(seq)
            self.running = still_running
        return finished
        ### END SOLUTION

    def _stop_status(self, seq: Sequence, token_id: int) -> SequenceStatus | None:
        """The finished status the sequence reaches with ``token_id``, or None to go on.

        FINISHED_STOPPED on the EOS token (``config.eos_token_id``) unless ``ignore_eos``;
        FINISHED_LENGTH_CAPPED at ``max_tokens`` completion tokens, or when ``num_tokens >
        max_model_len`` (strictly: vLLM's rule lets a sequence end one token past it, as that
        token's K/V are never computed). EOS wins when both apply. ``token_id`` has already been
        appended (it is ``seq.last_token`` and counts in ``num_completion_tokens``).
        """
        ### BEGIN SOLUTION part2.2
        params = seq.sampling_params
        eos_token_id = self.config.eos_token_id
        if eos_token_id is not None and token_id == eos_token_id and not params.ignore_eos:
            return SequenceStatus.FINISHED_STOPPED
        if seq.num_completion_tokens >= params.max_tokens:
            return SequenceStatus.FINISHED_LENGTH_CAPPED
        if seq.num_tokens > self.config.max_model_len:
            return SequenceStatus.FINISHED_LENGTH_CAPPED
        return None
        ### END SOLUTION

    # -- part 2.3: preemption by recompute ----------------------------------------------------

    def _preempt(self, seqs: list[Sequence], out: SchedulerOutput) -> None:
        """Take a group of running sequences (one or more, in arrival order) off the GPU.

        By swap, the group together, when ``config.preemption_mode`` is SWAP, or AUTO and the
        group has more than one sequence (vLLM v0: a group of parallel samples shares blocks, so
        swapping keeps one copy of them; a lone sequence is cheaper to recompute). When the swap
        is refused (``_preempt_by_swap`` returns False: no room in the CPU pool, or the group
        shares a block with a sequence outside it) and for RECOMPUTE: each one by recompute,
        so that ``waiting`` starts with the group in arrival order. Record them in
        ``out.preempted`` (in order) and count each in ``num_preemptions``.
        """
        ### BEGIN SOLUTION part2.3
        mode = self.config.preemption_mode
        try_swap = False
        if mode == PreemptionMode.SWAP:
            try_swap = True
        elif mode == PreemptionMode.AUTO and len(seqs) > 1:
            try_swap = True

        swapped_out = False
        if try_swap:
            swapped_out = self._preempt_by_swap(seqs, out)
        if not swapped_out:
            # last member first, so that waiting starts with the group in order
            for seq in reversed(seqs):
                self._preempt_by_recompute(seq)

        for seq in seqs:
            out.preempted.append(seq)
            self.num_preemptions += 1
        ### END SOLUTION

    def _preempt_by_recompute(self, seq: Sequence) -> None:
        """Free all of the sequence's blocks; it waits, first in line, to prefill again.

        Everything it had computed is lost (``num_computed_tokens`` back to 0, ``is_prefill``
        True again); its tokens, generated ones included, are kept and recomputed by its next
        prefill. It shares no block any more, so it leaves its group: ``group_id = seq_id``.
        """
        ### BEGIN SOLUTION part2.3
        if self.block_manager.device_of(seq) is not None:
            self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.is_prefill = True
        seq.group_id = seq.seq_id
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        ### END SOLUTION

    # -- part 2.4: preemption by swap ---------------------------------------------------------

    def _preempt_by_swap(self, seqs: list[Sequence], out: SchedulerOutput) -> bool:
        """Move the group's blocks to the CPU pool, in one swap; False (nothing done) if
        ``can_swap_out`` refuses.

        On success the map goes into ``out.blocks_to_swap_out``, and each sequence becomes
        SWAPPED and joins ``swapped`` in arrival order (``bisect.insort`` by ``_by_arrival``: a
        victim is often newer than sequences swapped before it). Their computed tokens survive.
        """
        ### BEGIN SOLUTION part2.4
        if not self.block_manager.can_swap_out(seqs):
            return False
        mapping = self.block_manager.swap_out(seqs)
        for gpu_block_id, cpu_block_id in mapping.items():
            out.blocks_to_swap_out[gpu_block_id] = cpu_block_id
        for seq in seqs:
            seq.status = SequenceStatus.SWAPPED
            bisect.insort(self.swapped, seq, key=_by_arrival)
        return True
        ### END SOLUTION

    def _schedule_swapped(self, out: SchedulerOutput, budget: SchedulingBudget) -> None:
        """Swap groups back in, oldest first, while the GPU pool and the budgets allow.

        For the group at the front of ``swapped`` (``_front_group``: one sequence, or the
        parallel samples swapped out together), ``can_swap_in(group)`` says:
        NEVER: take the group out and ignore each of its sequences (``_ignore``, reason
        ``_never_fits``), go on;
        LATER: stop. Stop too if its work does not fit the budgets (a place per sequence, and one
        token per decode, or ``_prefill_chunk`` tokens for a sequence in its prefill, none left:
        stop). Otherwise the group is swapped in, in one ``swap_in`` (the map goes into
        ``out.blocks_to_swap_in``); each sequence becomes RUNNING, joins ``running`` in arrival
        order and is scheduled in this very step: a decode gets the slot for its newest token
        (``append_slot``: ``can_swap_in`` kept a block for it), a prefill its next chunk.
        """
        ### BEGIN SOLUTION part2.4
        while len(self.swapped) > 0:
            group = self._front_group(self.swapped)
            status = self.block_manager.can_swap_in(group)

            if status == AllocStatus.NEVER:
                del self.swapped[: len(group)]
                for seq in group:
                    self._ignore(seq, self._never_fits(seq), out)
                continue
            if status == AllocStatus.LATER:
                break

            # how many tokens each member computes in this step
            tokens_per_seq = []
            for seq in group:
                if seq.is_prefill:
                    tokens_per_seq.append(self._prefill_chunk(seq, budget))
                else:
                    tokens_per_seq.append(1)
            if 0 in tokens_per_seq:
                break
            total_tokens = 0
            for num_tokens in tokens_per_seq:
                total_tokens += num_tokens
            if not budget.can_schedule(total_tokens, len(group)):
                break

            mapping = self.block_manager.swap_in(group)
            for cpu_block_id, gpu_block_id in mapping.items():
                out.blocks_to_swap_in[cpu_block_id] = gpu_block_id
            del self.swapped[: len(group)]

            for i in range(len(group)):
                seq = group[i]
                seq.status = SequenceStatus.RUNNING
                bisect.insort(self.running, seq, key=_by_arrival)
                if seq.is_prefill:
                    out.scheduled.append(ScheduledSequence(seq, tokens_per_seq[i], True))
                else:
                    # can_swap_in kept a block for the newest token
                    self._append_slot(seq, out)
                    out.scheduled.append(ScheduledSequence(seq, 1, False))
            budget.add(total_tokens, len(group))
        ### END SOLUTION

    @staticmethod
    def _front_group(seqs: list[Sequence]) -> list[Sequence]:
        """The first sequence of ``seqs`` and the members of its group right after it (given)."""
        end = 1
        while end < len(seqs) and seqs[end].group_id == seqs[0].group_id:
            end += 1
        return seqs[:end]

    # -- part 2.5: chunked prefill ------------------------------------------------------------

    def _prefill_chunk(self, seq: Sequence, budget: SchedulingBudget) -> int:
        """How many of the sequence's uncomputed tokens fit in what is left of the token budget.

        Given (swap-in and the chunk pass use it).
        """
        return min(seq.num_tokens - seq.num_computed_tokens, budget.remaining_tokens)

    def _schedule_prefill_chunks(
        self, seqs: list[Sequence], out: SchedulerOutput, budget: SchedulingBudget
    ) -> None:
        """Schedule the next chunk of each running, unfinished prefill, oldest first.

        Each gets ``_prefill_chunk`` tokens; stop when the token budget is spent (no chunk of 0
        tokens is scheduled). These sequences already hold their blocks and count as running:
        they use tokens, not sequence places. (Under ``schedule()``'s policy at most one running
        sequence is in its prefill at a time: a prompt admitted with a cut chunk spent the whole
        budget. The method is general, as in vLLM, and tested as such.)
        """
        ### BEGIN SOLUTION part2.5
        for seq in seqs:
            chunk = self._prefill_chunk(seq, budget)
            if chunk <= 0:
                break
            out.scheduled.append(ScheduledSequence(seq, chunk, True))
            budget.add(chunk, 0)
        ### END SOLUTION
