"""Graded tests for Phase 2: the continuous-batching Scheduler.

``uv run pytest tests/test_phase2.py -k part3 -v`` runs the tests of part 2.3. The tests drive
the scheduler as the engine does: ``out = schedule()``, run the step (here: invent one token
per scheduled sequence), ``postprocess(out.scheduled, tokens)``.
"""

from collections import Counter, deque
from typing import ClassVar

import pytest
from cost import fastest_ratio
from grading_policy import policy_test
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from hypothesis_settings import graded_settings, run_counted_machine
from scheduler_stand_ins import ids, small_scheduler, stand_in_preempt

from vkv.config import Config
from vkv.engine.block import Device
from vkv.engine.block_manager import BlockManager
from vkv.engine.scheduler import (
    ScheduledSequence,
    Scheduler,
    SchedulerOutput,
    SchedulingBudget,
)
from vkv.engine.sequence import Sequence, SequenceStatus
from vkv.engine.simulator import Request, simulate
from vkv.sampling_params import SamplingParams

TOKEN = 5
EOS = 2
STATEFUL = graded_settings(max_examples=60, stateful_step_count=40)


def make_scheduler(**overrides) -> Scheduler:
    return small_scheduler(**{"eos_token_id": EOS, **overrides})


def chunked(**overrides) -> Scheduler:
    options = {"enable_chunked_prefill": True, "max_num_batched_tokens": 16, "max_model_len": 64}
    options.update(overrides)
    return make_scheduler(**options)


def make_seq(
    scheduler: Scheduler,
    seq_id: int,
    prompt_len: int,
    max_tokens: int = 16,
    arrival: float | None = None,
    ignore_eos: bool = False,
) -> Sequence:
    seq = Sequence(
        seq_id,
        [10 + seq_id * 100 + i for i in range(prompt_len)],
        scheduler.config.block_size,
        SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
        arrival_time=float(seq_id if arrival is None else arrival),
    )
    scheduler.add(seq)
    return seq


def step(scheduler: Scheduler, token: int = TOKEN) -> SchedulerOutput:
    """One engine step with a stand-in model that samples ``token`` for everyone."""
    out = scheduler.schedule()
    scheduler.postprocess(out.scheduled, [token] * len(out.scheduled))
    return out


def planned(out: SchedulerOutput) -> list[tuple[int, int, bool]]:
    return [(item.seq.seq_id, item.num_tokens, item.is_prefill) for item in out.scheduled]


def run_to_the_end(scheduler: Scheduler, max_steps: int) -> list[SchedulerOutput]:
    """Step until every sequence finished; fail with the liveness rule after ``max_steps``."""
    outs = []
    for _ in range(max_steps):
        if scheduler.is_finished():
            return outs
        outs.append(step(scheduler))
    raise AssertionError(
        f"after {max_steps} steps {scheduler.num_unfinished} sequences are unfinished (waiting "
        f"{ids(scheduler.waiting)}, running {ids(scheduler.running)}, swapped "
        f"{ids(scheduler.swapped)}): starvation or livelock"
    )


def outgrowing_then_small(mode: str) -> tuple[Scheduler, Sequence, Sequence]:
    """An 8-token sequence that fills a 2-block pool and must grow, and a small one behind it."""
    s = make_scheduler(
        block_size=4, num_gpu_blocks=2, num_cpu_blocks=2, max_model_len=64, preemption_mode=mode
    )
    big = make_seq(s, 0, 8, max_tokens=20, ignore_eos=True)
    small = make_seq(s, 1, 3, max_tokens=2)
    return s, big, small


def check_outgrown_is_ignored_and_the_small_one_runs(s, big, small) -> None:
    outs = run_to_the_end(s, max_steps=100)
    assert big.status is SequenceStatus.FINISHED_IGNORED, (
        f"the 8-token sequence needs a third block for its ninth token and the pool has 2: it "
        f"can never run again and must end FINISHED_IGNORED, got {big.status.name}"
    )
    reasons = [i.reason for out in outs for i in out.ignored if i.seq is big]
    assert len(reasons) == 1, (
        f"the outgrown sequence is ignored once, and then is in no queue: expected 1 entry in "
        f"out.ignored over the run, got {len(reasons)}: {reasons}"
    )
    assert "3 blocks" in reasons[0] and "2" in reasons[0], (
        f"the reason names the blocks it needs (3) and the pool (2): {reasons}"
    )
    assert small.status is SequenceStatus.FINISHED_LENGTH_CAPPED, (
        f"the 3-token request behind it must run to its end, got {small.status.name}"
    )
    assert s.block_manager.num_free_gpu_blocks == 2, (
        "finished sequences hold no block: once all have finished, the 2 GPU blocks are free; "
        f"got {s.block_manager.num_free_gpu_blocks} free"
    )
    assert s.block_manager.num_free_cpu_blocks == 2, (
        "finished sequences hold no block: once all have finished, the 2 CPU blocks are free; "
        f"got {s.block_manager.num_free_cpu_blocks} free"
    )


# --------------------------------------------------------------------------------------------
# Part 2.1: admission and budgets
# --------------------------------------------------------------------------------------------


# Each part's first test: its regions follow the grading policy (tests/grading_policy.py).
test_part1_follows_the_grading_policy = policy_test("2.1")
test_part2_follows_the_grading_policy = policy_test("2.2")
test_part3_follows_the_grading_policy = policy_test("2.3")
test_part4_follows_the_grading_policy = policy_test("2.4")
test_part5_follows_the_grading_policy = policy_test("2.5")


def test_part1_admits_waiting_prompts_first_come_first_served_as_one_prefill_step():
    s = make_scheduler()
    a, b, c = (make_seq(s, i, n) for i, n in enumerate((5, 9, 3)))
    out = s.schedule()
    assert planned(out) == [(0, 5, True), (1, 9, True), (2, 3, True)], (
        "each admitted prompt is scheduled as one prefill of all its tokens, oldest first"
    )
    assert out.kind == "prefill", (
        f"a step that admits prompts is a prefill step, got kind {out.kind!r}"
    )
    assert out.num_batched_tokens == 17, (
        f"the step computes every admitted prompt token: 5 + 9 + 3 = 17, "
        f"got {out.num_batched_tokens}"
    )
    assert ids(s.running) == [0, 1, 2], (
        f"admitted sequences join running in arrival order: expected [0, 1, 2], "
        f"got {ids(s.running)}"
    )
    assert not s.waiting, (
        f"admission pops each admitted sequence from waiting: expected [], got {ids(s.waiting)}"
    )
    assert all(seq.status is SequenceStatus.RUNNING for seq in (a, b, c)), (
        f"an admitted sequence becomes RUNNING: got {[seq.status.name for seq in (a, b, c)]}"
    )
    assert [len(seq.block_table) for seq in (a, b, c)] == [2, 3, 1], (
        "admission allocates the blocks of each prompt: 5, 9, 3 tokens in blocks of 4 need 2, "
        f"3, 1 blocks; got {[len(seq.block_table) for seq in (a, b, c)]}"
    )


def test_part1_max_num_seqs_caps_admission():
    s = make_scheduler(max_num_seqs=2)
    for i in range(4):
        make_seq(s, i, 3)
    out = s.schedule()
    assert ids(out.seqs) == [0, 1], (
        f"at most max_num_seqs=2 sequences may run: expected [0, 1], got {ids(out.seqs)}"
    )
    assert ids(s.waiting) == [2, 3], (
        "the prompts over max_num_seqs stay in waiting, in order: expected [2, 3], "
        f"got {ids(s.waiting)}"
    )


def test_part1_token_budget_caps_admission_without_overtaking():
    s = make_scheduler(max_num_batched_tokens=64, max_model_len=64)
    make_seq(s, 0, 40)
    make_seq(s, 1, 30)  # 40 + 30 > 64: waits
    make_seq(s, 2, 4)  # would fit, but must not overtake sequence 1
    out = s.schedule()
    assert ids(out.seqs) == [0], (
        f"budget 64 tokens: admit the 40-token prompt and stop at the 30-token one (FCFS), "
        f"got {ids(out.seqs)}"
    )
    assert ids(s.waiting) == [1, 2], (
        "the 30-token prompt and the one behind it stay in waiting, in order (FCFS: nobody "
        f"overtakes): expected [1, 2], got {ids(s.waiting)}"
    )


def test_part1_later_stops_admission_for_this_step():
    s = make_scheduler(num_gpu_blocks=8)
    make_seq(s, 0, 20)  # 5 blocks
    later = make_seq(s, 1, 16)  # 4 blocks: only 3 left -> LATER
    make_seq(s, 2, 4)  # 1 block would fit, but FCFS: no overtaking
    out = s.schedule()
    assert ids(out.seqs) == [0], (
        "the 16-token prompt needs 4 blocks and 3 are free (LATER): admission stops for this "
        f"step, and the 1-block prompt behind it may not overtake (FCFS); expected [0], "
        f"got {ids(out.seqs)}"
    )
    assert list(s.waiting) == [later, s.waiting[1]], (
        "a LATER sequence stays at the front of waiting, the one behind it after it: expected "
        f"[1, 2], got {ids(s.waiting)}"
    )
    assert later.status is SequenceStatus.WAITING, (
        f"a sequence that must wait stays WAITING, got {later.status.name}"
    )
    assert later.block_table == [], (
        f"a sequence that must wait holds no blocks, got block table {later.block_table}"
    )
    assert not out.ignored, (
        "LATER is not NEVER: a prompt that fits the pool alone is not ignored; "
        f"got ignored {ids(i.seq for i in out.ignored)}"
    )


def test_part1_prompt_longer_than_max_model_len_is_ignored_with_a_reason():
    s = make_scheduler(max_model_len=16)
    too_long = make_seq(s, 0, 17)
    fine = make_seq(s, 1, 4)
    out = s.schedule()
    assert [i.seq for i in out.ignored] == [too_long], (
        "a prompt longer than max_model_len (17 > 16) is ignored: expected out.ignored to hold "
        f"sequence 0, got {ids(i.seq for i in out.ignored)}"
    )
    assert "max_model_len" in out.ignored[0].reason, (
        f"the reason names max_model_len, got {out.ignored[0].reason!r}"
    )
    assert too_long.status is SequenceStatus.FINISHED_IGNORED, (
        f"an ignored prompt finishes as FINISHED_IGNORED, got {too_long.status.name}"
    )
    assert too_long.block_table == [], (
        f"an ignored prompt holds no blocks, got block table {too_long.block_table}"
    )
    assert ids(out.seqs) == [1], (
        f"an ignored request must not hold up the ones behind it: expected [1], got {ids(out.seqs)}"
    )
    assert fine.status is SequenceStatus.RUNNING, (
        f"the 4-token prompt behind it is admitted (RUNNING), got {fine.status.name}"
    )
    assert s.num_unfinished == 1, (
        "an ignored sequence is finished and in no queue: 1 unfinished sequence expected, got "
        f"{s.num_unfinished} (waiting {ids(s.waiting)}, running {ids(s.running)})"
    )


def test_part1_a_prompt_of_exactly_max_model_len_is_admitted():
    s = make_scheduler(max_model_len=16)
    seq = make_seq(s, 0, 16)
    out = s.schedule()
    assert ids(out.seqs) == [0] and not out.ignored, (
        "max_model_len is the longest allowed prompt: 16 tokens of 16 must run; got scheduled "
        f"{ids(out.seqs)}, ignored {ids(i.seq for i in out.ignored)}"
    )
    assert seq.status is SequenceStatus.RUNNING, (
        f"an admitted prompt is RUNNING, got {seq.status.name}"
    )


def test_part1_prompt_that_never_fits_the_pool_is_ignored():
    s = make_scheduler(num_gpu_blocks=4, max_model_len=64)
    huge = make_seq(s, 0, 17)  # 5 blocks > 4
    make_seq(s, 1, 4)
    out = s.schedule()
    assert [i.seq for i in out.ignored] == [huge], (
        "a prompt of 5 blocks can never fit a pool of 4 (can_allocate is NEVER): it is ignored; "
        f"expected out.ignored to hold sequence 0, got {ids(i.seq for i in out.ignored)}"
    )
    assert huge.status is SequenceStatus.FINISHED_IGNORED, (
        f"NEVER means FINISHED_IGNORED, got {huge.status.name}"
    )
    assert ids(out.seqs) == [1], (
        f"an ignored request must not hold up the ones behind it: expected [1], got {ids(out.seqs)}"
    )
    assert s.block_manager.num_free_gpu_blocks == 3, (
        "the ignored prompt holds no block and the admitted one 1: 3 of 4 blocks free, "
        f"got {s.block_manager.num_free_gpu_blocks}"
    )


