"""Graded tests for Phase 1: block-based KV memory management.

Each test name carries its part: ``uv run pytest tests/test_phase1.py -k part3 -v`` runs the
tests of part 1.3 (BlockManager). Expected values are computed here from first principles
(ceil division, a list model), never by calling other code under test.
"""

import math
from collections import Counter
from typing import ClassVar

import pytest
from block_stand_ins import with_stand_in
from cost import fastest_ratio
from grading_policy import policy_test
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from hypothesis_settings import graded_settings, run_counted_machine

from vkv.engine.block import Block, BlockAllocator, Device, DoubleFreeError, NoFreeBlocksError
from vkv.engine.block_manager import AllocStatus, BlockManager
from vkv.engine.evictor import Evictor
from vkv.engine.sequence import Sequence, SequenceStatus
from vkv.engine.swapper import Swapper
from vkv.sampling_params import SamplingParams

FAST = graded_settings(max_examples=60)
STATEFUL = graded_settings(max_examples=60, stateful_step_count=50)
FINISHED = [s for s in SequenceStatus if s.name.startswith("FINISHED_")]


def make_seq(seq_id: int, num_tokens: int, block_size: int) -> Sequence:
    """A sequence whose prompt is the token ids 100, 101, ... (distinct, easy to read)."""
    return Sequence(seq_id, list(range(100, 100 + num_tokens)), block_size)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def pool_counts(bm: BlockManager) -> tuple[int, int, list[int]]:
    """Everything a failed call must leave unchanged."""
    return (
        bm.num_free_gpu_blocks,
        bm.num_free_cpu_blocks,
        [b.ref_count for b in bm.gpu_allocator.blocks + bm.cpu_allocator.blocks],
    )


# --------------------------------------------------------------------------------------------
# Part 1.1: Sequence
# --------------------------------------------------------------------------------------------


# Each part's first test: its regions follow the grading policy (tests/grading_policy.py).
test_part1_follows_the_grading_policy = policy_test("1.1")
test_part2_follows_the_grading_policy = policy_test("1.2")
test_part3_follows_the_grading_policy = policy_test("1.3")
test_part4_follows_the_grading_policy = policy_test("1.4")
test_part5_follows_the_grading_policy = policy_test("1.5")


def test_part1_new_sequence_holds_a_copy_of_the_prompt_and_waits():
    prompt = [5, 6, 7]
    params = SamplingParams(max_tokens=3)
    seq = Sequence(7, prompt, block_size=4, sampling_params=params, arrival_time=2.5)
    prompt.append(8)
    assert seq.seq_id == 7, (
        f"seq_id is the constructor's first argument: expected 7, got {seq.seq_id!r}"
    )
    assert seq.status is SequenceStatus.WAITING, f"a new sequence is WAITING, got {seq.status}"
    assert seq.token_ids == [5, 6, 7], (
        f"token_ids must be a copy of the prompt, unaffected by later changes to the caller's "
        f"list; got {seq.token_ids}"
    )
    assert (seq.num_prompt_tokens, seq.num_tokens, seq.num_completion_tokens) == (3, 3, 0), (
        "a new sequence's tokens are its prompt: (num_prompt_tokens, num_tokens, "
        "num_completion_tokens) expected (3, 3, 0), got "
        f"{(seq.num_prompt_tokens, seq.num_tokens, seq.num_completion_tokens)}"
    )
    assert seq.block_table == [], (
        f"a new sequence holds no blocks: block_table must be [], got {seq.block_table}"
    )
    assert seq.block_size == 4, (
        f"block_size is the constructor argument: expected 4, got {seq.block_size!r}"
    )
    assert seq.sampling_params is params, (
        f"the sequence keeps the sampling_params it was given (the same object), got "
        f"{seq.sampling_params!r}"
    )
    assert seq.arrival_time == 2.5, (
        f"arrival_time is the constructor argument: expected 2.5, got {seq.arrival_time!r}"
    )
    assert len(seq) == 3, f"len(seq) is num_tokens: expected 3, got {len(seq)}"


def test_part1_default_sampling_params():
    seq = Sequence(0, [1], block_size=1)
    assert seq.sampling_params == SamplingParams(), "without sampling_params, use SamplingParams()"


def test_part1_append_token_grows_the_completion_only():
    seq = Sequence(1, [10, 11], block_size=2)
    for token in (12, 13, 14):
        seq.append_token(token)
    assert seq.token_ids == [10, 11, 12, 13, 14], (
        "tokens are only ever appended: token_ids is the prompt followed by the completion, "
        f"expected [10, 11, 12, 13, 14], got {seq.token_ids}"
    )
    assert seq.num_tokens == 5, (
        "num_tokens == num_prompt_tokens + num_completion_tokens: expected 2 + 3 = 5, got "
        f"{seq.num_tokens}"
    )
    assert seq.num_prompt_tokens == 2, (
        f"appending generated tokens must not change the prompt: num_prompt_tokens expected 2, "
        f"got {seq.num_prompt_tokens}"
    )
    assert seq.num_completion_tokens == 3, (
        f"each appended token is a completion token: expected 3, got {seq.num_completion_tokens}"
    )
    assert seq.prompt_token_ids == [10, 11], (
        f"prompt_token_ids are the prompt's tokens only: expected [10, 11], got "
        f"{seq.prompt_token_ids}"
    )
    assert seq.completion_token_ids == [12, 13, 14], (
        f"completion_token_ids are the tokens generated after the prompt: expected [12, 13, 14], "
        f"got {seq.completion_token_ids}"
    )
    assert seq.last_token == 14, (
        f"last_token is the most recent token id: expected 14, got {seq.last_token}"
    )


def test_part1_prompt_and_completion_ids_are_copies():
    seq = Sequence(1, [10, 11], block_size=2)
    seq.append_token(12)
    seq.prompt_token_ids.append(99)
    seq.completion_token_ids.append(99)
    assert seq.token_ids == [10, 11, 12], "prompt_token_ids / completion_token_ids return copies"


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
def test_part1_num_blocks_and_last_block_num_tokens(block_size):
    for num_tokens in (1, 2, 3, 4, 5, 15, 16, 17, 33):
        seq = make_seq(0, num_tokens, block_size)
        expected_blocks = math.ceil(num_tokens / block_size)
        expected_last = num_tokens - (expected_blocks - 1) * block_size
        assert seq.num_blocks == expected_blocks, (
            f"{num_tokens} tokens in blocks of {block_size} span {expected_blocks} logical "
            f"blocks, num_blocks returned {seq.num_blocks}"
        )
        assert seq.last_block_num_tokens == expected_last, (
            f"{num_tokens} tokens in blocks of {block_size}: the last block holds "
            f"{expected_last}, last_block_num_tokens returned {seq.last_block_num_tokens}"
        )


@pytest.mark.parametrize("k", [1, 2, 5])
def test_part1_prompt_of_exactly_k_blocks_fills_its_last_block(k):
    seq = make_seq(0, 4 * k, block_size=4)
    assert seq.num_blocks == k, (
        f"a prompt of exactly {k} blocks spans {k} blocks, not more: got {seq.num_blocks}"
    )
    assert seq.last_block_num_tokens == 4, (
        "the last block of an exact multiple is full: last_block_num_tokens expected 4, got "
        f"{seq.last_block_num_tokens}"
    )
    seq.append_token(1)
    assert (seq.num_blocks, seq.last_block_num_tokens) == (k + 1, 1), (
        "one token past a full block opens a new block holding 1 token: (num_blocks, "
        f"last_block_num_tokens) expected {(k + 1, 1)}, got "
        f"{(seq.num_blocks, seq.last_block_num_tokens)}"
    )


def test_part1_block_size_one_puts_each_token_in_its_own_block():
    seq = make_seq(0, 5, block_size=1)
    assert seq.num_blocks == 5, (
        f"num_blocks == ceil(num_tokens / block_size): 5 tokens in blocks of 1 span 5 blocks, "
        f"got {seq.num_blocks}"
    )
    assert seq.last_block_num_tokens == 1, (
        f"with block size 1 the last block holds 1 token, got {seq.last_block_num_tokens}"
    )
    assert [seq.block(i) for i in range(5)] == [[100], [101], [102], [103], [104]], (
        "logical block i holds positions [i * block_size, (i + 1) * block_size): with block "
        f"size 1, block(i) is [token i]; got {[seq.block(i) for i in range(5)]}"
    )


@given(
    tokens=st.lists(st.integers(0, 50_000), min_size=1, max_size=40),
    block_size=st.integers(1, 9),
    appended=st.lists(st.integers(0, 50_000), max_size=10),
)
@FAST
def test_part1_blocks_concatenate_to_the_tokens(tokens, block_size, appended):
    seq = Sequence(0, tokens, block_size)
    for token in appended:
        seq.append_token(token)
    blocks = [seq.block(i) for i in range(seq.num_blocks)]
    joined = [token for block in blocks for token in block]
    assert joined == tokens + appended, (
        f"block(0) + ... + block(n-1) must equal token_ids: expected {tokens + appended}, "
        f"got {joined}"
    )
    assert all(len(b) == block_size for b in blocks[:-1]), (
        f"every block but the last is full ({block_size} tokens): block sizes "
        f"{[len(b) for b in blocks]}"
    )


@pytest.mark.parametrize("index", [-1, 2, 10])
def test_part1_block_out_of_range_raises_index_error(index):
    seq = make_seq(0, 5, block_size=4)
    with pytest.raises(IndexError):
        seq.block(index)


@pytest.mark.parametrize("block_size", [0, -1, -16, True, 2.0, "4"])
def test_part1_rejects_a_block_size_that_is_not_a_positive_integer(block_size):
    with pytest.raises(ValueError, match="block_size"):
        Sequence(0, [1, 2], block_size=block_size)


def test_part1_rejects_an_empty_prompt():
    with pytest.raises(ValueError):
        Sequence(0, [], block_size=4)


@pytest.mark.parametrize("status", FINISHED, ids=lambda s: s.name)
def test_part1_appending_to_a_finished_sequence_raises_and_changes_nothing(status):
    seq = make_seq(0, 3, block_size=4)
    seq.status = status
    assert seq.is_finished, f"{status.name} is a finished status"
    with pytest.raises(ValueError):
        seq.append_token(9)
    assert seq.num_tokens == 3, "a rejected append must leave the tokens unchanged"


@pytest.mark.parametrize(
    "status",
    [SequenceStatus.WAITING, SequenceStatus.RUNNING, SequenceStatus.SWAPPED],
    ids=lambda s: s.name,
)
def test_part1_unfinished_statuses_take_tokens(status):
    seq = make_seq(0, 3, block_size=4)
    seq.status = status
    assert not seq.is_finished, f"{status.name} is not a FINISHED_* status: is_finished is False"
    seq.append_token(9)
    assert seq.num_tokens == 4, (
        f"an unfinished ({status.name}) sequence takes tokens: 3 + 1 appended = 4 expected, "
        f"got {seq.num_tokens}"
    )


def test_part1_default_arrival_time_is_zero():
    seq = Sequence(0, [1], block_size=1)
    assert seq.arrival_time == 0.0, (
        f"without arrival_time a sequence arrived at 0.0 (the default), got {seq.arrival_time!r}"
    )


def test_part1_empty_prompt_error_names_the_sequence():
    with pytest.raises(
        ValueError, match=r"\bsequence 3: the prompt must hold at least one token\b"
    ):
        Sequence(3, [], block_size=4)


def test_part1_block_out_of_range_error_names_the_valid_range():
    seq = make_seq(0, 5, block_size=4)  # 2 logical blocks: 0 and 1
    message = r"\bsequence 0 has logical blocks 0\.\.1, block 2 does not exist\b"
    with pytest.raises(IndexError, match=message):
        seq.block(2)


def test_part1_appending_to_a_finished_sequence_error_names_its_status():
    seq = make_seq(3, 2, block_size=4)
    seq.status = SequenceStatus.FINISHED_STOPPED
    message = r"\bsequence 3 is FINISHED_STOPPED: a finished sequence takes no tokens\b"
    with pytest.raises(ValueError, match=message):
        seq.append_token(9)


# --------------------------------------------------------------------------------------------
# Part 1.2: Block and BlockAllocator
# --------------------------------------------------------------------------------------------


def test_part2_pool_starts_with_every_block_free():
    pool = BlockAllocator(Device.GPU, 8)
    assert pool.num_blocks == 8, f"num_blocks is the pool's size: expected 8, got {pool.num_blocks}"
    assert pool.num_free_blocks == 8, (
        f"a new pool has every block free: expected 8 free, got {pool.num_free_blocks}"
    )
    assert [b.block_id for b in pool.blocks] == list(range(8)), (
        f"blocks[i].block_id must be i: got ids {[b.block_id for b in pool.blocks]}"
    )
    assert all(b.device is Device.GPU for b in pool.blocks), (
        f"every block of a GPU pool has device GPU: got {[b.device for b in pool.blocks]}"
    )
    assert all(b.ref_count == 0 for b in pool.blocks), (
        "a new pool's blocks are free (ref_count 0): got ref counts "
        f"{[b.ref_count for b in pool.blocks]}"
    )


