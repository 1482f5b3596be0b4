"""Prefix caching in the engine: ``PrefixCachingBlockManager`` over the RadixCache, and the bar
that greedy output with caching on equals output with it off."""

from collections import Counter
from typing import ClassVar

import pytest
from hypothesis import seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test
from prefix_checks import check_prefix_cache, check_tree_sizes, path_blocks

from vkv import LLM, SamplingParams
from vkv.config import Config
from vkv.engine.block import Device, NoFreeBlocksError
from vkv.engine.block_manager import AllocStatus
from vkv.engine.prefix_caching import PrefixCachingBlockManager
from vkv.engine.scheduler import Scheduler
from vkv.engine.sequence import Sequence, SequenceStatus

BS = 4


def manager(num_gpu_blocks: int = 16, num_cpu_blocks: int = 16) -> PrefixCachingBlockManager:
    return PrefixCachingBlockManager(BS, num_gpu_blocks, num_cpu_blocks, watermark=0.0)


def prompt(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def computed(m: PrefixCachingBlockManager, seq_id: int, tokens: list[int]) -> Sequence:
    """A sequence allocated and prefilled: its tokens all computed but the newest."""
    seq = Sequence(seq_id, tokens, BS)
    m.allocate(seq)
    return prefilled(seq)


def finish(m: PrefixCachingBlockManager, seq: Sequence) -> None:
    seq.status = SequenceStatus.FINISHED_STOPPED
    m.free(seq)


def test_a_hit_reuses_the_cached_blocks_and_counts_them_computed():
    m = manager()
    a = computed(m, 0, prompt(10))
    a_blocks = list(a.block_table)
    finish(m, a)
    b = Sequence(1, [*prompt(10), 1, 2, 3], BS)
    assert m.num_cached_tokens(b) == 8
    m.allocate(b)
    assert b.block_table[:2] == a_blocks[:2] and b.num_computed_tokens == 8
    assert (m.num_query_tokens, m.num_hit_tokens) == (10 + 13, 8)
    check_prefix_cache(m, [b])


def test_a_hit_never_covers_the_last_prompt_token():
    m = manager()
    finish(m, computed(m, 0, prompt(8)))  # caches 2 blocks: 8 tokens computed
    same = Sequence(1, prompt(8), BS)
    m.allocate(same)
    assert same.num_computed_tokens == 4, "the last token's block is computed again (its logits)"


def test_cached_blocks_in_use_cost_no_free_block_at_admission():
    m = manager(num_gpu_blocks=4)
    a = computed(m, 0, prompt(12))  # 3 full blocks + 1 for the appended token = 4 blocks
    m.append_slot(a)  # its first decode: the computed blocks are cached and locked
    assert m.num_free_gpu_blocks == 0
    b = Sequence(1, [*prompt(12), 5], BS)  # shares 3 blocks, needs 1 more: none is free
    assert m.can_allocate(b) is AllocStatus.LATER
    c = Sequence(2, prompt(9), BS)  # shares 2 blocks in use, needs 1 more
    finish(m, a)
    assert m.can_allocate(c) is AllocStatus.OK and m.can_allocate(b) is AllocStatus.OK


def prefilled(seq: Sequence) -> Sequence:
    """What a step's prefill and postprocess do to an allocated sequence."""
    seq.num_computed_tokens, seq.is_prefill = seq.num_tokens, False
    seq.append_token(7)
    return seq


def test_identical_prompts_admitted_together_share_blocks_from_their_first_decode():
    m = manager()
    a, b = Sequence(0, prompt(9), BS), Sequence(1, prompt(9), BS)
    m.allocate(a)
    m.allocate(b)  # the same step: a's blocks are not computed yet
    assert set(a.block_table).isdisjoint(b.block_table), "both compute the prompt"
    prefilled(a), prefilled(b)
    free_before = m.num_free_gpu_blocks
    m.append_slot(a)
    m.append_slot(b)
    assert b.block_table[:2] == a.block_table[:2], "b switched to the tree's (a's) blocks"
    assert m.num_free_gpu_blocks == free_before + 2, "b's two duplicates are freed"
    assert [m.gpu_allocator.blocks[i].ref_count for i in a.block_table[:2]] == [2, 2]
    check_prefix_cache(m, [a, b])


def test_a_prompt_admitted_a_step_after_another_reuses_its_computed_blocks():
    m = manager()
    a = prefilled(allocated(m, 0, prompt(9)))  # computed in the last step, not decoded yet
    b = Sequence(1, [*prompt(9), 5], BS)
    assert m.num_cached_tokens(b) == 8, "a's prefill is merged before b's admission"
    m.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.num_computed_tokens == 8
    check_prefix_cache(m, [a, b])


def test_a_chunked_prefill_shares_its_chunks_as_they_are_computed():
    m = manager()
    a = allocated(m, 0, prompt(13))
    a.num_computed_tokens = 8  # the first chunk: 2 full blocks
    b = Sequence(1, prompt(13), BS)
    assert m.num_cached_tokens(b) == 8
    a.num_computed_tokens = 12
    assert m.num_cached_tokens(b) == 12, "the next chunk's block is merged too"
    check_prefix_cache(m, [a])


def allocated(m: PrefixCachingBlockManager, seq_id: int, tokens: list[int]) -> Sequence:
    seq = Sequence(seq_id, tokens, BS)
    m.allocate(seq)
    return seq


def test_eviction_gives_up_the_least_recently_used_prefix_first():
    m = manager(num_gpu_blocks=6)
    old, new = computed(m, 0, prompt(9, 100)), computed(m, 1, prompt(9, 200))
    finish(m, old)
    finish(m, new)  # 4 cached blocks in the Evictor, all free
    assert m.num_free_gpu_blocks == 6 and m.tree.evictable_size == 4
    m.allocate(Sequence(2, prompt(16, 300), BS))  # 4 blocks: 2 free + 2 evicted
    assert m.num_cached_tokens(Sequence(3, prompt(9, 100), BS)) == 0, "the older prefix went"
    assert m.num_cached_tokens(Sequence(4, prompt(9, 200), BS)) == 8, "the newer one stays"


def test_a_recomputed_sequence_is_not_counted_as_a_hit():
    m = manager()
    seq = computed(m, 0, prompt(10))
    m.free(seq)  # preempted by recompute: not finished
    seq.num_computed_tokens = 0
    m.allocate(seq)
    assert seq.num_computed_tokens == 8, "its own blocks are reused"
    assert (m.num_query_tokens, m.num_hit_tokens) == (10, 0), "but not counted as a hit"


def test_a_group_sharing_blocks_with_another_is_not_swapped_out():
    m = manager()
    a = computed(m, 0, prompt(9))
    m.append_slot(a)
    b = Sequence(1, [*prompt(9), 1], BS)
    m.allocate(b)
    assert not m.can_swap_out([b]), "b's cached blocks are a's too: recompute it instead"
    assert m.can_swap_out([a, b]), "the two hold their blocks alone together"


def test_a_swapped_sequence_releases_the_tree_and_merges_back_after_swap_in():
    m = manager()
    a = computed(m, 0, prompt(9))
    m.append_slot(a)
    cached = a.block_table[:2]
    m.swap_out([a])
    assert m.tree.protected_size == 0 and m.tree.evictable_size == 2, "cached, evictable"
    check_prefix_cache(m, [])
    m.swap_in([a])
    assert set(a.block_table).isdisjoint(cached), "fresh GPU copies"
    m.append_slot(a)
    assert a.block_table[:2] == cached, "back on the tree's blocks"
    check_prefix_cache(m, [a])


def test_a_forked_child_locks_the_parents_cached_path():
    m = manager()
    parent = computed(m, 0, prompt(10))
    child = Sequence(1, prompt(10), BS)
    m.fork(parent, child)
    check_prefix_cache(m, [parent, child])
    assert set(parent.block_table[:2]) <= path_blocks(m._locked[child.seq_id])
    finish(m, parent)
    check_prefix_cache(m, [child])
    assert m.tree.evict(10) == [], "the child still uses the path: nothing is evictable"


def test_a_hash_collision_is_a_miss():
    m = manager()
    m.hash_function = lambda parent, tokens: 0
    finish(m, computed(m, 0, prompt(9, 100)))
    other = Sequence(1, prompt(9, 200), BS)
    assert m.num_cached_tokens(other) == 0
    m.allocate(other)
    assert other.num_computed_tokens == 0
    check_prefix_cache(m, [other])


def snapshot(m: PrefixCachingBlockManager) -> tuple:
    blocks = [(b.ref_count, b.content_hash) for b in m.gpu_allocator.blocks]
    counts = (m.num_free_gpu_blocks, len(m.gpu_allocator.evictor), m.num_hit_tokens)
    return blocks, counts, (m.tree.evictable_size, m.tree.protected_size), dict(m._locked)


def test_blocks_shared_with_a_fork_that_locks_no_path_to_them_are_not_cached():
    m = manager()
    m.hash_function = lambda parent, tokens: 0  # every block collides
    finish(m, computed(m, 0, prompt(9, 100)))  # cached under hash 0
    parent = computed(m, 1, prompt(9, 200))
    child = Sequence(2, parent.token_ids, BS)
    m.fork(parent, child)  # the parent's merge collides: nothing cached, both lock the root
    child.num_computed_tokens = parent.num_computed_tokens
    m._make_room(m.num_free_gpu_blocks)  # the colliding prefix is evicted
    m.free(parent)  # preempted: its blocks, still the child's, must not become cached
    check_prefix_cache(m, [child])
    child.status = SequenceStatus.FINISHED_STOPPED
    m.free(child)  # the last holder: now they are
    assert m.num_cached_tokens(Sequence(3, prompt(9, 200), BS)) == 8
    check_prefix_cache(m, [])


def test_a_refused_allocate_changes_nothing():
    m = manager(num_gpu_blocks=3)
    finish(m, computed(m, 0, prompt(9)))
    seq = Sequence(1, prompt(20), BS)
    before = snapshot(m)
    with pytest.raises(NoFreeBlocksError, match="sequence 1 needs 5 GPU blocks, 3 are free"):
        m.allocate(seq)
    assert snapshot(m) == before
    assert seq.block_table == [] and m.device_of(seq) is None and seq.num_computed_tokens == 0


def test_the_scheduler_charges_only_the_uncached_rest():
    s = Scheduler(
        Config(BS, num_gpu_blocks=32, watermark=0.0, max_model_len=64, enable_prefix_caching=True)
    )
    first = Sequence(0, prompt(12), BS, SamplingParams(max_tokens=1))
    s.add(first)
    s.postprocess(s.schedule().scheduled, [7])  # computed, finished, cached
    again = Sequence(1, [*prompt(12), 3, 4], BS, SamplingParams(max_tokens=1))
    s.add(again)
    out = s.schedule()
    assert [(item.seq.seq_id, item.num_tokens) for item in out.scheduled] == [(1, 2)]
    assert again.num_computed_tokens == 12


PROMPTS = [
    "You are a careful Python programmer. Answer with code only.\n" * 2 + f"def task_{i}(x):\n"
    for i in range(6)
] + ["You are a careful Python programmer. Answer with code only.\n" * 2 + "def task_2(x):\n"] * 2


CASES = [(1, "recompute", 260, 24), (1, "swap", 260, 24), (16, "recompute", 18, 24)]
CASES += [(16, "swap", 18, 24), (64, "recompute", 7, 64), (64, "swap", 7, 64)]


@pytest.mark.parametrize(("block_size", "mode", "num_gpu_blocks", "max_tokens"), CASES)
def test_greedy_output_is_the_same_with_prefix_caching_on_and_off(
    block_size, mode, num_gpu_blocks, max_tokens
):
    """Pools far smaller than the working set: preemption and eviction in every run."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs, engines = {}, {}
    for caching in (False, True):
        llm = LLM(
            block_size=block_size,
            num_gpu_blocks=num_gpu_blocks,
            num_cpu_blocks=4 * num_gpu_blocks,
            preemption_mode=mode,
            max_model_len=num_gpu_blocks * block_size,
            enable_prefix_caching=caching,
        )
        results = llm.generate(PROMPTS, params, use_progress=False)
        outputs[caching] = [result["token_ids"] for result in results]
        engines[caching] = llm.engine
    assert outputs[True] == outputs[False]
    cached = engines[True]
    assert cached.stats["prefix_cache_hits"] > 0, cached.stats
    assert cached.scheduler.num_preemptions > 0, "the pool is meant to be too small"


class PrefixCachingMachine(RuleBasedStateMachine):
    """Random admissions (prompts sharing prefixes), decodes, forks, finishes, preemptions and
    swaps over a small pool, with the content of every slot tracked: after every step the
    manager's invariants hold, every block's reference count equals its holders, and every
    computed position of every sequence reads back the K/V written for its prefix (a stand-in
    per slot: the prefix itself), so a prefix hit never serves another prefix's K/V."""

    REACHED: ClassVar = None
    PREFIXES: ClassVar = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9, 9], [7, 7, 7, 7]]

    def __init__(self) -> None:
        super().__init__()
        self.bs = 2
        self.m = PrefixCachingBlockManager(self.bs, 10, 8, watermark=0.0)
        self.slots: dict[tuple[Device, int], list[tuple | None]] = {}
        self.gpu: list[Sequence] = []
        self.cpu: list[Sequence] = []
        self.waiting: list[Sequence] = []
        self.next_id = 0

    def slot(self, device: Device, block_id: int) -> list[tuple | None]:
        return self.slots.setdefault((device, block_id), [None] * self.bs)

    def write(self, seq: Sequence, start: int, end: int) -> None:
        for pos in range(start, end):
            block = seq.block_table[pos // self.bs]
            self.slot(Device.GPU, block)[pos % self.bs] = tuple(seq.token_ids[: pos + 1])
        seq.num_computed_tokens = end

    def move(self, src: Device, dst: Device, mapping: dict[int, int]) -> None:
        for a, b in mapping.items():
            self.slots[dst, b] = list(self.slot(src, a))

    @rule(data=st.data())
    def admit(self, data):
        if self.waiting and data.draw(st.booleans()):
            seq = self.waiting.pop(0)
        else:
            tokens = data.draw(st.sampled_from(self.PREFIXES)) + data.draw(
                st.lists(st.integers(0, 3), min_size=1, max_size=4)
            )
            seq = Sequence(self.next_id, tokens, self.bs)
            self.next_id += 1
        if self.m.can_allocate(seq) is not AllocStatus.OK:
            self.REACHED["admit", "later"] += 1
            self.waiting.append(seq)
            return
        self.m.allocate(seq)
        self.REACHED["admit", "hit" if seq.num_computed_tokens else "miss"] += 1
        self.write(seq, seq.num_computed_tokens, seq.num_tokens)
        seq.append_token(data.draw(st.integers(0, 3)))
        self.gpu.append(seq)

    @rule(data=st.data())
    def decode(self, data):
        if not self.gpu:
            return
        seq = data.draw(st.sampled_from(self.gpu))
        if not self.m.can_append_slot(seq):
            self.REACHED["decode", "no room"] += 1
            return
        copy = self.m.append_slot(seq)
        if copy is not None:
            self.move(Device.GPU, Device.GPU, {copy[0]: copy[1]})
        self.REACHED["decode", "copy on write" if copy else "in place"] += 1
        self.write(seq, seq.num_tokens - 1, seq.num_tokens)
        seq.append_token(data.draw(st.integers(0, 3)))

    @rule(data=st.data())
    def fork(self, data):
        if not self.gpu:
            return
        parent = data.draw(st.sampled_from(self.gpu))
        child = Sequence(self.next_id, parent.token_ids, self.bs)
        self.next_id += 1
        self.m.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        self.gpu.append(child)
        self.REACHED["fork", "GPU"] += 1

    @rule(data=st.data(), finished=st.booleans())
    def free(self, data, finished):
        if not self.gpu:
            return
        seq = data.draw(st.sampled_from(self.gpu))
        self.gpu.remove(seq)
        if finished:
            seq.status = SequenceStatus.FINISHED_STOPPED
        self.m.free(seq)
        self.REACHED["free", "finish" if finished else "preempt"] += 1
        if not finished:
            seq.num_computed_tokens = 0
            self.waiting.append(seq)

    @rule(data=st.data())
    def swap_out(self, data):
        if not self.gpu:
            return
        seq = data.draw(st.sampled_from(self.gpu))
        if not self.m.can_swap_out([seq]):
            self.REACHED["swap out", "refused"] += 1
            return
        self.move(Device.GPU, Device.CPU, self.m.swap_out([seq]))
        self.gpu.remove(seq)
        self.cpu.append(seq)
        self.REACHED["swap out", "moved"] += 1

    @rule(data=st.data())
    def swap_in(self, data):
        if not self.cpu:
            return
        seq = data.draw(st.sampled_from(self.cpu))
        if self.m.can_swap_in([seq]) is not AllocStatus.OK:
            self.REACHED["swap in", "later"] += 1
            return
        self.move(Device.CPU, Device.GPU, self.m.swap_in([seq]))
        self.cpu.remove(seq)
        self.gpu.append(seq)
        self.REACHED["swap in", "moved"] += 1

    @invariant()
    def consistent(self):
        check_prefix_cache(self.m, self.gpu)
        check_tree_sizes(self.m)
        for device, allocator, seqs in (
            (Device.GPU, self.m.gpu_allocator, self.gpu),
            (Device.CPU, self.m.cpu_allocator, self.cpu),
        ):
            holders = [0] * allocator.num_blocks
            for seq in seqs:
                for block_id in seq.block_table:
                    holders[block_id] += 1
            assert [b.ref_count for b in allocator.blocks] == holders, f"{device}: refs"
            used = sum(count > 0 for count in holders)
            assert allocator.num_free_blocks + used == allocator.num_blocks, f"{device}: leak"
            for seq in seqs:
                for pos in range(seq.num_computed_tokens):
                    got = self.slot(device, seq.block_table[pos // self.bs])[pos % self.bs]
                    assert got == tuple(seq.token_ids[: pos + 1]), (
                        f"sequence {seq.seq_id} position {pos} reads K/V of {got}"
                    )


def run_counted_machine(machine, options, required) -> None:
    machine.REACHED = Counter()
    seed(0)(machine)
    run_state_machine_as_test(machine, settings=options)
    missing = required - set(machine.REACHED)
    assert not missing, f"the random runs never reached {sorted(missing)}: {machine.REACHED}"


def test_random_operations_keep_the_invariants_and_the_content():
    required = {
        ("admit", "hit"),
        ("admit", "miss"),
        ("admit", "later"),
        ("decode", "copy on write"),
        ("decode", "in place"),
        ("decode", "no room"),
        ("fork", "GPU"),
        ("free", "finish"),
        ("free", "preempt"),
        ("swap out", "moved"),
        ("swap out", "refused"),
        ("swap in", "moved"),
    }
    run_counted_machine(
        PrefixCachingMachine,
        settings(
            max_examples=150,
            stateful_step_count=40,
            deadline=None,
            derandomize=True,
            database=None,
        ),
        required,
    )
    print(dict(PrefixCachingMachine.REACHED))