def test_part1_the_never_reason_names_the_blocks_the_pool_and_the_watermark():
    s = make_scheduler(num_gpu_blocks=10, watermark=0.2, max_model_len=64)
    huge = make_seq(s, 0, 33)  # 9 blocks: 10 - 9 < 2
    out = s.schedule()
    assert [i.seq for i in out.ignored] == [huge], (
        "can_allocate is NEVER: 9 blocks would leave 1 of a pool of 10 free, under the watermark "
        f"of 2; it is ignored: expected sequence 0 in out.ignored, got "
        f"{ids(i.seq for i in out.ignored)}"
    )
    reason = out.ignored[0].reason
    assert "9 blocks" in reason and "10" in reason and "watermark of 2" in reason, (
        f"say what it needs and what the pool keeps: 9 blocks, a pool of 10, a watermark of 2; "
        f"got {reason!r}"
    )


def test_part1_the_never_reason_gives_the_pool_size_not_the_free_blocks():
    s = make_scheduler(num_gpu_blocks=10, max_model_len=64)
    s.block_manager.allocate(Sequence(9, [1] * 8, 4))  # 2 blocks in use: 8 free
    huge = make_seq(s, 1, 44)  # 11 blocks
    out = s.schedule()
    assert [i.seq for i in out.ignored] == [huge], (
        "an 11-block prompt can never fit a pool of 10 (NEVER): it is ignored; expected sequence "
        f"1 in out.ignored, got {ids(i.seq for i in out.ignored)}"
    )
    reason = out.ignored[0].reason
    assert "11 blocks" in reason and "pool has 10" in reason, (
        f"the reason gives the pool's size (10), not the blocks free now (8): {reason!r}"
    )


def test_part1_admission_keeps_the_watermark_free():
    s = make_scheduler(num_gpu_blocks=10, watermark=0.2)
    make_seq(s, 0, 32)  # 8 blocks: 10 - 8 = 2 = the watermark, OK
    late = make_seq(s, 1, 1)
    out = s.schedule()
    assert ids(out.seqs) == [0], (
        "after an 8-block prompt 2 blocks are free, all of them the watermark's: the 1-block "
        f"prompt must wait (LATER), got {ids(out.seqs)}"
    )
    assert late.status is SequenceStatus.WAITING, (
        f"a prompt that must wait (LATER) stays WAITING, got {late.status.name}"
    )
    assert not out.ignored, (
        "LATER is not NEVER: the 1-block prompt fits the pool alone and is not ignored; "
        f"got ignored {ids(i.seq for i in out.ignored)}"
    )


def test_part1_with_chunked_prefill_the_last_prompt_is_cut_to_the_budget_left():
    s = chunked()
    make_seq(s, 0, 5)
    make_seq(s, 1, 20)
    make_seq(s, 2, 3)
    out = s.schedule()
    assert planned(out) == [(0, 5, True), (1, 11, True)], (
        "with chunked prefill a prompt is admitted with as many tokens as the budget (16) "
        f"leaves: 5, then 11 of 20; got {planned(out)}"
    )
    assert ids(s.waiting) == [2], (
        f"the budget is spent: the third prompt waits; expected [2], got {ids(s.waiting)}"
    )
    assert out.num_batched_tokens == 16, (
        "admission fills the token budget of 16 and never exceeds it: expected 16 tokens, "
        f"got {out.num_batched_tokens}"
    )


def test_part1_with_chunked_prefill_no_prompt_is_admitted_with_zero_tokens():
    s = chunked()
    make_seq(s, 0, 16)
    late = make_seq(s, 1, 2)
    out = s.schedule()
    assert planned(out) == [(0, 16, True)], (
        f"the budget of 16 is spent by the first prompt, got {planned(out)}"
    )
    assert late.status is SequenceStatus.WAITING and late.block_table == [], (
        "a prompt that would get 0 tokens is not admitted: it waits and holds no blocks; got "
        f"{late.status.name} with block table {late.block_table}"
    )


def test_part1_a_later_prompt_holds_back_the_ones_behind_it_with_chunked_prefill():
    s = chunked(num_gpu_blocks=4)
    make_seq(s, 0, 12)  # 3 blocks
    make_seq(s, 1, 8)  # 2 blocks: LATER
    make_seq(s, 2, 1)  # 1 block would fit, but must not overtake
    out = s.schedule()
    assert planned(out) == [(0, 12, True)], (
        f"FCFS holds with chunked prefill too: nobody overtakes a LATER prompt, got {planned(out)}"
    )


class CachedPrefixBlockManager(BlockManager):
    """A BlockManager that reports the first 8 tokens of every prompt as cached, and counts them
    computed when it allocates (what prefix caching, Phase 4, does): part 2.1 alone."""

    def num_cached_tokens(self, seq: Sequence) -> int:
        return 8 if seq.num_tokens > 8 else 0

    def allocate(self, seq: Sequence) -> None:
        super().allocate(seq)
        seq.num_computed_tokens = 8


def with_cached_prefix(s: Scheduler) -> Scheduler:
    c = s.config
    s.block_manager = CachedPrefixBlockManager(c.block_size, c.num_gpu_blocks, 0, c.watermark)
    return s


def test_part1_a_cached_prefix_is_not_computed_or_charged_again():
    s = with_cached_prefix(make_scheduler(max_num_batched_tokens=64, max_num_seqs=8))
    for seq_id in range(5):
        make_seq(s, seq_id, 20)
    out = s.schedule()
    assert planned(out)[:1] == [(0, 12, True)], (
        "a prompt of 20 tokens whose first 8 a prefix cache holds (block_manager."
        "num_cached_tokens) is a prefill of the other 12; got " + str(planned(out)[:1])
    )
    assert planned(out) == [(i, 12, True) for i in range(5)], (
        "the token budget (64) is charged only the 12 uncached tokens of each prompt, so five "
        f"fit (5 x 12 = 60); got {planned(out)}"
    )


def test_part1_with_chunked_prefill_a_cached_prefix_leaves_more_of_the_budget():
    s = with_cached_prefix(chunked())
    make_seq(s, 0, 20)
    make_seq(s, 1, 20)
    out = s.schedule()
    assert planned(out) == [(0, 12, True), (1, 4, True)], (
        "with chunked prefill and 8 cached tokens per prompt, the first prompt computes its 12 "
        f"uncached tokens and the second the 4 the budget of 16 leaves; got {planned(out)}"
    )


def test_part1_a_request_of_n_parallel_samples_takes_n_places():
    s = make_scheduler(max_num_seqs=4)
    first = Sequence(0, [10, 11, 12], 4, SamplingParams(max_tokens=4, n=3), 0.0)
    second = Sequence(1, [20, 21, 22], 4, SamplingParams(max_tokens=4, n=2), 1.0)
    s.add(first)
    s.add(second)
    out = s.schedule()
    assert planned(out) == [(0, 3, True)], (
        "a request with n = 3 is forked into 3 samples after its prefill, so its admission "
        "takes 3 of the 4 sequence places (_seats); the next, n = 2, must wait: got "
        f"{planned(out)}"
    )
    assert ids(s.waiting) == [1], f"1 waits for 2 places, got waiting {ids(s.waiting)}"


def test_part1_duplicate_seq_id_is_rejected_and_changes_nothing():
    s = make_scheduler()
    make_seq(s, 0, 4)
    twin = Sequence(0, [1, 2], 4)
    with pytest.raises(ValueError, match=r"\ba sequence with id 0 is already scheduled\b"):
        s.add(twin)
    assert s.num_unfinished == 1 and len(s.waiting) == 1, (
        "a rejected add changes nothing: still 1 unfinished sequence, in waiting; got "
        f"{s.num_unfinished} unfinished, waiting {ids(s.waiting)}"
    )


def test_part1_the_id_of_a_running_sequence_cannot_be_added_again():
    s = make_scheduler()
    make_seq(s, 0, 4)
    s.schedule()  # 0 runs now: waiting is empty
    with pytest.raises(ValueError):
        s.add(Sequence(0, [1, 2], 4))
    assert ids(s.running) == [0] and not s.waiting and s.num_unfinished == 1, (
        "an id is taken while its sequence is unfinished, in any queue, not only in waiting: "
        f"the add must change nothing; got running {ids(s.running)}, waiting {ids(s.waiting)}"
    )


def test_part1_add_rejects_a_sequence_that_is_not_fresh_or_of_another_block_size():
    s = make_scheduler()
    used = Sequence(1, [1, 2], 4)
    used.status = SequenceStatus.RUNNING
    fresh_only = r"\bsequence 1 is RUNNING\b.*\bonly a new WAITING sequence that holds no blocks\b"
    with pytest.raises(ValueError, match=fresh_only):
        s.add(used)
    with pytest.raises(ValueError, match=r"\bsequence 2 has block size 8, the scheduler 4\b"):
        s.add(Sequence(2, [1, 2], 8))
    assert s.num_unfinished == 0, (
        "a rejected add changes nothing: no sequence is queued; got "
        f"{s.num_unfinished} unfinished (waiting {ids(s.waiting)})"
    )


def test_part1_abort_a_waiting_and_a_running_sequence():
    s = make_scheduler(max_num_seqs=1)
    running, waiting = make_seq(s, 0, 8), make_seq(s, 1, 8)
    s.schedule()
    assert s.abort(1) is waiting, "abort(seq_id) returns the sequence it finished"
    assert waiting.status is SequenceStatus.FINISHED_ABORTED, (
        f"abort finishes a waiting sequence as FINISHED_ABORTED, got {waiting.status.name}"
    )
    s.abort(0)
    assert running.status is SequenceStatus.FINISHED_ABORTED, (
        f"abort finishes a running sequence as FINISHED_ABORTED, got {running.status.name}"
    )
    assert running.block_table == [], (
        f"an aborted sequence's blocks are freed at once, got block table {running.block_table}"
    )
    assert s.block_manager.num_free_gpu_blocks == 64, (
        "an aborted sequence's blocks are freed at once: all 64 free, got "
        f"{s.block_manager.num_free_gpu_blocks}"
    )
    assert s.is_finished(), (
        "abort takes a sequence out of its queue: expected none left, got waiting "
        f"{ids(s.waiting)}, running {ids(s.running)}"
    )


def test_part1_abort_finds_a_swapped_sequence_and_frees_its_blocks():
    s = make_scheduler()
    seq = make_seq(s, 0, 5)
    s.schedule()
    s.running.remove(seq)  # moved to swapped by hand (a real swap-out is part 2.4's)
    seq.status = SequenceStatus.SWAPPED
    s.swapped.append(seq)
    assert s.abort(0) is seq, "abort(seq_id) returns the sequence it finished"
    assert seq.status is SequenceStatus.FINISHED_ABORTED, (
        f"abort finishes a swapped sequence as FINISHED_ABORTED, got {seq.status.name}"
    )
    assert s.swapped == [] and s.is_finished(), (
        "abort takes it out of the queue its status names: got swapped "
        f"{ids(s.swapped)}, {s.num_unfinished} unfinished"
    )
    assert seq.block_table == [] and s.block_manager.num_free_gpu_blocks == 64, (
        "an aborted sequence's blocks are freed at once, wherever it is queued: got block "
        f"table {seq.block_table}, {s.block_manager.num_free_gpu_blocks} of 64 blocks free"
    )


def test_part1_aborting_an_unknown_id_raises_and_changes_nothing():
    s = make_scheduler()
    make_seq(s, 0, 4)
    s.schedule()
    with pytest.raises(ValueError, match=r"\bno unfinished sequence has id 42\b"):
        s.abort(42)
    s.abort(0)
    with pytest.raises(ValueError):
        s.abort(0)  # already finished
    assert s.block_manager.num_free_gpu_blocks == 64, (
        "the aborted sequence's blocks are freed, and a failed abort changes nothing: all 64 "
        f"free, got {s.block_manager.num_free_gpu_blocks}"
    )
    assert s.is_finished(), (
        "a failed abort changes nothing and the aborted sequence left its queue: expected none "
        f"left, got waiting {ids(s.waiting)}, running {ids(s.running)}"
    )


# --------------------------------------------------------------------------------------------
# Part 2.2: decode and continuous batching
# --------------------------------------------------------------------------------------------


def test_part2_prefill_yields_the_first_token_then_each_decode_one_more():
    s = make_scheduler()
    seq = make_seq(s, 0, 6)
    step(s, token=11)
    assert seq.completion_token_ids == [11], "a finished prefill samples the first new token"
    assert seq.num_computed_tokens == 6, "the prefill computed the 6 prompt tokens"
    out = step(s, token=12)
    assert planned(out) == [(0, 1, False)], (
        "after its prefill a sequence is a decode of one token (is_prefill False): expected "
        f"[(0, 1, False)] as (id, tokens, prefill), got {planned(out)}"
    )
    assert out.kind == "decode", f"a step of decodes only is a decode step, got {out.kind!r}"
    assert seq.completion_token_ids == [11, 12], (
        "postprocess appends each step's sampled token: expected completion [11, 12], got "
        f"{seq.completion_token_ids}"
    )
    assert seq.num_computed_tokens == 7, (
        f"the decode computed one token: 6 + 1 = 7 computed, got {seq.num_computed_tokens}"
    )