def test_part2_allocate_hands_out_distinct_blocks_with_one_holder():
    pool = BlockAllocator(Device.CPU, 5)
    taken = [pool.allocate() for _ in range(5)]
    assert len({b.block_id for b in taken}) == 5, (
        f"allocate returned the same block twice: ids {[b.block_id for b in taken]}"
    )
    assert all(b.ref_count == 1 for b in taken), (
        f"an allocated block has ref_count 1: got {[b.ref_count for b in taken]}"
    )
    assert all(pool.blocks[b.block_id] is b for b in taken), (
        "allocate returns the pool's own Block (blocks[block_id]), not a new one"
    )
    assert pool.num_free_blocks == 0, (
        f"all 5 blocks of a pool of 5 are in use: expected 0 free, got {pool.num_free_blocks}"
    )


def test_part2_exhausted_pool_raises_no_free_blocks_and_changes_nothing():
    pool = BlockAllocator(Device.GPU, 2)
    pool.allocate()
    pool.allocate()
    with pytest.raises(NoFreeBlocksError):
        pool.allocate()
    assert pool.num_free_blocks == 0, (
        f"NoFreeBlocksError leaves every count unchanged: expected 0 free, got "
        f"{pool.num_free_blocks}"
    )
    assert [b.ref_count for b in pool.blocks] == [1, 1], (
        f"a failed allocate changes no ref count: expected [1, 1], got "
        f"{[b.ref_count for b in pool.blocks]}"
    )


def test_part2_empty_pool_is_allowed_and_has_nothing_to_give():
    pool = BlockAllocator(Device.CPU, 0)
    assert pool.num_free_blocks == 0, (
        f"a pool of 0 blocks has 0 free blocks, got {pool.num_free_blocks}"
    )
    with pytest.raises(NoFreeBlocksError):
        pool.allocate()


def test_part2_negative_pool_size_is_rejected():
    with pytest.raises(ValueError):
        BlockAllocator(Device.GPU, -1)


def test_part2_freed_block_can_be_allocated_again():
    pool = BlockAllocator(Device.GPU, 3)
    b = [pool.allocate() for _ in range(3)][1]
    pool.free(b)
    assert b.ref_count == 0, f"free drops the only holder: ref_count expected 0, got {b.ref_count}"
    assert pool.num_free_blocks == 1, (
        f"a block whose count drops to zero is free again: expected 1 free, got "
        f"{pool.num_free_blocks}"
    )
    again = pool.allocate()
    assert again is b, f"the only free block is {b.block_id}, allocate returned {again.block_id}"
    assert again.ref_count == 1, f"allocate returns a block with ref_count 1, got {again.ref_count}"


def test_part2_double_free_raises_and_changes_nothing():
    pool = BlockAllocator(Device.GPU, 4)
    block = pool.allocate()
    pool.free(block)
    with pytest.raises(DoubleFreeError):
        pool.free(block)
    assert pool.num_free_blocks == 4, (
        f"after a rejected double free, every block is still free: expected 4 free, got "
        f"{pool.num_free_blocks}"
    )
    assert block.ref_count == 0, (
        f"a ref count never goes below zero: expected 0, got {block.ref_count}"
    )
    taken = {pool.allocate().block_id for _ in range(4)}
    assert taken == {0, 1, 2, 3}, (
        "a double free must not put a block twice on the free list: 4 allocations gave ids "
        f"{sorted(taken)}, expected [0, 1, 2, 3]"
    )
    with pytest.raises(NoFreeBlocksError):
        pool.allocate()


def test_part2_freeing_a_block_of_another_pool_raises_and_changes_nothing():
    gpu = BlockAllocator(Device.GPU, 4)
    other_gpu = BlockAllocator(Device.GPU, 4)
    cpu = BlockAllocator(Device.CPU, 4)
    mine = gpu.allocate()
    for foreign in (cpu.allocate(), other_gpu.allocate(), Block(99, Device.GPU, ref_count=1)):
        with pytest.raises(ValueError):
            gpu.free(foreign)
    assert gpu.num_free_blocks == 3, (
        "freeing a block of another pool raises ValueError and changes nothing: expected 3 "
        f"free, got {gpu.num_free_blocks}"
    )
    assert mine.ref_count == 1, (
        "a rejected free changes no ref count: the pool's own allocated block expected "
        f"ref_count 1, got {mine.ref_count}"
    )
    assert cpu.num_free_blocks == 3 and other_gpu.num_free_blocks == 3, (
        "a rejected free changes no count in the block's own pool either: expected 3 free in "
        f"each, the CPU pool has {cpu.num_free_blocks}, the other GPU pool "
        f"{other_gpu.num_free_blocks}"
    )


def test_part2_shared_block_is_free_only_after_its_last_holder_frees_it():
    pool = BlockAllocator(Device.GPU, 2)
    block = pool.allocate()
    pool.share(block)
    pool.share(block)
    assert block.ref_count == 3, (
        f"allocate gives 1 holder and each share adds one: expected ref_count 3, got "
        f"{block.ref_count}"
    )
    pool.free(block)
    pool.free(block)
    assert (block.ref_count, pool.num_free_blocks) == (1, 1), (
        "a block with holders left is not free: after 2 of 3 frees, (ref_count, free blocks) "
        f"expected (1, 1), got {(block.ref_count, pool.num_free_blocks)}"
    )
    pool.free(block)
    assert (block.ref_count, pool.num_free_blocks) == (0, 2), (
        "the last holder's free makes the block free: (ref_count, free blocks) expected (0, 2), "
        f"got {(block.ref_count, pool.num_free_blocks)}"
    )


def test_part2_sharing_a_free_block_is_rejected():
    pool = BlockAllocator(Device.GPU, 2)
    with pytest.raises(ValueError):
        pool.share(pool.blocks[0])
    assert pool.num_free_blocks == 2 and pool.blocks[0].ref_count == 0, (
        "sharing a free block raises ValueError and changes no count: expected 2 free and "
        f"ref_count 0, got {pool.num_free_blocks} free and ref_count {pool.blocks[0].ref_count}"
    )


def test_part2_freed_block_with_a_hash_goes_to_the_evictor():
    pool = with_stand_in(Device.GPU, 4)
    block = pool.allocate()
    block.content_hash, block.num_hashed_tokens = 1234, 16
    pool.free(block)
    assert block.block_id in pool.evictor, (
        "a block whose count drops to zero goes to the evictor if it has a content_hash: "
        f"block {block.block_id} is not in it"
    )
    assert pool.num_free_blocks == 4, (
        "a cached free block still counts as free (free list plus evictor): expected 4, got "
        f"{pool.num_free_blocks}"
    )


def test_part2_allocator_draws_from_truly_free_blocks_before_evicting():
    pool = with_stand_in(Device.GPU, 3)
    blocks = [pool.allocate() for _ in range(3)]
    for when, block in zip((2.0, 1.0), blocks[:2], strict=True):
        block.content_hash, block.num_hashed_tokens, block.last_accessed = 77 + when, 16, when
        pool.free(block)
    pool.free(blocks[2])  # no hash: truly free
    first = pool.allocate()
    assert first is blocks[2], (
        "allocate takes from the free list first and evicts only when it is empty: expected "
        f"block {blocks[2].block_id}, got {first.block_id}"
    )
    second = pool.allocate()
    assert second is blocks[1], (
        "then the least recently used cached block is evicted: expected block "
        f"{blocks[1].block_id} (accessed at 1.0), got {second.block_id}"
    )
    assert second.content_hash is None and second.num_hashed_tokens == 0, (
        "an evicted block's content record is cleared: expected content_hash None and "
        f"num_hashed_tokens 0, got {second.content_hash} and {second.num_hashed_tokens}"
    )
    assert pool.allocate() is blocks[0], (
        f"the free list is empty and only block {blocks[0].block_id} is cached: allocate must "
        "evict it"
    )
    with pytest.raises(NoFreeBlocksError):
        pool.allocate()


def test_part2_reuse_takes_a_cached_block_back_with_its_content():
    pool = with_stand_in(Device.GPU, 2)
    block = pool.allocate()
    block.content_hash, block.num_hashed_tokens = 99, 16
    pool.free(block)
    again = pool.reuse(block.block_id)
    assert again is block, (
        f"reuse(block_id) returns the pool's block {block.block_id} itself, got {again!r}"
    )
    assert block.ref_count == 1, (
        f"a free block taken back by reuse has ref_count 1, got {block.ref_count}"
    )
    assert block.content_hash == 99, (
        "reuse keeps the block's content (a prefix-cache hit): content_hash expected 99, got "
        f"{block.content_hash}"
    )
    assert block.block_id not in pool.evictor, (
        f"reuse takes the cached block out of the evictor: block {block.block_id} is still in it"
    )
    assert pool.num_free_blocks == 1, (
        f"a reused block is in use, no longer free: expected 1 free of 2, got "
        f"{pool.num_free_blocks}"
    )
    assert pool.reuse(block.block_id).ref_count == 2, (
        f"reusing a block in use adds a holder: expected ref_count 2, got {block.ref_count}"
    )


def allocate_and_free(num_blocks: int, count: int = 2048):
    """A fresh pool of ``num_blocks`` (untimed) and the measured call: ``count`` allocations,
    then as many frees."""
    pool = BlockAllocator(Device.GPU, num_blocks)

    def run():
        blocks = [pool.allocate() for _ in range(count)]
        for block in blocks:
            pool.free(block)

    return run


def test_part2_allocate_and_free_cost_the_same_in_a_pool_32_times_larger():
    small, large = fastest_ratio(
        lambda: allocate_and_free(8192), lambda: allocate_and_free(8192 * 32), repeats=5
    )
    assert large < 4 * small, (
        f"2,048 allocations and frees took {large * 1e3:.1f} ms of CPU in a pool of 262,144 "
        f"blocks and {small * 1e3:.1f} ms in a pool of 8,192: allocate and free must be O(1), "
        "whatever the pool's size (a list's pop(0) or remove is O(n): use a deque)"
    )


def test_part2_reuse_of_a_free_block_without_content_is_rejected():
    pool = BlockAllocator(Device.GPU, 2)
    with pytest.raises(ValueError):
        pool.reuse(0)
    for outside in (5, 2, -1):
        with pytest.raises(ValueError):
            pool.reuse(outside)
    assert pool.num_free_blocks == 2, (
        f"a rejected reuse changes no count: expected 2 free, got {pool.num_free_blocks}"
    )


def test_part2_reuse_of_a_negative_id_is_rejected_even_when_the_last_block_is_in_use():
    pool = BlockAllocator(Device.GPU, 2)
    blocks = [pool.allocate(), pool.allocate()]
    with pytest.raises(ValueError):
        pool.reuse(-1)  # outside the pool, not Python's "last block"
    assert [block.ref_count for block in blocks] == [1, 1], (
        f"a rejected reuse adds no holder: ref counts {[block.ref_count for block in blocks]}"
    )


@given(ops=st.lists(st.tuples(st.sampled_from(["alloc", "free", "share"]), st.integers(0, 5))))
@FAST
def test_part2_free_plus_used_is_always_the_pool_size(ops):
    pool = BlockAllocator(Device.GPU, 6)
    holders = {i: 0 for i in range(6)}  # the model: how many holders each block has
    for op, i in ops:
        if op == "alloc":
            if sum(h == 0 for h in holders.values()) == 0:
                with pytest.raises(NoFreeBlocksError):
                    pool.allocate()
            else:
                block = pool.allocate()
                assert holders[block.block_id] == 0, f"allocate gave block {block.block_id}, in use"
                holders[block.block_id] = 1
        elif op == "free" and holders[i] > 0:
            pool.free(pool.blocks[i])
            holders[i] -= 1
        elif op == "share" and holders[i] > 0:
            pool.share(pool.blocks[i])
            holders[i] += 1
        used = sum(h > 0 for h in holders.values())
        assert pool.num_free_blocks + used == 6, (
            f"free ({pool.num_free_blocks}) + used ({used}) must equal the pool size 6"
        )
        assert [b.ref_count for b in pool.blocks] == [holders[i] for i in range(6)], (
            "each block's ref_count counts its holders (allocate 1, share +1, free -1): "
            f"expected {[holders[i] for i in range(6)]}, got {[b.ref_count for b in pool.blocks]}"
        )


def test_part2_negative_pool_size_error_names_the_value():
    with pytest.raises(ValueError, match=r"\bnum_blocks must be >= 0, got -1\b"):
        BlockAllocator(Device.GPU, -1)


def test_part2_exhausted_pool_error_names_the_device_and_the_pool_size():
    pool = BlockAllocator(Device.GPU, 2)
    pool.allocate()
    pool.allocate()
    message = r"\bthe gpu pool has no free block: all 2 are in use\b"
    with pytest.raises(NoFreeBlocksError, match=message):
        pool.allocate()


def test_part2_sharing_a_free_block_error_names_the_block():
    pool = BlockAllocator(Device.GPU, 2)
    with pytest.raises(ValueError, match=r"\bgpu block 0 is free: allocate it, do not share it\b"):
        pool.share(pool.blocks[0])


def test_part2_double_free_error_names_the_block():
    pool = BlockAllocator(Device.GPU, 4)
    block = [pool.allocate() for _ in range(4)][3]
    pool.free(block)
    with pytest.raises(DoubleFreeError, match=r"\bdouble free: gpu block 3 is already free\b"):
        pool.free(block)


