"""Hidden tests for Phase 1: instructor-only (left out of the student edition).

``vkv grade SUBMISSION --trusted EDITION --hidden tests/hidden`` adds them; Gradescope shows
them after the due date. They follow the graded tests' naming (``test_part<N>_...``) and check
the same rules as ``tests/test_phase1.py``, on inputs drawn from the grade's seed: sizes, token
ids, block sizes, pool sizes and orders of operations change from one grade to the next, so a
table of the visible tests' answers cannot pass them. Every test gets its ``rng`` from
``@seeded`` (``test_seed.py``: the seed is ``VKV_GRADE_SEED``, or a fresh one when it is unset,
and every failure names it). Expected values come from first principles here: ceil division, a
list or dictionary model of the pool, never from the code under test.
"""

import pytest
from block_stand_ins import with_stand_in
from test_seed import seeded

from vkv.engine.block import Block, BlockAllocator, Device, DoubleFreeError, NoFreeBlocksError
from vkv.engine.block_manager import AllocStatus, BlockManager
from vkv.engine.evictor import Evictor
from vkv.engine.sequence import Sequence, SequenceStatus
from vkv.sampling_params import SamplingParams

VOCAB = 151_936
FINISHED = [s for s in SequenceStatus if s.name.startswith("FINISHED_")]
UNFINISHED = [s for s in SequenceStatus if not s.name.startswith("FINISHED_")]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def draw_length(rng, block_size: int) -> int:
    """A prompt length; a third of the draws fill their last block exactly, a third open it."""
    kind = rng.randrange(3)
    if kind == 0:
        return block_size * rng.randint(1, 6)
    if kind == 1:
        return block_size * rng.randint(0, 5) + 1
    return rng.randint(1, 7 * block_size)