def test_part2_decode_step_runs_every_running_sequence_once():
    s = make_scheduler()
    for i in range(3):
        make_seq(s, i, 4 + i)
    step(s)
    out = step(s)
    assert planned(out) == [(0, 1, False), (1, 1, False), (2, 1, False)], (
        "a decode step gives every running sequence, oldest first, one decode token; got "
        f"{planned(out)} as (id, tokens, prefill)"
    )


def test_part2_decode_takes_a_new_block_exactly_at_a_block_boundary():
    s = make_scheduler()
    seq = make_seq(s, 0, 7, max_tokens=30)  # 7 tokens: 2 blocks of 4
    step(s)  # prefill -> token 8, still in block 2
    assert len(seq.block_table) == 2, (
        "a 7-token prompt is admitted with 2 blocks of 4, and its sampled eighth token still "
        f"fits block 2: 2 blocks expected, got {len(seq.block_table)}"
    )
    step(s)  # decode token 8 (in block 2), sample token 9
    assert len(seq.block_table) == 2, (
        "the token at position 7 fits the last slot of block 2: no new block before a block "
        f"boundary, 2 blocks expected, got {len(seq.block_table)}"
    )
    step(s)  # decode token 9: opens block 3
    assert len(seq.block_table) == 3, (
        f"the token at position 8 needs a third block of 4, got {len(seq.block_table)} blocks"
    )


def test_part2_finishes_at_max_tokens_and_frees_blocks_at_once():
    s = make_scheduler()
    seq = make_seq(s, 0, 4, max_tokens=3)
    finished = []
    for _ in range(3):
        finished += s.postprocess((out := s.schedule()).scheduled, [TOKEN] * len(out.scheduled))
    assert finished == [seq], (
        "postprocess returns the sequences that finished: sequence 0, at its third token; got "
        f"{ids(finished)}"
    )
    assert seq.status is SequenceStatus.FINISHED_LENGTH_CAPPED, (
        "num_completion_tokens >= max_tokens (3) means FINISHED_LENGTH_CAPPED, got "
        f"{seq.status.name}"
    )
    assert seq.num_completion_tokens == 3, (
        f"it stops at max_tokens: 3 completion tokens expected, got {seq.num_completion_tokens}"
    )
    assert seq.block_table == [] and s.block_manager.num_free_gpu_blocks == 64, (
        "a finished sequence frees its blocks in postprocess, not at the next schedule: got "
        f"block table {seq.block_table}, {s.block_manager.num_free_gpu_blocks} of 64 free"
    )
    assert s.running == [] and s.is_finished(), (
        "postprocess rebuilds running without the finished: expected no sequence left, got "
        f"running {ids(s.running)}, waiting {ids(s.waiting)}"
    )


def test_part2_finishes_on_eos_unless_ignore_eos():
    s = make_scheduler()
    stops = make_seq(s, 0, 4, max_tokens=10)
    goes_on = make_seq(s, 1, 4, max_tokens=10, ignore_eos=True)
    step(s, token=EOS)
    assert stops.status is SequenceStatus.FINISHED_STOPPED, (
        f"the EOS token finishes a sequence as FINISHED_STOPPED, got {stops.status.name}"
    )
    assert stops.completion_token_ids == [EOS], (
        f"the EOS token is part of the output: expected [{EOS}], got {stops.completion_token_ids}"
    )
    assert goes_on.status is SequenceStatus.RUNNING, (
        f"ignore_eos keeps generating past EOS: expected RUNNING, got {goes_on.status.name}"
    )
    assert ids(s.running) == [1], (
        "the stopped sequence leaves running in postprocess, the ignore_eos one stays: "
        f"expected [1], got {ids(s.running)}"
    )


def a_step_where_all_finish(batch: int):
    """``batch`` sequences prefilled (untimed), and the measured call: the decode step in which
    every one of them reaches max_tokens."""
    s = make_scheduler(
        num_gpu_blocks=batch + 8, max_num_seqs=batch, max_num_batched_tokens=2 * batch
    )
    for i in range(batch):
        make_seq(s, i, 1, max_tokens=2)
    step(s)  # the prefills: one token generated each

    def run():
        step(s)
        assert s.is_finished(), f"all {batch} sequences finish in the second step"

    return run


def test_part2_a_step_costs_o_of_the_batch():
    small, large = 256, 8192
    per_small, per_large = fastest_ratio(
        lambda: a_step_where_all_finish(small), lambda: a_step_where_all_finish(large), repeats=5
    )
    per_small, per_large = per_small / small, per_large / large
    assert per_large < 4 * per_small, (
        f"a decode step cost {per_large * 1e6:.1f} µs of CPU per sequence with {large} running "
        f"and {per_small * 1e6:.1f} µs with {small}: a step must cost O(batch), not O(batch²) "
        "(build the new running list as you go; do not search or remove from lists per sequence)"
    )


def test_part2_eos_wins_over_max_tokens():
    s = make_scheduler()
    seq = make_seq(s, 0, 4, max_tokens=1)
    step(s, token=EOS)
    assert seq.status is SequenceStatus.FINISHED_STOPPED, (
        "the first token is EOS and also the max_tokens-th: EOS wins (FINISHED_STOPPED), "
        f"got {seq.status.name}"
    )


def test_part2_finishes_past_max_model_len():
    s = make_scheduler(max_model_len=8)
    seq = make_seq(s, 0, 6, max_tokens=100)
    for _ in range(5):
        step(s)
        if seq.is_finished:
            break
    assert seq.status is SequenceStatus.FINISHED_LENGTH_CAPPED, (
        "a sequence with more than max_model_len (8) tokens finishes as FINISHED_LENGTH_CAPPED, "
        f"got {seq.status.name} with {seq.num_tokens} tokens"
    )
    assert seq.num_tokens == 9, (
        f"with max_model_len 8 a sequence stops when it passes 8 tokens; it has {seq.num_tokens}"
    )


def test_part2_a_finished_sequences_place_is_refilled_the_next_step():
    s = make_scheduler(max_num_seqs=2)
    make_seq(s, 0, 4, max_tokens=2)
    make_seq(s, 1, 4, max_tokens=10)
    waiting = make_seq(s, 2, 4, max_tokens=10)
    step(s)  # prefill 0 and 1
    step(s)  # decode: sequence 0 finishes
    assert ids(s.running) == [1], (
        "sequence 0 reached max_tokens=2: it leaves running in postprocess; expected [1], got "
        f"{ids(s.running)}"
    )
    out = step(s)
    assert ids(out.seqs) == [2] and out.kind == "prefill", (
        "continuous batching: the freed place goes to the waiting request at the next step, a "
        f"prefill step; got {planned(out)} as (id, tokens, prefill)"
    )
    assert ids(s.running) == [1, 2], (
        f"the admitted request joins running in arrival order: expected [1, 2], "
        f"got {ids(s.running)}"
    )
    assert waiting.status is SequenceStatus.RUNNING, (
        f"the admitted request is RUNNING, got {waiting.status.name}"
    )


def test_part2_when_blocks_run_out_the_newest_unhandled_sequence_is_preempted(monkeypatch):
    s = make_scheduler(num_gpu_blocks=8)
    for i in range(4):
        make_seq(s, i, 8, max_tokens=8)  # 2 blocks each: the pool is full
    step(s)  # 9 tokens each: every one needs a third block
    victims, preempt = stand_in_preempt(s)
    monkeypatch.setattr(s, "_preempt", preempt)
    out = s.schedule()
    assert victims == [[3], [2]], (
        "0 needs a block: preempt the newest (3); 1 takes the other freed block; 2 needs one and "
        f"is the newest left: it preempts itself. _preempt got {victims}, expected [[3], [2]]"
    )
    assert planned(out) == [(0, 1, False), (1, 1, False)], (
        "0 and 1 get their blocks and decode, oldest first: expected [(0, 1, False), "
        f"(1, 1, False)] as (id, tokens, prefill), got {planned(out)}"
    )
    assert ids(s.running) == [0, 1], (
        f"the preempted sequences leave running: expected [0, 1], got {ids(s.running)}"
    )


def test_part2_append_slot_returns_false_only_for_a_missing_block():
    s = make_scheduler(num_gpu_blocks=3)
    a = make_seq(s, 0, 8)  # 2 blocks of 4
    b = make_seq(s, 1, 3)  # 1 block: the pool is full once both are admitted
    step(s)
    out = SchedulerOutput()
    assert s._append_slot(b, out) is True, (
        "b's newest token fits in its last block: _append_slot gives it the slot and returns True"
    )
    table = list(a.block_table)
    assert s._append_slot(a, out) is False, (
        "a's newest token opens a new block and none is free: _append_slot returns False"
    )
    assert a.block_table == table, "a refused _append_slot changes nothing"
    waiting = make_seq(s, 2, 3)
    with pytest.raises(ValueError):
        s._append_slot(waiting, out)  # holds no blocks: append_slot's ValueError goes through
    assert out.blocks_to_copy == {}, "no copy on write happened"


def test_part2_copies_on_write_go_into_blocks_to_copy():
    s = make_scheduler()
    a = make_seq(s, 0, 5)
    step(s)  # 6 tokens in 2 blocks, the last one half full
    for seq_id in (1, 2):  # two parallel samples, made by hand: they share a's blocks
        child = Sequence(seq_id, a.token_ids, 4, SamplingParams(max_tokens=16), seq_id)
        s.block_manager.fork(a, child)
        child.status, child.num_computed_tokens, child.is_prefill = SequenceStatus.RUNNING, 5, False
        s.running.append(child)
    b, c = s.running[1:]
    shared = a.block_table[-1]
    out = s.schedule()
    expected = {shared: [a.block_table[-1], b.block_table[-1]]}
    assert out.blocks_to_copy == expected, (
        f"a and b write their newest token into shared block {shared}: each gets a copy, and "
        f"blocks_to_copy lists both as {{src: [dst, dst]}}: expected {expected}, got "
        f"{out.blocks_to_copy}"
    )
    assert c.block_table[-1] == shared, "c then holds the block alone and writes it in place"


def test_part2_after_a_recompute_a_chunk_short_of_the_generated_tokens_yields_nothing():
    s = chunked()
    seq = make_seq(s, 0, 7)
    out = s.schedule()
    s.postprocess(out.scheduled, [TOKEN])  # 8 tokens: 7 prompt + 1 generated
    seq.num_computed_tokens, seq.is_prefill = 0, True  # as a recompute leaves it (part 2.3)
    s.postprocess([ScheduledSequence(seq, 7, is_prefill=True)], [TOKEN])
    assert (seq.num_tokens, seq.num_computed_tokens, seq.is_prefill) == (8, 7, True), (
        "a chunk that covers the prompt but not the generated token stops short of the end: no "
        f"token, still in its prefill; got {seq.num_tokens} tokens, {seq.num_computed_tokens} "
        f"computed, is_prefill={seq.is_prefill}"
    )
    s.postprocess([ScheduledSequence(seq, 1, is_prefill=True)], [TOKEN])
    assert (seq.num_tokens, seq.num_computed_tokens, seq.is_prefill) == (9, 8, False), (
        "the chunk that computes the last (generated) token ends the prefill and appends the "
        f"sampled token: expected 9 tokens, 8 computed, is_prefill=False; got {seq.num_tokens} "
        f"tokens, {seq.num_computed_tokens} computed, is_prefill={seq.is_prefill}"
    )