@pytest.mark.parametrize(
    ("device", "block_id", "message"),
    [
        (Device.CPU, 0, r"\bcpu block 0 does not belong to this gpu pool of 4 blocks\b"),
        # an id equal to the pool's size is foreign too: a ValueError, not an IndexError
        (Device.GPU, 4, r"\bgpu block 4 does not belong to this gpu pool of 4 blocks\b"),
    ],
    ids=["another-device", "id-equal-to-the-pool-size"],
)
def test_part2_a_foreign_block_error_names_the_block_and_the_pool(device, block_id, message):
    pool = BlockAllocator(Device.GPU, 4)
    with pytest.raises(ValueError, match=message):
        pool.free(Block(block_id, device, ref_count=1))
    assert pool.num_free_blocks == 4, (
        f"a rejected free changes no count: expected 4 free, got {pool.num_free_blocks}"
    )


def test_part2_reuse_of_an_id_outside_the_pool_error_names_the_valid_range():
    pool = BlockAllocator(Device.GPU, 2)
    with pytest.raises(ValueError, match=r"\bblock id 5 is outside the gpu pool \(0\.\.1\)"):
        pool.reuse(5)


def test_part2_reuse_of_a_free_block_without_content_error_names_the_block():
    pool = BlockAllocator(Device.GPU, 2)
    message = r"\bgpu block 0 is free and holds no cached content\b"
    with pytest.raises(ValueError, match=message):
        pool.reuse(0)


# --------------------------------------------------------------------------------------------
# Part 1.3: BlockManager
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"block_size": 0, "num_gpu_blocks": 4},
        {"block_size": -4, "num_gpu_blocks": 4},
        {"block_size": True, "num_gpu_blocks": 4},
        {"block_size": 2.0, "num_gpu_blocks": 4},
        {"block_size": 4, "num_gpu_blocks": 0},
        {"block_size": 4, "num_gpu_blocks": 4, "num_cpu_blocks": -1},
        {"block_size": 4, "num_gpu_blocks": 4, "watermark": 1.0},
        {"block_size": 4, "num_gpu_blocks": 4, "watermark": -0.1},
    ],
)
def test_part3_rejects_bad_configuration(kwargs):
    with pytest.raises(ValueError):
        BlockManager(**kwargs)


def test_part3_default_watermark_is_one_percent_of_the_gpu_pool():
    assert BlockManager(16, 1000).watermark_blocks == 10, (
        "watermark_blocks is int(watermark * num_gpu_blocks): the default watermark 0.01 of "
        "1000 GPU blocks is 10"
    )
    assert BlockManager(16, 99).watermark_blocks == 0, (
        "watermark_blocks is int(watermark * num_gpu_blocks), rounded down: int(0.01 * 99) == 0"
    )


def test_part3_allocate_gives_one_block_per_logical_block():
    bm = BlockManager(block_size=4, num_gpu_blocks=10, watermark=0.0)
    seq = make_seq(1, 9, 4)
    assert bm.can_allocate(seq) is AllocStatus.OK, (
        "9 tokens need 3 blocks, 10 are free and the watermark is 0: can_allocate expected OK"
    )
    bm.allocate(seq)
    assert len(seq.block_table) == 3, f"9 tokens in blocks of 4 need 3 blocks: {seq.block_table}"
    assert len(set(seq.block_table)) == 3, (
        f"a block table never holds a block twice: {seq.block_table}"
    )
    assert bm.num_free_gpu_blocks == 7, (
        "allocate takes one GPU block per logical block: 10 - 3 = 7 free expected, got "
        f"{bm.num_free_gpu_blocks}"
    )
    assert bm.get_block_table(seq) == seq.block_table, (
        f"get_block_table returns the sequence's block table {seq.block_table}"
    )
    assert all(bm.gpu_allocator.blocks[b].ref_count == 1 for b in seq.block_table), (
        "a newly allocated block has one holder: expected ref counts all 1, got "
        f"{[bm.gpu_allocator.blocks[b].ref_count for b in seq.block_table]}"
    )
    assert bm.device_of(seq) is Device.GPU, (
        f"allocate puts the sequence's blocks on the GPU: device_of expected Device.GPU, got "
        f"{bm.device_of(seq)}"
    )


@pytest.mark.parametrize("k", [1, 3])
def test_part3_prompt_of_exactly_k_blocks_takes_k_blocks(k):
    bm = BlockManager(block_size=4, num_gpu_blocks=8, watermark=0.0)
    seq = make_seq(1, 4 * k, 4)
    bm.allocate(seq)
    assert len(seq.block_table) == k, (
        f"{4 * k} tokens fill exactly {k} blocks of 4, no more: got table {seq.block_table}"
    )


def test_part3_block_size_one_takes_a_block_per_token():
    bm = BlockManager(block_size=1, num_gpu_blocks=8, watermark=0.0)
    seq = make_seq(1, 3, 1)
    bm.allocate(seq)
    assert len(seq.block_table) == 3, (
        f"with block size 1 a 3-token prompt takes 3 blocks, got table {seq.block_table}"
    )
    for n in range(4, 9):
        seq.append_token(n)
        bm.append_slot(seq)
        assert len(seq.block_table) == n, (
            f"with block size 1 every token needs a new block: {n} tokens, expected {n} "
            f"blocks, got {len(seq.block_table)}"
        )
    assert bm.num_free_gpu_blocks == 0, (
        "8 tokens of block size 1 hold all 8 GPU blocks: expected 0 free, got "
        f"{bm.num_free_gpu_blocks}"
    )


def test_part3_prompt_longer_than_the_whole_pool_is_never_allocatable():
    bm = BlockManager(block_size=4, num_gpu_blocks=4, watermark=0.0)
    seq = make_seq(1, 17, 4)  # 5 blocks > 4
    assert bm.can_allocate(seq) is AllocStatus.NEVER, (
        "a prompt needing 5 blocks can never fit a pool of 4: expected NEVER"
    )
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(seq)
    assert bm.num_free_gpu_blocks == 4, (
        "allocate is all or nothing: a prompt that does not fit takes no block, expected 4 "
        f"free, got {bm.num_free_gpu_blocks}"
    )
    assert seq.block_table == [], f"a failed allocate leaves the table empty, got {seq.block_table}"


@pytest.mark.parametrize(
    ("free_blocks", "need", "expected"),
    [
        # pool of 100 blocks, watermark 10 %: 10 blocks must stay free after admission
        (100, 90, AllocStatus.OK),  # 100 - 90 = 10 >= 10
        (100, 91, AllocStatus.NEVER),  # 100 - 91 = 9 < 10 even in an empty pool
        (50, 40, AllocStatus.OK),  # 50 - 40 = 10: exactly at the watermark
        (50, 41, AllocStatus.LATER),  # 50 - 41 = 9: fits the pool, not now
        (10, 1, AllocStatus.LATER),  # any admission would dip below the watermark
    ],
)
def test_part3_can_allocate_watermark_boundary(free_blocks, need, expected):
    bm = BlockManager(block_size=1, num_gpu_blocks=100, watermark=0.1)
    assert bm.watermark_blocks == 10, (
        "watermark_blocks is int(watermark * num_gpu_blocks): int(0.1 * 100) = 10 expected, "
        f"got {bm.watermark_blocks}"
    )
    if free_blocks < 100:
        bm.allocate(make_seq(0, 100 - free_blocks, 1))
    status = bm.can_allocate(make_seq(1, need, 1))
    assert status is expected, (
        f"pool 100, watermark 10, {free_blocks} free, need {need}: expected {expected.name}, "
        f"got {status.name}"
    )


def test_part3_allocating_a_sequence_twice_raises_and_changes_nothing():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, watermark=0.0)
    seq = make_seq(1, 5, 4)
    bm.allocate(seq)
    table, counts = list(seq.block_table), pool_counts(bm)
    with pytest.raises(ValueError):
        bm.allocate(seq)
    assert seq.block_table == table, (
        "allocate refuses a sequence that already holds blocks and leaves its table unchanged: "
        f"expected {table}, got {seq.block_table}"
    )
    assert pool_counts(bm) == counts, (
        f"a rejected allocate changes no count: counts {counts} before, {pool_counts(bm)} after"
    )


def test_part3_allocate_without_room_raises_and_changes_nothing():
    bm = BlockManager(block_size=4, num_gpu_blocks=3, watermark=0.0)
    bm.allocate(make_seq(1, 8, 4))
    seq, counts = make_seq(2, 8, 4), pool_counts(bm)
    assert bm.can_allocate(seq) is AllocStatus.LATER, (
        "a prompt of 2 blocks fits a pool of 3 but only 1 block is free now: can_allocate "
        "expected LATER"
    )
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(seq)
    assert pool_counts(bm) == counts, (
        "allocate is all or nothing: no block may be taken when the sequence does not fit; "
        f"counts {counts} before, {pool_counts(bm)} after"
    )
    assert seq.block_table == [], f"a failed allocate leaves the table empty, got {seq.block_table}"


@pytest.mark.parametrize("block_size", [1, 2, 4, 16])
def test_part3_append_slot_adds_a_block_exactly_when_the_new_token_opens_one(block_size):
    bm = BlockManager(block_size=block_size, num_gpu_blocks=64, watermark=0.0)
    seq = make_seq(1, 3, block_size)
    bm.allocate(seq)
    for _ in range(40):
        seq.append_token(7)
        before = len(seq.block_table)
        opens_block = (seq.num_tokens - 1) % block_size == 0
        assert bm.append_slot(seq) is None, "append_slot on an unshared block copies nothing"
        grew = len(seq.block_table) - before
        assert grew == int(opens_block), (
            f"block size {block_size}, token #{seq.num_tokens} (position {seq.num_tokens - 1}): "
            f"expected {int(opens_block)} new block(s), got {grew}"
        )
        assert len(seq.block_table) == ceil_div(seq.num_tokens, block_size), (
            f"the blocks always cover every token: {seq.num_tokens} tokens in blocks of "
            f"{block_size} need {ceil_div(seq.num_tokens, block_size)} blocks, the table has "
            f"{len(seq.block_table)}"
        )


def test_part3_can_append_slot_needs_a_free_block_only_for_a_new_block():
    bm = BlockManager(block_size=4, num_gpu_blocks=2, watermark=0.0)
    seq = make_seq(1, 7, 4)
    bm.allocate(seq)  # both blocks taken, 1 slot left in the last one
    assert bm.num_free_gpu_blocks == 0, (
        "7 tokens in blocks of 4 take both blocks of a pool of 2: expected 0 free, got "
        f"{bm.num_free_gpu_blocks}"
    )
    seq.append_token(1)  # token #8 fits in the last block
    assert bm.can_append_slot(seq), "token 8 of blocks of 4 fits in the last block"
    bm.append_slot(seq)
    seq.append_token(1)  # token #9 opens a third block
    assert not bm.can_append_slot(seq), "token 9 needs a new block and none is free"
    counts = pool_counts(bm)
    with pytest.raises(NoFreeBlocksError):
        bm.append_slot(seq)
    assert pool_counts(bm) == counts, (
        f"a failed append_slot changes no count: counts {counts} before, {pool_counts(bm)} after"
    )
    assert len(seq.block_table) == 2, (
        f"a failed append_slot leaves the table unchanged: expected 2 blocks, got {seq.block_table}"
    )


def test_part3_can_append_slot_ignores_the_watermark():
    bm = BlockManager(block_size=1, num_gpu_blocks=100, watermark=0.05)
    seq = make_seq(1, 99, 1)
    bm.allocate(seq)
    seq.append_token(1)
    assert bm.can_append_slot(seq), "running sequences may use the watermark's blocks"


def test_part3_append_slot_rejects_a_sequence_more_than_one_token_past_its_blocks():
    bm = BlockManager(block_size=2, num_gpu_blocks=8, watermark=0.0)
    seq = make_seq(1, 2, 2)
    bm.allocate(seq)
    seq.append_token(1)
    seq.append_token(2)
    counts = pool_counts(bm)
    with pytest.raises(ValueError):
        bm.append_slot(seq)
    assert pool_counts(bm) == counts, (
        "append_slot must follow every appended token: a sequence 2 tokens past its blocks is "
        f"refused and no count changes; counts {counts} before, {pool_counts(bm)} after"
    )


def test_part3_append_slot_requires_the_sequence_on_the_gpu():
    bm = BlockManager(block_size=2, num_gpu_blocks=8, watermark=0.0)
    with pytest.raises(ValueError):
        bm.append_slot(make_seq(1, 2, 2))


def test_part3_append_slot_refuses_a_sequence_whose_blocks_are_on_the_cpu():
    # swap_out (part 1.4) would move the blocks; _device_of (the constructor's docstring) is
    # what it records, so set it as swap_out would and keep this test to part 1.3
    bm = BlockManager(block_size=4, num_gpu_blocks=8, watermark=0.0)
    seq = make_seq(1, 5, 4)
    bm.allocate(seq)
    bm._device_of[seq.seq_id] = Device.CPU
    message = (
        r"\bsequence 1 has its blocks on the cpu; this operation needs its blocks on the gpu\b"
    )
    for more in (0, 4):  # 5 tokens: the newest fits in its last block; 9: it opens a block
        for _ in range(more):
            seq.append_token(1)
        counts, table = pool_counts(bm), list(seq.block_table)
        with pytest.raises(ValueError, match=message):
            bm.append_slot(seq)
        assert (pool_counts(bm), seq.block_table) == (counts, table), (
            "append_slot on a sequence whose blocks are on the CPU changes nothing: counts "
            f"{counts} and table {table} before, {pool_counts(bm)} and {seq.block_table} after"
        )