def draw_tokens(rng, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def new_seq(rng, seq_id: int, n: int, block_size: int) -> Sequence:
    return Sequence(seq_id, draw_tokens(rng, n), block_size)


def draw_device(rng) -> Device:
    return rng.choice([Device.GPU, Device.CPU])


def counts(pool: BlockAllocator) -> tuple[int, list[int]]:
    return pool.num_free_blocks, [block.ref_count for block in pool.blocks]


def manager_state(bm: BlockManager, seqs: list[Sequence]) -> tuple:
    """Everything a refused call must leave as it was."""
    return (
        bm.num_free_gpu_blocks,
        bm.num_free_cpu_blocks,
        [b.ref_count for b in bm.gpu_allocator.blocks + bm.cpu_allocator.blocks],
        [list(seq.block_table) for seq in seqs],
        [bm.device_of(seq) for seq in seqs],
    )


# --------------------------------------------------------------------------------------------
# Part 1.1: Sequence
# --------------------------------------------------------------------------------------------


@seeded
def test_part1_a_new_sequence_records_its_arguments(rng):
    block_size = rng.randint(1, 16)
    prompt = draw_tokens(rng, draw_length(rng, block_size))
    seq_id, arrival = rng.randrange(10**6), rng.randrange(1, 10**6) / 8
    params = SamplingParams(max_tokens=rng.randint(1, 500), ignore_eos=rng.random() < 0.5)
    seq = Sequence(seq_id, prompt, block_size, params, arrival)
    got = (seq.seq_id, seq.status, seq.block_size, seq.arrival_time, seq.block_table)
    assert got == (seq_id, SequenceStatus.WAITING, block_size, arrival, []), (
        "Sequence(seq_id, prompt, block_size, params, arrival_time) sets seq_id, status WAITING, "
        f"block_size, arrival_time and an empty block_table: expected "
        f"{(seq_id, 'WAITING', block_size, arrival, [])}, got {got}"
    )
    assert seq.sampling_params is params, "the given sampling_params are kept as they are"
    assert (seq.num_prompt_tokens, seq.num_tokens) == (len(prompt), len(prompt)), (
        f"a new sequence has {len(prompt)} prompt tokens and as many tokens, got "
        f"{(seq.num_prompt_tokens, seq.num_tokens)}"
    )
    copy = list(prompt)
    prompt.append(rng.randrange(VOCAB))
    prompt[0] = -1
    assert seq.token_ids == copy, (
        "token_ids is a copy of the prompt: changing the caller's list afterwards must not "
        "change the sequence"
    )
    plain = Sequence(seq_id + 1, copy, block_size)
    assert plain.sampling_params == SamplingParams() and plain.arrival_time == 0.0, (
        "without them, sampling_params is SamplingParams() and arrival_time 0.0; got "
        f"{plain.sampling_params} and {plain.arrival_time}"
    )


@seeded
def test_part1_appends_grow_the_completion_and_keep_the_prompt(rng):
    block_size = rng.randint(1, 16)
    prompt = draw_tokens(rng, draw_length(rng, block_size))
    seq = Sequence(rng.randrange(10**6), prompt, block_size)
    seq.status = rng.choice(UNFINISHED)
    completion: list[int] = []
    for _ in range(rng.randint(1, 3 * block_size + 3)):
        token = rng.randrange(VOCAB)
        seq.append_token(token)
        completion.append(token)
        got = (seq.num_tokens, seq.num_prompt_tokens, seq.num_completion_tokens, seq.last_token)
        expected = (len(prompt) + len(completion), len(prompt), len(completion), token)
        assert got == expected, (
            f"after appending {len(completion)} tokens to a prompt of {len(prompt)} (status "
            f"{seq.status.name}): (num_tokens, num_prompt_tokens, num_completion_tokens, "
            f"last_token) expected {expected}, got {got}"
        )
    assert seq.prompt_token_ids == prompt and seq.completion_token_ids == completion, (
        "prompt_token_ids is the prompt and completion_token_ids the appended tokens, in order"
    )
    assert seq.token_ids == prompt + completion, "token_ids is the prompt, then the completion"
    seq.prompt_token_ids.append(-1)
    seq.completion_token_ids.append(-1)
    assert seq.token_ids == prompt + completion, (
        "prompt_token_ids and completion_token_ids return copies: appending to them must not "
        "change the sequence"
    )


@seeded
def test_part1_blocks_are_a_ceil_division_and_concatenate_to_the_tokens(rng):
    block_size = rng.randint(1, 12)
    seq = new_seq(rng, rng.randrange(1000), draw_length(rng, block_size), block_size)
    for _ in range(block_size + 1 + rng.randint(0, block_size + 2)):  # an exact multiple too
        n = seq.num_tokens
        want_blocks = ceil_div(n, block_size)
        got = (seq.num_blocks, seq.last_block_num_tokens)
        expected = (want_blocks, n - (want_blocks - 1) * block_size)
        assert got == expected, (
            f"{n} tokens in blocks of {block_size}: (num_blocks, last_block_num_tokens) "
            f"expected {expected} (ceil division; the last block holds 1..block_size), got {got}"
        )
        for i in range(want_blocks):
            want = seq.token_ids[i * block_size : (i + 1) * block_size]
            assert seq.block(i) == want, (
                f"block({i}) of {n} tokens in blocks of {block_size} holds the token ids of "
                f"positions [{i * block_size}, {min(n, (i + 1) * block_size)}): expected {want}, "
                f"got {seq.block(i)}"
            )
        seq.append_token(rng.randrange(VOCAB))


@seeded
def test_part1_a_block_index_outside_the_range_raises_index_error(rng):
    block_size = rng.randint(1, 12)
    seq_id = rng.randrange(10**5)
    seq = new_seq(rng, seq_id, draw_length(rng, block_size), block_size)
    last = ceil_div(seq.num_tokens, block_size) - 1
    for index in (last + 1, last + rng.randint(2, 50), -1, -rng.randint(2, last + 3)):
        message = f"sequence {seq_id} has logical blocks 0..{last}, block {index} does not exist"
        with pytest.raises(IndexError) as raised:
            seq.block(index)
        assert str(raised.value).strip("'\"") == message, (
            f'block({index}) of a sequence of {last + 1} blocks: IndexError("{message}") '
            f"expected (negative indices are errors, not Python's from-the-end), got "
            f"{raised.value!r}"
        )


@seeded
def test_part1_a_finished_sequence_takes_no_token_and_stays_unchanged(rng):
    block_size = rng.randint(1, 8)
    seq_id = rng.randrange(10**5)
    seq = new_seq(rng, seq_id, draw_length(rng, block_size), block_size)
    for _ in range(rng.randint(0, 5)):
        seq.append_token(rng.randrange(VOCAB))
    before = (list(seq.token_ids), seq.num_tokens, seq.num_completion_tokens)
    for status in rng.sample(FINISHED, len(FINISHED)):
        seq.status = status
        assert seq.is_finished is True, f"status {status.name} is finished: is_finished True"
        message = f"sequence {seq_id} is {status.name}: a finished sequence takes no tokens"
        with pytest.raises(ValueError) as raised:
            seq.append_token(rng.randrange(VOCAB))
        assert str(raised.value) == message, (
            f'expected ValueError("{message}"), got {raised.value!r}'
        )
        after = (list(seq.token_ids), seq.num_tokens, seq.num_completion_tokens)
        assert after == before, "a refused append_token changes nothing (tokens and counts)"
    for status in UNFINISHED:
        seq.status = status
        assert seq.is_finished is False, f"status {status.name} is not finished"


@seeded
def test_part1_bad_block_sizes_and_empty_prompts_are_refused(rng):
    k = rng.randint(1, 64)
    for block_size in (0, -k, float(k), True, str(k)):
        with pytest.raises(ValueError, match="block_size"):
            Sequence(rng.randrange(100), draw_tokens(rng, 3), block_size)
    seq_id = rng.randrange(10**6)
    message = f"sequence {seq_id}: the prompt must hold at least one token"
    with pytest.raises(ValueError) as raised:
        Sequence(seq_id, [], rng.randint(1, 32))
    assert str(raised.value) == message, f'expected ValueError("{message}"), got {raised.value!r}'


# --------------------------------------------------------------------------------------------
# Part 1.2: BlockAllocator
# --------------------------------------------------------------------------------------------


@seeded
def test_part2_a_pool_hands_out_each_block_once_with_one_holder(rng):
    device, size = draw_device(rng), rng.randint(1, 400)
    pool = BlockAllocator(device, size)
    assert (pool.num_blocks, pool.num_free_blocks) == (size, size), (
        f"a new {device.value} pool of {size}: num_blocks and num_free_blocks {size}, got "
        f"{(pool.num_blocks, pool.num_free_blocks)}"
    )
    assert [b.block_id for b in pool.blocks] == list(range(size)), (
        "blocks[i] is the block whose block_id is i"
    )
    taken = rng.randint(1, size)
    got = [pool.allocate() for _ in range(taken)]
    ids = [b.block_id for b in got]
    assert len(set(ids)) == taken and all(0 <= i < size for i in ids), (
        f"{taken} allocations from a pool of {size} hand out {taken} distinct blocks of the pool, "
        f"got ids {sorted(ids)}"
    )
    assert all(b is pool.blocks[b.block_id] and b.device is device for b in got), (
        "allocate returns the pool's own blocks, of its device"
    )
    assert all(b.ref_count == 1 for b in got), "an allocated block has ref_count 1"
    assert pool.num_free_blocks == size - taken, (
        f"{taken} of {size} in use: num_free_blocks {size - taken}, got {pool.num_free_blocks}"
    )


@seeded
def test_part2_freed_blocks_come_back_first_in_first_out(rng):
    device, size = draw_device(rng), rng.randint(2, 200)
    pool = BlockAllocator(device, size)
    blocks = [pool.allocate() for _ in range(size)]
    freed = rng.sample(blocks, rng.randint(1, size))
    for block in freed:
        pool.free(block)
    again = [pool.allocate().block_id for _ in freed]
    order = [b.block_id for b in freed]
    assert again == order, (
        "free appends a block to the back of the free list and allocate takes from the front: "
        f"blocks freed in the order {order} into an exhausted pool come back in that order, got "
        f"{again}"
    )


@seeded
def test_part2_an_exhausted_pool_raises_and_changes_nothing(rng):
    device, size = draw_device(rng), rng.randint(0, 300)
    pool = BlockAllocator(device, size)
    for _ in range(size):
        pool.allocate()
    before = counts(pool)
    message = f"the {device.value} pool has no free block: all {size} are in use"
    with pytest.raises(NoFreeBlocksError) as raised:
        pool.allocate()
    assert str(raised.value) == message, f'expected "{message}", got {raised.value!r}'
    assert counts(pool) == before, "a refused allocate changes no count"


@seeded
def test_part2_ref_counts_follow_allocate_share_and_free(rng):
    device, size = draw_device(rng), rng.randint(1, 40)
    pool = BlockAllocator(device, size)
    holders = [0] * size  # the model: how many holders each block has
    for step in range(300):
        in_use = [i for i in range(size) if holders[i] > 0]
        op = rng.randrange(3)
        if op == 0 and sum(h == 0 for h in holders) > 0:
            block = pool.allocate()
            assert holders[block.block_id] == 0, (
                f"step {step}: allocate handed out block {block.block_id}, which is in use "
                f"({holders[block.block_id]} holders)"
            )
            holders[block.block_id] = 1
        elif op == 1 and in_use:
            i = rng.choice(in_use)
            pool.share(pool.blocks[i])
            holders[i] += 1
        elif in_use:
            i = rng.choice(in_use)
            pool.free(pool.blocks[i])
            holders[i] -= 1
        got = [b.ref_count for b in pool.blocks]
        assert got == holders, (
            f"step {step}: ref counts after allocate (1), share (+1) and free (-1) expected "
            f"{holders}, got {got}"
        )
        free = sum(h == 0 for h in holders)
        assert pool.num_free_blocks == free, (
            f"step {step}: free + used = total: {free} blocks have no holder, "
            f"num_free_blocks is {pool.num_free_blocks}"
        )


@seeded
def test_part2_a_double_free_raises_and_changes_nothing(rng):
    device, size = draw_device(rng), rng.randint(2, 60)
    pool = BlockAllocator(device, size)
    blocks = [pool.allocate() for _ in range(rng.randint(1, size))]
    victim = rng.choice(blocks)
    for block in blocks:
        if rng.random() < 0.5:
            pool.share(block)
    while victim.ref_count:
        pool.free(victim)
    before = counts(pool)
    message = f"double free: {device.value} block {victim.block_id} is already free"
    with pytest.raises(DoubleFreeError) as raised:
        pool.free(victim)
    assert str(raised.value) == message, f'expected "{message}", got {raised.value!r}'
    assert counts(pool) == before, "a double free changes no count"
    ids = [pool.allocate().block_id for _ in range(before[0])]
    assert len(set(ids)) == len(ids), (
        f"after the refused double free, the {before[0]} free blocks are each handed out once: "
        f"got {sorted(ids)} (a block must not enter the free list twice)"
    )
    with pytest.raises(NoFreeBlocksError):
        pool.allocate()


@seeded
def test_part2_a_block_of_another_pool_is_refused_and_changes_nothing(rng):
    device, size = draw_device(rng), rng.randint(1, 50)
    other = Device.CPU if device is Device.GPU else Device.GPU
    pool = BlockAllocator(device, size)
    for _ in range(rng.randint(0, size)):
        pool.allocate()
    before = counts(pool)
    same_id = rng.randrange(size)
    foreign = [
        Block(same_id, other, ref_count=rng.randint(1, 3)),  # another device
        Block(size + rng.randrange(10), device, ref_count=rng.randint(1, 3)),  # past the pool
        Block(-rng.randint(1, 5), device, ref_count=rng.randint(1, 3)),  # a negative id
        Block(same_id, device, ref_count=rng.randint(1, 3)),  # an id of the pool, not its block
    ]
    for block in foreign:
        message = (
            f"{block.device.value} block {block.block_id} does not belong to this "
            f"{device.value} pool of {size} blocks"
        )
        for call in (pool.free, pool.share):
            with pytest.raises(ValueError) as raised:
                call(block)
            assert str(raised.value) == message, (
                f'{call.__name__}({block}): expected ValueError("{message}"), got {raised.value!r}'
            )
    assert counts(pool) == before, "a refused free or share changes no count"


@seeded
def test_part2_sharing_a_free_block_is_refused(rng):
    device, size = draw_device(rng), rng.randint(1, 50)
    pool = BlockAllocator(device, size)
    block = pool.blocks[rng.randrange(size)]
    before = counts(pool)
    message = f"{device.value} block {block.block_id} is free: allocate it, do not share it"
    with pytest.raises(ValueError) as raised:
        pool.share(block)
    assert str(raised.value) == message, f'expected "{message}", got {raised.value!r}'
    assert counts(pool) == before, "a refused share changes no count"


@seeded
def test_part2_cached_blocks_wait_in_the_evictor_and_go_after_the_free_list(rng):
    device, size = draw_device(rng), rng.randint(2, 40)
    pool = with_stand_in(device, size)
    blocks = [pool.allocate() for _ in range(size)]
    cached = rng.sample(blocks, rng.randint(1, size - 1))
    times = rng.sample(range(1000), len(cached))
    for block, when in zip(cached, times, strict=True):
        block.content_hash = rng.getrandbits(64)
        block.num_hashed_tokens, block.last_accessed = rng.randint(1, 64), float(when)
    order = rng.sample(blocks, size)
    for block in order:
        pool.free(block)
    in_evictor = sorted(b for b in pool.evictor.cached)
    assert in_evictor == sorted(b.block_id for b in cached), (
        "a block whose count drops to zero goes to the evictor if it has a content_hash, to the "
        f"free list otherwise: expected {sorted(b.block_id for b in cached)} in the evictor, got "
        f"{in_evictor}"
    )
    assert pool.num_free_blocks == size, (
        f"cached free blocks still count as free: expected {size}, got {pool.num_free_blocks}"
    )
    plain = [b.block_id for b in order if b.content_hash is None]
    oldest_first = [b.block_id for b in sorted(cached, key=lambda b: b.last_accessed)]
    got = [pool.allocate() for _ in range(size)]
    assert [b.block_id for b in got] == plain + oldest_first, (
        "allocate takes the free list first (in the order freed), and only then evicts cached "
        f"blocks (the evictor's choice, here oldest first): expected {plain + oldest_first}, got "
        f"{[b.block_id for b in got]}"
    )
    assert all(b.content_hash is None and b.num_hashed_tokens == 0 for b in got), (
        "an evicted block's content record is cleared (content_hash None, num_hashed_tokens 0)"
    )


@seeded
def test_part2_reuse_takes_a_cached_block_back_with_its_content(rng):
    device, size = draw_device(rng), rng.randint(2, 40)
    pool = with_stand_in(device, size)
    blocks = [pool.allocate() for _ in range(size)]
    cached = rng.sample(blocks, rng.randint(1, size - 1))
    hashes = {}
    for block in cached:
        block.content_hash = hashes[block.block_id] = rng.getrandbits(64)
        block.num_hashed_tokens = rng.randint(1, 64)
        pool.free(block)
    free = pool.num_free_blocks
    for block in rng.sample(cached, len(cached)):
        again = pool.reuse(block.block_id)
        free -= 1
        assert again is block and block.ref_count == 1, (
            f"reuse({block.block_id}) returns the pool's block with ref_count 1, got "
            f"{again!r} with ref_count {again.ref_count}"
        )
        assert block.content_hash == hashes[block.block_id], "reuse keeps the block's content"
        assert block.block_id not in pool.evictor, "reuse takes the block out of the evictor"
        assert pool.num_free_blocks == free, (
            f"a reused block is in use: expected {free} free, got {pool.num_free_blocks}"
        )
    busy = rng.choice(blocks)
    holders = busy.ref_count
    assert pool.reuse(busy.block_id) is busy and busy.ref_count == holders + 1, (
        f"reusing a block in use adds a holder: ref_count {holders + 1} expected, got "
        f"{busy.ref_count}"
    )


@seeded
def test_part2_reuse_of_an_id_outside_the_pool_or_without_content_is_refused(rng):
    device, size = draw_device(rng), rng.randint(1, 40)
    pool = with_stand_in(device, size)
    for _ in range(rng.randint(0, size)):
        pool.allocate()
    before = counts(pool)
    for block_id in (size + rng.randrange(20), -rng.randint(1, 20)):
        message = f"block id {block_id} is outside the {device.value} pool (0..{size - 1})"
        with pytest.raises(ValueError) as raised:
            pool.reuse(block_id)
        assert str(raised.value) == message, f'expected "{message}", got {raised.value!r}'
    empty = [b.block_id for b in pool.blocks if b.ref_count == 0]
    if empty:
        block_id = rng.choice(empty)
        message = f"{device.value} block {block_id} is free and holds no cached content"
        with pytest.raises(ValueError) as raised:
            pool.reuse(block_id)
        assert str(raised.value) == message, f'expected "{message}", got {raised.value!r}'
    assert counts(pool) == before, "a refused reuse changes no count"
    value = -rng.randint(1, 10**6)
    with pytest.raises(ValueError) as raised:
        BlockAllocator(device, value)
    assert str(raised.value) == f"num_blocks must be >= 0, got {value}", (
        f'BlockAllocator({value}): expected "num_blocks must be >= 0, got {value}", got '
        f"{raised.value!r}"
    )


# --------------------------------------------------------------------------------------------
# Part 1.3: BlockManager
# --------------------------------------------------------------------------------------------


@seeded
def test_part3_allocate_gives_each_prompt_ceil_blocks_of_its_own(rng):
    block_size, size = rng.randint(1, 16), rng.randint(1, 120)
    bm = BlockManager(block_size, size, watermark=0.0)
    seqs, used = [], 0
    while True:
        seq = new_seq(rng, len(seqs), draw_length(rng, block_size), block_size)
        need = ceil_div(seq.num_tokens, block_size)
        if need > size - used:
            break
        bm.allocate(seq)
        used += need
        seqs.append(seq)
        assert len(seq.block_table) == need, (
            f"a prompt of {seq.num_tokens} tokens in blocks of {block_size} gets {need} blocks, "
            f"got {len(seq.block_table)}"
        )
        assert bm.device_of(seq) is Device.GPU, "allocate puts the blocks on the GPU"
    ids = [b for seq in seqs for b in seq.block_table]
    assert len(set(ids)) == len(ids) == used, (
        f"no block is in two tables: {used} blocks handed out, {len(set(ids))} distinct"
    )
    assert all(bm.gpu_allocator.blocks[b].ref_count == 1 for b in ids), "each has one holder"
    assert bm.num_free_gpu_blocks == size - used, (
        f"free + used = total: {size - used} free expected, got {bm.num_free_gpu_blocks}"
    )
    assert bm.gpu_usage == pytest.approx(used / size), (
        f"gpu_usage is the fraction in use: {used}/{size}, got {bm.gpu_usage}"
    )
    if seqs:
        table = bm.get_block_table(seqs[0])
        table.append(-1)
        assert seqs[0].block_table == table[:-1], "get_block_table returns a copy"


@seeded
def test_part3_can_allocate_keeps_the_watermark_free(rng):
    for _ in range(40):
        block_size, size = rng.randint(1, 8), rng.randint(1, 200)
        watermark = rng.randrange(60) / 100
        bm = BlockManager(block_size, size, watermark=watermark)
        mark = int(watermark * size)
        assert bm.watermark_blocks == mark, (
            f"watermark_blocks = int({watermark} * {size}) = {mark}, got {bm.watermark_blocks}"
        )
        need = rng.randint(1, size + 3)
        # free blocks at the boundary (OK exactly, one short) or anywhere
        free = need + mark + rng.choice([0, 0, -1, -1, rng.randint(-size, size)])
        free = min(max(free, 0), size)
        used = size - free
        if used:
            bm.allocate(new_seq(rng, 0, used * block_size - rng.randrange(block_size), block_size))
        seq = new_seq(rng, 1, need * block_size - rng.randrange(block_size), block_size)
        if size - need < mark:
            expected = AllocStatus.NEVER
        elif free - need >= mark:
            expected = AllocStatus.OK
        else:
            expected = AllocStatus.LATER
        got = bm.can_allocate(seq)
        assert got is expected, (
            f"a prompt of {need} blocks, a pool of {size} with {free} free and a watermark of "
            f"{mark}: NEVER if {size} - {need} < {mark}, OK if {free} - {need} >= {mark}, else "
            f"LATER; expected {expected.name}, got {got}"
        )
        assert bm.num_free_gpu_blocks == free, "can_allocate only asks: it takes no block"


@seeded
def test_part3_append_slot_opens_a_block_exactly_when_the_newest_token_has_none(rng):
    for block_size in (1, rng.randint(2, 8)):  # block size 1: every token opens one
        seq = new_seq(rng, rng.randrange(100), draw_length(rng, block_size), block_size)
        appends = rng.randint(2 * block_size, 5 * block_size + 3)
        size = ceil_div(seq.num_tokens + appends, block_size) + rng.randint(0, 4)
        bm = BlockManager(block_size, size, watermark=rng.choice([0.0, 0.3, 0.9]))
        bm.allocate(seq)
        for _ in range(appends):
            seq.append_token(rng.randrange(VOCAB))
            n, held = seq.num_tokens, len(seq.block_table)
            opens = n > held * block_size
            assert bm.can_append_slot(seq), (
                f"{bm.num_free_gpu_blocks} blocks are free: the token at position {n - 1} finds "
                "its block (can_append_slot ignores the watermark)"
            )
            assert bm.append_slot(seq) is None, "a block held alone is never copied"
            want = held + 1 if opens else held
            assert len(seq.block_table) == want == ceil_div(n, block_size), (
                f"the token at position {n - 1} with block size {block_size} needs a new block "
                f"exactly when {n} > {held} * {block_size}: expected {want} blocks, got "
                f"{len(seq.block_table)}"
            )
        assert bm.num_free_gpu_blocks == size - len(seq.block_table)


@seeded
def test_part3_a_token_without_a_free_block_raises_and_changes_nothing(rng):
    for block_size in (1, rng.randint(2, 8)):
        seq_id = rng.randrange(1000)
        full = block_size * rng.randint(1, 5)  # fills its last block
        seq = new_seq(rng, seq_id, full, block_size)
        other = new_seq(rng, seq_id + 1, draw_length(rng, block_size), block_size)
        size = ceil_div(full, block_size) + ceil_div(other.num_tokens, block_size)
        bm = BlockManager(block_size, size, watermark=0.0)
        bm.allocate(seq)
        bm.allocate(other)
        seq.append_token(rng.randrange(VOCAB))  # opens a block; none is free
        before = manager_state(bm, [seq, other])
        assert bm.can_append_slot(seq) is False, "no block is free for the new block: False"
        message = f"sequence {seq_id} needs a GPU block and none is free"
        with pytest.raises(NoFreeBlocksError) as raised:
            bm.append_slot(seq)
        assert str(raised.value) == message, f'expected "{message}", got {raised.value!r}'
        assert manager_state(bm, [seq, other]) == before, "a refused append_slot changes nothing"


@seeded
def test_part3_copy_on_write_gives_each_writer_but_the_last_a_copy(rng):
    for k in range(4):
        check_copy_on_write(rng, fills=k == 0)


def check_copy_on_write(rng, fills: bool) -> None:
    """A family sharing a partly full last block; each member appends one token (``fills``: the
    token fills the block)."""
    block_size = rng.randint(2, 8)
    part = block_size - 1 if fills else rng.randint(1, block_size - 1)
    n = block_size * rng.randint(0, 4) + part  # the last block is partly full
    parent = new_seq(rng, 0, n, block_size)
    children = [Sequence(i, parent.token_ids, block_size) for i in range(1, rng.randint(2, 5))]
    family = [parent, *children]
    spare = len(children) + rng.randint(0, 3)
    bm = BlockManager(block_size, ceil_div(n, block_size) + spare, watermark=0.0)
    bm.allocate(parent)
    free = bm.num_free_gpu_blocks
    for child in children:
        bm.fork(parent, child)
    table = list(parent.block_table)
    assert all(c.block_table == table for c in children) and bm.num_free_gpu_blocks == free, (
        "fork shares every block of the parent and allocates none"
    )
    refs = [bm.gpu_allocator.blocks[b].ref_count for b in table]
    assert refs == [len(family)] * len(table), (
        f"{len(family)} tables hold each block: ref counts {[len(family)] * len(table)} "
        f"expected, got {refs}"
    )
    shared, writers = table[-1], rng.sample(family, len(family))
    for k, seq in enumerate(writers):
        seq.append_token(rng.randrange(VOCAB))
        copy = bm.append_slot(seq)
        if k < len(writers) - 1:
            assert copy == (shared, seq.block_table[-1]) and seq.block_table[-1] != shared, (
                f"writer {k + 1} of {len(writers)} appends into shared, partly full block "
                f"{shared}: it gets a fresh block and append_slot returns (src, dst) = "
                f"({shared}, new); got {copy} with table {seq.block_table}"
            )
            assert bm.gpu_allocator.blocks[seq.block_table[-1]].ref_count == 1
        else:
            assert copy is None and seq.block_table[-1] == shared, (
                f"the last writer holds block {shared} alone by then: it writes in place "
                f"(None), got {copy} with table {seq.block_table}"
            )
        left = max(1, len(writers) - 1 - k)
        assert bm.gpu_allocator.blocks[shared].ref_count == left, (
            f"each copy drops one reference to block {shared}: ref_count {left} expected after "
            f"{k + 1} writes, got {bm.gpu_allocator.blocks[shared].ref_count}"
        )
        assert seq.block_table[:-1] == table[:-1], "the full blocks stay shared"
    assert bm.num_free_gpu_blocks == free - len(children), (
        f"{len(children)} copies: {free - len(children)} free expected, got "
        f"{bm.num_free_gpu_blocks}"
    )


@seeded
def test_part3_a_token_past_a_full_shared_block_opens_a_block_without_copying(rng):
    block_size = rng.randint(1, 8)
    n = block_size * rng.randint(1, 4)  # the last block is full
    parent = new_seq(rng, 0, n, block_size)
    children = [Sequence(i, parent.token_ids, block_size) for i in range(1, rng.randint(2, 4))]
    bm = BlockManager(block_size, n // block_size + len(children) + 1, watermark=0.0)
    bm.allocate(parent)
    for child in children:
        bm.fork(parent, child)
    table = list(parent.block_table)
    writer = rng.choice([parent, *children])
    writer.append_token(rng.randrange(VOCAB))
    assert bm.append_slot(writer) is None, "a full shared block is not written: no copy"
    assert writer.block_table[:-1] == table and len(writer.block_table) == len(table) + 1, (
        f"the token at position {n} opens a new block; the shared ones stay: expected "
        f"{table} + [new], got {writer.block_table}"
    )
    assert [bm.gpu_allocator.blocks[b].ref_count for b in table] == [1 + len(children)] * len(
        table
    ), "the shared blocks keep every holder"


@seeded
def test_part3_can_append_slot_counts_the_block_a_copy_on_write_needs(rng):
    block_size = rng.randint(2, 8)
    n = block_size * rng.randint(0, 3) + rng.randint(1, block_size - 1)  # last block partial
    parent = new_seq(rng, 0, n, block_size)
    child = Sequence(1, parent.token_ids, block_size)
    other = block_size * rng.randint(0, 3) + rng.randint(1, block_size - 1)
    alone = new_seq(rng, 2, other, block_size)
    size = ceil_div(n, block_size) + ceil_div(other, block_size)
    bm = BlockManager(block_size, size, watermark=0.0)  # full once both are allocated
    bm.allocate(parent)
    bm.allocate(alone)
    bm.fork(parent, child)
    writer = rng.choice([parent, child])
    writer.append_token(rng.randrange(VOCAB))
    alone.append_token(rng.randrange(VOCAB))
    seqs = [parent, child, alone]
    before = manager_state(bm, seqs)
    assert bm.can_append_slot(alone) is True, (
        "the pool is full, but the newest token of a sequence fits in its own unshared last "
        "block: append_slot needs no block, can_append_slot is True"
    )
    assert bm.can_append_slot(writer) is False, (
        f"the newest token of sequence {writer.seq_id} goes into a shared, partly full block: "
        "writing it needs a copy, a block, and none is free: can_append_slot is False"
    )
    with pytest.raises(NoFreeBlocksError):
        bm.append_slot(writer)
    assert manager_state(bm, seqs) == before, (
        "a copy-on-write that finds no free block raises and changes nothing: the shared block "
        "keeps both holders and the table its id"
    )
    assert bm.append_slot(alone) is None
    bm.free(alone)  # its blocks come back: now the copy finds one
    shared = writer.block_table[-1]
    copy = bm.append_slot(writer)
    assert copy == (shared, writer.block_table[-1]), (
        f"with a free block, the copy is made: (src, dst) = ({shared}, new), got {copy}"
    )


@seeded
def test_part3_a_sequence_off_the_gpu_or_past_its_blocks_is_refused(rng):
    block_size = rng.randint(2, 8)  # two tokens past: less than a block past
    bm = BlockManager(block_size, 100, watermark=0.0)
    base = rng.randrange(1000)
    nowhere = new_seq(rng, base, draw_length(rng, block_size), block_size)
    on_cpu = new_seq(rng, base + 1, draw_length(rng, block_size), block_size)
    behind = new_seq(rng, base + 2, draw_length(rng, block_size), block_size)
    for seq in (on_cpu, behind):
        bm.allocate(seq)
    # swap_out (part 1.4) would move the blocks; _device_of (named in the constructor's
    # docstring) is what it records: set as swap_out would, to keep this test to part 1.3
    bm._device_of[on_cpu.seq_id] = Device.CPU
    seqs = [nowhere, on_cpu, behind]
    before = manager_state(bm, seqs)
    for seq, where in ((nowhere, "no blocks"), (on_cpu, "its blocks on the cpu")):
        want = f"sequence {seq.seq_id} has {where}; this operation needs its blocks on the gpu"
        for name, call in (
            ("append_slot", lambda q=seq: bm.append_slot(q)),
            ("get_slot_mapping(0, 0)", lambda q=seq: bm.get_slot_mapping(q, 0, 0)),
        ):
            with pytest.raises(ValueError) as raised:
                call()
            assert str(raised.value) == want, f"{name}: expected {want!r}, got {raised.value!r}"
        with pytest.raises(ValueError):
            bm.can_append_slot(seq)  # _require_device's error too
    capacity = ceil_div(behind.num_tokens, block_size) * block_size
    while behind.num_tokens < capacity + 2:  # two tokens past its blocks (one block short)
        behind.append_token(rng.randrange(VOCAB))
    for extra in (0, rng.randint(1, 2 * block_size)):
        for _ in range(extra):
            behind.append_token(rng.randrange(VOCAB))
        want = (
            f"sequence {behind.seq_id} has {behind.num_tokens} tokens but blocks for "
            f"{capacity}: append_slot must follow every appended token"
        )
        with pytest.raises(ValueError) as raised:
            bm.append_slot(behind)
        assert str(raised.value) == want, (
            f"more than one TOKEN past its blocks (not one block): expected {want!r}, got "
            f"{raised.value!r}"
        )
    assert manager_state(bm, seqs) == before, "every refused call changes nothing"


@seeded
def test_part3_fork_into_a_child_that_holds_blocks_is_refused(rng):
    block_size = rng.randint(1, 8)
    bm = BlockManager(block_size, 100, watermark=0.0)
    parent = new_seq(rng, rng.randrange(100), draw_length(rng, block_size), block_size)
    child = new_seq(rng, parent.seq_id + 1, draw_length(rng, block_size), block_size)
    bm.allocate(parent)
    bm.allocate(child)
    before = manager_state(bm, [parent, child])
    want = f"sequence {child.seq_id} has its blocks on the gpu; this operation needs no blocks"
    with pytest.raises(ValueError) as raised:
        bm.fork(parent, child)
    assert str(raised.value) == want, f"expected {want!r}, got {raised.value!r}"
    assert manager_state(bm, [parent, child]) == before, "a refused fork changes nothing"
    stranger = Sequence(parent.seq_id + 2, [1], block_size)
    want = f"sequence {stranger.seq_id} has no blocks; this operation needs its blocks on the gpu"
    with pytest.raises(ValueError) as raised:
        bm.fork(stranger, Sequence(parent.seq_id + 3, [1], block_size))
    assert str(raised.value) == want, f"a parent without blocks: expected {want!r}"


@seeded
def test_part3_free_returns_every_block_last_first(rng):
    block_size = rng.randint(1, 8)
    seqs = [new_seq(rng, i, draw_length(rng, block_size), block_size) for i in range(4)]
    size = sum(ceil_div(s.num_tokens, block_size) for s in seqs)
    bm = BlockManager(block_size, size, watermark=0.0)
    for seq in seqs:
        bm.allocate(seq)
    victim = rng.choice(seqs)
    table = list(victim.block_table)
    bm.free(victim)
    assert victim.block_table == [] and bm.device_of(victim) is None, (
        "free empties the table and forgets where the blocks were"
    )
    assert bm.num_free_gpu_blocks == len(table), (
        f"free returns all {len(table)} blocks, got {bm.num_free_gpu_blocks} free"
    )
    fresh = Sequence(99, draw_tokens(rng, len(table) * block_size), block_size)
    bm.allocate(fresh)
    assert fresh.block_table == table[::-1], (
        f"free returns the blocks last first (into the back of the free list): a pool that was "
        f"full hands them out again as {table[::-1]}, got {fresh.block_table}"
    )


@seeded
def test_part3_freeing_a_forked_parent_keeps_the_childrens_blocks(rng):
    block_size = rng.randint(1, 8)
    parent = new_seq(rng, 0, draw_length(rng, block_size), block_size)
    children = [Sequence(i, parent.token_ids, block_size) for i in range(1, rng.randint(2, 5))]
    bm = BlockManager(block_size, ceil_div(parent.num_tokens, block_size) + 2, watermark=0.0)
    bm.allocate(parent)
    for child in children:
        bm.fork(parent, child)
    table, free = list(parent.block_table), bm.num_free_gpu_blocks
    order = rng.sample([parent, *children], len(children) + 1)
    for k, seq in enumerate(order[:-1]):
        bm.free(seq)
        refs = [bm.gpu_allocator.blocks[b].ref_count for b in table]
        assert refs == [len(order) - 1 - k] * len(table) and bm.num_free_gpu_blocks == free, (
            f"after {k + 1} of {len(order)} holders freed, the blocks keep "
            f"{len(order) - 1 - k} holders and none is free again; got ref counts {refs}"
        )
    assert order[-1].block_table == table, "the last holder keeps its table"
    bm.free(order[-1])
    assert bm.num_free_gpu_blocks == free + len(table), "the last free returns the blocks"


@seeded
def test_part3_slot_mapping_follows_the_block_table(rng):
    block_size = rng.randint(1, 8)
    bm = BlockManager(block_size, 200, watermark=0.0)
    others = [new_seq(rng, i, draw_length(rng, block_size), block_size) for i in range(1, 6)]
    seq = new_seq(rng, 0, draw_length(rng, block_size), block_size)
    for other in others:
        bm.allocate(other)
    for other in rng.sample(others, 3):
        bm.free(other)
    bm.allocate(seq)  # scattered blocks: whatever the pool had free
    for _ in range(rng.randint(0, 2 * block_size)):
        seq.append_token(rng.randrange(VOCAB))
        bm.append_slot(seq)
    n, table = seq.num_tokens, list(seq.block_table)
    for _ in range(20):
        start = rng.randint(0, n)
        end = rng.randint(start, n)
        want = [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
        got = bm.get_slot_mapping(seq, start, end)
        assert got == want, (
            f"slots of [{start}, {end}) with table {table}, block size {block_size}: "
            f"block_table[pos // bs] * bs + pos % bs = {want}, got {got}"
        )


@seeded
def test_part3_slot_ranges_outside_the_slotted_positions_are_refused(rng):
    block_size = rng.randint(1, 8)
    seq_id = rng.randrange(1000)
    full = block_size * rng.randint(1, 4)
    seq = new_seq(rng, seq_id, full, block_size)
    bm = BlockManager(block_size, 64, watermark=0.0)
    bm.allocate(seq)
    seq.append_token(rng.randrange(VOCAB))  # position `full` has no slot yet
    n = full + 1
    message = (
        f"slot range [0, {n}) is outside the {full} positions sequence {seq_id} has slots for "
        f"({n} tokens)"
    )
    with pytest.raises(ValueError) as raised:
        bm.get_slot_mapping(seq, 0, n)
    assert str(raised.value) == message, f'expected "{message}", got {raised.value!r}'
    start = rng.randint(1, full)
    for bad in ((start, start - 1), (-1, rng.randint(0, full)), (0, n + rng.randint(1, 9))):
        with pytest.raises(ValueError):
            bm.get_slot_mapping(seq, *bad)
    assert bm.get_slot_mapping(seq, full, full) == [], "an empty range inside the slots is []"


@seeded
def test_part3_refused_calls_raise_and_change_nothing(rng):
    block_size = rng.randint(1, 8)
    bm = BlockManager(block_size, rng.randint(4, 40), watermark=0.0)
    seq_id = rng.randrange(1000)
    seq = new_seq(rng, seq_id, rng.randint(1, 2 * block_size), block_size)
    bm.allocate(seq)
    before = manager_state(bm, [seq])
    message = f"sequence {seq_id} has its blocks on the gpu; this operation needs no blocks"
    with pytest.raises(ValueError) as raised:
        bm.allocate(seq)
    assert str(raised.value) == message, f'allocate twice: expected "{message}", got {raised}'
    assert manager_state(bm, [seq]) == before, "a refused allocate changes nothing"
    other_size = block_size + rng.randint(1, 4)
    with pytest.raises(ValueError, match="block size"):
        bm.allocate(Sequence(seq_id + 1, [1, 2, 3], other_size))
    free = bm.num_free_gpu_blocks
    big = new_seq(rng, seq_id + 2, (free + rng.randint(1, 5)) * block_size, block_size)
    message = f"sequence {seq_id + 2} needs {big.num_blocks} GPU blocks, {free} are free"
    with pytest.raises(NoFreeBlocksError) as raised:
        bm.allocate(big)
    assert str(raised.value) == message, f'expected "{message}", got {raised.value!r}'
    assert big.block_table == [] and manager_state(bm, [seq]) == before, (
        "a prompt that does not fit takes no block (all or nothing)"
    )
    unknown = seq_id + 3
    message = f"free: sequence {unknown} holds no blocks (never allocated, or already freed)"
    with pytest.raises(ValueError) as raised:
        bm.free(Sequence(unknown, [1], block_size))
    assert str(raised.value) == message, f'expected "{message}", got {raised.value!r}'
    assert manager_state(bm, [seq]) == before, "a refused call changes nothing"


@seeded
def test_part3_bad_configuration_is_refused_with_the_argument_and_its_value(rng):
    k = rng.randint(1, 100)
    for block_size in (0, -k, float(k), True):
        with pytest.raises(ValueError) as raised:
            BlockManager(block_size, 8)
        want = f"block_size must be a positive integer, got {block_size!r}"
        assert str(raised.value) == want, f'expected "{want}", got {raised.value!r}'
    for gpu in (0, -k):
        with pytest.raises(ValueError) as raised:
            BlockManager(4, gpu)
        want = f"num_gpu_blocks must be >= 1, got {gpu}"
        assert str(raised.value) == want, f'expected "{want}", got {raised.value!r}'
    for watermark in (1.0, 1 + k / 4, -k / 8):
        with pytest.raises(ValueError) as raised:
            BlockManager(4, 8, watermark=watermark)
        want = f"watermark must be in [0, 1), got {watermark}"
        assert str(raised.value) == want, f'expected "{want}", got {raised.value!r}'
    with pytest.raises(ValueError, match=rf"^num_blocks must be >= 0, got -{k}$"):
        BlockManager(4, 8, num_cpu_blocks=-k)
    assert BlockManager(4, 8).cpu_usage == 0.0, "no CPU pool: cpu_usage is 0"
    cpu = rng.randint(1, 30)
    bm = BlockManager(4, 8, num_cpu_blocks=cpu)
    used = rng.randint(0, cpu)
    for _ in range(used):
        bm.cpu_allocator.allocate()
    got = (bm.cpu_allocator.num_blocks, bm.num_free_cpu_blocks, bm.cpu_usage)
    assert got[:2] == (cpu, cpu - used) and got[2] == pytest.approx(used / cpu), (
        f"a CPU pool of {cpu} blocks, {used} used: (size, free, cpu_usage) expected "
        f"({cpu}, {cpu - used}, {used / cpu}), got {got}"
    )


# --------------------------------------------------------------------------------------------
# Part 1.4: Swapper (through the BlockManager)
# --------------------------------------------------------------------------------------------


def family(
    rng, bm: BlockManager, first_id: int, diverge: bool = True, children: int = 0
) -> list[Sequence]:
    """A parent and ``children`` to 3 forked children; some append a token (opening or copying
    a block)."""
    size = bm.block_size
    parent = new_seq(rng, first_id, draw_length(rng, size), size)
    bm.allocate(parent)
    group = [parent]
    for i in range(rng.randint(children, 3)):
        child = Sequence(first_id + 1 + i, parent.token_ids, size)
        bm.fork(parent, child)
        group.append(child)
    if diverge:
        for seq in group:
            if rng.random() < 0.5:
                seq.append_token(rng.randrange(VOCAB))
                bm.append_slot(seq)
    return group


def seq_state(bm: BlockManager, seqs: list[Sequence]) -> list:
    """The tables, devices and ref counts of these sequences' blocks."""
    return [
        (
            list(s.block_table),
            bm.device_of(s),
            [bm.gpu_allocator.blocks[b].ref_count for b in s.block_table],
        )
        for s in seqs
    ]


def distinct(seqs: list[Sequence]) -> list[int]:
    return list(dict.fromkeys(b for seq in seqs for b in seq.block_table))


def holders(seqs: list[Sequence], block: int) -> int:
    return sum(seq.block_table.count(block) for seq in seqs)


@seeded
def test_part4_swap_out_moves_each_distinct_block_once_with_its_ref_count(rng):
    bm = BlockManager(rng.randint(1, 6), 300, num_cpu_blocks=200, watermark=0.0)
    groups = [  # the first: forked, nothing copied yet, so every block is shared
        family(rng, bm, 10 * g, diverge=g > 0, children=int(g == 0))
        for g in range(rng.randint(2, 4))
    ]
    group, rest = groups[0], [s for g in groups[1:] for s in g]
    rest_before = seq_state(bm, rest)
    old = {seq.seq_id: list(seq.block_table) for seq in group}
    blocks = distinct(group)
    free_gpu, free_cpu = bm.num_free_gpu_blocks, bm.num_free_cpu_blocks
    assert bm.can_swap_out(group), "no sharer outside the group and room in the CPU pool: True"
    mapping = bm.swap_out(group)
    assert sorted(mapping) == sorted(blocks), (
        f"the map's keys are the group's distinct GPU blocks {sorted(blocks)} (a shared block "
        f"once), got {sorted(mapping)}"
    )
    assert len(set(mapping.values())) == len(blocks), "each moves to a CPU block of its own"
    for seq in group:
        want = [mapping[b] for b in old[seq.seq_id]]
        assert seq.block_table == want, (
            f"sequence {seq.seq_id}: its table lists the CPU copies in the same logical order, "
            f"expected {want}, got {seq.block_table}"
        )
        assert bm.device_of(seq) is Device.CPU
    for gpu, cpu in mapping.items():
        count = holders(group, cpu)
        assert bm.cpu_allocator.blocks[cpu].ref_count == count, (
            f"CPU block {cpu} (from GPU block {gpu}) is held by {count} tables of the group: it "
            f"keeps that ref count, got {bm.cpu_allocator.blocks[cpu].ref_count}"
        )
        assert bm.gpu_allocator.blocks[gpu].ref_count == 0, f"GPU block {gpu} is freed"
    got = (bm.num_free_gpu_blocks, bm.num_free_cpu_blocks)
    want = (free_gpu + len(blocks), free_cpu - len(blocks))
    assert got == want, f"(free GPU, free CPU) expected {want}, got {got}"
    assert seq_state(bm, rest) == rest_before, "the other groups are untouched"


@seeded
def test_part4_a_round_trip_maps_every_logical_block_back_to_the_gpu(rng):
    bm = BlockManager(rng.randint(1, 6), 300, num_cpu_blocks=200, watermark=0.0)
    groups = [family(rng, bm, 10 * g) for g in range(rng.randint(1, 3))]
    before = manager_state(bm, [s for g in groups for s in g])
    old = [[list(s.block_table) for s in g] for g in groups]
    out = [bm.swap_out(g) for g in groups]
    back = [bm.swap_in(g) for g in rng.sample(groups, len(groups))]
    back_of = {}
    for mapping in back:
        back_of.update(mapping)
    for g, group in enumerate(groups):
        for seq, table in zip(group, old[g], strict=True):
            want = [back_of[out[g][b]] for b in table]
            assert seq.block_table == want, (
                f"sequence {seq.seq_id}: each logical block sits where the two maps send it, "
                f"expected {want}, got {seq.block_table}"
            )
            assert bm.device_of(seq) is Device.GPU
        for block in distinct(group):
            assert bm.gpu_allocator.blocks[block].ref_count == holders(group, block)
    after = manager_state(bm, [s for g in groups for s in g])
    assert after[:2] == before[:2], (
        f"a round trip returns every CPU block and takes as many GPU blocks as it freed: "
        f"(free GPU, free CPU) expected {before[:2]}, got {after[:2]}"
    )
    assert bm.num_free_cpu_blocks == 200 and bm.cpu_usage == 0.0


@seeded
def test_part4_can_swap_in_counts_distinct_blocks_and_a_block_for_each_next_token(rng):
    for _ in range(20):
        block_size = rng.randint(1, 5)
        size = rng.randint(8, 60)
        watermark = rng.choice([0.0, 0.05, 0.1, 0.25])
        bm = BlockManager(block_size, size, num_cpu_blocks=400, watermark=watermark)
        parent = new_seq(rng, 0, rng.randint(1, 3 * block_size), block_size)
        bm.allocate(parent)
        group = [parent]
        for i in range(rng.randint(0, 3)):
            child = Sequence(i + 1, parent.token_ids, block_size)
            bm.fork(parent, child)
            group.append(child)
        for seq in group:
            if rng.random() < 0.4 and bm.num_free_gpu_blocks:
                seq.append_token(rng.randrange(VOCAB))
                bm.append_slot(seq)
        bm.swap_out(group)
        for seq in group:
            if rng.random() < 0.5:
                seq.append_token(rng.randrange(VOCAB))  # its slot comes with the next step
        cpu = bm.cpu_allocator.blocks
        look = sum(
            seq.num_tokens > len(seq.block_table) * block_size
            or cpu[seq.block_table[-1]].ref_count > 1
            for seq in group
        )
        need = len(distinct(group)) + look
        mark = int(watermark * size)
        # free blocks at the boundary (OK exactly, one short) or anywhere: a miscount flips it
        free = need + mark + rng.choice([0, 0, -1, -1, rng.randint(-size, size)])
        free = min(max(free, 0), size)
        filler = size - free
        if filler:
            bm.allocate(Sequence(50, [7] * (filler * block_size), block_size))
        if size - need < mark:
            expected = AllocStatus.NEVER
        elif free - need >= mark:
            expected = AllocStatus.OK
        else:
            expected = AllocStatus.LATER
        got = bm.can_swap_in(group)
        assert got is expected, (
            f"a group of {len(group)} with {len(distinct(group))} distinct blocks and {look} "
            f"needing a block for the next token (no slot yet, or a shared last block): need "
            f"{need}; pool {size}, {free} free, watermark {mark}: expected {expected.name}, got "
            f"{got}"
        )


@seeded
def test_part4_a_shared_last_block_needs_a_block_for_its_copy(rng):
    for _ in range(6):
        block_size = rng.randint(2, 6)
        n = block_size * rng.randint(0, 3) + rng.randint(1, block_size - 1)  # partly full
        blocks = ceil_div(n, block_size)
        members = rng.randint(2, 4)
        size = blocks + members + rng.randint(2, 10)
        watermark = rng.choice([0.0, 0.1, 0.2])
        bm = BlockManager(block_size, size, num_cpu_blocks=blocks, watermark=watermark)
        parent = new_seq(rng, 0, n, block_size)
        bm.allocate(parent)
        group = [parent]
        for i in range(1, members):
            child = Sequence(i, parent.token_ids, block_size)
            bm.fork(parent, child)
            group.append(child)
        bm.swap_out(group)  # every newest token has its slot; the last block is shared
        need, mark = blocks + members, int(watermark * size)
        free = min(size, need + mark - rng.choice([0, 1]))
        if size - free:
            bm.allocate(Sequence(50, [7] * ((size - free) * block_size), block_size))
        if size - need < mark:
            expected = AllocStatus.NEVER
        elif free - need >= mark:
            expected = AllocStatus.OK
        else:
            expected = AllocStatus.LATER
        got = bm.can_swap_in(group)
        assert got is expected, (
            f"{members} samples share {blocks} blocks, the last partly full: each one's next "
            f"token copies it first, so the need is {blocks} + {members} = {need}; {free} free "
            f"of {size}, watermark {mark}: expected {expected.name}, got {got}"
        )


@seeded
def test_part4_a_sequence_that_outgrew_the_pool_can_never_swap_in(rng):
    block_size = rng.randint(1, 6)
    seq = new_seq(rng, rng.randrange(100), block_size * rng.randint(1, 8), block_size)
    size = ceil_div(seq.num_tokens, block_size)
    watermark = rng.choice([0.0, 0.1, 0.3])
    bm = BlockManager(block_size, size, num_cpu_blocks=size, watermark=watermark)
    bm.allocate(seq)
    bm.swap_out([seq])
    seq.append_token(rng.randrange(VOCAB))  # its next step needs block size + 1
    got = bm.can_swap_in([seq])
    assert got is AllocStatus.NEVER, (
        f"a sequence of {size} blocks whose newest token needs another, and a pool of {size}: "
        f"{size} - {size + 1} < watermark {int(watermark * size)}: NEVER expected, got {got}"
    )


@seeded
def test_part4_a_swap_in_exactly_at_the_watermark_is_allowed(rng):
    block_size = rng.randint(1, 6)
    seq = new_seq(rng, rng.randrange(100), draw_length(rng, block_size), block_size)
    blocks = ceil_div(seq.num_tokens, block_size)
    gpu, watermark = blocks + rng.randint(10, 30), rng.choice([0.1, 0.2, 0.3])
    mark = int(watermark * gpu)
    bm = BlockManager(block_size, gpu, num_cpu_blocks=blocks, watermark=watermark)
    bm.allocate(seq)
    bm.swap_out([seq])
    free = blocks + mark  # after the swap-in exactly the watermark is left
    bm.allocate(Sequence(999, [3] * (gpu - free) * block_size, block_size))
    assert bm.swapper.can_swap_in([seq]) is True and bm.can_swap_in([seq]) is AllocStatus.OK, (
        f"{blocks} blocks into {free} free with a watermark of {mark}: {free} - {blocks} >= "
        f"{mark}, the swap-in fits"
    )
    bm.swap_in([seq])
    assert bm.num_free_gpu_blocks == mark and bm.device_of(seq) is Device.GPU


@seeded
def test_part4_a_sharer_left_out_refuses_the_swap_and_changes_nothing(rng):
    for extra in range(3):
        check_sharer_left_out(rng, extra)


def check_sharer_left_out(rng, extra: int) -> None:
    """Part of a forked family, with ``extra`` steps of sequences sharing nothing."""
    block_size = rng.randint(1, 6)
    bm = BlockManager(block_size, 200, num_cpu_blocks=200, watermark=0.0)
    parent = new_seq(rng, 0, draw_length(rng, block_size), block_size)
    bm.allocate(parent)
    group = [parent]
    for i in range(rng.randint(1, 4)):
        child = Sequence(i + 1, parent.token_ids, block_size)
        bm.fork(parent, child)
        group.append(child)
    part = rng.sample(group, rng.randint(1, len(group) - 1))
    held = len(part)
    outsiders = [0, len(group) - held, len(group) - held + 1][extra]  # as many as the sharers
    for i in range(outsiders):  # sequences sharing nothing may come along
        other = new_seq(rng, 100 + i, draw_length(rng, block_size), block_size)
        bm.allocate(other)
        part.insert(rng.randint(0, len(part)), other)
    before = manager_state(bm, group)
    assert bm.can_swap_out(part) is False, (
        f"sequences {[s.seq_id for s in part]} share blocks with others of "
        f"{[s.seq_id for s in group]} left out: the swap is refused, can_swap_out False"
    )
    with pytest.raises(ValueError) as raised:
        bm.swap_out(part)
    said = str(raised.value)
    assert (
        said.startswith("gpu block ")
        and said.endswith("swap every sequence that shares it together")
        and f"has ref_count {len(group)} but the group holds it {held} time(s)" in said
    ), (
        f"the error names the block, its ref_count {len(group)} and the {held} tables of "
        f"the group holding it, then says what to do; got {said!r}"
    )
    assert manager_state(bm, group) == before, "a refused swap changes nothing"


@seeded
def test_part4_a_swap_out_without_cpu_room_raises_and_changes_nothing(rng):
    block_size = rng.randint(1, 6)
    seqs = [new_seq(rng, i, draw_length(rng, block_size), block_size) for i in range(3)]
    blocks = ceil_div(seqs[0].num_tokens, block_size)
    cpu = rng.randint(0, blocks - 1)
    gpu = sum(ceil_div(s.num_tokens, block_size) for s in seqs) + rng.randint(0, 3)
    bm = BlockManager(block_size, gpu, num_cpu_blocks=cpu, watermark=0.0)
    for seq in seqs:
        bm.allocate(seq)
    before = manager_state(bm, seqs)
    assert bm.can_swap_out([seqs[0]]) is False, (
        f"{blocks} blocks and {cpu} free CPU blocks: can_swap_out False"
    )
    message = f"swap out needs {blocks} CPU blocks, {cpu} are free"
    with pytest.raises(NoFreeBlocksError) as raised:
        bm.swap_out([seqs[0]])
    assert str(raised.value) == message, f'expected "{message}", got {raised.value!r}'
    assert manager_state(bm, seqs) == before, "a refused swap-out changes nothing"


@seeded
def test_part4_a_swap_in_below_the_watermark_raises_and_changes_nothing(rng):
    block_size = rng.randint(1, 6)
    seq = new_seq(rng, rng.randrange(100), draw_length(rng, block_size), block_size)
    blocks = ceil_div(seq.num_tokens, block_size)
    gpu, watermark = blocks + 10, rng.choice([0.1, 0.2, 0.3])
    mark = int(watermark * gpu)  # at least 1
    bm = BlockManager(block_size, gpu, num_cpu_blocks=blocks, watermark=watermark)
    bm.allocate(seq)
    bm.swap_out([seq])
    free = rng.randint(blocks, blocks + mark - 1)  # the blocks fit, not with the watermark
    bm.allocate(Sequence(999, [3] * (gpu - free) * block_size, block_size))
    before = manager_state(bm, [seq])
    message = f"swap in needs {blocks} GPU blocks plus a watermark of {mark}, {free} are free"
    with pytest.raises(NoFreeBlocksError) as raised:
        bm.swap_in([seq])
    assert str(raised.value) == message, f'expected "{message}", got {raised.value!r}'
    assert manager_state(bm, [seq]) == before, "a refused swap-in changes nothing"


@seeded
def test_part4_every_swap_call_checks_the_group(rng):
    block_size = rng.randint(1, 6)
    bm = BlockManager(block_size, 100, num_cpu_blocks=100, watermark=0.0)
    on_gpu = new_seq(rng, rng.randrange(100), draw_length(rng, block_size), block_size)
    on_cpu = new_seq(rng, on_gpu.seq_id + 1, draw_length(rng, block_size), block_size)
    nowhere = Sequence(on_gpu.seq_id + 2, [1, 2], block_size)
    bm.allocate(on_gpu)
    bm.allocate(on_cpu)
    bm.swap_out([on_cpu])
    seqs = [on_gpu, on_cpu, nowhere]
    before = manager_state(bm, seqs)
    gpu_calls = (bm.can_swap_out, bm.swap_out)
    cpu_calls = (bm.can_swap_in, bm.swap_in)
    for calls, here, there, device in (
        (gpu_calls, on_gpu, on_cpu, "gpu"),
        (cpu_calls, on_cpu, on_gpu, "cpu"),
    ):
        for call in calls:
            for group, want in (
                ([], "a swap needs at least one sequence"),
                ([here, here], "a swap group lists a sequence twice"),
                (
                    [here, there],
                    f"sequence {there.seq_id} has its blocks on the "
                    f"{'cpu' if device == 'gpu' else 'gpu'}; this operation needs its blocks on "
                    f"the {device}",
                ),
                (
                    [nowhere],
                    f"sequence {nowhere.seq_id} has no blocks; this operation needs its blocks "
                    f"on the {device}",
                ),
            ):
                with pytest.raises(ValueError) as raised:
                    call(group)
                assert str(raised.value) == want, (
                    f"{call.__name__}({[s.seq_id for s in group]}): expected ValueError("
                    f'"{want}"), got {raised.value!r}'
                )
    assert manager_state(bm, seqs) == before, "a refused swap call changes nothing"


# --------------------------------------------------------------------------------------------
# Part 1.5: Evictor
# --------------------------------------------------------------------------------------------


def cached_block(rng, block_id: int, times: list[float], depths: list[int]) -> Block:
    return Block(
        block_id,
        Device.GPU,
        content_hash=rng.getrandbits(64),
        num_hashed_tokens=rng.choice(depths),
        last_accessed=rng.choice(times),
    )


def key(block: Block) -> tuple[float, int, int]:
    return (block.last_accessed, -block.num_hashed_tokens, block.block_id)


@seeded
def test_part5_evict_takes_the_smallest_key_through_random_adds_updates_and_removes(rng):
    evictor = Evictor()
    times = [float(t) for t in rng.sample(range(1000), 6)]
    depths = rng.sample(range(1, 200), 4)
    ids = rng.sample(range(10_000), 120)
    held: dict[int, Block] = {}
    for step in range(400):
        op = rng.random()
        spare = [i for i in ids if i not in held]
        if op < 0.35 and spare:
            block = cached_block(rng, rng.choice(spare), times, depths)
            evictor.add(block)
            held[block.block_id] = block
        elif op < 0.65 and held:
            block_id = rng.choice(list(held))
            when = rng.choice(times)
            evictor.update(block_id, when)
            assert held[block_id].last_accessed == when, (
                f"update({block_id}, {when}) sets the block's last_accessed"
            )
        elif op < 0.8 and held:
            block_id = rng.choice(list(held))
            assert evictor.remove(block_id) is held.pop(block_id), "remove returns the block"
        elif held:
            want = min(held.values(), key=key)
            got = evictor.evict()
            assert got is want, (
                f"step {step}: evict takes the smallest (last_accessed, -num_hashed_tokens, "
                f"block_id) of the held blocks: expected {key(want)}, got {key(got)}"
            )
            del held[want.block_id]
        assert len(evictor) == len(held), f"step {step}: {len(held)} held, len {len(evictor)}"
    order = [evictor.evict().block_id for _ in range(len(held))]
    want = [b.block_id for b in sorted(held.values(), key=key)]
    assert order == want, f"evicting all: expected {want}, got {order}"


@seeded
def test_part5_equal_ages_go_to_more_hashed_tokens_then_the_smaller_id(rng):
    evictor = Evictor()
    when = float(rng.randrange(10**6))
    blocks = [
        Block(i, Device.GPU, content_hash=i + 1, num_hashed_tokens=rng.randint(1, 6) * 16)
        for i in rng.sample(range(1000), rng.randint(3, 30))
    ]
    for block in blocks:
        block.last_accessed = when
        evictor.add(block)
    order = [evictor.evict().block_id for _ in blocks]
    want = [b.block_id for b in sorted(blocks, key=lambda b: (-b.num_hashed_tokens, b.block_id))]
    assert order == want, (
        "equally old blocks go deepest first (the most hashed tokens), then by smaller id: "
        f"expected {want}, got {order}"
    )
    with pytest.raises(ValueError) as raised:
        evictor.evict()
    want_message = "evict() on an empty evictor: no cached block to give up"
    assert str(raised.value) == want_message, f"expected {want_message!r}, got {raised.value!r}"


@seeded
def test_part5_a_block_added_again_or_updated_is_ordered_by_its_new_key(rng):
    evictor = Evictor()
    n = rng.randint(4, 20)
    blocks = [
        Block(i, Device.GPU, content_hash=i + 7, last_accessed=float(t))
        for i, t in zip(rng.sample(range(500), n), rng.sample(range(100, 1000), n), strict=True)
    ]
    for block in blocks:
        evictor.add(block)
    moved = rng.sample(blocks, rng.randint(1, n - 1))
    for block in moved:
        if rng.random() < 0.5:
            evictor.update(block.block_id, float(rng.randrange(1000, 2000)))
        else:
            evictor.remove(block.block_id)
            block.last_accessed = float(rng.randrange(1000, 2000))
            evictor.add(block)
    order = [evictor.evict().block_id for _ in blocks]
    want = [b.block_id for b in sorted(blocks, key=key)]
    assert order == want, (
        "a block updated, or removed and added again, is evicted by its new key: the old "
        f"entries are stale and skipped; expected {want}, got {order}"
    )


@seeded
def test_part5_stale_entries_do_not_pile_up(rng):
    evictor = Evictor()
    blocks = [
        Block(i, Device.GPU, content_hash=i + 1, last_accessed=float(t))
        for t, i in enumerate(rng.sample(range(1000), rng.randint(1, 6)))
    ]
    for block in blocks:
        evictor.add(block)
    clock = 10.0
    for _ in range(rng.randint(2000, 4000)):
        block = rng.choice(blocks)
        clock += 1
        if rng.random() < 0.8:
            evictor.update(block.block_id, clock)
        else:
            evictor.remove(block.block_id)
            block.last_accessed = clock
            evictor.add(block)
    assert len(evictor._heap) <= 2 * len(blocks) + 100, (
        f"{len(blocks)} blocks after thousands of updates and removes: the heap holds "
        f"{len(evictor._heap)} entries; rebuild it when stale entries outnumber live ones, or "
        "it grows without bound"
    )
    order = [evictor.evict().block_id for _ in blocks]
    want = [b.block_id for b in sorted(blocks, key=key)]
    assert order == want, f"and the order is still by the newest keys: {want}, got {order}"


@seeded
def test_part5_refused_calls_name_the_block_and_change_nothing(rng):
    evictor = Evictor()
    ids = rng.sample(range(1000), 12)
    blocks = [Block(i, Device.GPU, content_hash=i + 3, last_accessed=float(i)) for i in ids[:8]]
    for block in blocks:
        evictor.add(block)
    busy = Block(ids[8], Device.GPU, ref_count=rng.randint(1, 5), content_hash=5)
    bare = Block(ids[9], Device.GPU)
    held = rng.choice(blocks)
    for block, want in (
        (
            busy,
            f"block {busy.block_id} has ref_count {busy.ref_count}: only free blocks can be cached",
        ),
        (bare, f"block {bare.block_id} has no content hash: nothing to cache"),
        (held, f"block {held.block_id} is already in the evictor"),
    ):
        with pytest.raises(ValueError) as raised:
            evictor.add(block)
        assert str(raised.value) == want, f"add: expected {want!r}, got {raised.value!r}"
    unknown = ids[10]
    want = f"block {unknown} is not in the evictor"
    for call in (lambda: evictor.remove(unknown), lambda: evictor.update(unknown, 1.0)):
        with pytest.raises(ValueError) as raised:
            call()
        assert str(raised.value) == want, f"expected {want!r}, got {raised.value!r}"
    assert len(evictor) == len(blocks) and ids[8] not in evictor and ids[9] not in evictor
    order = [evictor.evict().block_id for _ in blocks]
    assert order == sorted(ids[:8]), (
        f"the refused calls changed nothing: eviction order {sorted(ids[:8])} expected, got {order}"
    )