def test_part2_decodes_come_before_an_older_prefill(monkeypatch):
    s = chunked()
    young = make_seq(s, 0, 4, arrival=5.0)
    old = make_seq(s, 1, 40, arrival=1.0)  # added second, but arrived first
    step(s)  # young: 4 tokens; old: 12 of 40
    assert ids(s.running) == [1, 0], (
        "running is kept in arrival order (1 arrived at 1.0, 0 at 5.0), not in add order: "
        f"expected [1, 0], got {ids(s.running)}"
    )
    assert old.is_prefill, (
        "the 40-token prompt, admitted with a chunk of 12, is still in its prefill: expected "
        f"is_prefill=True, got {old.is_prefill} ({old.num_computed_tokens} computed)"
    )
    assert not young.is_prefill, (
        "the 4-token prompt computed all its tokens: its prefill ended (is_prefill=False), got "
        f"{young.is_prefill}"
    )
    calls = []
    monkeypatch.setattr(
        s,
        "_schedule_prefill_chunks",
        lambda seqs, out, budget: calls.append((ids(seqs), planned(out))),
    )
    out = s.schedule()
    assert calls == [([1], [(0, 1, False)])], (
        "every decode is scheduled before the prefills are passed on, even when the prefill "
        f"is the older sequence: (prefills, decodes so far) at the call, got {calls}"
    )
    assert planned(out) == [(0, 1, False)], (
        "with _schedule_prefill_chunks replaced by a stand-in that schedules nothing, the step "
        f"holds the decode of 0 only: expected [(0, 1, False)], got {planned(out)}"
    )
    s = chunked()
    seq = make_seq(s, 0, 20)
    out = s.schedule()  # admitted with a chunk of 16
    s.postprocess(out.scheduled, [TOKEN])
    assert (seq.is_prefill, seq.num_computed_tokens, seq.num_tokens) == (True, 16, 20), (
        "a chunk that stops short of the end computes its tokens, yields no token and the "
        f"sequence stays in its prefill; got is_prefill={seq.is_prefill}, computed "
        f"{seq.num_computed_tokens}, tokens {seq.num_tokens}"
    )
    s.postprocess([ScheduledSequence(seq, 4, is_prefill=True)], [TOKEN])
    assert (seq.is_prefill, seq.num_computed_tokens, seq.num_tokens) == (False, 20, 21), (
        "the chunk that computes the last token ends the prefill (is_prefill = False) and "
        f"appends the sampled token; got is_prefill={seq.is_prefill}, computed "
        f"{seq.num_computed_tokens}, tokens {seq.num_tokens}"
    )


def test_part2_sequences_in_their_prefill_are_passed_on_not_decoded(monkeypatch):
    s = chunked()
    make_seq(s, 0, 4, max_tokens=30)
    step(s)  # sequence 0 is decoding
    late = make_seq(s, 1, 16)
    step(s)  # 0 decodes; 1 is admitted with a chunk of 15: one prompt token left
    assert late.is_prefill, (
        "admitted with a chunk of 15 of its 16 tokens, it is still in its prefill: expected "
        f"is_prefill=True, got {late.is_prefill}"
    )
    assert late.num_tokens - late.num_computed_tokens == 1, (
        "the chunk of 15 leaves one prompt token to compute: expected 16 tokens, 15 computed; "
        f"got {late.num_tokens} tokens, {late.num_computed_tokens} computed"
    )
    passed = []
    monkeypatch.setattr(
        s, "_schedule_prefill_chunks", lambda seqs, out, budget: passed.append(list(seqs))
    )
    out = s.schedule()
    assert planned(out) == [(0, 1, False)], (
        "a running sequence in its prefill is not decoded, even with one prompt token left; "
        f"got {planned(out)}"
    )
    assert passed == [[late]], (
        f"it goes to _schedule_prefill_chunks after the decodes, got {passed}"
    )
    assert ids(s.running) == [0, 1], "it stays in running"


def test_part2_a_step_decodes_every_sequence_exactly_once_and_charges_one_token_each():
    s = make_scheduler(max_num_batched_tokens=64)
    for i in range(3):
        make_seq(s, i, 5)
    step(s)
    out = s.schedule()
    assert planned(out) == [(0, 1, False), (1, 1, False), (2, 1, False)], (
        "every running sequence, oldest first, is scheduled exactly once as a decode of one "
        f"token; got {planned(out)} as (id, tokens, prefill)"
    )
    assert out.num_batched_tokens == 3, (
        f"a decode charges one token: 3 decodes make 3 tokens, got {out.num_batched_tokens}"
    )
    assert out.kind == "decode", f"a step of decodes only is a decode step, got {out.kind!r}"
    assert out.num_prefills == 0, (
        "a sequence whose prefill has ended is a decode, not a prefill: 0 prefills expected, "
        f"got {out.num_prefills}"
    )


def test_part2_postprocess_with_a_token_count_mismatch_raises_and_changes_nothing():
    s = make_scheduler()
    seq = make_seq(s, 0, 4)
    out = s.schedule()
    with pytest.raises(ValueError, match=r"\bpostprocess got 0 tokens for 1 sequences\b"):
        s.postprocess(out.scheduled, [])
    assert seq.num_tokens == 4 and seq.num_computed_tokens == 0, (
        "a postprocess that raises ValueError changes nothing: expected 4 tokens, 0 computed; "
        f"got {seq.num_tokens} tokens, {seq.num_computed_tokens} computed"
    )


def test_part2_a_step_with_nothing_to_run_is_idle():
    s = make_scheduler()
    make_seq(s, 0, 4, max_tokens=1)
    step(s)  # the prefill yields its only token: finished
    out = s.schedule()
    assert (out.kind, out.scheduled) == ("idle", []), (
        f"with every sequence finished a step runs nothing: kind 'idle', got {out.kind!r}"
    )


def test_part2_a_short_chunk_in_the_middle_of_a_batch_does_not_stop_postprocess():
    s = chunked()
    short, full = make_seq(s, 0, 10), make_seq(s, 1, 3)
    s.schedule()  # both admitted: short with all 10, full with 3 (planned by hand below)
    s.postprocess(
        [ScheduledSequence(short, 4, is_prefill=True), ScheduledSequence(full, 3, True)],
        [TOKEN, TOKEN],
    )
    assert (short.num_computed_tokens, short.num_tokens) == (4, 10), (
        "a chunk that stops short computes its tokens and yields none: 4 computed of 10, got "
        f"{short.num_computed_tokens} of {short.num_tokens}"
    )
    assert (full.num_computed_tokens, full.num_tokens) == (3, 4), (
        "the sequences after a short chunk are postprocessed too: the 3-token prompt gets its "
        f"token; got {full.num_computed_tokens} computed of {full.num_tokens}"
    )


def test_part2_a_decode_takes_no_new_sequence_place(monkeypatch):
    s = chunked(max_num_seqs=2)
    make_seq(s, 0, 4, max_tokens=20)
    step(s)  # 0 decodes from now on: it holds one of the 2 places
    late = make_seq(s, 1, 4)
    out = s.schedule()
    assert planned(out) == [(0, 1, False), (1, 4, True)], (
        "the running sequences are counted once, at the start of the step: a decode spends a "
        f"token, not a place, so the second place admits sequence 1; got {planned(out)}"
    )
    assert late.status is SequenceStatus.RUNNING


def test_part2_a_sequence_aborted_mid_step_is_skipped_by_postprocess():
    s = make_scheduler()
    make_seq(s, 0, 4)
    keep = make_seq(s, 1, 4)
    out = s.schedule()
    gone = s.abort(0)
    s.postprocess(out.scheduled, [TOKEN, TOKEN])
    assert gone.num_tokens == 4, (
        "postprocess skips a sequence aborted since schedule: it takes no token; expected 4 "
        f"tokens, got {gone.num_tokens}"
    )
    assert gone.status is SequenceStatus.FINISHED_ABORTED, (
        f"an aborted sequence stays FINISHED_ABORTED through postprocess, got {gone.status.name}"
    )
    assert keep.num_tokens == 5, (
        "the other sequence of the step gets its sampled token: expected 5 tokens, got "
        f"{keep.num_tokens}"
    )
    assert ids(s.running) == [1], (
        f"only the sequence that was not aborted is running: expected [1], got {ids(s.running)}"
    )


def test_part2_all_requests_finish_with_their_full_output():
    config = Config(block_size=4, num_gpu_blocks=256, max_model_len=64, max_num_seqs=4)
    requests = [Request(0.0, 3 + 5 * i % 17, 1 + 7 * i % 13) for i in range(12)]
    result = simulate(config, requests)
    assert len(result.finished) == 12, (
        f"all 12 requests must finish, {len(result.finished)} did: {sorted(ids(result.finished))}"
    )
    assert result.num_preemptions == 0, (
        "a pool of 256 blocks holds every request at once: no preemption expected, got "
        f"{result.num_preemptions}"
    )
    by_id = {seq.seq_id: seq for seq in result.finished}
    assert [by_id[i].num_completion_tokens for i in range(12)] == [
        r.output_len for r in requests
    ], (
        "every request generates exactly its max_tokens: completion tokens by request id "
        "(left) vs the requested output lengths (right)"
    )
    assert max(step.num_running for step in result.steps) == 4, (
        "continuous batching fills the max_num_seqs=4 places, and never more: the fullest step "
        f"runs 4, got {max(step.num_running for step in result.steps)}"
    )


def with_a_group(mode: str = "auto", **overrides) -> tuple[Scheduler, Sequence, Sequence, Sequence]:
    """An old sequence (0, 8 tokens) and a request of two parallel samples (1, 6 tokens, n = 2,
    forked into 2 after its prefill) fill a pool of 4 blocks; the old one needs a block next."""
    options = {"num_gpu_blocks": 4, "num_cpu_blocks": 8, "preemption_mode": mode}
    s = make_scheduler(**{**options, **overrides})
    old = make_seq(s, 0, 8, max_tokens=8)
    parent = Sequence(1, [110 + i for i in range(6)], 4, SamplingParams(max_tokens=8, n=2), 1.0)
    s.add(parent)
    step(s)  # prefills: 0 holds 2 blocks (9 tokens now), 1 holds 2 (7 tokens now)
    child = Sequence(2, parent.prompt_token_ids, 4, SamplingParams(max_tokens=8))
    child.append_token(TOKEN + 1)  # its own first token, sampled from the parent's logits
    s.fork(parent, child)  # given: 2 shares 1's blocks, joins its group and running
    assert ids(s.running) == [0, 1, 2] and s.block_manager.num_free_gpu_blocks == 0, (
        "setup (parts 2.1, 2.2): 0, then the group [1, 2], fill the pool of 4; got running "
        f"{ids(s.running)}, {s.block_manager.num_free_gpu_blocks} free"
    )
    return s, old, parent, child


def test_part2_the_newest_group_is_preempted_together(monkeypatch):
    s, _, _parent, _child = with_a_group()
    victims, preempt = stand_in_preempt(s)
    monkeypatch.setattr(s, "_preempt", preempt)
    out = s.schedule()
    assert victims == [[1, 2]], (
        "0 needs a block: the newest group, the parallel samples 1 and 2 (same group_id), is "
        f"preempted in one _preempt call, in arrival order; _preempt got {victims}, "
        "expected [[1, 2]] (_pop_newest_group takes it from the back of the queue)"
    )
    assert planned(out) == [(0, 1, False)], f"0 then decodes alone, got {planned(out)}"


def test_part2_fork_adds_a_running_sample_after_its_parent():
    s, _, parent, child = with_a_group()
    assert child.status is SequenceStatus.RUNNING and ids(s.running) == [0, 1, 2], (
        f"fork (given) makes the child RUNNING, after its parent; got {child.status.name}, "
        f"running {ids(s.running)}"
    )
    assert (child.group_id, child.num_computed_tokens, child.is_prefill) == (1, 6, False)
    assert child.block_table == parent.block_table


def test_part2_fork_refuses_a_parent_that_is_not_running_or_a_child_that_does_not_fit():
    s, _old, parent, _ = with_a_group()
    waiting = make_seq(s, 7, 3)
    with pytest.raises(ValueError, match=r"^fork: sequence 7 is not running here$"):
        s.fork(waiting, Sequence(8, waiting.token_ids, 4))
    for tokens in (parent.token_ids[:6], [*parent.token_ids[:6], 1, 2], [9] * 7):
        with pytest.raises(ValueError, match=r"^fork: sequence 9 must hold the 6 computed tokens"):
            s.fork(parent, Sequence(9, tokens, 4))
    c = chunked(num_gpu_blocks=16, max_num_batched_tokens=16)
    long = make_seq(c, 0, 40)
    c.schedule()
    with pytest.raises(ValueError, match=r"^fork: sequence 3 must hold"):
        c.fork(long, Sequence(3, long.token_ids[:17], 4))


def test_part3_a_recomputed_sample_takes_one_place_again():
    s, old, _parent, _child = with_a_group("recompute")
    s.schedule()  # the group is recomputed: both wait, with their tokens
    s.abort(old.seq_id)
    s.config.max_num_seqs = 2
    s.schedule()
    assert ids(s.running) == [1, 2], (
        "a parent that has sampled (num_completion_tokens > 0) was forked already: admitted "
        f"again it takes one place (_seats), so both fit 2 places; got running {ids(s.running)}"
    )


# --------------------------------------------------------------------------------------------
# Part 2.3: preemption by recompute
# --------------------------------------------------------------------------------------------


def full_pool_of_two(mode: str = "recompute", **overrides) -> tuple[Scheduler, Sequence, Sequence]:
    """Two running sequences whose blocks fill a pool of 4; both need a new block next."""
    s = make_scheduler(num_gpu_blocks=4, preemption_mode=mode, **overrides)
    old, new = make_seq(s, 0, 7, max_tokens=8), make_seq(s, 1, 7, max_tokens=8)
    step(s)  # prefill both: 2 blocks each, now 8 tokens each
    step(s)  # decode token 8: fits; sampled token 9 needs a new block
    assert s.block_manager.num_free_gpu_blocks == 0, (
        "setup (parts 2.1, 2.2): two sequences of 8 tokens hold 2 blocks each of the pool of 4: "
        f"0 free expected, got {s.block_manager.num_free_gpu_blocks}"
    )
    return s, old, new