def test_part3_fork_shares_every_block_without_allocating():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, watermark=0.0)
    parent, child = make_seq(1, 6, 4), make_seq(2, 6, 4)
    bm.allocate(parent)
    bm.fork(parent, child)
    assert child.block_table == parent.block_table, (
        f"fork lets the child share all of the parent's blocks: expected {parent.block_table}, "
        f"got {child.block_table}"
    )
    assert child.block_table is not parent.block_table, (
        "the child needs its own list (an equal copy, not the parent's list object)"
    )
    assert bm.num_free_gpu_blocks == 6, (
        f"fork allocates nothing: expected 6 free, got {bm.num_free_gpu_blocks}"
    )
    assert [bm.gpu_allocator.blocks[b].ref_count for b in parent.block_table] == [2, 2], (
        "fork adds a holder to each of the parent's blocks: ref counts expected [2, 2], got "
        f"{[bm.gpu_allocator.blocks[b].ref_count for b in parent.block_table]}"
    )


def test_part3_copy_on_write_replaces_the_last_block_of_a_longer_table():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, watermark=0.0)
    parent, child = make_seq(1, 10, 4), make_seq(2, 10, 4)  # 3 blocks, the last half full
    bm.allocate(parent)
    bm.fork(parent, child)
    table = list(parent.block_table)
    parent.append_token(1)
    src, dst = bm.append_slot(parent)
    assert src == table[2], (
        f"the block copied is the last one (logical block 2, {table[2]}), got {src}"
    )
    assert parent.block_table == [table[0], table[1], dst], (
        f"only the last entry of the table changes: expected {[table[0], table[1], dst]}, got "
        f"{parent.block_table}"
    )


def test_part3_append_into_a_shared_last_block_copies_on_write():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, watermark=0.0)
    parent, child = make_seq(1, 6, 4), make_seq(2, 6, 4)
    bm.allocate(parent)
    bm.fork(parent, child)
    shared_first, shared_last = parent.block_table
    parent.append_token(1)  # token #7 goes into the shared, partly full last block
    copy = bm.append_slot(parent)
    assert copy is not None, "writing into a block another sequence holds needs a copy"
    src, dst = copy
    assert src == shared_last, (
        f"copy-on-write copies the shared, partly full last block: src expected {shared_last}, "
        f"got {src}"
    )
    assert dst not in (shared_first, shared_last), (
        f"copy-on-write copies into a fresh block: dst {dst} is one of the shared blocks "
        f"{[shared_first, shared_last]}"
    )
    assert parent.block_table == [shared_first, dst], (
        f"the writer moves to the copy: expected {[shared_first, dst]}, got {parent.block_table}"
    )
    assert child.block_table == [shared_first, shared_last], (
        f"the other holder keeps the original: expected {[shared_first, shared_last]}, got "
        f"{child.block_table}"
    )
    refs = {b: bm.gpu_allocator.blocks[b].ref_count for b in (shared_first, shared_last, dst)}
    assert refs == {shared_first: 2, shared_last: 1, dst: 1}, (
        "the writer drops its reference to the old block and holds the copy: ref counts "
        f"expected { ({shared_first: 2, shared_last: 1, dst: 1}) }, got {refs}"
    )
    child.append_token(1)
    assert bm.append_slot(child) is None, "the child is the last holder now: no copy"


def test_part3_a_token_that_fills_a_shared_last_block_copies_it_and_adds_no_block():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, watermark=0.0)
    parent, child = make_seq(1, 3, 4), make_seq(2, 3, 4)
    bm.allocate(parent)
    bm.fork(parent, child)
    (shared,) = parent.block_table
    parent.append_token(1)  # token #4 takes the last slot of the shared block
    copy = bm.append_slot(parent)
    assert copy is not None and copy[0] == shared, (
        f"4 tokens fit in one block of 4, which the child holds too: the newest token's write "
        f"needs a copy of block {shared}, append_slot returned {copy}"
    )
    assert parent.block_table == [copy[1]], (
        f"the block is copied, not extended: expected the table [{copy[1]}], got "
        f"{parent.block_table}"
    )


def test_part3_can_append_slot_counts_the_block_a_copy_on_write_needs():
    bm = BlockManager(block_size=4, num_gpu_blocks=2, watermark=0.0)
    parent, child = make_seq(1, 6, 4), make_seq(2, 6, 4)
    bm.allocate(parent)
    bm.fork(parent, child)
    assert bm.num_free_gpu_blocks == 0, (
        "the parent's 2 blocks fill the pool of 2 and fork allocates nothing: expected 0 free, "
        f"got {bm.num_free_gpu_blocks}"
    )
    parent.append_token(1)  # token 7 fits in the last block, but that block is shared
    assert not bm.can_append_slot(parent), (
        "writing into a shared block needs a copy, and no block is free for it"
    )
    counts = pool_counts(bm)
    with pytest.raises(NoFreeBlocksError):
        bm.append_slot(parent)
    assert pool_counts(bm) == counts, (
        f"a failed append_slot changes no count: counts {counts} before, {pool_counts(bm)} after"
    )
    assert parent.block_table == child.block_table, (
        "a failed copy-on-write leaves the parent on the shared blocks: parent "
        f"{parent.block_table}, child {child.block_table}"
    )


def test_part3_a_token_past_a_full_shared_block_opens_a_block_without_copying():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, watermark=0.0)
    parent, child = make_seq(1, 8, 4), make_seq(2, 8, 4)
    bm.allocate(parent)
    bm.fork(parent, child)
    shared = list(parent.block_table)
    parent.append_token(1)  # token 9 opens a third block: nothing shared is written
    assert bm.append_slot(parent) is None, "no copy: the new token goes into a new block"
    assert parent.block_table[:2] == shared, (
        "nothing shared is written, so the full shared blocks stay in the parent's table: "
        f"expected {shared} first, got {parent.block_table}"
    )
    assert len(parent.block_table) == 3, (
        f"token 9 in blocks of 4 opens a third block: expected 3 blocks, got {parent.block_table}"
    )
    assert [bm.gpu_allocator.blocks[b].ref_count for b in shared] == [2, 2], (
        "no copy was made, so both shared blocks keep their 2 holders: ref counts expected "
        f"[2, 2], got {[bm.gpu_allocator.blocks[b].ref_count for b in shared]}"
    )


def test_part3_fork_into_a_child_that_holds_blocks_is_rejected():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, watermark=0.0)
    parent, child = make_seq(1, 5, 4), make_seq(2, 3, 4)
    bm.allocate(parent)
    bm.allocate(child)
    counts, table = pool_counts(bm), list(child.block_table)
    with pytest.raises(ValueError):
        bm.fork(parent, child)
    assert pool_counts(bm) == counts, (
        "fork into a child that already holds blocks is refused and changes no count: counts "
        f"{counts} before, {pool_counts(bm)} after"
    )
    assert child.block_table == table, (
        f"a refused fork leaves the child's table unchanged: expected {table}, got "
        f"{child.block_table}"
    )


def test_part3_a_sequence_of_another_block_size_is_rejected():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, watermark=0.0)
    with pytest.raises(ValueError, match="block size"):
        bm.allocate(make_seq(1, 8, 2))
    parent = make_seq(2, 4, 4)
    bm.allocate(parent)
    with pytest.raises(ValueError, match="block size"):
        bm.fork(parent, make_seq(3, 4, 2))
    assert bm.num_free_gpu_blocks == 7, (
        "a refused allocate or fork takes no block: only the parent's block is in use, "
        f"expected 7 free, got {bm.num_free_gpu_blocks}"
    )


def test_part3_slot_mapping_rejects_a_token_that_has_no_slot_yet():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, watermark=0.0)
    seq = make_seq(1, 8, 4)
    bm.allocate(seq)
    seq.append_token(1)  # position 8 needs a third block, not given yet
    with pytest.raises(ValueError):
        bm.get_slot_mapping(seq, 0, 9)
    bm.append_slot(seq)
    assert len(bm.get_slot_mapping(seq, 0, 9)) == 9, (
        "once append_slot gave position 8 its block, get_slot_mapping(seq, 0, 9) gives one slot "
        "per position: expected 9 slots"
    )


def test_part3_free_returns_the_blocks_last_first():
    bm = BlockManager(block_size=4, num_gpu_blocks=3, watermark=0.0)
    seq = make_seq(1, 12, 4)
    bm.allocate(seq)
    table = list(seq.block_table)
    bm.free(seq)
    again = [bm.gpu_allocator.allocate().block_id for _ in range(3)]
    assert again == table[::-1], (
        f"free returns a table's blocks last first, so the free list hands them out again in "
        f"that order: expected {table[::-1]}, got {again}"
    )


def test_part3_free_returns_every_block_and_empties_the_table():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, watermark=0.0)
    a, b = make_seq(1, 9, 4), make_seq(2, 4, 4)
    bm.allocate(a)
    bm.allocate(b)
    bm.free(a)
    assert a.block_table == [], f"free empties the block table, got {a.block_table}"
    assert bm.device_of(a) is None, (
        f"a freed sequence holds nothing: device_of expected None, got {bm.device_of(a)}"
    )
    assert bm.num_free_gpu_blocks == 7, (
        f"free(a) must return all 3 of a's blocks: expected 7 free, got {bm.num_free_gpu_blocks}"
    )
    bm.free(b)
    assert bm.num_free_gpu_blocks == 8, (
        f"after freeing every sequence all 8 blocks are free, got {bm.num_free_gpu_blocks}"
    )
    assert all(block.ref_count == 0 for block in bm.gpu_allocator.blocks), (
        "after freeing every sequence, every block has ref_count 0: got "
        f"{[block.ref_count for block in bm.gpu_allocator.blocks]}"
    )


def test_part3_freeing_a_forked_parent_keeps_the_childs_blocks():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, watermark=0.0)
    parent, child = make_seq(1, 8, 4), make_seq(2, 8, 4)
    bm.allocate(parent)
    bm.fork(parent, child)
    bm.free(parent)
    assert bm.num_free_gpu_blocks == 6, (
        f"the child still holds both blocks: expected 6 free, got {bm.num_free_gpu_blocks}"
    )
    assert all(bm.gpu_allocator.blocks[b].ref_count == 1 for b in child.block_table), (
        "freeing the parent drops one holder of each shared block: the child's blocks "
        f"expected ref counts all 1, got "
        f"{[bm.gpu_allocator.blocks[b].ref_count for b in child.block_table]}"
    )


def test_part3_double_free_of_a_sequence_raises_and_changes_nothing():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, watermark=0.0)
    seq, other = make_seq(1, 9, 4), make_seq(2, 5, 4)
    bm.allocate(seq)
    bm.allocate(other)
    bm.free(seq)
    counts = pool_counts(bm)
    with pytest.raises(ValueError):
        bm.free(seq)
    assert pool_counts(bm) == counts, (
        f"a rejected free changes no count: counts {counts} before, {pool_counts(bm)} after"
    )


def test_part3_freeing_an_unknown_sequence_raises():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, watermark=0.0)
    counts = pool_counts(bm)
    with pytest.raises(ValueError):
        bm.free(make_seq(5, 3, 4))
    assert pool_counts(bm) == counts, (
        "free of a sequence that holds no blocks raises ValueError and changes no count: "
        f"counts {counts} before, {pool_counts(bm)} after"
    )


def test_part3_slot_mapping_follows_the_block_table():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, watermark=0.0)
    filler = make_seq(0, 4, 4)
    bm.allocate(filler)  # take a block so the sequence's blocks are not 0, 1, 2
    seq = make_seq(1, 10, 4)
    bm.allocate(seq)
    table = seq.block_table
    expected = [table[pos // 4] * 4 + pos % 4 for pos in range(10)]
    assert bm.get_slot_mapping(seq, 0, 10) == expected, (
        f"slot of position p is block_table[p // 4] * 4 + p % 4 with table {table}"
    )
    assert bm.get_slot_mapping(seq, 9, 10) == expected[9:], (
        f"a decode step maps only its token: [9, 10) expected {expected[9:]}"
    )
    assert bm.get_slot_mapping(seq, 3, 3) == [], "an empty range [3, 3) maps to no slot"


def test_part3_slot_mapping_needs_the_blocks_on_the_gpu_even_for_an_empty_range():
    # where a sequence's blocks are is checked first, whatever the range; the CPU holding is
    # set as swap_out (part 1.4) records it, to keep this test to part 1.3
    bm = BlockManager(block_size=4, num_gpu_blocks=8, watermark=0.0)
    unallocated, on_cpu = make_seq(1, 5, 4), make_seq(2, 5, 4)
    bm.allocate(on_cpu)
    bm._device_of[on_cpu.seq_id] = Device.CPU
    for seq, where in ((unallocated, "no blocks"), (on_cpu, "its blocks on the cpu")):
        message = (
            rf"\bsequence {seq.seq_id} has {where}; this operation needs its blocks on the gpu\b"
        )
        for start, end in ((0, 0), (0, 1)):
            with pytest.raises(ValueError, match=message):
                bm.get_slot_mapping(seq, start, end)


@pytest.mark.parametrize(("start", "end"), [(-1, 2), (3, 2), (0, 11)])
def test_part3_slot_mapping_rejects_a_range_outside_the_tokens(start, end):
    bm = BlockManager(block_size=4, num_gpu_blocks=8, watermark=0.0)
    seq = make_seq(1, 10, 4)
    bm.allocate(seq)
    with pytest.raises(ValueError):
        bm.get_slot_mapping(seq, start, end)


def test_part3_usage_is_the_fraction_of_blocks_in_use():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=4, watermark=0.0)
    assert bm.gpu_usage == 0.0 and bm.cpu_usage == 0.0, (
        "with no block in use both pools are 0 % used: expected gpu_usage 0.0 and cpu_usage "
        f"0.0, got {bm.gpu_usage} and {bm.cpu_usage}"
    )
    bm.allocate(make_seq(1, 8, 4))
    assert bm.gpu_usage == pytest.approx(2 / 8), (
        f"gpu_usage is the fraction of GPU blocks in use: 2 of 8 = 0.25, got {bm.gpu_usage}"
    )
    assert bm.num_gpu_blocks == 8, (
        f"num_gpu_blocks is the GPU pool's size: expected 8, got {bm.num_gpu_blocks}"
    )


def test_part3_cpu_usage_is_zero_for_an_empty_cpu_pool():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=0, watermark=0.0)
    bm.allocate(make_seq(1, 8, 4))
    assert bm.cpu_usage == 0.0, "a CPU pool of 0 blocks is 0 % used (not a division by zero)"


