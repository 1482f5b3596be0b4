"""Scheduler: continuous batching over a paged KV cache (vLLM v0's policy, in small pieces).

Each engine step the scheduler picks the sequences that run and how many tokens each computes;
the model runs them; ``postprocess`` appends the sampled tokens. A sequence joins the batch as
soon as its blocks fit and leaves it the step it finishes (iteration-level scheduling, Orca):
there is no waiting for the slowest request of a batch.

What a step hands the model runner (``SchedulerOutput``) and how its tokens are counted:
``scheduler_output.py``. The queues and the given helpers your parts call: ``scheduler_state.py``.

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

Invariants
- Every unfinished sequence is in exactly one queue, with the matching status and blocks.
- A finished sequence (stopped, length-capped, aborted, ignored) is in no queue and holds no
  block: ``postprocess`` and ``abort`` free blocks at once.
- Each step respects both budgets; a swap-in and a swap-out never happen in one step.
"""

import bisect
from collections import deque

from vkv.config import PreemptionMode
from vkv.engine.block import NoFreeBlocksError
from vkv.engine.block_manager import AllocStatus
from vkv.engine.scheduler_output import (
    IgnoredSequence,
    ScheduledSequence,
    SchedulerOutput,
    SchedulingBudget,
)
from vkv.engine.scheduler_state import SchedulerState
from vkv.engine.sequence import Sequence, SequenceStatus


def _by_arrival(seq: Sequence) -> tuple[float, int, int]:
    """Arrival order; the members of a group (same arrival) next to each other."""
    return seq.arrival_time, seq.group_id, seq.seq_id