def test_part3_the_newest_running_sequence_is_preempted_by_recompute():
    s, _, new = full_pool_of_two()
    out = s.schedule()
    assert out.preempted == [new], (
        "when blocks run out, the newest running sequence (1) goes: expected preempted [1], got "
        f"{ids(out.preempted)}"
    )
    assert planned(out) == [(0, 1, False)], (
        f"the oldest goes on decoding: expected [(0, 1, False)], got {planned(out)}"
    )
    assert new.status is SequenceStatus.WAITING, (
        f"a sequence preempted by recompute goes back to WAITING, got {new.status.name}"
    )
    assert s.waiting[0] is new, (
        "a sequence preempted by recompute goes to the front of waiting: expected 1 first, got "
        f"waiting {ids(s.waiting)}"
    )
    assert new.block_table == [], (
        f"recompute frees all the victim's blocks, got block table {new.block_table}"
    )
    assert new.num_computed_tokens == 0, (
        "recompute drops the victim's K/V: num_computed_tokens back to 0, got "
        f"{new.num_computed_tokens}"
    )
    assert new.num_tokens == 9, (
        "recompute keeps the generated tokens, only the K/V are lost: expected 9 tokens, got "
        f"{new.num_tokens}"
    )
    assert s.num_preemptions == 1, (
        f"each preemption is counted in num_preemptions: 1 expected, got {s.num_preemptions}"
    )
    assert ids(s.running) == [0], (
        f"the preempted sequence leaves running: expected [0], got {ids(s.running)}"
    )


def test_part3_a_preempted_sequence_waits_in_front_of_new_requests():
    s, _, new = full_pool_of_two()
    newcomer = make_seq(s, 7, 4)  # no block is free for it: it waits
    out = s.schedule()
    assert out.preempted == [new], (
        "0 needs a block and none is free: the newest running sequence (1) is preempted; got "
        f"preempted {ids(out.preempted)}"
    )
    assert list(s.waiting) == [new, newcomer], (
        "a preempted sequence goes to the front of waiting: it arrived before the newcomer; "
        f"expected [1, 7], got {ids(s.waiting)}"
    )


def test_part3_a_sequence_preempts_itself_when_it_is_the_newest():
    s = make_scheduler(num_gpu_blocks=4, preemption_mode="recompute")
    make_seq(s, 0, 8, max_tokens=6)
    new = make_seq(s, 1, 7, max_tokens=6)
    step(s)  # seq 0: 8 tokens -> 9 (needs block 3), new: 7 -> 8 (fits)
    out = s.schedule()
    assert out.preempted == [new], (
        "sequence 0 needs a block: the newest running sequence (1) is preempted instead; got "
        f"preempted {ids(out.preempted)}"
    )
    assert ids(out.seqs) == [0], (
        "a preempted sequence is not scheduled in that step: only 0 decodes; expected [0], got "
        f"{ids(out.seqs)}"
    )
    s.postprocess(out.scheduled, [TOKEN])
    s2 = make_scheduler(num_gpu_blocks=4, preemption_mode="recompute")
    make_seq(s2, 0, 7, max_tokens=6)
    b = make_seq(s2, 1, 8, max_tokens=6)
    step(s2)  # seq 0: 8 tokens (fits), b: 9 tokens (needs a block, none free)
    out = s2.schedule()
    assert out.preempted == [b], (
        "b is the newest: with no one newer to preempt, it preempts itself; expected preempted "
        f"[1], got {ids(out.preempted)}"
    )
    assert ids(out.seqs) == [0], (
        "a sequence that preempted itself is not scheduled: only 0 decodes; expected [0], got "
        f"{ids(out.seqs)}"
    )


def test_part3_a_preempted_sequence_is_recomputed_and_finishes_correctly():
    s, old, new = full_pool_of_two()
    for _ in range(200):
        if s.is_finished():
            break
        out = step(s)
        assert not out.blocks_to_swap_out, (
            f"recompute mode never swaps, got blocks_to_swap_out {out.blocks_to_swap_out}"
        )
    assert s.is_finished(), (
        "both sequences finish within 200 steps (no starvation or livelock): got waiting "
        f"{ids(s.waiting)}, running {ids(s.running)}, swapped {ids(s.swapped)}"
    )
    for seq in (old, new):
        assert seq.status is SequenceStatus.FINISHED_LENGTH_CAPPED, (
            f"sequence {seq.seq_id} runs to max_tokens=8: FINISHED_LENGTH_CAPPED expected, got "
            f"{seq.status.name}"
        )
        assert seq.num_completion_tokens == 8, (
            f"sequence {seq.seq_id} lost tokens: a preemption by recompute keeps the generated "
            f"tokens; expected 8, got {seq.num_completion_tokens}"
        )


def test_part3_recompute_prefills_prompt_and_generated_tokens():
    s, _, new = full_pool_of_two()
    step(s)  # preempts new, which holds 9 tokens: 7 prompt + 2 generated
    for _ in range(50):
        out = s.schedule()
        if new in out.seqs:
            break
        s.postprocess(out.scheduled, [TOKEN] * len(out.scheduled))
    item = next(item for item in out.scheduled if item.seq is new)
    assert (item.num_tokens, item.is_prefill) == (9, True), (
        f"re-admitted, it prefills all 9 tokens (prompt and generated); "
        f"got {item.num_tokens} tokens, prefill={item.is_prefill}"
    )


def test_part3_a_sequence_preempted_by_recompute_starts_a_new_prefill():
    s, _, new = full_pool_of_two()
    assert not new.is_prefill, (
        "setup (part 2.2): a decoding sequence has ended its prefill: expected is_prefill=False, "
        f"got {new.is_prefill}"
    )
    s.schedule()
    assert new.is_prefill and new.num_computed_tokens == 0, (
        "after a preemption by recompute the sequence is in its prefill again (is_prefill True, "
        f"nothing computed); got is_prefill={new.is_prefill}, computed {new.num_computed_tokens}"
    )


def test_part3_preemptions_are_counted_one_by_one():
    s = make_scheduler(num_gpu_blocks=8, preemption_mode="recompute")
    seqs = [make_seq(s, i, 8, max_tokens=8) for i in range(4)]  # 2 blocks each: the pool is full
    step(s)
    out = s.schedule()  # each needs a third block: 3 is preempted, then 2 preempts itself
    assert out.preempted == [seqs[3], seqs[2]], (
        "0 needs a block: the newest (3) is preempted; 2 is then the newest left and preempts "
        f"itself: expected preempted [3, 2], got {ids(out.preempted)}"
    )
    assert s.num_preemptions == 2, (
        f"two sequences were preempted in this step: num_preemptions 2, got {s.num_preemptions}"
    )
    s.postprocess(out.scheduled, [TOKEN] * len(out.scheduled))
    outs = run_to_the_end(s, max_steps=100)
    total = 2 + sum(len(out.preempted) for out in outs)
    assert s.num_preemptions == total, (
        f"num_preemptions counts every preemption: {total} in all, got {s.num_preemptions}"
    )


def test_part3_a_sequence_that_outgrew_the_pool_is_ignored_and_the_next_runs():
    check_outgrown_is_ignored_and_the_small_one_runs(*outgrowing_then_small("recompute"))


def test_part3_a_swap_without_room_falls_back_to_recompute(monkeypatch):
    s, _, new = full_pool_of_two(mode="swap", num_cpu_blocks=8)
    monkeypatch.setattr(s, "_preempt_by_swap", lambda seqs, out: False)  # as if the CPU is full
    out = s.schedule()
    assert out.preempted == [new], (
        "the victim is the newest running sequence (1), recorded in out.preempted even when "
        f"its swap fails; got preempted {ids(out.preempted)}"
    )
    assert new.status is SequenceStatus.WAITING, (
        "when _preempt_by_swap says False, _preempt recomputes instead: the victim waits, "
        f"got {new.status.name}"
    )
    assert new.block_table == [], (
        f"the recompute frees the victim's blocks, got block table {new.block_table}"
    )
    assert s.waiting[0] is new, (
        "the recomputed victim goes to the front of waiting: expected 1 first, got waiting "
        f"{ids(s.waiting)}"
    )
    assert s.num_preemptions == 1, (
        "a fallback to recompute is one preemption, counted once: expected 1, got "
        f"{s.num_preemptions}"
    )


def test_part3_auto_mode_recomputes_single_sequences():
    s, _, new = full_pool_of_two(mode="auto", num_cpu_blocks=16)
    out = s.schedule()
    assert out.preempted == [new], (
        "0 needs a block and none is free: the newest running sequence (1) is preempted; got "
        f"preempted {ids(out.preempted)}"
    )
    assert not out.blocks_to_swap_out, (
        "auto mode recomputes single sequences: nothing is swapped out, got blocks_to_swap_out "
        f"{out.blocks_to_swap_out}"
    )
    assert new.status is SequenceStatus.WAITING, (
        f"auto mode recomputes: the victim goes back to WAITING, got {new.status.name}"
    )


def stand_in_swap(s: Scheduler, monkeypatch) -> list[list[int]]:
    """A stand-in for part 2.4's ``_preempt_by_swap`` that refuses every swap, recording what
    it was asked to swap (so that part 2.3 is tested on its own)."""
    asked: list[list[int]] = []

    def refuse(seqs: list[Sequence], out: SchedulerOutput) -> bool:
        asked.append(ids(seqs))
        return False

    monkeypatch.setattr(s, "_preempt_by_swap", refuse)
    return asked


def test_part3_auto_mode_swaps_a_group_of_parallel_samples_together(monkeypatch):
    s, _, parent, child = with_a_group("auto")
    asked = stand_in_swap(s, monkeypatch)
    out = s.schedule()
    assert asked == [[1, 2]], (
        "auto swaps a group of more than one sequence, the group in one _preempt_by_swap call "
        f"(vLLM v0: its shared blocks are kept once); _preempt_by_swap got {asked}"
    )
    assert out.preempted == [parent, child] and s.num_preemptions == 2, (
        "both are recorded, in order, and counted one by one: expected preempted [1, 2] and 2 "
        f"preemptions, got {ids(out.preempted)} and {s.num_preemptions}"
    )
    assert [parent.status, child.status] == [SequenceStatus.WAITING] * 2, (
        "the swap was refused (the stand-in says False): both are recomputed, got "
        f"{parent.status.name} and {child.status.name}"
    )


def test_part3_a_group_preempted_by_recompute_waits_in_order_and_leaves_its_group():
    s, _old, parent, child = with_a_group("recompute")
    s.schedule()
    assert ids(s.waiting)[:2] == [1, 2], (
        "each sequence of the group is recomputed, and waiting starts with the group in "
        f"arrival order: expected [1, 2, ...], got {ids(s.waiting)}"
    )
    assert (parent.group_id, child.group_id) == (1, 2), (
        "a sequence preempted by recompute shares no block any more: it leaves its group "
        f"(group_id = seq_id), got group ids {parent.group_id} and {child.group_id}"
    )
    assert s.num_preemptions == 2, f"two preemptions, got {s.num_preemptions}"


def test_part3_everything_finishes_under_memory_pressure():
    config = Config(
        block_size=4,
        num_gpu_blocks=20,
        max_model_len=64,
        max_num_seqs=8,
        watermark=0.0,
        preemption_mode="recompute",
    )
    requests = [Request(0.0, 10 + i % 7, 20 + 3 * i % 11) for i in range(10)]
    result = simulate(config, requests)
    assert result.num_preemptions > 0, "this pool is too small for all to run: expect preemption"
    by_id = {seq.seq_id: seq for seq in result.finished}
    assert [by_id[i].num_completion_tokens for i in range(10)] == [
        r.output_len for r in requests
    ], (
        "every request finishes with its whole output, preempted or not (recompute keeps the "
        "generated tokens): completion tokens by request id (left) vs output lengths (right)"
    )


# --------------------------------------------------------------------------------------------
# Part 2.4: preemption by swap
# --------------------------------------------------------------------------------------------