def test_part3_cpu_usage_is_the_fraction_of_cpu_blocks_in_use():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=4, watermark=0.0)
    bm.cpu_allocator.allocate()  # as a swap-out would (part 1.4)
    assert (bm.cpu_usage, bm.gpu_usage) == (pytest.approx(1 / 4), 0.0), (
        f"1 of 4 CPU blocks is in use: cpu_usage 0.25, got {bm.cpu_usage}"
    )


def test_part3_get_block_table_is_a_copy():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, watermark=0.0)
    seq = make_seq(1, 5, 4)
    bm.allocate(seq)
    bm.get_block_table(seq).append(99)
    assert len(seq.block_table) == 2, (
        f"get_block_table returns a copy: changing it changed the table to {seq.block_table}"
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_size": 0}, r"\bblock_size must be a positive integer, got 0\b"),
        ({"num_gpu_blocks": 0}, r"\bnum_gpu_blocks must be >= 1, got 0\b"),
        ({"watermark": 1.0}, r"\bwatermark must be in \[0, 1\), got 1\.0\b"),
    ],
    ids=["block_size", "num_gpu_blocks", "watermark"],
)
def test_part3_bad_configuration_error_names_the_argument_and_its_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BlockManager(**({"block_size": 4, "num_gpu_blocks": 4} | kwargs))


def test_part3_default_manager_has_no_cpu_pool():
    bm = BlockManager(block_size=4, num_gpu_blocks=8)
    assert bm.cpu_allocator.num_blocks == 0, (
        "num_cpu_blocks defaults to 0: a manager built without it has a CPU pool of 0 blocks, "
        f"got {bm.cpu_allocator.num_blocks}"
    )


def test_part3_each_pool_is_on_its_own_device():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=2)
    assert bm.gpu_allocator.device is Device.GPU, (
        f"gpu_allocator is BlockAllocator(Device.GPU, ...): got device {bm.gpu_allocator.device}"
    )
    assert bm.cpu_allocator.device is Device.CPU, (
        f"cpu_allocator is BlockAllocator(Device.CPU, ...): got device {bm.cpu_allocator.device}"
    )
    devices = [block.device for block in bm.cpu_allocator.blocks]
    assert devices == [Device.CPU, Device.CPU], (
        f"the CPU pool's 2 blocks are CPU blocks: got devices {devices}"
    )


def test_part3_allocate_without_room_error_names_the_need_and_the_free_blocks():
    bm = BlockManager(block_size=4, num_gpu_blocks=3, watermark=0.0)
    bm.allocate(make_seq(1, 8, 4))
    with pytest.raises(NoFreeBlocksError, match=r"\bsequence 2 needs 2 GPU blocks, 1 are free\b"):
        bm.allocate(make_seq(2, 8, 4))


def test_part3_wrong_device_error_says_where_the_blocks_are_and_where_they_must_be():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, watermark=0.0)
    seq = make_seq(1, 5, 4)
    message = r"\bsequence 1 has no blocks; this operation needs its blocks on the gpu\b"
    with pytest.raises(ValueError, match=message):
        bm.append_slot(seq)
    bm.allocate(seq)
    message = r"\bsequence 1 has its blocks on the gpu; this operation needs no blocks\b"
    with pytest.raises(ValueError, match=message):
        bm.allocate(seq)


def test_part3_append_slot_without_a_free_block_error_names_the_sequence():
    bm = BlockManager(block_size=4, num_gpu_blocks=1, watermark=0.0)
    seq = make_seq(1, 4, 4)
    bm.allocate(seq)
    seq.append_token(1)  # token 5 opens a second block; the pool of 1 has none left
    message = r"\bsequence 1 needs a GPU block and none is free\b"
    with pytest.raises(NoFreeBlocksError, match=message):
        bm.append_slot(seq)


def test_part3_a_sequence_two_tokens_past_its_blocks_error_names_both_counts():
    bm = BlockManager(block_size=2, num_gpu_blocks=8, watermark=0.0)
    seq = make_seq(1, 2, 2)
    bm.allocate(seq)
    seq.append_token(1)
    seq.append_token(2)
    message = (
        r"\bsequence 1 has 4 tokens but blocks for 2: "
        r"append_slot must follow every appended token\b"
    )
    with pytest.raises(ValueError, match=message):
        bm.append_slot(seq)


def test_part3_freeing_a_sequence_without_blocks_error_names_it():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, watermark=0.0)
    message = r"\bfree: sequence 5 holds no blocks \(never allocated, or already freed\)"
    with pytest.raises(ValueError, match=message):
        bm.free(make_seq(5, 3, 4))


def test_part3_slot_range_error_names_the_range_and_the_positions_with_slots():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, watermark=0.0)
    seq = make_seq(1, 10, 4)
    bm.allocate(seq)
    message = (
        r"\bslot range \[0, 11\) is outside the 10 positions sequence 1 has slots for "
        r"\(10 tokens\)"
    )
    with pytest.raises(ValueError, match=message):
        bm.get_slot_mapping(seq, 0, 11)


def test_part3_copy_on_write_with_exactly_one_free_block_succeeds():
    bm = BlockManager(block_size=4, num_gpu_blocks=3, watermark=0.0)
    parent, child = make_seq(1, 6, 4), make_seq(2, 6, 4)
    bm.allocate(parent)
    bm.fork(parent, child)
    shared_last = parent.block_table[-1]
    assert bm.num_free_gpu_blocks == 1, (
        "the parent's 2 blocks of a pool of 3, shared by fork: expected 1 free, got "
        f"{bm.num_free_gpu_blocks}"
    )
    parent.append_token(1)  # token 7 goes into the shared last block: a copy takes 1 block
    assert bm.can_append_slot(parent), (
        "a copy-on-write needs exactly 1 block and 1 is free: can_append_slot must be True"
    )
    copy = bm.append_slot(parent)
    assert copy is not None and copy[0] == shared_last, (
        f"the shared last block {shared_last} is copied on write: expected ({shared_last}, "
        f"new block), got {copy}"
    )
    assert bm.num_free_gpu_blocks == 0, (
        f"the copy takes the last free block: expected 0 free, got {bm.num_free_gpu_blocks}"
    )


# --------------------------------------------------------------------------------------------
# Part 1.4: Swapper (through the BlockManager's swap methods)
# --------------------------------------------------------------------------------------------


def test_part4_swap_out_moves_the_blocks_to_the_cpu_pool():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=8, watermark=0.0)
    seq = make_seq(1, 10, 4)
    bm.allocate(seq)
    gpu_table = list(seq.block_table)
    assert bm.can_swap_out([seq]), (
        "the group's 3 GPU blocks fit in the 8 free CPU blocks: can_swap_out must be True"
    )
    mapping = bm.swap_out([seq])
    assert sorted(mapping) == sorted(gpu_table), (
        f"the map's keys are the GPU blocks moved: expected {sorted(gpu_table)}, got "
        f"{sorted(mapping)}"
    )
    assert seq.block_table == [mapping[b] for b in gpu_table], (
        "the table now lists the CPU copies, in the same logical order: expected "
        f"{[mapping[b] for b in gpu_table]}, got {seq.block_table}"
    )
    assert bm.device_of(seq) is Device.CPU, (
        f"swap_out puts the blocks on the CPU: device_of expected Device.CPU, got "
        f"{bm.device_of(seq)}"
    )
    assert (bm.num_free_gpu_blocks, bm.num_free_cpu_blocks) == (8, 5), (
        "swap_out frees the 3 GPU blocks and takes 3 CPU blocks: (free GPU, free CPU) expected "
        f"(8, 5), got {(bm.num_free_gpu_blocks, bm.num_free_cpu_blocks)}"
    )
    assert all(bm.cpu_allocator.blocks[b].ref_count == 1 for b in seq.block_table), (
        "a moved block keeps its ref count (1 for an unshared block): CPU ref counts "
        f"{[bm.cpu_allocator.blocks[b].ref_count for b in seq.block_table]}"
    )


def test_part4_swap_in_brings_the_blocks_back_in_order():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=8, watermark=0.0)
    seq = make_seq(1, 10, 4)
    bm.allocate(seq)
    gpu_table = list(seq.block_table)
    out = bm.swap_out([seq])
    cpu_table = list(seq.block_table)
    assert bm.can_swap_in([seq]) is AllocStatus.OK, (
        "3 blocks, the newest token has its slot, 8 free GPU blocks, watermark 0: can_swap_in "
        "expected OK"
    )
    back = bm.swap_in([seq])
    assert sorted(back) == sorted(cpu_table), (
        f"swap_in's map's keys are the CPU blocks moved: expected {sorted(cpu_table)}, got "
        f"{sorted(back)}"
    )
    assert seq.block_table == [back[out[block]] for block in gpu_table], (
        "after a round trip each logical block sits where the two maps send it: expected "
        f"{[back.get(out.get(block)) for block in gpu_table]}, got {seq.block_table}"
    )
    assert bm.device_of(seq) is Device.GPU, (
        f"swap_in puts the blocks back on the GPU: device_of expected Device.GPU, got "
        f"{bm.device_of(seq)}"
    )
    assert (bm.num_free_gpu_blocks, bm.num_free_cpu_blocks) == (5, 8), (
        "swap_in takes 3 GPU blocks and frees the 3 CPU blocks: (free GPU, free CPU) expected "
        f"(5, 8), got {(bm.num_free_gpu_blocks, bm.num_free_cpu_blocks)}"
    )
    assert bm.get_slot_mapping(seq, 0, 1) == [seq.block_table[0] * 4], (
        "after swap_in the slots follow the new GPU table: position 0 is offset 0 of block "
        f"{seq.block_table[0]}, slot {seq.block_table[0] * 4}"
    )


def test_part4_swapping_a_group_that_shares_blocks_moves_each_block_once():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=8, watermark=0.0)
    parent, child = make_seq(1, 6, 4), make_seq(2, 6, 4)
    bm.allocate(parent)
    bm.fork(parent, child)
    child.append_token(1)
    bm.append_slot(child)  # copy on write: the group shares block 0 only
    shared = parent.block_table[0]
    mapping = bm.swap_out([parent, child])
    assert len(mapping) == 3, f"3 distinct blocks move (one shared), mapping was {mapping}"
    assert parent.block_table[0] == child.block_table[0] == mapping[shared], (
        f"a shared block moves once: GPU block {shared} goes to CPU block "
        f"{mapping.get(shared)}, held by both tables; parent {parent.block_table}, child "
        f"{child.block_table}"
    )
    cpu_shared = bm.cpu_allocator.blocks[mapping[shared]]
    assert cpu_shared.ref_count == 2, (
        f"a shared block keeps its ref count when it moves: expected 2, got {cpu_shared.ref_count}"
    )
    assert bm.num_free_cpu_blocks == 5 and bm.num_free_gpu_blocks == 8, (
        "3 distinct blocks move, the shared one once: expected 5 free CPU and 8 free GPU "
        f"blocks, got {bm.num_free_cpu_blocks} and {bm.num_free_gpu_blocks}"
    )
    back = bm.swap_in([parent, child])
    assert len(back) == 3, f"swap_in moves each of the 3 distinct blocks once, map was {back}"
    assert parent.block_table[0] == child.block_table[0], (
        "the shared block comes back as one GPU block held by both: parent "
        f"{parent.block_table}, child {child.block_table}"
    )
    assert bm.gpu_allocator.blocks[parent.block_table[0]].ref_count == 2, (
        "a shared block keeps its ref count on the way back: expected 2, got "
        f"{bm.gpu_allocator.blocks[parent.block_table[0]].ref_count}"
    )
    assert bm.num_free_gpu_blocks == 5 and bm.num_free_cpu_blocks == 8, (
        "3 distinct blocks come back, the shared one once: expected 5 free GPU and 8 free CPU "
        f"blocks, got {bm.num_free_gpu_blocks} and {bm.num_free_cpu_blocks}"
    )