class Scheduler(SchedulerState):
    """Continuous batching with preemption; see the module docstring for the policy, and
    ``SchedulerState`` for the queues and the given helpers (``_seats``, ``_pop_newest_group``,
    ``_front_group``, ``_prefill_chunk``)."""

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
        if seq.status is not SequenceStatus.WAITING or seq.block_table:
            raise ValueError(
                f"sequence {seq.seq_id} is {seq.status.name} with blocks {seq.block_table}: "
                "only a new WAITING sequence that holds no blocks can be added"
            )
        if seq.block_size != self.config.block_size:
            raise ValueError(
                f"sequence {seq.seq_id} has block size {seq.block_size}, "
                f"the scheduler {self.config.block_size}"
            )
        self._unfinished[seq.seq_id] = seq
        self.waiting.append(seq)
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
        queue = {
            SequenceStatus.WAITING: self.waiting,
            SequenceStatus.RUNNING: self.running,
            SequenceStatus.SWAPPED: self.swapped,
        }[seq.status]
        queue.remove(seq)
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
        while self.waiting:
            seq = self.waiting[0]
            if seq.num_tokens > self.config.max_model_len:
                self.waiting.popleft()
                self._ignore(
                    seq,
                    f"{seq.num_tokens} tokens exceed max_model_len {self.config.max_model_len}",
                    out,
                )
                continue
            status = self.block_manager.can_allocate(seq)
            if status is AllocStatus.NEVER:
                self.waiting.popleft()
                self._ignore(seq, self._never_fits(seq), out)
                continue
            if status is AllocStatus.LATER:
                break
            num_tokens = seq.num_tokens - self.block_manager.num_cached_tokens(seq)
            if self.config.enable_chunked_prefill:
                num_tokens = min(num_tokens, budget.remaining_tokens)
            seats = self._seats(seq)
            if num_tokens == 0 or not budget.can_schedule(num_tokens, seats):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=_by_arrival)
            out.scheduled.append(ScheduledSequence(seq, num_tokens, is_prefill=True))
            budget.add(num_tokens, seats)
        ### END SOLUTION

    def _never_fits(self, seq: Sequence) -> str:
        """The reason given for a sequence whose blocks could NEVER fit the GPU pool."""
        ### BEGIN SOLUTION part2.1
        return (
            f"needs {seq.num_blocks} blocks; the GPU pool has {self.block_manager.num_gpu_blocks}"
            f" with a watermark of {self.block_manager.watermark_blocks}"
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
        del self._unfinished[seq.seq_id]
        self._decodes.pop(seq.seq_id, None)
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
        queue = deque(self.running)
        kept: list[Sequence] = []
        unfinished_prefills: list[Sequence] = []
        scheduled = out.scheduled
        while queue:
            seq = queue.popleft()
            if seq.is_prefill:
                kept.append(seq)
                unfinished_prefills.append(seq)
                continue
            while not self._append_slot(seq, out):
                victims = self._pop_newest_group(queue) if queue else [seq]
                self._preempt(victims, out)
                if victims[0] is seq:
                    break
            else:
                kept.append(seq)
                item = self._decodes.get(seq.seq_id)
                if item is None or item.seq is not seq:  # its first decode (or a reused id)
                    item = self._decodes[seq.seq_id] = ScheduledSequence(seq, 1, False)
                scheduled.append(item)
        budget.add(len(kept) - len(unfinished_prefills), 0)
        self.running = kept
        if unfinished_prefills:
            self._schedule_prefill_chunks(unfinished_prefills, out, budget)
        ### END SOLUTION

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
            out.blocks_to_copy.setdefault(copy[0], []).append(copy[1])
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
        for item, token_id in zip(scheduled, token_ids, strict=True):
            seq = item.seq
            if seq.status.is_finished:  # aborted since schedule
                continue
            seq.num_computed_tokens += item.num_tokens
            if seq.num_computed_tokens < seq.num_tokens:
                continue
            seq.is_prefill = False
            seq.append_token(token_id)
            status = self._stop_status(seq, token_id)
            if status is not None:
                self._finish(seq, status)
                finished.append(seq)
        if finished:
            self.running = [seq for seq in self.running if not seq.status.is_finished]
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
        if token_id == self.config.eos_token_id and not params.ignore_eos:
            return SequenceStatus.FINISHED_STOPPED
        num_tokens = seq.num_tokens
        if num_tokens - seq.num_prompt_tokens >= params.max_tokens:
            return SequenceStatus.FINISHED_LENGTH_CAPPED
        if num_tokens > self.config.max_model_len:
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
        swap = mode is PreemptionMode.SWAP or (mode is PreemptionMode.AUTO and len(seqs) > 1)
        if not (swap and self._preempt_by_swap(seqs, out)):
            for seq in reversed(seqs):
                self._preempt_by_recompute(seq)
        out.preempted.extend(seqs)
        self.num_preemptions += len(seqs)
        ### END SOLUTION

    def _preempt_by_recompute(self, seq: Sequence) -> None:
        """Free all of the sequence's blocks; it waits, first in line, to prefill again.

        Everything it had computed is lost (``num_computed_tokens`` back to 0, ``is_prefill``
        True again); its tokens, generated ones included, are kept and recomputed by its next
        prefill. It shares no block any more, so it leaves its group: ``group_id = seq_id``.
        """
        ### BEGIN SOLUTION part2.3
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
        out.blocks_to_swap_out.update(self.block_manager.swap_out(seqs))
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
        while self.swapped:
            group = self._front_group(self.swapped)
            status = self.block_manager.can_swap_in(group)
            if status is AllocStatus.NEVER:
                del self.swapped[: len(group)]
                for seq in group:
                    self._ignore(seq, self._never_fits(seq), out)
                continue
            tokens = [self._prefill_chunk(seq, budget) if seq.is_prefill else 1 for seq in group]
            if status is AllocStatus.LATER or 0 in tokens:
                break
            if not budget.can_schedule(sum(tokens), len(group)):
                break
            del self.swapped[: len(group)]
            out.blocks_to_swap_in.update(self.block_manager.swap_in(group))
            for seq, num_tokens in zip(group, tokens, strict=True):
                seq.status = SequenceStatus.RUNNING
                bisect.insort(self.running, seq, key=_by_arrival)
                if not seq.is_prefill:
                    self._append_slot(seq, out)  # True: can_swap_in kept a block for it
                out.scheduled.append(ScheduledSequence(seq, num_tokens, seq.is_prefill))
            budget.add(sum(tokens), len(group))
        ### END SOLUTION

    # -- part 2.5: chunked prefill ------------------------------------------------------------

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
            num_tokens = self._prefill_chunk(seq, budget)
            if num_tokens == 0:
                break
            out.scheduled.append(ScheduledSequence(seq, num_tokens, is_prefill=True))
            budget.add(num_tokens, 0)
        ### END SOLUTION