def test_part4_swap_mode_moves_the_newest_sequence_to_the_cpu():
    s, _, new = full_pool_of_two(mode="swap", num_cpu_blocks=8)
    gpu_blocks = list(new.block_table)
    out = s.schedule()
    assert out.preempted == [new], (
        "0 needs a block and none is free: the newest running sequence (1) is preempted; got "
        f"preempted {ids(out.preempted)}"
    )
    assert sorted(out.blocks_to_swap_out) == sorted(gpu_blocks), (
        f"blocks_to_swap_out maps each of its GPU blocks {sorted(gpu_blocks)} to a CPU block, "
        f"got {out.blocks_to_swap_out}"
    )
    assert new.status is SequenceStatus.SWAPPED, (
        f"a sequence preempted by swap becomes SWAPPED, got {new.status.name}"
    )
    assert ids(s.swapped) == [1], (
        f"a sequence preempted by swap joins swapped: expected [1], got {ids(s.swapped)}"
    )
    assert s.block_manager.device_of(new) is Device.CPU, (
        f"a swapped sequence's blocks are in the CPU pool, got {s.block_manager.device_of(new)}"
    )
    assert new.num_computed_tokens == 8, (
        "a swapped sequence keeps its computed K/V: 8 computed expected, got "
        f"{new.num_computed_tokens}"
    )


def test_part4_swapped_sequences_come_back_before_new_prompts():
    s, _, new = full_pool_of_two(mode="swap", num_cpu_blocks=8, max_model_len=64)
    s.schedule()  # new is swapped out
    s.postprocess([], [])
    s.abort(0)  # the old one leaves: room for everyone
    newcomer = make_seq(s, 5, 4)
    out = s.schedule()
    assert new.status is SequenceStatus.RUNNING, (
        "with the old sequence gone there is room: the swapped sequence comes back first "
        f"(RUNNING), got {new.status.name}"
    )
    assert ids(out.seqs) == [1], (
        "while a sequence is swapped out, no new prompt is admitted, and a swapped-in sequence "
        f"decodes in the step that brings it back: expected [1], got {ids(out.seqs)}"
    )
    assert sorted(out.blocks_to_swap_in.values()) == sorted(new.block_table[:2]), (
        "blocks_to_swap_in maps its 2 CPU blocks to the GPU blocks its table now starts with: "
        f"got {out.blocks_to_swap_in}, block table {new.block_table}"
    )
    assert newcomer.status is SequenceStatus.WAITING, (
        "while a sequence is swapped out, no new prompt is admitted: the newcomer stays "
        f"WAITING, got {newcomer.status.name}"
    )
    assert not out.blocks_to_swap_out, (
        f"a step never swaps in and out at once, got blocks_to_swap_out {out.blocks_to_swap_out}"
    )


def test_part4_swap_in_is_first_come_first_served():
    s = make_scheduler(num_gpu_blocks=8, num_cpu_blocks=12, preemption_mode="swap")
    # 2 blocks each: the pool is full; sequence 0 finishes at its third token
    seqs = [make_seq(s, i, 7, max_tokens=3 if i == 0 else 8) for i in range(4)]
    step(s)
    step(s)
    out = s.schedule()  # each needs a third block: 3 goes, then 2 (the newest left) goes
    assert out.preempted == [seqs[3], seqs[2]], (
        "victims are the newest running sequences: 3, then 2 (the newest left); expected "
        f"preempted [3, 2], got {ids(out.preempted)}"
    )
    assert ids(s.swapped) == [2, 3], (
        "swapped stays in arrival order, not in the order of preemption: expected [2, 3], got "
        f"{ids(s.swapped)}"
    )
    s.postprocess(out.scheduled, [TOKEN] * len(out.scheduled))
    assert s.block_manager.num_free_gpu_blocks == 5, (
        "room for one of the two to come back with a block for its newest token (2 + 1): "
        f"sequence 0 finished and freed its blocks, 5 free expected, got "
        f"{s.block_manager.num_free_gpu_blocks}"
    )
    out = s.schedule()
    assert seqs[2].status is SequenceStatus.RUNNING, (
        "the oldest swapped sequence (2) comes back first: expected RUNNING, got "
        f"{seqs[2].status.name}"
    )
    assert ids(s.swapped) == [3], (
        "the other swapped sequence waits (LATER) at the front of swapped: expected [3], got "
        f"{ids(s.swapped)}"
    )
    assert planned(out) == [(1, 1, False), (2, 1, False)], (
        f"the swapped-in sequence decodes in the step that brings it back, got {planned(out)}"
    )


def test_part4_a_sequence_that_outgrew_the_pool_is_ignored_when_swapped_not_livelocked():
    check_outgrown_is_ignored_and_the_small_one_runs(*outgrowing_then_small("swap"))


def test_part4_a_never_fitting_swapped_sequence_does_not_block_the_next_one():
    s = make_scheduler(num_gpu_blocks=4, num_cpu_blocks=8, preemption_mode="swap")
    old, new = make_seq(s, 0, 12, max_tokens=8, ignore_eos=True), make_seq(s, 1, 4)
    step(s)  # old: 3 blocks, 13 tokens; new: 1 block, 5 tokens
    out = s.schedule()  # old needs a 4th block: new is swapped out
    assert out.preempted == [new], (
        "old needs a 4th block and none is free: the newest running sequence (1) is swapped "
        f"out; got preempted {ids(out.preempted)}"
    )
    s.postprocess(out.scheduled, [TOKEN])
    for _ in range(8):  # old decodes until its 17th token needs a 5th block: it swaps itself out
        if old in step(s).preempted:
            break
    assert ids(s.swapped) == [0, 1], (
        "old outgrows the pool and preempts itself by swap; swapped is in arrival order: "
        f"expected [0, 1], got {ids(s.swapped)}"
    )
    out = s.schedule()
    assert [i.seq for i in out.ignored] == [old], (
        "the oldest swapped sequence needs 4 blocks + 1 for its newest token > 4: NEVER, "
        f"ignored; expected out.ignored [0], got {ids(i.seq for i in out.ignored)}"
    )
    assert planned(out) == [(1, 1, False)], (
        f"the next swapped sequence comes back in the same step, got {planned(out)}"
    )
    assert new.status is SequenceStatus.RUNNING, (
        f"the swapped-in sequence is RUNNING again, got {new.status.name}"
    )


def test_part4_a_prefill_swapped_out_midway_comes_back_as_a_prefill_chunk():
    s = chunked(
        num_gpu_blocks=5, num_cpu_blocks=8, preemption_mode="swap", max_num_batched_tokens=8
    )
    make_seq(s, 0, 7, max_tokens=3)
    step(s)  # first: 8 tokens, 2 blocks
    late = make_seq(s, 1, 12)
    step(s)  # first decodes; late is admitted (3 blocks) with a chunk of 7
    out = s.schedule()  # first needs a third block: late, mid-prefill, is swapped out
    assert out.preempted == [late], (
        "the first sequence needs a third block: the newest running sequence (1) is preempted; "
        f"got preempted {ids(out.preempted)}"
    )
    assert late.status is SequenceStatus.SWAPPED, (
        "in swap mode a sequence is swapped out even in the middle of its prefill: expected "
        f"SWAPPED, got {late.status.name}"
    )
    s.postprocess(out.scheduled, [TOKEN] * len(out.scheduled))  # first finishes
    out = s.schedule()
    assert planned(out) == [(1, 5, True)], (
        "a sequence swapped out in its prefill comes back as a prefill of its next chunk "
        f"(the 5 tokens left), in the same step; got {planned(out)}"
    )
    assert out.kind == "prefill", (
        f"a swapped-in prefill chunk is a prefill: a prefill step, got kind {out.kind!r}"
    )
    assert late.num_computed_tokens <= late.num_tokens, (
        "a sequence never has more computed tokens than tokens: got "
        f"{late.num_computed_tokens} computed of {late.num_tokens}"
    )


def test_part4_a_swapped_in_prefill_chunk_is_cut_to_the_budget():
    s = chunked(
        num_gpu_blocks=6, num_cpu_blocks=8, preemption_mode="swap", max_num_batched_tokens=8
    )
    make_seq(s, 0, 7, max_tokens=3)
    step(s)  # 8 tokens, 2 blocks
    late = make_seq(s, 1, 16)
    step(s)  # 0 decodes; late is admitted (4 blocks) with a chunk of 7
    out = s.schedule()  # 0 needs a third block: late is swapped out in its prefill
    assert out.preempted == [late], (
        "0 needs a third block: the newest running sequence (1), in its prefill, is swapped "
        f"out; got preempted {ids(out.preempted)}"
    )
    s.postprocess(out.scheduled, [TOKEN] * len(out.scheduled))  # 0 finishes
    newcomer = make_seq(s, 2, 4)
    out = s.schedule()
    assert newcomer.status is SequenceStatus.WAITING, (
        "the swapped-in chunk spent the whole budget: nothing is left to admit a prompt with"
    )
    assert planned(out) == [(1, 8, True)], (
        "9 prompt tokens are left and the budget is 8: the swapped-in prefill gets a chunk of "
        f"8, got {planned(out)}"
    )
    assert out.num_batched_tokens == 8, (
        f"the step fills the token budget of 8 and never exceeds it, got {out.num_batched_tokens}"
    )


def test_part4_aborting_a_swapped_sequence_frees_its_cpu_blocks():
    s, _, new = full_pool_of_two(mode="swap", num_cpu_blocks=8)
    step(s)
    assert new.status is SequenceStatus.SWAPPED, (
        "0 needs a block and none is free: in swap mode the newest (1) is swapped out; expected "
        f"SWAPPED, got {new.status.name}"
    )
    assert s.abort(1) is new, "abort(seq_id) returns the sequence it finished"
    assert new.status is SequenceStatus.FINISHED_ABORTED, (
        f"abort finishes a swapped sequence as FINISHED_ABORTED, got {new.status.name}"
    )
    assert new.block_table == [] and s.block_manager.num_free_cpu_blocks == 8, (
        "an aborted swapped sequence's CPU blocks are freed at once: got block table "
        f"{new.block_table}, {s.block_manager.num_free_cpu_blocks} of 8 CPU blocks free"
    )
    assert s.swapped == [], f"abort takes it out of swapped, got swapped {ids(s.swapped)}"
    assert s.num_unfinished == 1, (
        f"only sequence 0 is left unfinished, got {s.num_unfinished} unfinished (waiting "
        f"{ids(s.waiting)}, running {ids(s.running)})"
    )


def test_part4_no_swap_in_when_the_token_budget_is_spent(monkeypatch):
    s = chunked(num_gpu_blocks=16, num_cpu_blocks=8, preemption_mode="swap")
    back = make_seq(s, 0, 4)
    make_seq(s, 1, 40)
    out = s.schedule()  # back: 4 tokens; prefill: 12 of 40
    s.postprocess(out.scheduled, [TOKEN, TOKEN])
    s.running.remove(back)  # swapped out by hand
    s.block_manager.swap_out([back])
    back.status = SequenceStatus.SWAPPED
    s.swapped.append(back)

    def spend_the_budget(seqs, out, budget):  # a stand-in for part 2.5
        for seq in seqs:
            out.scheduled.append(ScheduledSequence(seq, budget.remaining_tokens, True))
            budget.add(budget.remaining_tokens, 0)

    monkeypatch.setattr(s, "_schedule_prefill_chunks", spend_the_budget)
    out = s.schedule()
    assert back.status is SequenceStatus.SWAPPED and not out.blocks_to_swap_in, (
        "the prefill chunk spent the 16-token budget: a decode swapped in now would make 17; "
        f"got {back.status.name}, blocks_to_swap_in {out.blocks_to_swap_in}"
    )
    assert out.num_batched_tokens == 16, (
        f"the step never exceeds the token budget of 16, got {out.num_batched_tokens} tokens"
    )


def test_part4_swap_in_fills_the_sequence_places():
    s = make_scheduler(num_gpu_blocks=8, num_cpu_blocks=8, max_num_seqs=2, preemption_mode="swap")
    seqs = [make_seq(s, i, 4) for i in range(2)]
    s.schedule()
    for seq in seqs:  # both swapped out by hand
        s.running.remove(seq)
        s.block_manager.swap_out([seq])
        seq.status = SequenceStatus.SWAPPED
        s.swapped.append(seq)
    out = s.schedule()
    assert ids(s.running) == [0, 1] and not s.swapped, (
        "max_num_seqs=2 and nothing runs: both swapped sequences come back in one step, each "
        f"taking one place; running {ids(s.running)}, swapped {ids(s.swapped)}"
    )
    assert len(out.blocks_to_swap_in) == 2


def test_part4_falls_back_to_recompute_when_the_cpu_pool_is_full():
    s, _, new = full_pool_of_two(mode="swap", num_cpu_blocks=1)
    out = s.schedule()
    assert out.preempted == [new], (
        "0 needs a block and none is free: the newest running sequence (1) is preempted; got "
        f"preempted {ids(out.preempted)}"
    )
    assert not out.blocks_to_swap_out, (
        "the CPU pool has 1 block and the victim holds 2: nothing is swapped out, got "
        f"blocks_to_swap_out {out.blocks_to_swap_out}"
    )
    assert new.status is SequenceStatus.WAITING and new.block_table == [], (
        "no CPU room for 2 blocks: recompute instead of failing (WAITING, no blocks); got "
        f"{new.status.name} with block table {new.block_table}"
    )