def test_part4_swapping_part_of_a_sharing_group_is_rejected():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=8, watermark=0.0)
    parent, child = make_seq(1, 6, 4), make_seq(2, 6, 4)
    bm.allocate(parent)
    bm.fork(parent, child)
    counts, table = pool_counts(bm), list(parent.block_table)
    with pytest.raises(ValueError):
        bm.swap_out([parent])  # the child still holds the blocks on the GPU
    assert pool_counts(bm) == counts, (
        "every holder of every block must be in the group: a swap that leaves one out raises "
        f"and changes no count; counts {counts} before, {pool_counts(bm)} after"
    )
    assert parent.block_table == table, (
        f"a refused swap rewrites no table: expected {table}, got {parent.block_table}"
    )
    assert bm.device_of(parent) is Device.GPU, (
        f"a refused swap leaves the sequence on the GPU: device_of got {bm.device_of(parent)}"
    )


def test_part4_can_swap_out_is_false_for_part_of_a_sharing_group():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=8, watermark=0.0)
    parent, child = make_seq(1, 6, 4), make_seq(2, 6, 4)
    bm.allocate(parent)
    bm.fork(parent, child)
    assert not bm.can_swap_out([parent]), (
        "the child shares the parent's blocks: swap_out([parent]) would be refused, so "
        "can_swap_out([parent]) must be False (Swapper.holds_alone), though 8 CPU blocks are free"
    )
    assert not bm.swapper.holds_alone([child]), (
        "holds_alone([child]) must be False: each block has ref_count 2, the group holds it once"
    )
    assert bm.can_swap_out([parent, child]) and bm.swapper.holds_alone([parent, child]), (
        "together the two hold every reference to their blocks: can_swap_out must be True"
    )
    other = make_seq(3, 3, 4)
    bm.allocate(other)
    assert not bm.swapper.holds_alone([child, other]), (
        "a group of 2 whose blocks of ref_count 2 it holds once each (the parent outside holds "
        "them too) does not hold them alone: the count per block must match, not the group's "
        "size"
    )


def test_part4_a_sharer_left_out_is_found_before_any_block_moves():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=8, watermark=0.0)
    alone, parent, child = make_seq(1, 8, 4), make_seq(2, 4, 4), make_seq(3, 4, 4)
    bm.allocate(alone)
    bm.allocate(parent)
    bm.fork(parent, child)
    counts, tables = pool_counts(bm), (list(alone.block_table), list(parent.block_table))
    with pytest.raises(ValueError):
        bm.swap_out([alone, parent])  # alone's blocks come first; parent's is shared with child
    assert pool_counts(bm) == counts, (
        "the group is checked for sharers outside it before anything moves: no CPU block taken, "
        f"counts {counts} before, {pool_counts(bm)} after"
    )
    assert (alone.block_table, parent.block_table) == tables, (
        f"a refused swap rewrites no table: expected {tables}, got "
        f"{(alone.block_table, parent.block_table)}"
    )


def test_part4_a_group_listing_a_sequence_twice_is_refused_by_every_swap_call():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=8, watermark=0.0)
    seq = make_seq(1, 5, 4)
    bm.allocate(seq)
    with pytest.raises(ValueError):
        bm.can_swap_out([seq, seq])
    bm.swap_out([seq])
    with pytest.raises(ValueError):
        bm.can_swap_in([seq, seq])


def test_part4_swap_out_without_cpu_room_is_all_or_nothing():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=2, watermark=0.0)
    seq = make_seq(1, 10, 4)  # 3 blocks > 2 CPU blocks
    bm.allocate(seq)
    counts, table = pool_counts(bm), list(seq.block_table)
    assert not bm.can_swap_out([seq]), (
        "3 GPU blocks do not fit in 2 free CPU blocks: can_swap_out must be False"
    )
    with pytest.raises(NoFreeBlocksError):
        bm.swap_out([seq])
    assert pool_counts(bm) == counts, (
        "a swap that cannot complete must take no CPU block: counts "
        f"{counts} before, {pool_counts(bm)} after"
    )
    assert seq.block_table == table, (
        f"a swap that cannot complete rewrites no table: expected {table}, got {seq.block_table}"
    )
    assert bm.device_of(seq) is Device.GPU, (
        "a swap that cannot complete leaves the sequence on the GPU: device_of got "
        f"{bm.device_of(seq)}"
    )


def test_part4_swap_in_respects_the_watermark_and_is_all_or_nothing():
    bm = BlockManager(block_size=1, num_gpu_blocks=100, num_cpu_blocks=50, watermark=0.1)
    seq = make_seq(1, 40, 1)
    bm.allocate(seq)
    bm.swap_out([seq])
    bm.allocate(make_seq(2, 51, 1))  # 49 GPU blocks free: 49 - 40 = 9 < watermark 10
    assert bm.can_swap_in([seq]) is AllocStatus.LATER, (
        "49 free GPU blocks, 40 needed, watermark 10: swap-in must wait (LATER)"
    )
    counts = pool_counts(bm)
    with pytest.raises(NoFreeBlocksError):
        bm.swap_in([seq])
    assert pool_counts(bm) == counts, (
        "a swap-in that would dip below the watermark raises and changes no count: counts "
        f"{counts} before, {pool_counts(bm)} after"
    )
    assert bm.device_of(seq) is Device.CPU, (
        "a swap-in that cannot complete leaves the sequence on the CPU: device_of got "
        f"{bm.device_of(seq)}"
    )


def swap_in_lookahead(group: list[Sequence]) -> int:
    """A block for each sequence whose newest token has no slot or whose last block another
    table of the (closed) group holds too."""
    holders = Counter(block_id for seq in group for block_id in seq.block_table)
    return sum(
        seq.num_blocks > len(seq.block_table) or holders[seq.block_table[-1]] > 1 for seq in group
    )


def swap_in_status(bm: BlockManager, group: list[Sequence]) -> AllocStatus:
    """The swap-in rule of the handout, written out independently."""
    need = len({b for s in group for b in s.block_table}) + swap_in_lookahead(group)
    if bm.num_gpu_blocks - need < bm.watermark_blocks:
        return AllocStatus.NEVER
    if bm.num_free_gpu_blocks - need >= bm.watermark_blocks:
        return AllocStatus.OK
    return AllocStatus.LATER


def test_part4_swap_in_reserves_a_block_for_a_newest_token_without_a_slot():
    bm = BlockManager(block_size=4, num_gpu_blocks=4, num_cpu_blocks=8, watermark=0.0)
    seq = make_seq(1, 8, 4)
    bm.allocate(seq)  # 2 full blocks
    seq.append_token(7)  # the 9th token opens block 3: no slot yet
    bm.swap_out([seq])
    bm.allocate(make_seq(2, 5, 4))  # 2 GPU blocks left: the 2 held fit, the next token not
    status = bm.can_swap_in([seq])
    assert status is AllocStatus.LATER, (
        "a sequence whose newest token opens a new block needs its 2 blocks + 1 to come back "
        f"and decode; 2 are free: LATER, got {status}"
    )
    assert bm.can_swap_in([seq]) is AllocStatus.LATER, (
        "can_swap_in only answers, so asking again gives the same answer: expected LATER"
    )
    assert bm.device_of(seq) is Device.CPU, (
        f"can_swap_in moves nothing: the sequence stays on the CPU, device_of got "
        f"{bm.device_of(seq)}"
    )


def test_part4_swap_in_needs_no_lookahead_when_the_newest_token_has_a_slot():
    bm = BlockManager(block_size=4, num_gpu_blocks=4, num_cpu_blocks=8, watermark=0.0)
    seq = make_seq(1, 7, 4)
    bm.allocate(seq)
    seq.append_token(7)  # the 8th token still fits block 2
    bm.swap_out([seq])
    bm.allocate(make_seq(2, 5, 4))
    status = bm.can_swap_in([seq])
    assert status is AllocStatus.OK, (
        f"2 blocks held, the newest token has its slot, 2 free: OK, got {status}"
    )


def test_part4_swap_in_is_never_for_a_sequence_that_outgrew_the_pool():
    bm = BlockManager(block_size=4, num_gpu_blocks=2, num_cpu_blocks=8, watermark=0.0)
    seq = make_seq(1, 8, 4)
    bm.allocate(seq)  # the whole GPU pool
    seq.append_token(7)  # needs a third block: the pool can never hold it
    bm.swap_out([seq])
    status = bm.can_swap_in([seq])
    assert status is AllocStatus.NEVER, (
        f"2 blocks + 1 for the newest token > a GPU pool of 2: NEVER, got {status}"
    )


def test_part4_swap_in_never_keeps_the_watermark_like_admission():
    bm = BlockManager(block_size=1, num_gpu_blocks=10, num_cpu_blocks=16, watermark=0.2)
    big = make_seq(1, 8, 1)
    bm.allocate(big)
    big.append_token(1)
    bm.swap_out([big])  # 8 blocks + 1 lookahead = 9: 10 - 9 < watermark 2
    status = bm.can_swap_in([big])
    assert status is AllocStatus.NEVER, (
        f"needing 9 of 10 GPU blocks with a watermark of 2 is NEVER, as can_allocate of a "
        f"9-block prompt is, got {status}"
    )
    small = make_seq(2, 7, 1)
    bm.allocate(small)
    small.append_token(1)
    bm.swap_out([small])  # 7 + 1 = 8: 10 - 8 = the watermark, so not NEVER
    assert bm.can_swap_in([small]) is AllocStatus.OK, (
        "7 blocks + 1 for the newest token = 8 of 10 free, leaving exactly the watermark of 2: "
        "can_swap_in expected OK"
    )


def test_part4_swap_in_counts_a_lookahead_per_sequence_and_shared_blocks_once():
    for filler, expected in ((9, AllocStatus.LATER), (7, AllocStatus.OK)):
        bm = BlockManager(block_size=2, num_gpu_blocks=8, num_cpu_blocks=8, watermark=0.0)
        parent, child = make_seq(1, 4, 2), make_seq(2, 4, 2)
        bm.allocate(parent)
        bm.fork(parent, child)  # 2 shared blocks
        parent.append_token(1)
        child.append_token(1)  # both newest tokens open a block: 2 + 1 + 1 = 4 needed
        bm.swap_out([parent, child])
        bm.allocate(make_seq(3, filler, 2))
        status = bm.can_swap_in([parent, child])
        assert status is expected, (
            f"2 distinct blocks + a lookahead block for each of 2 sequences = 4 needed, "
            f"{bm.num_free_gpu_blocks} free: {expected.name}, got {status}"
        )


def test_part4_swap_in_counts_a_copy_on_write_for_a_shared_last_block():
    for filler, expected in ((17, AllocStatus.LATER), (16, AllocStatus.OK)):
        bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=8, watermark=0.0)
        parent, child = make_seq(1, 6, 4), make_seq(2, 6, 4)
        bm.allocate(parent)
        bm.fork(parent, child)  # 2 shared blocks; the last one holds 2 of 4 tokens
        parent.append_token(1)
        child.append_token(1)  # both newest tokens go into the shared last block: copies
        bm.swap_out([parent, child])
        bm.allocate(make_seq(3, filler, 4))  # 5 blocks (3 free) or 4 (4 free)
        status = bm.can_swap_in([parent, child])
        assert status is expected, (
            "2 distinct blocks + a block for each of 2 sequences whose last block is shared "
            f"(its write copies it) = 4 needed, {bm.num_free_gpu_blocks} free: "
            f"{expected.name}, got {status}"
        )


def test_part4_can_swap_in_requires_the_group_on_the_cpu():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=8, watermark=0.0)
    seq = make_seq(1, 5, 4)
    with pytest.raises(ValueError):
        bm.can_swap_in([seq])  # holds nothing
    bm.allocate(seq)
    with pytest.raises(ValueError):
        bm.can_swap_in([seq])  # on the GPU
    with pytest.raises(ValueError):
        bm.can_swap_in([])


def test_part4_swap_requires_the_group_on_the_source_device():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=8, watermark=0.0)
    seq = make_seq(1, 5, 4)
    with pytest.raises(ValueError):
        bm.swap_out([seq])  # holds nothing
    bm.allocate(seq)
    with pytest.raises(ValueError):
        bm.swap_in([seq])  # it is on the GPU
    with pytest.raises(ValueError):
        bm.swap_out([seq, seq])  # listed twice
    assert bm.device_of(seq) is Device.GPU, (
        f"a refused swap leaves the sequence on the GPU: device_of got {bm.device_of(seq)}"
    )
    assert bm.num_free_cpu_blocks == 8, (
        f"a refused swap takes no CPU block: expected 8 free, got {bm.num_free_cpu_blocks}"
    )


def test_part4_a_cpu_pool_of_exactly_the_groups_distinct_blocks_is_enough():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=3, watermark=0.0)
    parent, child = make_seq(1, 6, 4), make_seq(2, 6, 4)
    bm.allocate(parent)
    bm.fork(parent, child)
    child.append_token(1)
    bm.append_slot(child)  # tables [a, b] and [a, c]: 4 entries, 3 distinct blocks
    assert bm.can_swap_out([parent, child]), (
        "a shared block moves once: 3 distinct blocks fit 3 free CPU blocks, can_swap_out must "
        "be True"
    )
    assert len(bm.swap_out([parent, child])) == 3, (
        "swap_out moves each of the 3 distinct blocks once: expected a map of 3 entries"
    )
    assert bm.num_free_cpu_blocks == 0, (
        f"3 distinct blocks take all 3 CPU blocks: expected 0 free, got {bm.num_free_cpu_blocks}"
    )