def test_part4_a_group_is_swapped_out_in_one_swap():
    s, _, parent, child = with_a_group("auto")
    out = s.schedule()
    assert [parent.status, child.status] == [SequenceStatus.SWAPPED] * 2, (
        f"auto swaps the group of 2, got {parent.status.name} and {child.status.name}"
    )
    assert len(out.blocks_to_swap_out) == 2 and ids(s.swapped) == [1, 2], (
        "one swap of the group moves its 2 shared blocks once, and both join swapped in "
        f"order: got the map {out.blocks_to_swap_out}, swapped {ids(s.swapped)}"
    )


def test_part4_a_group_that_does_not_fit_the_cpu_pool_is_recomputed():
    s, _, parent, child = with_a_group("auto", num_cpu_blocks=1)
    s.schedule()
    assert [parent.status, child.status] == [SequenceStatus.WAITING] * 2, (
        "the group's 2 blocks do not fit the CPU pool of 1: _preempt_by_swap says False and "
        f"both are recomputed, got {parent.status.name} and {child.status.name}"
    )


def test_part4_a_swapped_group_comes_back_whole_or_not_at_all():
    s, old, _parent, _child = with_a_group("swap")
    s.postprocess(s.schedule().scheduled, [TOKEN])  # the group is swapped out, 0 decodes
    out = s.schedule()  # 0 holds 3 blocks: 1 is free, the group needs 2
    assert ids(s.swapped) == [1, 2] and not out.blocks_to_swap_in, (
        "can_swap_in([1, 2]) is LATER (2 blocks needed, 1 free): neither comes back alone; got "
        f"swapped {ids(s.swapped)}, swap-in map {out.blocks_to_swap_in}"
    )
    s.postprocess(out.scheduled, [TOKEN])
    s.abort(old.seq_id)
    out = s.schedule()
    assert ids(s.running) == [1, 2] and len(out.blocks_to_swap_in) == 2, (
        "with the pool free the group is swapped in together, in one swap of its 2 shared "
        f"blocks: got running {ids(s.running)}, swap-in map {out.blocks_to_swap_in}"
    )
    assert planned(out) == [(1, 1, False), (2, 1, False)], (
        f"and both decode in this very step, in order; got {planned(out)}"
    )
    assert out.num_batched_tokens == 2 and len(out.blocks_to_copy) == 1, (
        "a token each, and the shared last block is copied on the first write: got "
        f"{out.num_batched_tokens} tokens, copies {out.blocks_to_copy}"
    )


def test_part4_a_group_is_found_by_its_group_id_next_to_it():
    s, old, parent, child = with_a_group("swap")
    s.postprocess(s.schedule().scheduled, [TOKEN])  # the group is swapped out
    other = Sequence(5, [1, 2, 3], 4, arrival_time=2.0)
    assert s._front_group([parent, child, other]) == [parent, child], (
        "_front_group (given) takes the first sequence and the members of its group after it"
    )
    assert s._pop_newest_group(deque([old, parent, child])) == [parent, child]


def test_part4_a_swapped_group_that_can_never_come_back_is_ignored_whole():
    s, old, parent, child = with_a_group("swap")
    s.postprocess(s.schedule().scheduled, [TOKEN])  # the group is swapped out: 2 CPU blocks
    s.abort(old.seq_id)  # the GPU pool of 4 is free
    for seq in (parent, child):  # 9 tokens in blocks for 8: the next step of each needs a block
        seq.append_token(TOKEN)
        seq.append_token(TOKEN)
    s.block_manager.watermark_blocks = 1  # the group needs 2 + 2 blocks: NEVER with 1 kept free
    out = s.schedule()
    assert [item.seq for item in out.ignored] == [parent, child] and not s.swapped, (
        "can_swap_in([1, 2]) is NEVER: the whole group is taken out and each ignored, in order "
        "(alone, 2 could come back: 2 blocks + 1 fit); got ignored "
        f"{[item.seq.seq_id for item in out.ignored]}, swapped {ids(s.swapped)}"
    )
    assert child.status is SequenceStatus.FINISHED_IGNORED and child.block_table == []


def test_part4_a_swapped_group_needs_a_place_for_each_sequence():
    s, old, _parent, _child = with_a_group("swap")
    s.postprocess(s.schedule().scheduled, [TOKEN])  # the group is swapped out
    s.abort(old.seq_id)  # the pool is free
    s.config.max_num_seqs = 1
    out = s.schedule()
    assert ids(s.swapped) == [1, 2] and not out.blocks_to_swap_in, (
        "with max_num_seqs 1 the group of 2 does not fit the sequence places: it stays "
        f"swapped, whole; got swapped {ids(s.swapped)}, swap-in map {out.blocks_to_swap_in}"
    )
    s.config.max_num_seqs = 2
    s.schedule()
    assert ids(s.running) == [1, 2], f"2 places: the group comes back, got {ids(s.running)}"


def test_part4_everything_finishes_with_swapping():
    config = Config(
        block_size=4,
        num_gpu_blocks=20,
        num_cpu_blocks=40,
        max_model_len=64,
        max_num_seqs=8,
        watermark=0.0,
        preemption_mode="swap",
    )
    requests = [Request(0.0, 10 + i % 7, 20 + 3 * i % 11) for i in range(10)]
    swaps = []
    result = simulate(config, requests, on_step=lambda _, out: swaps.append(out.blocks_to_swap_out))
    assert any(swaps), "this pool is too small for all to run: expect swapping"
    by_id = {seq.seq_id: seq for seq in result.finished}
    assert [by_id[i].num_completion_tokens for i in range(10)] == [
        r.output_len for r in requests
    ], (
        "every request finishes with its whole output, swapped or not (a swapped sequence keeps "
        "its tokens): completion tokens by request id (left) vs output lengths (right)"
    )


# --------------------------------------------------------------------------------------------
# Part 2.5: chunked prefill
# --------------------------------------------------------------------------------------------


def test_part5_a_long_prompt_is_prefilled_in_chunks_under_the_token_budget():
    s = chunked()
    seq = make_seq(s, 0, 40)
    chunks = [planned(step(s)) for _ in range(3)]
    assert chunks == [[(0, 16, True)], [(0, 16, True)], [(0, 8, True)]], (
        f"a 40-token prompt under a 16-token budget runs as chunks 16, 16, 8; got {chunks}"
    )
    assert seq.num_completion_tokens == 1, (
        f"only the last chunk yields a token: 1 expected, got {seq.num_completion_tokens}"
    )
    assert seq.num_computed_tokens == 40, (
        f"the three chunks compute all 40 prompt tokens, got {seq.num_computed_tokens}"
    )


def test_part5_decodes_go_first_and_are_not_stalled_by_a_long_prompt():
    s = chunked()
    short = make_seq(s, 0, 4, max_tokens=30)
    step(s)  # prefill the short one
    make_seq(s, 1, 40)
    out = s.schedule()
    assert planned(out) == [(0, 1, False), (1, 15, True)], (
        "decodes first, then the prompt's chunk in what is left of the budget (16 - 1)"
    )
    assert out.kind == "mixed", (
        f"decodes and a prefill chunk in one step make a mixed step, got kind {out.kind!r}"
    )
    s.postprocess(out.scheduled, [TOKEN, TOKEN])
    for _ in range(3):
        out = step(s)
        assert (0, 1, False) in planned(out), (
            "the running sequence decodes every step, while the long prompt is prefilled in "
            f"chunks: expected (0, 1, False) among {planned(out)}"
        )
    assert short.num_completion_tokens == 5, (
        "the running sequence gains a token every step of the long prefill: 1 + 4 = 5 "
        f"expected, got {short.num_completion_tokens}"
    )


def test_part5_a_last_chunk_of_one_token_is_still_a_prefill():
    s = chunked()
    make_seq(s, 0, 4, max_tokens=30)
    step(s)
    late = make_seq(s, 1, 16)
    step(s)  # 0 decodes, late gets 15 of its 16 tokens
    out = s.schedule()
    assert planned(out) == [(0, 1, False), (1, 1, True)], (
        "the last prompt token of a chunked prefill is a prefill chunk of 1, not a decode; "
        f"got {planned(out)}"
    )
    assert out.num_prefills == 1, (
        f"the 1-token last chunk counts as a prefill: 1 prefill expected, got {out.num_prefills}"
    )
    assert out.kind == "mixed", (
        f"a decode and a prefill chunk in one step make a mixed step, got kind {out.kind!r}"
    )
    s.postprocess(out.scheduled, [TOKEN, TOKEN])
    assert late.num_completion_tokens == 1, (
        "the last chunk yields the first token: 1 completion token expected, got "
        f"{late.num_completion_tokens}"
    )
    assert not late.is_prefill, (
        "computing the last prompt token ends the prefill: expected is_prefill=False, got "
        f"{late.is_prefill}"
    )


def test_part5_a_recomputed_sequence_is_prefilled_in_chunks_to_its_last_token():
    s = chunked(num_gpu_blocks=4, max_num_batched_tokens=4, max_num_seqs=2)
    make_seq(s, 0, 7, max_tokens=8)
    late = make_seq(s, 1, 1, max_tokens=12)
    for _ in range(10):  # both decode until late (the newest) is preempted, holding 5 tokens
        if late in step(s).preempted:
            break
    assert late.status is SequenceStatus.WAITING, (
        "when blocks run out the newest running sequence (1) is preempted by recompute and "
        f"waits: expected WAITING, got {late.status.name}"
    )
    assert late.num_tokens == 5, (
        "a preemption by recompute keeps the tokens: 1 prompt + 4 generated = 5 expected, got "
        f"{late.num_tokens}"
    )
    chunks = []
    for _ in range(10):
        chunks += [(n, prefill) for seq_id, n, prefill in planned(step(s)) if seq_id == 1]
        if len(chunks) == 3:
            break
    assert chunks == [(4, True), (1, True), (1, False)], (
        "re-admitted after a recompute, the sequence prefills its 5 tokens (1 prompt + 4 "
        "generated) in chunks of 4 and 1, both prefills, then decodes; got (tokens, prefill) "
        f"{chunks}"
    )


def test_part5_prefill_chunks_go_oldest_first_and_stop_when_the_budget_is_spent():
    s = chunked()
    seqs = [make_seq(s, i, 10) for i in range(3)]
    for seq in seqs:  # three running prefills, made by hand (schedule() makes one at a time)
        s.waiting.remove(seq)
        s.block_manager.allocate(seq)
        seq.status = SequenceStatus.RUNNING
        s.running.append(seq)
    out, budget = SchedulerOutput(), SchedulingBudget(16, 8, num_seqs=3)
    s._schedule_prefill_chunks(seqs, out, budget)
    assert planned(out) == [(0, 10, True), (1, 6, True)], (
        "oldest first, each the chunk that fits what is left of the budget (10, then 6), and "
        f"no chunk of 0 tokens for the third; got {planned(out)}"
    )
    assert budget.num_batched_tokens == 16, (
        "each chunk charges its tokens to the budget: 10 + 6 = 16 expected, got "
        f"{budget.num_batched_tokens}"
    )
    assert budget.num_seqs == 3, (
        "chunks spend tokens, not sequence places (the sequences already run): num_seqs stays "
        f"3, got {budget.num_seqs}"
    )


def test_part4_with_chunked_prefill_swapped_sequences_still_come_first():
    s = chunked(
        num_gpu_blocks=5, num_cpu_blocks=8, preemption_mode="swap", max_num_batched_tokens=32
    )
    a = make_seq(s, 0, 8, max_tokens=10)
    make_seq(s, 1, 8, max_tokens=10)
    old = make_seq(s, 2, 3, arrival=0.5, max_tokens=10)
    step(s)  # a, b: 2 blocks each, 9 tokens; old: 1 block
    s.running.remove(old)  # swapped out by hand: 1 GPU block free
    s.block_manager.swap_out([old])
    old.status = SequenceStatus.SWAPPED
    s.swapped.append(old)
    out = s.schedule()  # a takes the free block; b needs one: it preempts itself (swap)
    assert ids(out.preempted) == [1] and ids(s.swapped) == [2, 1], (
        f"b is swapped out: preempted {ids(out.preempted)}, swapped {ids(s.swapped)}"
    )
    assert not out.blocks_to_swap_in, (
        "a step never swaps in and out at once, with chunked prefill too: old stays swapped "
        f"although 2 blocks are free now; got blocks_to_swap_in {out.blocks_to_swap_in}"
    )
    s.postprocess(out.scheduled, [TOKEN] * len(out.scheduled))
    newcomer = make_seq(s, 3, 1)
    out = s.schedule()  # old comes back (1 block); b needs 3 of the 1 left: LATER
    assert ids(s.swapped) == [1] and a.status is SequenceStatus.RUNNING, ids(s.swapped)
    assert newcomer.status is SequenceStatus.WAITING, (
        "while a sequence is swapped out no new prompt is admitted, with chunked prefill too: "
        f"the 1-token newcomer waits; got {newcomer.status.name}"
    )