def test_part4_swap_in_exactly_at_the_watermark_is_allowed():
    bm = BlockManager(block_size=1, num_gpu_blocks=100, num_cpu_blocks=50, watermark=0.1)
    seq = make_seq(1, 40, 1)
    bm.allocate(seq)
    bm.swap_out([seq])
    bm.allocate(make_seq(2, 50, 1))  # 50 free: 50 - 40 = 10 = the watermark
    assert bm.can_swap_in([seq]) is AllocStatus.OK, (
        "exactly watermark_blocks left free after the swap is fine"
    )
    bm.swap_in([seq])
    assert bm.num_free_gpu_blocks == 10, (
        f"swap_in takes the 40 blocks: 50 - 40 = 10 free expected, got {bm.num_free_gpu_blocks}"
    )


def test_part4_a_swapped_sequence_has_no_gpu_slots():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=8, watermark=0.0)
    seq = make_seq(1, 6, 4)
    bm.allocate(seq)
    bm.swap_out([seq])
    seq.append_token(1)
    for operation in (
        lambda: bm.get_slot_mapping(seq, 0, 1),
        lambda: bm.can_append_slot(seq),
        lambda: bm.append_slot(seq),
        lambda: bm.fork(seq, make_seq(2, 6, 4)),
    ):
        with pytest.raises(ValueError):
            operation()
    assert bm.num_free_gpu_blocks == 8 and bm.num_free_cpu_blocks == 6, (
        "a swapped-out sequence has no GPU slots: each refused call changes no count, expected "
        f"8 free GPU and 6 free CPU blocks, got {bm.num_free_gpu_blocks} and "
        f"{bm.num_free_cpu_blocks}"
    )


def test_part4_freeing_a_swapped_sequence_releases_its_cpu_blocks():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=8, watermark=0.0)
    seq = make_seq(1, 10, 4)
    bm.allocate(seq)
    bm.swap_out([seq])
    bm.free(seq)
    assert (bm.num_free_gpu_blocks, bm.num_free_cpu_blocks) == (8, 8), (
        "free returns a swapped-out sequence's blocks to the CPU pool: (free GPU, free CPU) "
        f"expected (8, 8), got {(bm.num_free_gpu_blocks, bm.num_free_cpu_blocks)}"
    )
    assert seq.block_table == [], f"free empties the block table, got {seq.block_table}"
    assert bm.device_of(seq) is None, (
        f"a freed sequence holds nothing: device_of expected None, got {bm.device_of(seq)}"
    )


def test_part4_an_empty_swap_group_error_says_so():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=8, watermark=0.0)
    with pytest.raises(ValueError, match=r"\ba swap needs at least one sequence\b"):
        bm.swap_out([])


def test_part4_a_group_listing_a_sequence_twice_error_says_so():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=8, watermark=0.0)
    seq = make_seq(1, 5, 4)
    bm.allocate(seq)
    with pytest.raises(ValueError, match=r"\ba swap group lists a sequence twice\b"):
        bm.can_swap_out([seq, seq])


def test_part4_swapping_in_a_sequence_on_the_gpu_error_says_where_its_blocks_are():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=8, watermark=0.0)
    seq = make_seq(1, 5, 4)
    bm.allocate(seq)
    message = (
        r"\bsequence 1 has its blocks on the gpu; this operation needs its blocks on the cpu\b"
    )
    with pytest.raises(ValueError, match=message):
        bm.swap_in([seq])


def test_part4_swap_out_without_cpu_room_error_names_the_need_and_the_free_blocks():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=2, watermark=0.0)
    seq = make_seq(1, 10, 4)  # 3 blocks
    bm.allocate(seq)
    with pytest.raises(NoFreeBlocksError, match=r"\bswap out needs 3 CPU blocks, 2 are free\b"):
        bm.swap_out([seq])


def test_part4_swap_in_below_the_watermark_error_names_the_need_the_watermark_and_the_free():
    bm = BlockManager(block_size=1, num_gpu_blocks=100, num_cpu_blocks=50, watermark=0.1)
    seq = make_seq(1, 40, 1)
    bm.allocate(seq)
    bm.swap_out([seq])
    bm.allocate(make_seq(2, 51, 1))  # 49 GPU blocks free: 49 - 40 = 9 < watermark 10
    message = r"\bswap in needs 40 GPU blocks plus a watermark of 10, 49 are free\b"
    with pytest.raises(NoFreeBlocksError, match=message):
        bm.swap_in([seq])


def test_part4_a_sharer_left_out_error_names_the_block_and_both_counts():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=8, watermark=0.0)
    parent, child = make_seq(1, 6, 4), make_seq(2, 6, 4)
    bm.allocate(parent)
    bm.fork(parent, child)
    child.append_token(1)
    bm.append_slot(child)  # copy on write: only the parent's first block is still shared
    shared = parent.block_table[0]
    message = (
        rf"\bgpu block {shared} has ref_count 2 but the group holds it 1 time\(s\)"
        r".*\bswap every sequence that shares it together\b"
    )
    with pytest.raises(ValueError, match=message):
        bm.swap_out([parent])


def test_part4_a_swapper_built_without_a_watermark_keeps_no_gpu_block_free():
    gpu, cpu = BlockAllocator(Device.GPU, 2), BlockAllocator(Device.CPU, 2)
    swapper = Swapper(gpu, cpu)
    assert swapper.watermark_blocks == 0, (
        f"watermark_blocks defaults to 0, got {swapper.watermark_blocks}"
    )
    seq = make_seq(1, 8, 4)
    seq.block_table = [cpu.allocate().block_id, cpu.allocate().block_id]
    assert swapper.can_swap_in([seq]), (
        "without a watermark, 2 CPU blocks fit the 2 free GPU blocks: can_swap_in must be True"
    )


def test_part4_a_swapped_out_sequence_holds_cpu_blocks():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=8, watermark=0.0)
    seq = make_seq(1, 10, 4)
    bm.allocate(seq)
    bm.swap_out([seq])
    devices = [bm.cpu_allocator.blocks[block_id].device for block_id in seq.block_table]
    assert devices == [Device.CPU] * 3, (
        f"swap_out moves the 3 blocks into the CPU pool, whose blocks are CPU blocks: got "
        f"devices {devices}"
    )


# --------------------------------------------------------------------------------------------
# Parts 1.3 and 1.4: the invariants under random operations (Hypothesis stateful testing)
# --------------------------------------------------------------------------------------------