def test_part5_the_budget_holds_every_step():
    s = chunked(max_num_seqs=4)
    for i in range(6):
        make_seq(s, i, 11 + 3 * i, max_tokens=5)
    for _ in range(500):
        if s.is_finished():
            break
        out = step(s)
        assert out.num_batched_tokens <= 16, f"step computed {out.num_batched_tokens} > 16 tokens"
        assert len(s.running) <= 4, (
            f"at most max_num_seqs=4 sequences run, got running {ids(s.running)}"
        )


def test_part5_chunked_and_unchunked_runs_produce_the_same_outputs():
    requests = [Request(0.0, 5 + 9 * i % 40, 1 + 5 * i % 9) for i in range(10)]
    base = {"block_size": 4, "num_gpu_blocks": 200, "max_model_len": 64, "max_num_seqs": 4}
    plain = simulate(Config(**base), requests)
    cut = simulate(Config(**base, enable_chunked_prefill=True, max_num_batched_tokens=8), requests)
    outputs = {s.seq_id: s.token_ids for s in plain.finished}
    assert {s.seq_id: s.token_ids for s in cut.finished} == outputs, (
        "chunking changes when the tokens are computed, not what is generated: every request's "
        "tokens with chunked prefill (left) must equal those without (right)"
    )
    assert any(step.kind == "mixed" for step in cut.steps), "expected mixed steps"
    assert max(step.num_batched_tokens for step in cut.steps) <= 8, (
        "no step computes more than max_num_batched_tokens=8, got a step of "
        f"{max(step.num_batched_tokens for step in cut.steps)}"
    )


# --------------------------------------------------------------------------------------------
# Random arrivals, steps and aborts on tiny pools (Hypothesis stateful testing)
# --------------------------------------------------------------------------------------------


class SchedulerMachine(RuleBasedStateMachine):
    """Drives the scheduler with random requests, steps and aborts; checks it after each step.

    Most requests the machine makes fit the GPU pool alone (prompt and output, above the
    watermark); some are too long to admit and must be ignored, some fit at first but outgrow
    the pool and must end ignored (or capped, or stopped) too. Arrival
    times are drawn, so add order and arrival order differ. At the end (teardown) it steps until
    all finish, within a bound: a scheduler that starves a request or livelocks fails there.

    ``REACHED`` counts the (operation, state) pairs the runs reached: an abort in each queue,
    steps that preempted, swapped in, ignored, ran mixed batches. Each test requires its own
    (an abort in ``swapped`` is rare here: ``test_part4_aborting_a_swapped_sequence...`` pins it).
    """

    MODE = "recompute"
    CHUNKED = False
    REACHED: ClassVar[Counter] = Counter()

    def __init__(self) -> None:
        super().__init__()
        self.next_id = 0
        self.seqs: list[Sequence] = []
        self.last: SchedulerOutput | None = None

    @initialize(
        block_size=st.integers(1, 4),
        num_gpu_blocks=st.integers(3, 12),
        num_cpu_blocks=st.sampled_from([0, 4, 8, 16]),
        max_num_seqs=st.integers(1, 4),
        watermark=st.sampled_from([0.0, 0.0, 0.1, 0.25]),
    )
    def setup(self, block_size, num_gpu_blocks, num_cpu_blocks, max_num_seqs, watermark):
        budget = max(max_num_seqs, 6) if self.CHUNKED else None
        self.s = Scheduler(
            Config(
                block_size=block_size,
                num_gpu_blocks=num_gpu_blocks,
                num_cpu_blocks=num_cpu_blocks,
                watermark=watermark,
                max_model_len=24,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=budget,
                enable_chunked_prefill=self.CHUNKED,
                preemption_mode=self.MODE,
                eos_token_id=EOS,
            )
        )

    @property
    def capacity(self) -> int:
        """The most tokens one sequence can hold alone: max_model_len, and the pool's blocks."""
        manager = self.s.block_manager
        usable = manager.num_gpu_blocks - manager.watermark_blocks
        return min(self.s.config.max_model_len, usable * manager.block_size)

    @rule(
        prompt_len=st.integers(1, 24),
        max_tokens=st.integers(1, 8),
        kind=st.sampled_from(["fits", "fits", "fits", "too long", "outgrows"]),
        arrival=st.integers(0, 40),
    )
    def add(self, prompt_len, max_tokens, kind, arrival):
        capacity = self.capacity
        if kind == "too long":
            prompt_len = capacity + 1
        elif kind == "outgrows":
            prompt_len = min(prompt_len, capacity)
            max_tokens = capacity - prompt_len + 2
        else:
            max_tokens = min(max_tokens, capacity - 1)
            prompt_len = max(1, min(prompt_len, capacity - max_tokens))
        seq = Sequence(
            self.next_id,
            [3] * prompt_len,
            self.s.config.block_size,
            SamplingParams(max_tokens=max_tokens),
            arrival_time=float(arrival),
        )
        self.next_id += 1
        self.s.add(seq)
        self.seqs.append(seq)

    @precondition(lambda self: hasattr(self, "s") and not self.s.is_finished())
    @rule(eos=st.booleans(), times=st.integers(1, 4))
    def steps(self, eos, times):
        for _ in range(times):
            self.step(eos)
            self.every_sequence_is_in_one_place()
            self.block_accounting_holds()

    def step(self, eos):
        self.last = self.s.schedule()
        tokens = [EOS if eos and i == 0 else TOKEN for i in range(len(self.last.scheduled))]
        self.s.postprocess(self.last.scheduled, tokens)
        self.check_step(self.last)
        self.count_step(self.last)

    @precondition(lambda self: hasattr(self, "s") and not self.s.is_finished())
    @rule(data=st.data(), skip=st.integers(0, 3))
    def abort(self, data, skip):
        if skip:  # abort one time in four: every abort takes the pressure off the pool
            return
        queues = [q for q in (list(self.s.waiting), self.s.running, self.s.swapped) if q]
        seq = data.draw(st.sampled_from(data.draw(st.sampled_from(queues))))
        self.REACHED["abort", seq.status.name] += 1
        self.s.abort(seq.seq_id)

    @precondition(lambda self: hasattr(self, "s") and self.s.swapped)
    @rule(data=st.data())
    def abort_swapped(self, data):
        seq = data.draw(st.sampled_from(self.s.swapped))
        self.REACHED["abort", seq.status.name] += 1
        self.s.abort(seq.seq_id)

    def count_step(self, out):
        reached = {
            "preempt": out.preempted,
            "swap out": out.blocks_to_swap_out,
            "swap in": out.blocks_to_swap_in,
            "ignore": out.ignored,
            "copy": out.blocks_to_copy,
        }
        for what, happened in reached.items():
            if happened:
                self.REACHED["step", what] += 1
        self.REACHED["step", out.kind] += 1
        if any(i.seq.num_completion_tokens for i in out.ignored):
            self.REACHED["step", "ignore after running"] += 1

    def check_step(self, out):
        config = self.s.config
        assert out.num_batched_tokens <= config.token_budget, (
            f"token budget exceeded: the step computed {out.num_batched_tokens} tokens, the "
            f"budget is {config.token_budget}; scheduled {planned(out)}"
        )
        assert len(out.scheduled) <= config.max_num_seqs, (
            f"max_num_seqs exceeded: the step scheduled {ids(out.seqs)}, at most "
            f"{config.max_num_seqs} may run"
        )
        assert len(self.s.running) <= config.max_num_seqs, (
            f"max_num_seqs exceeded: running holds {ids(self.s.running)}, at most "
            f"{config.max_num_seqs} may run"
        )
        assert not (out.blocks_to_swap_in and out.blocks_to_swap_out), (
            "a step never swaps in and out at once: got blocks_to_swap_in "
            f"{out.blocks_to_swap_in} and blocks_to_swap_out {out.blocks_to_swap_out}"
        )
        for ignored in out.ignored:
            assert ignored.seq.num_tokens > self.capacity, (
                f"sequence {ignored.seq.seq_id} fits alone but was ignored: {ignored.reason}"
            )

    @invariant()
    def every_sequence_is_in_one_place(self):
        if not hasattr(self, "s"):
            return
        queues = {
            SequenceStatus.WAITING: (list(self.s.waiting), None),
            SequenceStatus.RUNNING: (self.s.running, Device.GPU),
            SequenceStatus.SWAPPED: (self.s.swapped, Device.CPU),
        }
        for seq in self.seqs:
            places = [st for st, (queue, _) in queues.items() if any(q is seq for q in queue)]
            if seq.is_finished:
                assert places == [], f"finished sequence {seq.seq_id} is still queued"
                assert seq.block_table == [] and self.s.block_manager.device_of(seq) is None, (
                    f"finished sequence {seq.seq_id} ({seq.status.name}) still holds blocks"
                )
            else:
                assert places == [seq.status], (
                    f"sequence {seq.seq_id} is {seq.status.name} but queued in {places}"
                )
                assert self.s.block_manager.device_of(seq) is queues[seq.status][1], (
                    f"sequence {seq.seq_id} is {seq.status.name}: its blocks belong on "
                    f"{queues[seq.status][1]} (None: it holds none), got "
                    f"{self.s.block_manager.device_of(seq)}"
                )
        assert self.s.num_unfinished == sum(not seq.is_finished for seq in self.seqs), (
            "every unfinished sequence is in exactly one queue: expected "
            f"{sum(not seq.is_finished for seq in self.seqs)} queued, got waiting "
            f"{ids(self.s.waiting)}, running {ids(self.s.running)}, swapped {ids(self.s.swapped)}"
        )
        arrivals = [(seq.arrival_time, seq.seq_id) for seq in self.s.running]
        assert arrivals == sorted(arrivals), f"running is not in arrival order: {arrivals}"
        arrivals = [(seq.arrival_time, seq.seq_id) for seq in self.s.swapped]
        assert arrivals == sorted(arrivals), f"swapped is not in arrival order: {arrivals}"
        for seq in self.s.running + self.s.swapped:
            assert 0 <= seq.num_computed_tokens <= seq.num_tokens, (
                f"sequence {seq.seq_id}: {seq.num_computed_tokens} computed of {seq.num_tokens}"
            )

    @invariant()
    def block_accounting_holds(self):
        if not hasattr(self, "s"):
            return
        manager = self.s.block_manager
        for device, allocator, queue in (
            (Device.GPU, manager.gpu_allocator, self.s.running),
            (Device.CPU, manager.cpu_allocator, self.s.swapped),
        ):
            held = [b for seq in queue for b in seq.block_table]
            assert len(held) == len(set(held)), f"{device.value}: a block is held twice"
            assert allocator.num_free_blocks + len(held) == allocator.num_blocks, (
                f"{device.value}: free + used != total"
            )

    def teardown(self):
        if not hasattr(self, "s"):
            return
        left = [seq for seq in self.seqs if not seq.is_finished]
        bound = 3 * sum(seq.num_tokens + seq.sampling_params.max_tokens for seq in left) + 20
        for _ in range(bound):
            if self.s.is_finished():
                break
            self.step(eos=False)
            self.every_sequence_is_in_one_place()
            self.block_accounting_holds()
        assert self.s.is_finished(), (
            f"after {bound} steps {self.s.num_unfinished} sequences have not finished "
            f"(waiting {ids(self.s.waiting)}, running {ids(self.s.running)}, "
            f"swapped {ids(self.s.swapped)}): starvation or livelock"
        )


class SwapMachine(SchedulerMachine):
    MODE = "swap"


class ChunkedMachine(SchedulerMachine):
    CHUNKED = True


class ChunkedSwapMachine(SchedulerMachine):
    MODE = "swap"
    CHUNKED = True


ALWAYS = {
    ("abort", "WAITING"),
    ("abort", "RUNNING"),
    ("step", "preempt"),
    ("step", "ignore"),
    ("step", "ignore after running"),
}


def test_part3_random_workloads_keep_the_invariants_and_finish():
    run_counted_machine(
        SchedulerMachine, STATEFUL, ALWAYS | {("step", "prefill"), ("step", "decode")}
    )


def test_part4_random_workloads_with_swapping_keep_the_invariants_and_finish():
    run_counted_machine(SwapMachine, STATEFUL, ALWAYS | {("step", "swap out"), ("step", "swap in")})


def test_part5_random_workloads_with_chunked_prefill_keep_the_invariants_and_finish():
    run_counted_machine(ChunkedMachine, STATEFUL, ALWAYS | {("step", "mixed")})


def test_part5_random_workloads_with_chunked_prefill_and_swapping_finish():
    run_counted_machine(
        ChunkedSwapMachine, STATEFUL, ALWAYS | {("step", "swap in"), ("step", "mixed")}
    )