class BlockManagerMachine(RuleBasedStateMachine):
    """Drives a BlockManager with random sequences and checks the invariants after every step.

    Beside the manager it keeps a fake KV cache: each slot holds the token whose K/V would be
    there. Every write goes through the slot mapping, every copy through the maps the manager
    returns, so a lost, shared-by-mistake or mis-mapped block shows up as a wrong token.

    ``REACHED`` counts the (operation, state) pairs the runs met: each answer of can_allocate
    and can_swap_in, appends that fit, open a block, copy on write or find no room, frees on
    each device, refused double frees and swaps. Each test requires the pairs of its part.
    """

    SWAPS = False
    REACHED: ClassVar[Counter] = Counter()

    def __init__(self) -> None:
        super().__init__()
        self.next_id = 0
        self.live: dict[int, Sequence] = {}
        self.freed: list[Sequence] = []
        self.pending: set[int] = set()  # sequences whose newest token has no slot yet

    @initialize(
        block_size=st.integers(1, 4),
        num_gpu_blocks=st.integers(1, 12),
        num_cpu_blocks=st.integers(0, 10),
        watermark=st.sampled_from([0.0, 0.1, 0.3]),
    )
    def setup(self, block_size, num_gpu_blocks, num_cpu_blocks, watermark):
        self.bs = block_size
        self.bm = BlockManager(block_size, num_gpu_blocks, num_cpu_blocks, watermark)
        self.cache = {
            Device.GPU: [[None] * block_size for _ in range(num_gpu_blocks)],
            Device.CPU: [[None] * block_size for _ in range(num_cpu_blocks)],
        }

    # -- helpers -------------------------------------------------------------------------------

    def on(self, device):
        return sorted(
            (s for s in self.live.values() if self.bm.device_of(s) is device),
            key=lambda s: s.seq_id,
        )

    def write(self, seq, start, end):
        for pos, slot in zip(
            range(start, end), self.bm.get_slot_mapping(seq, start, end), strict=True
        ):
            self.cache[Device.GPU][slot // self.bs][slot % self.bs] = seq.token_ids[pos]

    def copy(self, src_device, dst_device, mapping):
        for src, dst in mapping.items():
            self.cache[dst_device][dst] = list(self.cache[src_device][src])

    def group_of(self, seq, device):
        """The sequences on ``device`` that share blocks with ``seq``, directly or not."""
        group, frontier = {seq.seq_id: seq}, [seq]
        while frontier:
            blocks = set(frontier.pop().block_table)
            for other in self.on(device):
                if other.seq_id not in group and blocks & set(other.block_table):
                    group[other.seq_id] = other
                    frontier.append(other)
        return list(group.values())

    # -- rules ---------------------------------------------------------------------------------

    @rule(data=st.data())
    def add(self, data):
        capacity = self.bm.num_gpu_blocks * self.bs  # a little more, now and then: NEVER
        num_tokens = data.draw(st.integers(1, capacity + self.bs), label="num_tokens")
        seq = Sequence(self.next_id, [1000 * self.next_id + i for i in range(num_tokens)], self.bs)
        self.next_id += 1
        need, total = ceil_div(num_tokens, self.bs), self.bm.num_gpu_blocks
        free, mark = self.bm.num_free_gpu_blocks, self.bm.watermark_blocks
        expected = (
            AllocStatus.NEVER
            if total - need < mark
            else AllocStatus.OK
            if free - need >= mark
            else AllocStatus.LATER
        )
        status = self.bm.can_allocate(seq)
        self.REACHED["allocate", expected.name] += 1
        assert status is expected, (
            f"can_allocate with need {need}, free {free}, pool {total}, watermark {mark}: "
            f"expected {expected.name}, got {status}"
        )
        if status is AllocStatus.OK:
            self.bm.allocate(seq)
            self.live[seq.seq_id] = seq
            self.write(seq, 0, seq.num_tokens)

    @rule(data=st.data(), times=st.integers(1, 8))
    def append(self, data, times):
        running = self.on(Device.GPU)
        if running:
            seq = data.draw(st.sampled_from(running))
            for _ in range(times):  # several tokens: to a block boundary, to a full pool
                if not self.append_one(seq):
                    break

    def append_one(self, seq) -> bool:
        """Append a token to ``seq`` as a decode step would; False if it found no room.

        With no room the sequence is preempted as the scheduler would: swapped out (when the
        machine swaps and the CPU has room) with its newest token still without a slot, or
        freed. A swapped-in sequence gets the slot its newest token is owed first.
        """
        if seq.seq_id in self.pending:
            self.pending.discard(seq.seq_id)
        else:
            seq.append_token(1000 * seq.seq_id + seq.num_tokens)
        opens_block = seq.num_tokens > len(seq.block_table) * self.bs
        last = seq.block_table[-1]
        shared = sum(last in other.block_table for other in self.on(Device.GPU)) > 1
        need = 1 if opens_block or shared else 0
        expected = need <= self.bm.num_free_gpu_blocks
        kind = "new block" if opens_block else "copy on write" if shared else "fits"
        self.REACHED["append", kind if expected else "no room"] += 1
        assert self.bm.can_append_slot(seq) is expected, (
            f"token {seq.num_tokens} of sequence {seq.seq_id}: needs {need} block(s) "
            f"(new block: {opens_block}, shared last block: {shared}), "
            f"{self.bm.num_free_gpu_blocks} free, so can_append_slot must be {expected}"
        )
        if not expected:
            counts = pool_counts(self.bm)
            with pytest.raises(NoFreeBlocksError):
                self.bm.append_slot(seq)
            assert pool_counts(self.bm) == counts, (
                "a failed append_slot changes no count: counts "
                f"{counts} before, {pool_counts(self.bm)} after"
            )
            group = self.group_of(seq, Device.GPU)
            if self.SWAPS and self.bm.can_swap_out(group):
                self.copy(Device.GPU, Device.CPU, self.bm.swap_out(group))
                self.pending.add(seq.seq_id)
                self.REACHED["swap out", "with a token owed"] += 1
            else:
                self.release(seq)
            return False
        copy = self.bm.append_slot(seq)
        if copy is not None:
            self.copy(Device.GPU, Device.GPU, {copy[0]: copy[1]})
        self.write(seq, seq.num_tokens - 1, seq.num_tokens)
        return True

    @rule(data=st.data())
    def fork(self, data):
        running = self.on(Device.GPU)
        if not running:
            return
        parent = data.draw(st.sampled_from(running))
        child = Sequence(self.next_id, parent.token_ids, self.bs)
        self.next_id += 1
        self.bm.fork(parent, child)
        self.live[child.seq_id] = child
        if parent.seq_id in self.pending:  # the child owes the same token a slot
            self.pending.add(child.seq_id)
        self.REACHED["fork", "GPU"] += 1

    @rule(data=st.data())
    def free(self, data):
        if self.live:
            self.release(
                data.draw(st.sampled_from(sorted(self.live.values(), key=lambda s: s.seq_id)))
            )

    @rule(data=st.data())
    def free_twice(self, data):
        if not self.freed:
            return
        seq = data.draw(st.sampled_from(self.freed))
        counts = pool_counts(self.bm)
        self.REACHED["free twice", "refused"] += 1
        with pytest.raises(ValueError):
            self.bm.free(seq)
        assert pool_counts(self.bm) == counts, (
            f"freeing sequence {seq.seq_id} twice is refused and changes no count: counts "
            f"{counts} before, {pool_counts(self.bm)} after"
        )

    @precondition(lambda self: self.SWAPS)
    @rule(data=st.data())
    def swap_out(self, data):
        self.swap(data, Device.GPU, Device.CPU)

    @precondition(lambda self: self.SWAPS)
    @rule(data=st.data())
    def swap_in(self, data):
        self.swap(data, Device.CPU, Device.GPU)

    def swap(self, data, src, dst):
        candidates = self.on(src)
        if not candidates:
            return
        group = self.group_of(data.draw(st.sampled_from(candidates)), src)
        need = len({b for s in group for b in s.block_table})
        if src is Device.GPU:
            can, expected = self.bm.can_swap_out(group), need <= self.bm.num_free_cpu_blocks
            assert can is expected, (
                f"moving {need} distinct blocks to the CPU: can_swap_out must be {expected}"
            )
        else:
            free, mark = self.bm.num_free_gpu_blocks, self.bm.watermark_blocks
            status = self.bm.can_swap_in(group)
            expected = swap_in_status(self.bm, group)
            assert status is expected, (
                f"{need} distinct blocks + {swap_in_lookahead(group)} lookahead, {free} free "
                f"of {self.bm.num_gpu_blocks}, watermark {mark}: can_swap_in must be "
                f"{expected.name}, got {status}"
            )
            can = free - need >= mark
            self.REACHED["swap in", expected.name] += 1
        direction = "swap out" if src is Device.GPU else "swap in"
        self.REACHED[direction, "moved" if can else "refused"] += 1
        move = self.bm.swap_out if src is Device.GPU else self.bm.swap_in
        if not can:
            counts = pool_counts(self.bm)
            with pytest.raises(NoFreeBlocksError):
                move(group)
            assert pool_counts(self.bm) == counts, (
                "a swap that cannot complete raises and changes nothing: counts "
                f"{counts} before, {pool_counts(self.bm)} after"
            )
            return
        mapping = move(group)
        distinct = {b for s in group for b in s.block_table}
        assert len(mapping) == len(distinct), (
            f"each distinct block moves exactly once: {len(distinct)} distinct blocks, map "
            f"{mapping}"
        )
        self.copy(src, dst, mapping)

    def release(self, seq):
        self.REACHED["free", self.bm.device_of(seq).name] += 1
        self.pending.discard(seq.seq_id)
        self.bm.free(seq)
        del self.live[seq.seq_id]
        self.freed.append(seq)

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def accounting_holds_on_each_device(self):
        if not hasattr(self, "bm"):
            return
        for device, allocator in (
            (Device.GPU, self.bm.gpu_allocator),
            (Device.CPU, self.bm.cpu_allocator),
        ):
            holders = [0] * allocator.num_blocks
            for seq in self.on(device):
                assert len(set(seq.block_table)) == len(seq.block_table), (
                    f"sequence {seq.seq_id} holds a block twice: {seq.block_table}"
                )
                for block_id in seq.block_table:
                    holders[block_id] += 1
            refs = [b.ref_count for b in allocator.blocks]
            assert refs == holders, (
                f"{device.value}: ref counts {refs} must equal the number of tables holding "
                f"each block {holders}"
            )
            used = sum(h > 0 for h in holders)
            assert allocator.num_free_blocks + used == allocator.num_blocks, (
                f"{device.value}: free {allocator.num_free_blocks} + used {used} "
                f"!= total {allocator.num_blocks}"
            )

    @invariant()
    def every_live_sequence_reads_back_its_tokens(self):
        if not hasattr(self, "bm"):
            return
        for seq in self.live.values():
            device = self.bm.device_of(seq)
            covered = seq.num_tokens - (seq.seq_id in self.pending)
            assert len(seq.block_table) == ceil_div(covered, self.bs), (
                f"sequence {seq.seq_id}: the blocks always cover every token that has a slot, "
                f"{covered} tokens in blocks of {self.bs} need {ceil_div(covered, self.bs)} "
                f"blocks, its table {seq.block_table} has {len(seq.block_table)}"
            )
            blocks = [self.cache[device][b] for b in seq.block_table]
            stored = [token for block in blocks for token in block][:covered]
            assert stored == seq.token_ids[:covered], (
                f"sequence {seq.seq_id} on the {device.value}: its blocks hold {stored}, "
                f"expected {seq.token_ids[:covered]} (a block was lost, mis-copied or wrongly "
                "shared)"
            )

    @invariant()
    def freed_sequences_hold_nothing(self):
        for seq in self.freed:
            assert seq.block_table == [], (
                f"free empties the table: freed sequence {seq.seq_id} still holds {seq.block_table}"
            )
            assert self.bm.device_of(seq) is None, (
                f"a freed sequence holds nothing: device_of sequence {seq.seq_id} expected "
                f"None, got {self.bm.device_of(seq)}"
            )


class SwappingMachine(BlockManagerMachine):
    SWAPS = True


MANAGER_PAIRS = {
    *(("allocate", status.name) for status in AllocStatus),
    *(("append", kind) for kind in ("fits", "new block", "copy on write", "no room")),
    ("fork", "GPU"),
    ("free", "GPU"),
    ("free twice", "refused"),
}


def test_part3_invariants_hold_under_random_allocate_append_fork_free():
    run_counted_machine(BlockManagerMachine, STATEFUL, MANAGER_PAIRS)


def test_part4_invariants_hold_under_random_operations_with_swaps():
    # Rare here, and pinned by tests of their own: a swap-in that is NEVER
    # (test_part4_swap_in_is_never_for_a_sequence_that_outgrew_the_pool) and freeing a swapped
    # sequence (test_part4_freeing_a_swapped_sequence_releases_its_cpu_blocks).
    swaps = {("swap out", "moved"), ("swap out", "refused"), ("swap out", "with a token owed")}
    swaps |= {("swap in", "OK"), ("swap in", "LATER"), ("swap in", "moved"), ("swap in", "refused")}
    run_counted_machine(SwappingMachine, STATEFUL, swaps)


# --------------------------------------------------------------------------------------------
# Part 1.5: Evictor
# --------------------------------------------------------------------------------------------


def cached(block_id: int, last_accessed: float, num_hashed_tokens: int = 16) -> Block:
    return Block(block_id, Device.GPU, 0, 1000 + block_id, num_hashed_tokens, last_accessed)


def test_part5_evicts_the_least_recently_used_block_first():
    evictor = Evictor()
    for block in (cached(0, 3.0), cached(1, 1.0), cached(2, 2.0)):
        evictor.add(block)
    order = [evictor.evict().block_id for _ in range(3)]
    assert order == [1, 2, 0], f"oldest access first: expected [1, 2, 0], got {order}"
    assert len(evictor) == 0, (
        f"evict removes the block it returns: after 3 evictions expected 0 held, got {len(evictor)}"
    )


def test_part5_ties_go_to_the_block_with_more_hashed_tokens():
    evictor = Evictor()
    evictor.add(cached(0, 1.0, num_hashed_tokens=16))
    evictor.add(cached(1, 1.0, num_hashed_tokens=48))
    evictor.add(cached(2, 1.0, num_hashed_tokens=32))
    order = [evictor.evict().block_id for _ in range(3)]
    assert order == [1, 2, 0], (
        f"equally old blocks: the deepest (most hashed tokens) goes first; got {order}"
    )


def test_part5_update_moves_a_block_back_in_the_order():
    evictor = Evictor()
    evictor.add(cached(0, 1.0))
    evictor.add(cached(1, 2.0))
    evictor.update(0, 5.0)
    assert evictor.evict().block_id == 1, "block 0 was accessed at t=5, after block 1"
    assert evictor.evict().block_id == 0, "block 0 is the only one left: evict returns it"


def test_part5_removed_block_is_no_longer_evictable():
    evictor = Evictor()
    evictor.add(cached(0, 1.0))
    evictor.add(cached(1, 2.0))
    removed = evictor.remove(0)
    assert removed.block_id == 0, (
        f"remove(block_id) returns the held block with that id: expected 0, got {removed.block_id}"
    )
    assert 0 not in evictor, "a removed block is no longer held: 0 is still in the evictor"
    assert len(evictor) == 1, f"remove takes out one block: expected 1 held, got {len(evictor)}"
    assert evictor.evict().block_id == 1, "a removed block must never be evicted"
    with pytest.raises(ValueError):
        evictor.evict()


def test_part5_the_eviction_order_survives_many_updates():
    evictor = Evictor()
    for block_id in range(3):
        evictor.add(cached(block_id, float(block_id)))
    for t in range(3000):
        evictor.update(t % 3, 10.0 + t)
    assert len(evictor._heap) <= 100, (
        f"3 blocks, 3000 updates: the heap holds {len(evictor._heap)} entries; drop the stale "
        "ones now and then or it grows without bound"
    )
    order = [evictor.evict().block_id for _ in range(3)]
    assert order == [0, 1, 2], f"last updates at t=2997, 2998, 2999 (blocks 0, 1, 2); got {order}"


def test_part5_rejects_blocks_that_cannot_be_cached():
    evictor = Evictor()
    in_use = cached(0, 1.0)
    in_use.ref_count = 1
    no_hash = Block(1, Device.GPU)
    with pytest.raises(ValueError):
        evictor.add(in_use)
    with pytest.raises(ValueError):
        evictor.add(no_hash)
    block = cached(2, 1.0)
    evictor.add(block)
    with pytest.raises(ValueError):
        evictor.add(block)
    assert len(evictor) == 1, (
        "add rejects a block in use, one without a content hash and one already held: only "
        f"block 2 is held, expected 1, got {len(evictor)}"
    )


def test_part5_unknown_block_ids_are_rejected():
    evictor = Evictor()
    evictor.add(cached(0, 1.0))
    with pytest.raises(ValueError):
        evictor.remove(7)
    with pytest.raises(ValueError):
        evictor.update(7, 2.0)
    assert len(evictor) == 1, (
        f"a rejected remove or update changes nothing: expected 1 held, got {len(evictor)}"
    )
    assert evictor.evict().block_id == 0, (
        "a rejected remove or update changes nothing: block 0 is still held and evictable"
    )


@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["add", "remove", "update", "evict"]),
            st.integers(0, 7),
            st.integers(0, 5),
            st.integers(1, 4),
        ),
        max_size=80,
    )
)
@FAST
def test_part5_matches_a_sorted_list_model(ops):
    evictor = Evictor()
    model: dict[int, tuple[float, int]] = {}  # block id -> (last_accessed, num_hashed_tokens)
    blocks: dict[int, Block] = {}
    for op, block_id, time, depth in ops:
        if op == "add" and block_id not in model:
            blocks[block_id] = cached(block_id, float(time), 16 * depth)
            evictor.add(blocks[block_id])
            model[block_id] = (float(time), 16 * depth)
        elif op == "remove" and block_id in model:
            evictor.remove(block_id)
            del model[block_id]
        elif op == "update" and block_id in model:
            evictor.update(block_id, float(time))
            model[block_id] = (float(time), model[block_id][1])
        elif op == "evict" and model:
            expected = min(model, key=lambda b: (model[b][0], -model[b][1], b))
            got = evictor.evict().block_id
            assert got == expected, f"model state {model}: expected to evict {expected}, got {got}"
            del model[expected]
        assert len(evictor) == len(model), (
            f"len(evictor) is the number of held blocks: expected {len(model)} (blocks "
            f"{sorted(model)}), got {len(evictor)}"
        )


def test_part5_adding_a_block_in_use_error_names_its_ref_count():
    in_use = cached(0, 1.0)
    in_use.ref_count = 1
    message = r"\bblock 0 has ref_count 1: only free blocks can be cached\b"
    with pytest.raises(ValueError, match=message):
        Evictor().add(in_use)


def test_part5_adding_a_block_without_a_content_hash_error_names_it():
    with pytest.raises(ValueError, match=r"\bblock 1 has no content hash: nothing to cache\b"):
        Evictor().add(Block(1, Device.GPU))


def test_part5_adding_a_held_block_again_error_names_it():
    evictor = Evictor()
    block = cached(2, 1.0)
    evictor.add(block)
    with pytest.raises(ValueError, match=r"\bblock 2 is already in the evictor\b"):
        evictor.add(block)


def test_part5_an_unknown_block_id_error_names_it():
    evictor = Evictor()
    evictor.add(cached(0, 1.0))
    with pytest.raises(ValueError, match=r"\bblock 7 is not in the evictor\b"):
        evictor.remove(7)
    with pytest.raises(ValueError, match=r"\bblock 7 is not in the evictor\b"):
        evictor.update(7, 2.0)


def test_part5_evict_on_an_empty_evictor_error_says_so():
    message = r"\bevict\(\) on an empty evictor: no cached block to give up\b"
    with pytest.raises(ValueError, match=message):
        Evictor().evict()
