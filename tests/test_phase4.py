"""Graded tests for Phase 4: prefix caching with a radix tree (``vkv/engine/radix_cache.py``).

``uv run pytest tests/test_phase4.py -k part3 -v`` runs the tests of part 4.3. The tree's tests
(parts 4.2-4.4) build their trees by hand (``grow``, through the given ``_new_node``) with an
independent hash of their own (``reference_hash``), so that a part is graded on its own code:
only part 4.1's tests use your ``block_hash`` and ``hash_blocks``, and only the state machine of
part 4.4 runs the tree's parts together, against a model of the cache as a plain dictionary
from prefixes to blocks. The BlockManager's tests (parts 4.5-4.9) run on your Phases 1-2 (or the
released reference) and your tree, and their state machine keeps an independent model of which
prefix each slot of the pool holds.
"""

import re
from collections.abc import Callable
from typing import ClassVar

import pytest
import xxhash
from grading_policy import policy_test
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from hypothesis_settings import graded_settings, run_counted_machine
from radix_trees import (
    Cache,
    chain_hashes,
    check_structure,
    colliding_hash,
    grow,
    insert,
    match,
    new_cache,
    reference_hash,
    seed_prefix,
    serve_one_at_a_time,
)

from vkv.engine.block import Device, NoFreeBlocksError
from vkv.engine.block_manager import AllocStatus, BlockManager
from vkv.engine.prefix_caching import PrefixCachingBlockManager
from vkv.engine.radix_cache import MatchResult, RadixCache, TreeNode, block_hash, hash_blocks
from vkv.engine.sequence import Sequence, SequenceStatus


def check_tree(cache: RadixCache) -> None:
    """The module docstring's invariants, each with a message naming the rule: the structure
    (``check_structure``), then the locks and the stamps."""
    check_structure(cache)
    stack = [(cache.root, child) for child in cache.root.children.values()]
    while stack:
        parent, node = stack.pop()
        assert node.lock_ref >= 0, f"node {node.key} has lock_ref {node.lock_ref}"
        if node.lock_ref and parent is not cache.root:
            assert parent.lock_ref >= node.lock_ref, (
                "a locked node's parent is locked at least as often"
            )
        assert parent is cache.root or parent.last_access >= node.last_access, (
            "a parent is never older than its children"
        )
        stack.extend((node, child) for child in node.children.values())


def assert_sizes(cache: RadixCache, evictable: int, protected: int, rule: str) -> None:
    got = (cache.evictable_size, cache.protected_size)
    assert got == (evictable, protected), (
        f"{rule}: expected evictable_size {evictable} and protected_size {protected}, got "
        f"{got[0]} and {got[1]}"
    )


def snapshot(cache: RadixCache) -> tuple:
    """Everything a failed call must leave as it was: every node, the sizes and the clock."""

    def describe(node: TreeNode) -> tuple:
        children = tuple(sorted((h, describe(child)) for h, child in node.children.items()))
        return (
            tuple(node.key),
            tuple(node.blocks),
            tuple(node.hashes),
            node.lock_ref,
            node.last_access,
            children,
        )

    return describe(cache.root), cache.evictable_size, cache.protected_size, cache._clock


def paths(cache: RadixCache) -> dict[tuple[int, ...], int]:
    """Every cached prefix of whole blocks and the block that ends it, read off the tree."""
    found: dict[tuple[int, ...], int] = {}

    def walk(node: TreeNode, prefix: tuple[int, ...]) -> None:
        size = cache.block_size
        for i, block in enumerate(node.blocks):
            found[prefix + tuple(node.key[: (i + 1) * size])] = block
        for child in node.children.values():
            walk(child, prefix + tuple(node.key))

    walk(cache.root, ())
    return found


# ---- Part 4.1: the chained block hash -----------------------------------------------------


# Each part's first test: its regions follow the grading policy (tests/grading_policy.py).
test_part1_follows_the_grading_policy = policy_test("4.1")
test_part2_follows_the_grading_policy = policy_test("4.2")
test_part3_follows_the_grading_policy = policy_test("4.3")
test_part4_follows_the_grading_policy = policy_test("4.4")
test_part5_follows_the_grading_policy = policy_test("4.5")
test_part6_follows_the_grading_policy = policy_test("4.6")
test_part7_follows_the_grading_policy = policy_test("4.7")
test_part8_follows_the_grading_policy = policy_test("4.8")
test_part9_follows_the_grading_policy = policy_test("4.9")


def test_part1_the_first_block_hashes_its_tokens_as_4_little_endian_bytes():
    data = b"".join(t.to_bytes(4, "little") for t in (1, 2, 300, 70000))
    assert block_hash(None, [1, 2, 300, 70000]) == xxhash.xxh64(data).intdigest(), (
        "block_hash(None, tokens) must be xxh64 of the tokens, each as 4 little-endian bytes"
    )


def test_part1_a_later_block_hashes_its_parent_first_as_8_little_endian_bytes():
    parent = 0xFEDCBA9876543210
    data = parent.to_bytes(8, "little") + (5).to_bytes(4, "little") + (6).to_bytes(4, "little")
    assert block_hash(parent, [5, 6]) == xxhash.xxh64(data).intdigest(), (
        "block_hash(parent, tokens) must be xxh64 of the parent (8 little-endian bytes), then "
        "the tokens (4 little-endian bytes each)"
    )


def test_part1_a_parent_hash_of_zero_is_still_a_parent():
    data = (0).to_bytes(8, "little") + (5).to_bytes(4, "little")
    assert block_hash(0, [5]) == xxhash.xxh64(data).intdigest(), (
        "parent 0 is a real hash: only None means the first block"
    )
    assert block_hash(0, [5]) != block_hash(None, [5])


def test_part1_the_hash_depends_on_the_whole_prefix_and_on_token_order():
    first = block_hash(None, [1, 2])
    assert block_hash(first, [3, 4]) != block_hash(block_hash(None, [9, 9]), [3, 4]), (
        "the same block after different prefixes must hash differently: it chains its parent"
    )
    assert block_hash(None, [1, 2]) != block_hash(None, [2, 1])
    assert block_hash(None, [1, 2]) == block_hash(None, (1, 2)), "any sequence of ints"


def counting(hash_function: Callable) -> tuple[Callable, list]:
    """``hash_function`` that records every block it hashes."""
    calls: list = []

    def counted(parent, tokens):
        calls.append(tuple(tokens))
        return hash_function(parent, tokens)

    return counted, calls


def test_part1_hash_blocks_chains_the_full_blocks_of_a_sequence():
    tokens = [1, 2, 3, 4, 5, 6, 7]
    hashes = hash_blocks([], tokens, 2, 3)
    first = block_hash(None, [1, 2])
    second = block_hash(first, [3, 4])
    assert hashes == [first, second, block_hash(second, [5, 6])], (
        "hash_blocks must chain block_hash over the blocks: block i hashes its tokens after the "
        "hash of block i - 1"
    )


def test_part1_hash_blocks_extends_the_list_in_place_and_returns_it():
    hashes: list[int] = []
    assert hash_blocks(hashes, [1, 2, 3, 4], 2, 2) is hashes, "it returns the list it extended"
    assert len(hashes) == 2, "the sequence's own list grows: the hashes are kept with it"


def test_part1_hash_blocks_hashes_only_the_blocks_not_hashed_yet():
    counted, calls = counting(reference_hash)
    hashes = [12345]  # block 0's hash as recorded earlier: kept, never recomputed
    hash_blocks(hashes, [1, 2, 3, 4, 5, 6], 2, 3, counted)
    assert calls == [(3, 4), (5, 6)], (
        f"blocks 1 and 2 are hashed once each, block 0 not again; hashed {calls}"
    )
    assert hashes == [
        12345,
        reference_hash(12345, [3, 4]),
        reference_hash(reference_hash(12345, [3, 4]), [5, 6]),
    ], "a new block chains from the last hash in the list"


def test_part1_hash_blocks_does_nothing_for_blocks_already_hashed():
    counted, calls = counting(reference_hash)
    hashes = [1, 2, 3]
    assert hash_blocks(hashes, [1, 2, 3, 4, 5, 6], 2, 2, counted) == [1, 2, 3]
    assert calls == [], "a list that holds enough hashes is returned as it is, nothing hashed"


def test_part1_hash_blocks_refuses_a_block_that_is_not_full():
    hashes = [7]
    message = r"^only full blocks are hashed: 3 blocks of 2 need 6 tokens, the sequence has 5$"
    with pytest.raises(ValueError, match=message):
        hash_blocks(hashes, [1, 2, 3, 4, 5], 2, 3)
    assert hashes == [7], "a refused call changes nothing"


# ---- Part 4.2: splitting a node, matching a prefix ----------------------------------------


def test_part2_split_gives_the_head_to_a_new_node_and_keeps_the_tail():
    cache = new_cache()
    node = grow(cache, cache.root, [1, 2, 3, 4, 5, 6], [10, 11, 12])
    grandchild = grow(cache, node, [7, 8], [13])
    hashes = list(node.hashes)
    head = cache._split(node, 1)
    assert (head.key, head.blocks, head.hashes) == ([1, 2], [10], hashes[:1]), (
        "the new node takes the first num_blocks blocks: their tokens, ids and hashes"
    )
    assert (node.key, node.blocks, node.hashes) == ([3, 4, 5, 6], [11, 12], hashes[1:]), (
        "the split node keeps the rest of its edge"
    )
    assert cache.root.children == {hashes[0]: head}, "the new node takes the old one's place"
    assert head.parent is cache.root and node.parent is head
    assert head.children == {hashes[1]: node}, "the old node is the new node's only child"
    assert node.children == {grandchild.hashes[0]: grandchild}, "children stay with the tail"
    check_tree(cache)


def test_part2_the_new_node_copies_lock_ref_and_last_access():
    cache = new_cache()
    node = grow(cache, cache.root, [1, 2, 3, 4, 5, 6], [10, 11, 12])
    node.lock_ref, node.last_access = 2, 7
    cache.evictable_size, cache.protected_size = 0, 3
    head = cache._split(node, 2)
    assert (head.lock_ref, head.last_access) == (2, 7), (
        f"a split node's head is locked and used exactly as the node was: got lock_ref "
        f"{head.lock_ref}, last_access {head.last_access}"
    )
    assert (node.lock_ref, node.last_access) == (2, 7), "the tail keeps its own"
    assert (head.blocks, node.blocks) == ([10, 11], [12])
    assert_sizes(cache, 0, 3, "a split moves no block between the sizes")
    check_tree(cache)


def test_part2_split_under_a_deeper_parent_registers_in_that_parent():
    cache = new_cache()
    top = grow(cache, cache.root, [1, 2], [10])
    node = grow(cache, top, [3, 4, 5, 6], [11, 12])
    key = node.hashes[0]
    head = cache._split(node, 1)
    assert top.children == {key: head} and head.parent is top
    check_tree(cache)


# ---- Part 4.2: matching a prefix (and the split it needs) ------------------------------------


def chain(cache: RadixCache) -> tuple[TreeNode, TreeNode]:
    """root -> [1..4] in blocks 10, 11 -> [5..8] in blocks 12, 13 (block size 2)."""
    top = grow(cache, cache.root, [1, 2, 3, 4], [10, 11])
    return top, grow(cache, top, [5, 6, 7, 8], [12, 13])


def test_part2_an_empty_prompt_is_refused_and_changes_nothing():
    cache = new_cache()
    chain(cache)
    before = snapshot(cache)
    with pytest.raises(ValueError, match=r"^cannot match an empty prompt$"):
        match(cache, [])
    assert snapshot(cache) == before


def test_part2_a_match_follows_the_path_through_several_nodes():
    cache = new_cache()
    _top, bottom = chain(cache)
    result = match(cache, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert isinstance(result, MatchResult)
    assert result.blocks == [10, 11, 12, 13], f"expected all four blocks, got {result.blocks}"
    assert result.node is bottom, "the match ends at the node of its last block"
    check_tree(cache)


def test_part2_a_match_never_covers_the_last_token():
    cache = new_cache()
    top, bottom = chain(cache)
    result = match(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    assert result.blocks == [10, 11, 12], (
        f"an 8-token prompt may match (8 - 1) // 2 = 3 blocks, whose last token is not in "
        f"them; got {result.blocks}"
    )
    assert result.node.blocks == [12] and result.node.parent is top, (
        "the match ends inside the edge [12, 13], after block 12: it must split that node and "
        f"end at a node holding [12] under [10, 11]; it ended at a node holding "
        f"{result.node.blocks}"
    )
    assert result.node.children == {bottom.hashes[0]: bottom} and bottom.blocks == [13], (
        "the split keeps the tail [13] in the old node, as the new node's only child"
    )
    check_tree(cache)


def test_part2_a_partial_last_block_never_matches():
    cache = new_cache()
    chain(cache)
    assert match(cache, [1, 2, 3]).blocks == [10], "3 tokens: at most 1 whole block"
    assert match(cache, [1, 2]).blocks == [], "2 tokens: the last token must be computed"
    assert match(cache, [1]).blocks == []


def test_part2_a_match_that_diverges_inside_an_edge_splits_it():
    cache = new_cache()
    top, _ = chain(cache)
    result = match(cache, [1, 2, 3, 4, 5, 6, 0, 0, 0])
    assert result.blocks == [10, 11, 12], f"three blocks agree, got {result.blocks}"
    assert result.node.parent is top and result.node.blocks == [12]
    assert len(result.node.children) == 1 and next(iter(result.node.children.values())).blocks == [
        13
    ]
    check_tree(cache)


def test_part2_a_miss_returns_the_root_and_no_blocks():
    cache = new_cache()
    chain(cache)
    before = snapshot(cache)[:3]
    result = match(cache, [9, 9, 9, 9, 9])
    assert result.blocks == [] and result.node is cache.root
    assert snapshot(cache)[:3] == before, "a miss changes no node"


def test_part2_a_hash_collision_is_a_miss_not_wrong_blocks():
    cache = new_cache(hash_function=colliding_hash)
    grow(cache, cache.root, [5, 6, 7, 8], [10, 11])
    result = match(cache, [1, 2, 3, 4, 5])
    assert result.blocks == [], (
        f"block [1, 2] hashes like cached block [5, 6] but its tokens differ: a miss, not "
        f"{result.blocks}"
    )
    assert result.node is cache.root


def test_part2_a_match_stamps_its_path_as_used_now():
    cache = new_cache()
    top, bottom = chain(cache)
    other = grow(cache, cache.root, [7, 7], [14])
    cache._clock = 41
    result = match(cache, [1, 2, 3, 4, 9, 9])
    assert result.node is top
    assert top.last_access == 42, (
        f"the matched node must be used now (tick 42), got {top.last_access}"
    )
    assert bottom.last_access == 0 and other.last_access == 0, "nodes off the path keep theirs"


def test_part2_the_tail_a_match_splits_off_keeps_its_stamp():
    cache = new_cache()
    top, bottom = chain(cache)
    top.last_access, bottom.last_access, cache._clock = 3, 3, 41
    result = match(cache, [1, 2, 3, 4, 5, 6, 9, 9])
    assert result.node.blocks == [12] and result.node.last_access == 42
    assert bottom.blocks == [13] and bottom.last_access == 3, (
        f"the split-off tail [13] is not on the matched path: it keeps last_access 3, got "
        f"{bottom.last_access}"
    )


def test_part2_a_match_changes_no_size():
    cache = new_cache()
    chain(cache)
    match(cache, [1, 2, 3, 4, 5, 6, 7])
    assert_sizes(cache, 4, 0, "a match moves no block between the sizes")
    check_tree(cache)


# ---- Part 4.3: inserting a prefix ---------------------------------------------------------


@pytest.mark.parametrize(("tokens", "blocks"), [([1, 2, 3], [10]), ([1, 2], [10, 11]), ([], [10])])
def test_part3_insert_takes_whole_blocks_only(tokens, blocks):
    cache = new_cache()
    before = snapshot(cache)
    message = f"^insert takes whole blocks: {len(tokens)} tokens for {len(blocks)} blocks of 2$"
    with pytest.raises(ValueError, match=message):
        insert(cache, tokens, blocks)
    assert snapshot(cache) == before


def test_part3_a_refused_insert_does_not_split_a_cached_edge_first():
    cache = new_cache()
    grow(cache, cache.root, [1, 2, 3, 4, 5, 6], [10, 11, 12])
    before = snapshot(cache)
    with pytest.raises(ValueError, match="insert takes whole blocks: 3 tokens for 1 blocks of 2"):
        insert(cache, [1, 2, 3], [20])
    assert snapshot(cache) == before, (
        "check the length before walking: [1, 2] would have split the cached edge"
    )


def test_part3_insert_into_an_empty_tree_makes_one_leaf():
    cache = new_cache()
    assert insert(cache, [1, 2, 3, 4], [10, 11]) == 0, "nothing was cached before"
    (leaf,) = cache.root.children.values()
    assert (leaf.key, leaf.blocks) == ([1, 2, 3, 4], [10, 11])
    assert cache.evictable_size == 2 and cache.protected_size == 0, "a new leaf is evictable"
    check_tree(cache)


def test_part3_inserting_a_cached_prefix_returns_its_length_and_keeps_the_tree_blocks():
    cache = new_cache()
    insert(cache, [1, 2, 3, 4], [10, 11])
    assert insert(cache, [1, 2, 3, 4], [20, 21]) == 2, "both blocks were cached already"
    assert paths(cache) == {(1, 2): 10, (1, 2, 3, 4): 11}, (
        "the tree keeps its own blocks; the caller frees its duplicates 20 and 21"
    )
    assert cache.total_size == 2


def test_part3_insert_extends_a_cached_prefix_with_a_new_leaf():
    cache = new_cache()
    insert(cache, [1, 2], [10])
    assert insert(cache, [1, 2, 3, 4, 5, 6], [20, 21, 22]) == 1
    assert paths(cache) == {(1, 2): 10, (1, 2, 3, 4): 21, (1, 2, 3, 4, 5, 6): 22}
    (top,) = cache.root.children.values()
    (leaf,) = top.children.values()
    assert leaf.blocks == [21, 22] and leaf.parent is top
    assert cache.evictable_size == 3
    check_tree(cache)


def test_part3_insert_that_diverges_inside_an_edge_splits_it():
    cache = new_cache()
    insert(cache, [1, 2, 3, 4, 5, 6], [10, 11, 12])
    assert insert(cache, [1, 2, 3, 4, 9, 9], [20, 21, 22]) == 2
    assert paths(cache) == {
        (1, 2): 10,
        (1, 2, 3, 4): 11,
        (1, 2, 3, 4, 5, 6): 12,
        (1, 2, 3, 4, 9, 9): 22,
    }
    (head,) = cache.root.children.values()
    assert head.blocks == [10, 11] and sorted(c.blocks[0] for c in head.children.values()) == [
        12,
        22,
    ]
    assert cache.evictable_size == 4, "blocks 20 and 21 were duplicates: not in the tree"
    check_tree(cache)


def test_part3_inserting_a_shorter_prefix_cuts_the_edge_where_it_ends():
    cache = new_cache()
    insert(cache, [1, 2, 3, 4, 5, 6], [10, 11, 12])
    assert insert(cache, [1, 2], [20]) == 1
    (head,) = cache.root.children.values()
    assert head.blocks == [10] and [c.blocks for c in head.children.values()] == [[11, 12]], (
        "an insert that ends inside an edge splits it there, like a match"
    )
    check_tree(cache)


def test_part3_a_new_leaf_under_a_locked_node_is_evictable():
    cache = new_cache()
    top = grow(cache, cache.root, [1, 2], [10])
    top.lock_ref, cache.evictable_size, cache.protected_size = 1, 0, 1
    assert insert(cache, [1, 2, 3, 4], [20, 21]) == 1
    assert (cache.evictable_size, cache.protected_size) == (1, 1), (
        "block 21's new leaf is not locked: evictable, whatever its parent"
    )


def test_part3_a_hash_collision_records_nothing_more():
    cache = new_cache(hash_function=colliding_hash)
    insert(cache, [5, 6], [10])
    assert insert(cache, [1, 2, 3, 4], [20, 21]) == 0
    assert paths(cache) == {(5, 6): 10}, (
        "[1, 2] collides with [5, 6]: its leaf cannot take that place, nothing is recorded"
    )
    assert cache.total_size == 1


def test_part3_insert_stamps_its_path_as_used_now():
    cache = new_cache()
    insert(cache, [1, 2], [10])
    cache._clock = 9
    insert(cache, [1, 2, 3, 4], [20, 21])
    (top,) = cache.root.children.values()
    (leaf,) = top.children.values()
    assert leaf.last_access == 10 and top.last_access == 10, (
        f"the inserted path is used now (tick 10): leaf {leaf.last_access}, "
        f"parent {top.last_access}"
    )


def test_part3_a_new_leaf_in_an_empty_tree_is_stamped():
    cache = new_cache()
    insert(cache, [1, 2, 3, 4], [10, 11])
    (leaf,) = cache.root.children.values()
    assert leaf.last_access == cache._clock == 1, (
        f"the new leaf is used now: the clock's first tick, 1; it has {leaf.last_access} "
        "(an unstamped leaf looks older than everything and is evicted first)"
    )


def test_part3_a_new_leaf_under_old_nodes_is_the_newest_of_its_path():
    cache = new_cache()
    top = grow(cache, cache.root, [1, 2], [10])
    middle = grow(cache, top, [3, 4], [11])
    top.last_access = middle.last_access = 7
    cache._clock = 7
    insert(cache, [1, 2, 3, 4, 5, 6], [20, 21, 22])
    (leaf,) = middle.children.values()
    stamps = (top.last_access, middle.last_access, leaf.last_access)
    assert stamps == (8, 8, 8), (
        f"one _touch of the new leaf stamps it and every ancestor with tick 8; got {stamps}"
    )


def test_part3_a_new_leaf_after_a_split_is_stamped_with_its_path():
    cache = new_cache()
    old = grow(cache, cache.root, [1, 2, 3, 4], [10, 11])
    old.last_access = cache._clock = 3
    insert(cache, [1, 2, 9, 9], [20, 21])
    (head,) = cache.root.children.values()
    leaf = next(child for child in head.children.values() if child.blocks == [21])
    assert (head.last_access, leaf.last_access) == (4, 4), (
        "the new leaf hangs under the split's head: both are on the inserted path, used now "
        f"(tick 4); head {head.last_access}, leaf {leaf.last_access}"
    )
    assert old.last_access == 3, "the tail the split cut off is not on the path"


def test_part3_an_insert_of_a_cached_prefix_still_stamps_its_path():
    cache = new_cache()
    insert(cache, [1, 2, 3, 4], [10, 11])
    (node,) = cache.root.children.values()
    cache._clock = 19
    assert insert(cache, [1, 2, 3, 4], [20, 21]) == 2
    assert node.last_access == 20, (
        f"all cached: the path is used now all the same (tick 20), got {node.last_access}"
    )


def test_part3_an_insert_that_meets_a_collision_stamps_where_its_prefix_ends():
    cache = new_cache(hash_function=colliding_hash)
    insert(cache, [5, 6, 3, 4], [10, 11])
    cache._clock = 29
    assert insert(cache, [5, 6, 1, 2], [20, 21]) == 1, "[5, 6] was cached"
    (head,) = cache.root.children.values()
    assert head.blocks == [10] and head.last_access == 30, (
        "[5, 6] is cached, [1, 2] collides with [3, 4]: nothing is recorded, but the node the "
        f"cached prefix ends at is used now (tick 30), got {head.last_access}"
    )
    (tail,) = head.children.values()
    assert tail.blocks == [11] and tail.last_access < 30, "the colliding node is not on the path"


def test_part3_the_tail_an_insert_splits_off_keeps_its_stamp():
    cache = new_cache()
    insert(cache, [1, 2, 3, 4, 5, 6], [10, 11, 12])
    (node,) = cache.root.children.values()
    node.last_access, cache._clock = 5, 9
    insert(cache, [1, 2, 7, 8], [20, 21])
    assert node.blocks == [11, 12] and node.last_access == 5, (
        f"the split-off tail [11, 12] is not on the inserted path: it keeps 5, got "
        f"{node.last_access}"
    )


@pytest.mark.parametrize("seed", range(5))
def test_part3_many_inserts_record_what_a_prefix_dictionary_records(seed):
    import random

    rng, cache, model = random.Random(seed), new_cache(), {}
    next_block = 100
    for _ in range(40):
        tokens = [rng.randrange(3) for _ in range(2 * rng.randint(1, 5))]
        blocks = list(range(next_block, next_block + len(tokens) // 2))
        next_block += len(blocks)
        prefixes = [tuple(tokens[: 2 * (k + 1)]) for k in range(len(blocks))]
        expected = sum(prefix in model for prefix in prefixes)
        for prefix, block in zip(prefixes, blocks, strict=True):
            model.setdefault(prefix, block)
        assert insert(cache, tokens, blocks) == expected, (
            f"insert({tokens}) after {len(model)} prefixes"
        )
        assert paths(cache) == model
        check_tree(cache)


# ---- Part 4.4: locks and eviction -----------------------------------------------------------


def test_part4_lock_counts_on_the_node_and_every_ancestor():
    cache = new_cache()
    top, bottom = chain(cache)
    cache.lock(bottom)
    assert (top.lock_ref, bottom.lock_ref) == (1, 1), "a lock counts up to the root"
    assert cache.root.lock_ref == 0, "the root is never locked"
    assert_sizes(cache, 0, 4, "lock(bottom) protects the blocks of bottom and of top")
    assert cache.total_size == 4, "a lock moves blocks between the sizes, their sum stays"
    cache.lock(top)
    assert (top.lock_ref, bottom.lock_ref) == (2, 1)
    assert_sizes(cache, 0, 4, "a block moves to protected only on its node's first lock")
    check_tree(cache)


def test_part4_each_node_moves_its_own_blocks():
    cache = new_cache()
    top = grow(cache, cache.root, [1, 2], [10])
    bottom = grow(cache, top, [3, 4, 5, 6, 7, 8], [11, 12, 13])
    cache.lock(bottom)
    assert_sizes(cache, 0, 4, "lock moves 1 block of top and 3 of bottom")
    cache.unlock(bottom)
    assert_sizes(cache, 4, 0, "unlock moves them back, each node its own")


def test_part4_locking_a_parent_protects_only_the_path_to_it():
    cache = new_cache()
    top, bottom = chain(cache)
    cache.lock(top)
    assert (top.lock_ref, bottom.lock_ref) == (1, 0)
    assert_sizes(cache, 2, 2, "lock(top) protects top's blocks, not its child's")


def test_part4_unlock_undoes_one_lock():
    cache = new_cache()
    top, bottom = chain(cache)
    cache.lock(bottom)
    cache.lock(bottom)
    cache.unlock(bottom)
    assert (top.lock_ref, bottom.lock_ref) == (1, 1)
    assert_sizes(cache, 0, 4, "after one of two unlocks the path is still locked")
    cache.unlock(bottom)
    assert (top.lock_ref, bottom.lock_ref) == (0, 0)
    assert_sizes(cache, 4, 0, "a node whose lock_ref falls to 0 is evictable again")
    check_tree(cache)


def test_part4_unlocking_a_node_that_is_not_locked_is_refused_and_changes_nothing():
    cache = new_cache()
    top, bottom = chain(cache)
    cache.lock(top)
    before = snapshot(cache)
    with pytest.raises(ValueError, match=r"^unlock of a node that is not locked$"):
        cache.unlock(bottom)
    assert snapshot(cache) == before, "a refused unlock must not touch the ancestors either"


def test_part4_the_root_cannot_be_locked_or_unlocked():
    cache = new_cache()
    chain(cache)
    before = snapshot(cache)
    cache.lock(cache.root)
    cache.unlock(cache.root)
    assert snapshot(cache) == before


# ---- Part 4.4: eviction, and the whole tree -------------------------------------------------


def fan(cache: RadixCache) -> tuple[TreeNode, list[TreeNode]]:
    """root -> [1, 2] (block 10) -> three leaves [3, 4] (11), [5, 6] (12), [7, 8, 9, 9] (13, 14)."""
    top = grow(cache, cache.root, [1, 2], [10])
    leaves = [grow(cache, top, [3, 4], [11]), grow(cache, top, [5, 6], [12])]
    leaves.append(grow(cache, top, [7, 8, 9, 9], [13, 14]))
    return top, leaves


def test_part4_a_negative_count_is_refused_and_zero_evicts_nothing():
    cache = new_cache()
    fan(cache)
    before = snapshot(cache)
    with pytest.raises(ValueError, match=r"^num_blocks must be >= 0, got -1$"):
        cache.evict(-1)
    assert cache.evict(0) == [] and snapshot(cache) == before


def test_part4_the_least_recently_used_leaf_goes_first():
    cache = new_cache()
    top, (a, b, c) = fan(cache)
    top.last_access, a.last_access, b.last_access, c.last_access = 9, 5, 3, 8
    assert cache.evict(1) == [12], "the leaf used longest ago (last_access 3) goes first"
    assert cache.evict(1) == [11]
    assert cache.evict(1) == [13, 14], "a leaf goes whole, its blocks in edge order"
    assert cache.evictable_size == 1 and set(top.children) == set()
    check_tree(cache)


def test_part4_equally_old_leaves_go_in_creation_order():
    cache = new_cache()
    _top, (_a, _b, _c) = fan(cache)
    assert cache.evict(2) == [11, 12], "ties on last_access go to the smaller node_id"


def test_part4_ties_follow_creation_order_not_block_ids():
    cache = new_cache()
    for block in (30, 20, 10):
        grow(cache, cache.root, [block, block], [block])
    assert cache.evict(1) == [30], "equally old: the node made first goes, whatever its blocks"


def test_part4_a_parent_left_a_leaf_keeps_its_own_age():
    cache = new_cache()
    parent = grow(cache, cache.root, [1, 2], [10])
    leaf = grow(cache, parent, [3, 4], [11])
    other = grow(cache, cache.root, [5, 6], [12])
    parent.last_access, leaf.last_access, other.last_access = 5, 1, 3
    assert cache.evict(2) == [11, 12], (
        "after leaf [11] (last_access 1) the candidates are [12] (3) and its parent [10] (5): "
        "the parent joins with its own last_access, so [12] goes first"
    )


def test_part4_eviction_goes_on_until_enough_blocks_are_out():
    cache = new_cache()
    _, (a, b, c) = fan(cache)
    a.last_access, b.last_access, c.last_access = 2, 2, 1
    assert cache.evict(1) == [13, 14], "at least one block: the whole leaf, two"
    assert cache.evict(2) == [11, 12]
    check_tree(cache)


def test_part4_a_parent_left_a_leaf_can_go_in_the_same_call():
    cache = new_cache()
    top, leaves = fan(cache)
    other = grow(cache, cache.root, [8, 8], [15])
    top.last_access, other.last_access = 2, 4
    for leaf in leaves:
        leaf.last_access = 1
    assert cache.evict(5) == [11, 12, 13, 14, 10], (
        "once its three leaves are out, [1, 2] (last_access 2) is an unlocked leaf older than "
        "[8, 8] (4): it goes next"
    )
    assert cache.root.children == {other.hashes[0]: other}
    assert cache.evictable_size == 1
    check_tree(cache)


def test_part4_locked_nodes_are_never_evicted():
    cache = new_cache()
    top, (a, _b, _c) = fan(cache)
    a.lock_ref = top.lock_ref = 1  # locked by hand: a test of eviction alone
    cache.evictable_size, cache.protected_size = 3, 2
    assert cache.evict(10) == [12, 13, 14], "a and its parent are locked: only b and c can go"
    assert cache.root.children == {top.hashes[0]: top} and top.children == {a.hashes[0]: a}
    assert_sizes(cache, 0, 2, "the locked path's two blocks stay, protected")
    check_tree(cache)


def test_part4_only_leaves_are_evicted_a_parent_waits_for_its_children():
    cache = new_cache()
    top, (a, b, c) = fan(cache)
    top.last_access = a.last_access = b.last_access = c.last_access = 1
    assert cache.evict(1) == [11], (
        "evict removes only leaves: [1, 2] (block 10) is as old as its children and was made "
        "first, but it has children, so it can go only once they are out"
    )
    check_tree(cache)


def test_part4_a_locked_parent_stays_when_its_unlocked_children_go():
    cache = new_cache()
    top, leaves = fan(cache)
    top.lock_ref = 1  # locked by hand: the sequence holding it uses [1, 2] only
    cache.evictable_size, cache.protected_size = 4, 1
    for leaf in leaves:
        leaf.last_access = 0
    top.last_access = 0
    assert cache.evict(10) == [11, 12, 13, 14], (
        "once its children are out, [1, 2] is a leaf, but a locked one: it is never evicted"
    )
    assert cache.root.children == {top.hashes[0]: top}
    assert_sizes(cache, 0, 1, "the locked parent's block stays, protected")


def test_part4_a_locked_node_deep_in_a_chain_keeps_its_whole_path():
    cache = new_cache()
    first = grow(cache, cache.root, [1, 2], [10])
    second = grow(cache, first, [3, 4], [11])
    third = grow(cache, second, [5, 6], [12])
    other = grow(cache, cache.root, [7, 7], [13])
    first.lock_ref = second.lock_ref = 1  # a sequence locked [1, 2, 3, 4]
    cache.evictable_size, cache.protected_size = 2, 2
    third.last_access, other.last_access = 1, 2
    assert cache.evict(4) == [12, 13], (
        "only the unlocked leaves [5, 6] and [7, 7] can go; the locked path [1, 2] -> [3, 4] "
        "stays, whatever is asked for"
    )
    assert second.children == {} and first.children == {second.hashes[0]: second}
    check_tree(cache)


def test_part4_a_locked_parent_survives_a_call_that_asks_for_everything():
    cache = new_cache()
    parent = grow(cache, cache.root, [1, 2], [10])
    child = grow(cache, parent, [3, 4], [11])
    other = grow(cache, cache.root, [5, 6], [12])
    parent.lock_ref = 1  # a sequence uses [1, 2] only
    cache.evictable_size, cache.protected_size = 2, 1
    parent.last_access = child.last_access = other.last_access = 0
    evicted = cache.evict(3)
    assert 10 not in evicted, (
        f"evict(3) returned {evicted}: block 10's node is locked; once its child is out it is "
        "a leaf, but a locked leaf is never evicted, however many blocks are asked for"
    )
    assert sorted(evicted) == [11, 12]


def test_part4_eviction_stops_when_nothing_is_evictable():
    cache = new_cache()
    _top, _ = fan(cache)
    assert cache.evict(100) == [11, 12, 13, 14, 10]
    assert cache.total_size == 0 and cache.root.children == {}
    assert cache.evict(1) == []


class RadixCacheMachine(RuleBasedStateMachine):
    """Every operation against a model: a dictionary from each cached prefix (whole blocks) to
    the block that ends it, and the prefixes locked; eviction order is pinned by unit tests.

    ``REACHED`` counts the (operation, state) pairs the runs met.
    """

    REACHED: ClassVar = None

    def __init__(self) -> None:
        super().__init__()
        self.cache = Cache(2)
        self.model: dict[tuple[int, ...], int] = {}
        self.locks: list[tuple[TreeNode, tuple[int, ...]]] = []
        self.next_block = 0
        self.inserted: list[list[int]] = []

    prompts = st.lists(st.integers(0, 2), min_size=1, max_size=9)

    @rule(tokens=prompts)
    def insert(self, tokens):
        whole = tokens[: len(tokens) // 2 * 2]
        if not whole:
            return
        blocks = list(range(self.next_block, self.next_block + len(whole) // 2))
        self.next_block += len(blocks)
        prefixes = [tuple(whole[: 2 * (k + 1)]) for k in range(len(blocks))]
        cached = sum(prefix in self.model for prefix in prefixes)
        assert insert(self.cache, whole, blocks) == cached
        self.inserted.append(whole)
        for prefix, block in zip(prefixes, blocks, strict=True):
            self.model.setdefault(prefix, block)
        self.REACHED["insert", "new" if cached < len(blocks) else "all cached"] += 1

    @rule(tokens=prompts, lock=st.booleans())
    def match(self, tokens, lock):
        self._match(tokens, lock)

    @precondition(lambda self: self.inserted)
    @rule(
        index=st.integers(0, 100),
        cut=st.integers(0, 3),
        tail=st.lists(st.integers(0, 2), max_size=3),
        lock=st.booleans(),
    )
    def match_a_cached_prompt(self, index, cut, tail, lock):
        """Most random prompts miss: this one starts with part of an inserted prompt."""
        known = self.inserted[index % len(self.inserted)]
        self._match(known[: max(1, len(known) - cut)] + tail, lock)

    def _match(self, tokens, lock):
        nodes = len(self.cache._nodes())
        result = match(self.cache, tokens)
        limit = (len(tokens) - 1) // 2
        expected = []
        for k in range(limit):
            block = self.model.get(tuple(tokens[: 2 * (k + 1)]))
            if block is None:
                break
            expected.append(block)
        assert result.blocks == expected, f"match({tokens}): {result.blocks}, model {expected}"
        split = len(self.cache._nodes()) > nodes
        self.REACHED["match", "split" if split else "hit" if expected else "miss"] += 1
        if lock:
            self.cache.lock(result.node)
            self.locks.append((result.node, tuple(tokens[: 2 * len(expected)])))
            self.REACHED["lock", "hit" if expected else "root"] += 1

    @precondition(lambda self: self.locks)
    @rule(index=st.integers(0, 100))
    def unlock(self, index):
        node, _ = self.locks.pop(index % len(self.locks))
        self.cache.unlock(node)
        self.REACHED["unlock", "locked"] += 1

    @rule(count=st.integers(0, 6))
    def evict(self, count):
        evictable = self.cache.evictable_size
        evicted = self.cache.evict(count)
        assert len(evicted) >= min(count, evictable), "eviction stopped short"
        locked = {prefix for _, prefix in self.locks}
        for prefix, block in list(self.model.items()):
            if block in evicted:
                assert not any(held[: len(prefix)] == prefix for held in locked), (
                    f"block {block} was evicted while a lock held its path"
                )
                del self.model[prefix]
        self.REACHED["evict", "some" if evicted else "none"] += 1

    @invariant()
    def tree_matches_the_model(self):
        check_tree(self.cache)
        assert paths(self.cache) == self.model


def test_part4_a_state_machine_keeps_every_invariant():
    required = {
        ("insert", "new"),
        ("insert", "all cached"),
        ("match", "hit"),
        ("match", "split"),
        ("match", "miss"),
        ("lock", "hit"),
        ("unlock", "locked"),
        ("evict", "some"),
        ("evict", "none"),
    }
    run_counted_machine(
        RadixCacheMachine,
        graded_settings(max_examples=100, stateful_step_count=40),
        required,
    )


# ---- The BlockManager with a prefix cache (parts 4.5-4.9) ----------------------------------

BS = 4


def new_manager(num_gpu_blocks: int = 16, num_cpu_blocks: int = 16) -> PrefixCachingBlockManager:
    """A manager whose sequences hash with the tests' own hash (``hash_blocks`` still runs)."""
    m = PrefixCachingBlockManager(BS, num_gpu_blocks, num_cpu_blocks, watermark=0.0)
    m.hash_function = reference_hash
    return m


def prompt(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def placed(m: PrefixCachingBlockManager, seq_id: int, tokens: list[int]) -> Sequence:
    """A sequence given new blocks and recorded as ``allocate`` records a miss (Phase 1's
    ``allocate``, then the records of the class docstring): part 4.7 does not run."""
    seq = Sequence(seq_id, tokens, BS)
    BlockManager.allocate(m, seq)
    m._locked[seq.seq_id] = m.tree.root
    m._num_cached[seq.seq_id] = 0
    m._unmerged[seq.seq_id] = seq
    return seq


def prefilled(seq: Sequence) -> Sequence:
    """What a step's prefill and postprocess do to an allocated sequence."""
    seq.num_computed_tokens, seq.is_prefill = seq.num_tokens, False
    seq.append_token(7)
    return seq


def allocated(m: PrefixCachingBlockManager, seq_id: int, tokens: list[int]) -> Sequence:
    seq = Sequence(seq_id, tokens, BS)
    m.allocate(seq)
    return seq


def finish(m: PrefixCachingBlockManager, seq: Sequence) -> None:
    seq.status = SequenceStatus.FINISHED_STOPPED
    m.free(seq)


def tree_blocks(m: PrefixCachingBlockManager) -> dict[int, tuple[TreeNode, int]]:
    where = {}
    for node in m.tree._nodes():
        for index, block_id in enumerate(node.blocks):
            where[block_id] = (node, index)
    return where


def path_blocks(node: TreeNode) -> set[int]:
    """Every block from the root down to ``node``."""
    blocks: set[int] = set()
    while node.parent is not None:
        blocks.update(node.blocks)
        node = node.parent
    return blocks


def check_prefix_cache(m: PrefixCachingBlockManager, on_gpu: list[Sequence]) -> None:
    """The invariants of ``prefix_caching.py``'s docstring, each with a message naming it."""
    tree, allocator = m.tree, m.gpu_allocator
    where = tree_blocks(m)
    for block in allocator.blocks:
        if block.block_id not in where:
            assert block.content_hash is None, (
                f"block {block.block_id} has a content hash but is not in the tree: only a "
                "cached block has one (an evicted or duplicate block loses it)"
            )
            continue
        node, index = where[block.block_id]
        assert block.content_hash == node.hashes[index], (
            f"block {block.block_id}: content_hash {block.content_hash}, its tree hash "
            f"{node.hashes[index]}"
        )
        locked = node.lock_ref > 0
        assert locked == (block.ref_count > 0), (
            f"block {block.block_id}: a cached block is locked exactly while some sequence "
            f"holds it; its node has lock_ref {node.lock_ref}, the block ref_count "
            f"{block.ref_count}"
        )
        assert locked or block.block_id in allocator.evictor, (
            f"block {block.block_id}: an unlocked cached block is free, in the Evictor"
        )
    assert len(allocator.evictor) == tree.evictable_size, (
        f"{len(allocator.evictor)} blocks in the Evictor, but the tree has "
        f"{tree.evictable_size} evictable: the two must agree"
    )
    locks: dict[int, int] = {}
    for seq in on_gpu:
        node = m._locked.get(seq.seq_id, tree.root)
        cached = {block_id for block_id in seq.block_table if block_id in where}
        assert cached <= path_blocks(node), (
            f"sequence {seq.seq_id} holds cached blocks {sorted(cached - path_blocks(node))} "
            "off the path it locked"
        )
        while node.parent is not None:
            locks[id(node)] = locks.get(id(node), 0) + 1
            node = node.parent
    for node in tree._nodes():
        got, expected = node.lock_ref, locks.get(id(node), 0)
        assert got == expected, (
            f"node {node.key}: lock_ref {got}, but {expected} sequences lock it or a node below it"
        )


def manager_snapshot(m: PrefixCachingBlockManager) -> tuple:
    blocks = [(b.ref_count, b.content_hash) for b in m.gpu_allocator.blocks]
    counts = (m.num_free_gpu_blocks, len(m.gpu_allocator.evictor), m.num_hit_tokens)
    records = (dict(m._locked), dict(m._num_cached), set(m._unmerged), set(m._counted))
    return blocks, counts, (m.tree.evictable_size, m.tree.protected_size), records


# ---- Part 4.5: caching the blocks a prefill computed -------------------------------------


def test_part5_a_computed_prefill_caches_its_full_blocks_with_their_hashes():
    m = new_manager()
    a = placed(m, 0, prompt(10))
    a.num_computed_tokens = 10
    m._merge(a)
    hashes = chain_hashes(prompt(10), BS)
    assert set(tree_blocks(m)) == set(a.block_table[:2]), (
        f"the two full computed blocks {a.block_table[:2]} enter the tree, the partial third "
        f"does not; the tree holds {sorted(tree_blocks(m))}"
    )
    got = [m.gpu_allocator.blocks[i].content_hash for i in a.block_table]
    assert got == [*hashes, None], (
        f"a cached block's content_hash is its chained hash: expected {[*hashes, None]}, got {got}"
    )
    got = [m.gpu_allocator.blocks[i].num_hashed_tokens for i in a.block_table[:2]]
    assert got == [4, 8], f"num_hashed_tokens counts the tokens up to the block's end: {got}"
    check_prefix_cache(m, [a])


def test_part5_only_computed_blocks_are_cached():
    m = new_manager()
    a = placed(m, 0, prompt(13))
    a.num_computed_tokens = 6  # a chunk of the prefill: one full block computed
    m._merge(a)
    assert set(tree_blocks(m)) == {a.block_table[0]}, (
        f"6 computed tokens fill one block: only it is cached, got {sorted(tree_blocks(m))}"
    )
    assert m._num_cached[0] == 1
    assert 0 in m._unmerged, "its prefill goes on: it stays unmerged"


def test_part5_the_merge_records_the_path_and_locks_its_end():
    m = new_manager()
    a = prefilled(placed(m, 0, prompt(10)))
    m._merge(a)
    node = m._locked[0]
    assert node.blocks == a.block_table[:2], "the sequence locks the node its cached path ends at"
    assert node.lock_ref == 1 and m.tree.protected_size == 2, (
        f"lock_ref {node.lock_ref}, protected_size {m.tree.protected_size}: the path is locked"
    )
    assert m._num_cached[0] == 2, "_num_cached: its two leading blocks are the tree's"
    assert 0 not in m._unmerged, "a prefill done (is_prefill False) is merged and forgotten"


def test_part5_a_duplicate_switches_to_the_tree_block_and_is_freed():
    m = new_manager()
    a, b = placed(m, 0, prompt(9)), placed(m, 1, prompt(9))  # the same step: both compute it
    prefilled(a), prefilled(b)
    m._merge(a)
    own, free_before = b.block_table[:2], m.num_free_gpu_blocks
    m._merge(b)
    assert b.block_table[:2] == a.block_table[:2], (
        f"the late merge: b switches to the tree's (a's) blocks {a.block_table[:2]}, its table "
        f"starts {b.block_table[:2]}"
    )
    assert m.num_free_gpu_blocks == free_before + 2, "b's two duplicates are freed"
    refs = [m.gpu_allocator.blocks[i].ref_count for i in a.block_table[:2]]
    assert refs == [2, 2], f"the tree's blocks gain b as a holder: ref_counts {refs}"
    assert all(m.gpu_allocator.blocks[i].content_hash is None for i in own), (
        "a duplicate is not cached: it goes to the free list without a hash"
    )
    check_prefix_cache(m, [a, b])


def test_part5_merge_computed_merges_a_prefill_that_computed_a_block_more():
    m = new_manager()
    a = placed(m, 0, prompt(13))
    a.num_computed_tokens = 8
    m._merge_computed()
    assert m.tree.total_size == 2, "two blocks computed since the admission: both merged"
    a.num_computed_tokens = 12
    m._merge_computed()
    assert m.tree.total_size == 3, "the next chunk's block is merged too"
    check_prefix_cache(m, [a])


def test_part5_merge_computed_leaves_a_prefill_that_filled_no_new_block():
    m = new_manager()
    a = placed(m, 0, prompt(13))
    a.num_computed_tokens = 4
    m._merge_computed()
    counted, calls = counting(reference_hash)
    m.hash_function = counted
    node = m._locked[0]
    a.num_computed_tokens = 7  # still one full block
    m._merge_computed()
    clock = m.tree._clock
    assert m._locked[0] is node and m.tree.total_size == 1 and 0 in m._unmerged, (
        "7 computed tokens fill no block more than the 4 merged: nothing to merge yet"
    )
    assert calls == [], f"and nothing is hashed: {calls}"
    m._merge_computed()
    assert m.tree._clock == clock, (
        "nothing to merge, so the tree is not even looked at (a merge stamps its path as used)"
    )


def test_part5_merge_computed_merges_a_finished_prefill_and_forgets_it():
    m = new_manager()
    a = placed(m, 0, prompt(4))
    a.num_computed_tokens = 4
    m._merge_computed()
    assert 0 in m._unmerged, "a's prefill is not over (is_prefill): it stays unmerged"
    prefilled(a)  # 5 tokens, 4 computed: no new full block, but the prefill is done
    b = placed(m, 1, prompt(13, 200))
    b.num_computed_tokens = 3
    m._merge_computed()
    assert 0 not in m._unmerged and m._num_cached[0] == 1, (
        "a's prefill is done (is_prefill False): merged and forgotten"
    )
    assert 1 in m._unmerged and m._num_cached[1] == 0, "b computed no full block: left as it is"


def test_part5_a_chunk_one_token_short_of_the_prompt_is_still_a_prefill():
    m = new_manager()
    a = placed(m, 0, prompt(8))
    a.num_computed_tokens = 7  # a chunk that stops before the prompt's last token
    m._merge_computed()
    assert 0 in m._unmerged, "the prefill goes on (is_prefill): a stays unmerged"
    a.num_computed_tokens = 8  # the last chunk: the second block is full now
    m._merge_computed()
    assert m.tree.total_size == 2, (
        "the block a's last chunk filled is merged before the next admission: the tree holds "
        f"both blocks, it holds {m.tree.total_size}"
    )


def test_part5_the_lock_moves_to_the_end_of_the_new_path():
    m = new_manager()
    a = placed(m, 0, prompt(13))
    a.num_computed_tokens = 4
    m._merge(a)
    a.num_computed_tokens = 12
    m._merge(a)
    refs = sorted(node.lock_ref for node in m.tree._nodes())
    assert refs == [1] * len(refs), (
        f"after two merges the sequence holds one lock, at the end of its longer path: the old "
        f"lock is given up; lock_refs {refs}"
    )
    assert m.tree.protected_size == 3
    check_prefix_cache(m, [a])


def test_part5_release_unlocks_and_forgets_the_sequence():
    m = new_manager()
    a = placed(m, 0, prompt(9))
    a.num_computed_tokens = 4
    m._merge(a)
    m._release(a)
    assert m.tree.protected_size == 0 and m.tree.evictable_size == 1, (
        "release unlocks the sequence's path: its blocks are evictable"
    )
    assert 0 not in m._locked and 0 not in m._num_cached and 0 not in m._unmerged, (
        "and forgets its records"
    )
    before = manager_snapshot(m)
    m._release(a)
    assert manager_snapshot(m) == before, "a sequence without a record is left as it is"


def test_part5_a_block_shared_with_a_fork_is_not_offered_to_the_tree():
    m = new_manager()
    a = placed(m, 0, prompt(9))
    a.num_computed_tokens = 9
    BlockManager.fork(m, a, Sequence(1, a.token_ids, BS))  # shares a's blocks, locks nothing
    result = m._cache(a)
    assert m.tree.total_size == 0 and result.blocks == [], (
        "a's blocks are held by another sequence too and are not cached: the offer stops "
        "before the first of them"
    )
    assert all(m.gpu_allocator.blocks[i].content_hash is None for i in a.block_table)


def test_part5_cache_returns_the_trees_path_for_the_computed_blocks():
    m = new_manager()
    ids = seed_prefix(m, prompt(8))
    a = placed(m, 0, prompt(10))
    a.num_computed_tokens = 10
    result = m._cache(a)
    assert isinstance(result, MatchResult)
    assert result.blocks == ids and result.node.blocks[-1] == ids[-1], (
        f"_cache returns the tree's blocks for the computed tokens, {ids}, got {result.blocks}"
    )
    assert a.block_table[:2] != ids, "_cache alone does not switch the table (_merge does)"


def test_part5_each_block_is_hashed_once_per_sequence():
    m = new_manager()
    counted, calls = counting(reference_hash)
    m.hash_function = counted
    a = placed(m, 0, prompt(13))
    for computed in (4, 8, 12):
        a.num_computed_tokens = computed
        m._merge(a)
    assert len(calls) == 3, (
        f"3 blocks filled, so 3 hashes; got {len(calls)}: a block is hashed once, when it "
        "fills, and its hash kept in seq.block_hashes (the tree never hashes)"
    )
    assert a.block_hashes == chain_hashes(prompt(12), BS)


def test_part5_a_hash_collision_is_not_a_duplicate():
    m = new_manager()
    m.hash_function = colliding_hash
    seed_prefix(m, prompt(8, 200))
    a = placed(m, 0, prompt(9, 100))
    own = list(a.block_table)
    prefilled(a)
    m._merge(a)
    assert a.block_table == own, "same hash, other tokens: a miss, a keeps its own blocks"
    assert m._num_cached[0] == 0, (
        f"_num_cached counts the table's blocks that are the tree's: none, got {m._num_cached[0]}"
    )
    check_prefix_cache(m, [a])


# ---- Part 4.6: eviction through the tree ----------------------------------------------------


def test_part6_no_eviction_while_the_free_list_holds_enough():
    m = new_manager(num_gpu_blocks=8)
    seed_prefix(m, prompt(8))
    m._make_room(6)
    assert m.tree.total_size == 2 and len(m.gpu_allocator.evictor) == 2, (
        "6 uncached free blocks are asked for and 6 are free: nothing is evicted"
    )


def test_part6_it_evicts_the_least_recently_used_prefix_for_what_is_missing():
    m = new_manager(num_gpu_blocks=6)
    old, new = seed_prefix(m, prompt(8, 100)), seed_prefix(m, prompt(8, 200))
    m._make_room(3)
    assert set(tree_blocks(m)) == set(new), (
        f"one block is missing: the least recently used leaf ({old}) goes, whole; the tree "
        f"holds {sorted(tree_blocks(m))}"
    )
    check_prefix_cache(m, [])


def test_part6_an_evicted_block_loses_its_content_and_goes_to_the_free_list():
    m = new_manager(num_gpu_blocks=6)
    old = seed_prefix(m, prompt(8, 100))
    seed_prefix(m, prompt(8, 200))
    m._make_room(3)
    for block_id in old:
        block = m.gpu_allocator.blocks[block_id]
        assert (block.content_hash, block.num_hashed_tokens) == (None, 0), (
            f"evicted block {block_id} keeps content_hash {block.content_hash}: it must lose it"
        )
        assert block_id not in m.gpu_allocator.evictor, f"block {block_id} is still cached"
    assert m.num_free_gpu_blocks == 6 and len(m.gpu_allocator.evictor) == 2


def test_part6_it_evicts_no_more_than_is_missing():
    m = new_manager(num_gpu_blocks=7)
    for start in (100, 200, 300):
        seed_prefix(m, prompt(8, start))
    m._make_room(3)
    assert m.tree.total_size == 4, (
        f"one free block, three asked for: two are missing, one leaf of two goes; the tree "
        f"keeps {m.tree.total_size} of 6"
    )


def test_part6_a_locked_path_is_never_evicted():
    m = new_manager(num_gpu_blocks=6)
    held = seed_prefix(m, prompt(8, 100))
    other = seed_prefix(m, prompt(8, 200))
    node = m.tree.match_prefix([*prompt(8, 100), 0], chain_hashes(prompt(8, 100), BS)).node
    for block_id in held:
        m.gpu_allocator.reuse(block_id)  # a sequence holds them, as allocate does
    m.tree.lock(node)
    m._make_room(6)
    assert set(tree_blocks(m)) == set(held), (
        f"the locked path {held} stays; only {other} can be evicted"
    )
    assert m.num_free_gpu_blocks == 4


def test_part6_asking_for_more_than_exists_evicts_everything_evictable():
    m = new_manager(num_gpu_blocks=6)
    seed_prefix(m, prompt(8, 100))
    seed_prefix(m, prompt(8, 200))
    m._make_room(100)
    assert m.tree.total_size == 0 and len(m.gpu_allocator.evictor) == 0, (
        "more asked for than the pool holds: every evictable block goes, and no error"
    )


def test_part6_the_allocator_never_picks_a_victim_of_its_own():
    m = new_manager(num_gpu_blocks=6)
    seed_prefix(m, prompt(8, 100))
    new = seed_prefix(m, prompt(8, 200))
    m._make_room(4)
    taken = [m.gpu_allocator.allocate().block_id for _ in range(4)]
    assert set(tree_blocks(m)) == set(new) and not set(taken) & set(new), (
        "after _make_room(4), four allocations come from the free list: the Evictor still "
        f"holds exactly the tree's evictable blocks {new}"
    )
    assert len(m.gpu_allocator.evictor) == m.tree.evictable_size == 2


# ---- Part 4.7: allocate with a hit -------------------------------------------------------


def test_part7_a_hit_reuses_the_cached_blocks_and_counts_them_computed():
    m = new_manager()
    ids = seed_prefix(m, prompt(10))
    b = Sequence(1, [*prompt(10), 1, 2, 3], BS)
    m.allocate(b)
    assert b.block_table[:2] == ids, (
        f"the cached prefix's blocks {ids} start the table, got {b.block_table[:2]}"
    )
    assert b.num_computed_tokens == 8, (
        f"num_computed_tokens is the tokens the cached blocks hold, 8; got {b.num_computed_tokens}"
    )
    assert len(b.block_table) == b.num_blocks and m.device_of(b) is Device.GPU
    check_prefix_cache(m, [b])


def test_part7_a_hit_never_covers_the_last_prompt_tokens_block():
    m = new_manager()
    seed_prefix(m, prompt(8))
    same = Sequence(1, prompt(8), BS)
    m.allocate(same)
    assert same.num_computed_tokens == 4, (
        "an 8-token prompt whose two blocks are cached reuses only the first: the block of the "
        f"last prompt token is computed again (its logits); got {same.num_computed_tokens}"
    )


def test_part7_num_cached_tokens_tells_the_hit_and_takes_nothing():
    m = new_manager()
    seed_prefix(m, prompt(10))
    b = Sequence(1, [*prompt(10), 1], BS)
    before = manager_snapshot(m)
    assert m.num_cached_tokens(b) == 8, "two cached blocks: 8 tokens"
    assert manager_snapshot(m) == before, "num_cached_tokens takes no block and locks nothing"
    assert m.num_cached_tokens(Sequence(2, prompt(10, 300), BS)) == 0, "a miss: 0"


def test_part7_allocate_locks_the_cached_path():
    m = new_manager()
    ids = seed_prefix(m, prompt(10))
    b = allocated(m, 1, [*prompt(10), 1])
    node = m._locked[1]
    assert node.blocks[-1] == ids[-1] and node.lock_ref == 1, (
        "the sequence locks the node its hit ends at (_locked)"
    )
    assert (m.tree.evictable_size, m.tree.protected_size) == (0, 2), (
        "the hit's blocks are protected while it holds them"
    )
    assert m._num_cached[1] == 2 and 1 in m._unmerged
    check_prefix_cache(m, [b])


def test_part7_a_miss_locks_nothing_and_takes_new_blocks():
    m = new_manager()
    seed_prefix(m, prompt(8, 200))
    b = allocated(m, 1, prompt(9, 100))
    assert b.num_computed_tokens == 0 and m._locked[1] is m.tree.root, (
        "a miss: nothing computed, the root recorded as its path's end"
    )
    assert m.tree.protected_size == 0
    check_prefix_cache(m, [b])


def test_part7_cached_blocks_in_use_cost_no_free_block_at_admission():
    m = new_manager(num_gpu_blocks=5)
    seed_prefix(m, prompt(12))
    a = allocated(m, 0, [*prompt(12), 5])  # 3 cached blocks + 1 new: one block left free
    b = Sequence(1, [*prompt(12), 6], BS)
    assert m.can_allocate(b) is AllocStatus.OK, (
        "b's 3 cached blocks are in use (a holds them): b needs 1 block, and 1 is free"
    )
    m.allocate(b)
    assert m.num_free_gpu_blocks == 0
    check_prefix_cache(m, [a, b])


def test_part7_cached_blocks_in_the_evictor_still_cost_a_free_block():
    m = new_manager(num_gpu_blocks=4)
    seed_prefix(m, prompt(12))
    placed(m, 0, prompt(3, 500))  # one block in use elsewhere: 3 free, all cached
    b = Sequence(1, [*prompt(12), 6], BS)
    assert m.can_allocate(b) is AllocStatus.LATER, (
        "b's cached blocks are free (in the Evictor): taking them back costs free blocks, so "
        "b needs 4 and 3 are free"
    )


def test_part7_never_still_compares_the_whole_prompt_with_the_pool():
    m = new_manager(num_gpu_blocks=3)
    seed_prefix(m, prompt(12))
    assert m.can_allocate(Sequence(1, prompt(13), BS)) is AllocStatus.NEVER, (
        "4 blocks never fit a pool of 3, cached or not"
    )


def test_part7_never_holds_even_when_cached_blocks_in_use_lower_the_need():
    m = new_manager(num_gpu_blocks=4)
    seed_prefix(m, prompt(12))
    allocated(m, 0, [*prompt(12), 5])  # holds the 3 cached blocks
    longer = Sequence(1, [*prompt(16), 1], BS)  # 5 blocks, 3 of them cached and in use
    assert m.can_allocate(longer) is AllocStatus.NEVER, (
        "5 blocks never fit a pool of 4 (a sequence holds all its blocks at once): NEVER, "
        "though its need now is only 2"
    )


def test_part7_a_refused_allocate_changes_nothing():
    m = new_manager(num_gpu_blocks=3)
    seed_prefix(m, prompt(9))
    seq = Sequence(1, prompt(20), BS)
    before = manager_snapshot(m)
    with pytest.raises(NoFreeBlocksError, match=r"^sequence 1 needs 5 GPU blocks, 3 are free$"):
        m.allocate(seq)
    assert manager_snapshot(m) == before, "a refused allocate changes no count, lock or record"
    assert seq.block_table == [] and m.device_of(seq) is None and seq.num_computed_tokens == 0


def test_part7_phase1s_errors_come_first():
    m = new_manager()
    seed_prefix(m, prompt(12))
    seq = allocated(m, 1, prompt(5))
    before = (manager_snapshot(m), m.tree._clock)
    with pytest.raises(ValueError, match="has its blocks on the gpu; this operation needs no"):
        m.allocate(seq)
    with pytest.raises(ValueError, match="block size"):
        m.allocate(Sequence(2, prompt(12), BS + 1))
    assert (manager_snapshot(m), m.tree._clock) == before, (
        "Phase 1's checks come before the tree is looked at: a refused call touches nothing"
    )


def test_part7_the_hit_stats_count_a_first_admission():
    m = new_manager()
    seed_prefix(m, prompt(10))
    allocated(m, 1, [*prompt(10), 1, 2, 3])
    allocated(m, 2, prompt(5, 300))
    assert (m.num_query_tokens, m.num_hit_tokens) == (13 + 5, 8), (
        "num_query_tokens counts the prompt tokens admitted, num_hit_tokens those served from "
        f"the cache: expected (18, 8), got {(m.num_query_tokens, m.num_hit_tokens)}"
    )


def test_part7_a_readmission_is_not_counted_again():
    m = new_manager()
    seed_prefix(m, prompt(10))
    seq = allocated(m, 1, prompt(10))
    m._release(seq)  # preempted by recompute: its blocks go back (Phase 1's free)
    BlockManager.free(m, seq)
    seq.num_computed_tokens = 0
    m.allocate(seq)
    assert (m.num_query_tokens, m.num_hit_tokens) == (10, 8), (
        "a re-admission is not a new query: its hits are its own blocks (vLLM's issue 25780)"
    )


def test_part7_a_prompt_admitted_a_step_after_another_reuses_its_computed_blocks():
    m = new_manager()
    a = prefilled(placed(m, 0, prompt(9)))  # computed in the last step, not decoded yet
    b = Sequence(1, [*prompt(9), 5], BS)
    assert m.num_cached_tokens(b) == 8, "a's prefill is merged before b's admission is decided"
    m.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.num_computed_tokens == 8
    check_prefix_cache(m, [a, b])


def test_part7_allocate_evicts_through_the_tree_when_blocks_are_needed():
    m = new_manager(num_gpu_blocks=6)
    seed_prefix(m, prompt(8, 100))
    seed_prefix(m, prompt(8, 200))
    seq = allocated(m, 2, prompt(16, 300))  # 4 blocks: 2 free + 2 evicted
    assert m.num_cached_tokens(Sequence(3, prompt(9, 100), BS)) == 0, "the older prefix went"
    assert m.num_cached_tokens(Sequence(4, prompt(9, 200), BS)) == 8, "the newer one stays"
    check_prefix_cache(m, [seq])


def test_part7_each_prompt_block_is_hashed_once():
    m = new_manager()
    counted, calls = counting(reference_hash)
    m.hash_function = counted
    seq = Sequence(1, prompt(13), BS)
    m.can_allocate(seq), m.num_cached_tokens(seq), m.allocate(seq)
    assert len(calls) == 3, (
        f"a 13-token prompt has 3 full blocks: hashed once each for all the admission's "
        f"questions, got {len(calls)} hashes"
    )


# ---- Part 4.8: free into the tree, fork -------------------------------------------------


def test_part8_free_caches_the_computed_full_blocks_decodes_included():
    m = new_manager()
    a = prefilled(allocated(m, 0, prompt(5)))
    for token in (1, 2, 3):  # decodes, their blocks from Phase 1's append_slot
        BlockManager.append_slot(m, a)
        a.num_computed_tokens = a.num_tokens
        a.append_token(token)
    finish(m, a)
    assert m.tree.total_size == 2 and m.tree.evictable_size == 2, (
        "the sequence computed 8 tokens: two full blocks, the decoded one too, are cached"
    )
    assert len(m.gpu_allocator.evictor) == 2 and m.num_free_gpu_blocks == 16, (
        "freed, they are free blocks kept in the Evictor"
    )
    check_prefix_cache(m, [])


def test_part8_free_hands_back_duplicates_uncached():
    m = new_manager()
    a, b = allocated(m, 0, prompt(9)), allocated(m, 1, prompt(9))
    prefilled(a), prefilled(b)
    finish(m, a)
    cached = sorted(tree_blocks(m))
    finish(m, b)
    assert sorted(tree_blocks(m)) == cached, "the tree keeps its own blocks for the prefix"
    assert all(m.gpu_allocator.blocks[i].content_hash is None for i in b.block_table or []), (
        "b's duplicates go to the free list without a hash"
    )
    assert len(m.gpu_allocator.evictor) == 2 and m.num_free_gpu_blocks == 16
    check_prefix_cache(m, [])


def test_part8_free_unlocks_the_sequences_path():
    m = new_manager()
    seed_prefix(m, prompt(10))
    seq = allocated(m, 1, [*prompt(10), 1])
    finish(m, seq)
    assert m.tree.protected_size == 0 and all(n.lock_ref == 0 for n in m.tree._nodes()), (
        "a freed sequence holds no lock: its cached path is evictable"
    )
    assert 1 not in m._locked and 1 not in m._unmerged
    check_prefix_cache(m, [])


def test_part8_a_preempted_sequence_stays_counted_a_finished_one_leaves():
    m = new_manager()
    seq = prefilled(allocated(m, 0, prompt(10)))
    m.free(seq)  # preempted by recompute: not finished
    seq.num_computed_tokens = 0
    m.allocate(seq)
    assert seq.num_computed_tokens == 8, "its own blocks are reused"
    assert (m.num_query_tokens, m.num_hit_tokens) == (10, 0), "but not counted as a hit"
    finish(m, seq)
    assert 0 not in m._counted, "a finished sequence leaves _counted"


def test_part8_a_forked_child_locks_the_parents_cached_path():
    m = new_manager()
    parent = prefilled(allocated(m, 0, prompt(10)))
    child = Sequence(1, parent.token_ids, BS)
    m.fork(parent, child)
    assert m.tree.total_size == 2, "the parent's computed blocks are merged first"
    node = m._locked[0]
    assert m._locked[1] is node and node.lock_ref == 2, (
        f"the child locks the parent's path too: lock_ref {node.lock_ref}, expected 2"
    )
    assert m._num_cached[1] == 2 and child.block_table == parent.block_table
    check_prefix_cache(m, [parent, child])
    finish(m, parent)
    check_prefix_cache(m, [child])
    assert m.tree.evict(10) == [], "the child still uses the path: nothing is evictable"


def test_part8_a_refused_fork_changes_nothing():
    m = new_manager()
    other = allocated(m, 1, prompt(3, 300))
    parent = prefilled(allocated(m, 0, prompt(10)))  # not merged yet
    before = manager_snapshot(m)
    with pytest.raises(ValueError, match="has its blocks on the gpu; this operation needs no"):
        m.fork(parent, other)
    assert manager_snapshot(m) == before, "the checks come before the merge"


def test_part8_blocks_shared_with_a_fork_that_locks_no_path_are_cached_by_the_last_holder():
    m = new_manager()
    m.hash_function = colliding_hash  # every block collides
    finish(m, prefilled(allocated(m, 0, prompt(9, 100))))  # cached
    parent = prefilled(allocated(m, 1, prompt(9, 200)))
    child = Sequence(2, parent.token_ids, BS)
    m.fork(parent, child)  # the parent's merge collides: nothing cached, both lock the root
    child.num_computed_tokens = parent.num_computed_tokens
    m._make_room(m.num_free_gpu_blocks)  # the colliding prefix is evicted
    m.free(parent)  # preempted: its blocks, still the child's, must not become cached
    check_prefix_cache(m, [child])
    finish(m, child)  # the last holder: now they are
    assert m.num_cached_tokens(Sequence(3, prompt(9, 200), BS)) == 8
    check_prefix_cache(m, [])


def test_part8_a_swapped_out_sequence_is_freed_as_phase_1_frees_it():
    m = new_manager()
    a = prefilled(allocated(m, 0, prompt(9)))
    m._release(a)  # what swap_out does first (part 4.9), then Phase 1's swap_out
    BlockManager.swap_out(m, [a])
    before = (m.tree.total_size, m.num_free_gpu_blocks)
    finish(m, a)
    assert (m.tree.total_size, m.num_free_gpu_blocks) == before, (
        "a sequence on the CPU has no GPU blocks to offer the tree: its CPU blocks are freed "
        "and nothing is cached"
    )
    assert m.num_free_cpu_blocks == 16 and m.device_of(a) is None
    check_prefix_cache(m, [])


def block_aligned_optimum(trace, block_size: int) -> list[int]:
    """Per request, the hit tokens an oracle with unlimited room finds (bench_prefix's rule,
    over the tokens an engine computes: a request's last generated token has no K/V)."""
    seen, best = [], []
    for prompt_ids, output in trace:
        shared = 0
        for earlier in seen:
            common = 0
            while common < min(len(earlier), len(prompt_ids)):
                if earlier[common] != prompt_ids[common]:
                    break
                common += 1
            shared = max(shared, common)
        limit = (len(prompt_ids) - 1) // block_size * block_size
        best.append(min(shared // block_size * block_size, limit))
        seen.append((prompt_ids + output)[:-1])  # the last token's K/V is never computed
    return best


def serve_through_the_manager(trace, block_size: int) -> list[int]:
    """Each request admitted, prefilled, decoded and finished, one at a time, in a pool that
    never evicts; the hits are what ``allocate`` reused."""
    m = PrefixCachingBlockManager(block_size, 4096, 0, watermark=0.0)
    m.hash_function = reference_hash
    return serve_one_at_a_time(m, trace)


def bench_traces() -> dict:
    """bench_prefix.py's workloads, small: a shared system prompt, few-shot, a chat."""
    import random

    rng = random.Random(0)
    system = [rng.randrange(50) for _ in range(37)]
    shots = [[rng.randrange(50) for _ in range(11)] for _ in range(4)]
    traces = {
        "system prompt": [
            (system + [rng.randrange(50) for _ in range(rng.randint(1, 9))], [1, 2, 3])
            for _ in range(12)
        ],
        "few-shot": [
            ([t for shot in rng.sample(shots, 3) for t in shot] + [rng.randrange(50)], [4, 5])
            for _ in range(12)
        ],
    }
    chat, history = [], [rng.randrange(50) for _ in range(9)]
    for _ in range(8):
        answer = [rng.randrange(50) for _ in range(rng.randint(3, 9))]
        chat.append((list(history), answer))
        history = history + answer + [rng.randrange(50) for _ in range(rng.randint(2, 6))]
    traces["chat"] = chat
    return traces


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_part8_hits_equal_the_block_aligned_optimum_on_the_benchmark_traces(block_size):
    global BS
    for name, trace in bench_traces().items():
        expected = block_aligned_optimum(trace, block_size)
        saved, BS = BS, block_size
        try:
            got = serve_through_the_manager(trace, block_size)
        finally:
            BS = saved
        assert got == expected, (
            f"{name}, block size {block_size}: with room for everything, each request must hit "
            f"every whole block it shares with the computed tokens of an earlier request (its "
            f"prompt and output but the last token), never its own last prompt token's; "
            f"expected {expected}, got {got}"
        )


# ---- Part 4.9: decode (copy-on-write) and swap ---------------------------------------------


def test_part9_the_first_decode_merges_the_computed_prefill():
    m = new_manager()
    a = prefilled(allocated(m, 0, prompt(9)))
    assert m.append_slot(a) is None
    assert set(tree_blocks(m)) == set(a.block_table[:2]) and 0 not in m._unmerged, (
        "at its first decode a sequence's computed full blocks enter the tree (if no admission "
        "merged them)"
    )
    check_prefix_cache(m, [a])


def test_part9_identical_prompts_admitted_together_share_from_their_first_decode():
    m = new_manager()
    a, b = allocated(m, 0, prompt(9)), allocated(m, 1, prompt(9))
    assert set(a.block_table).isdisjoint(b.block_table), "both compute the prompt"
    prefilled(a), prefilled(b)
    free_before = m.num_free_gpu_blocks
    m.append_slot(a)
    m.append_slot(b)
    assert b.block_table[:2] == a.block_table[:2], "b switched to the tree's (a's) blocks"
    assert m.num_free_gpu_blocks == free_before + 2, "b's two duplicates are freed"
    check_prefix_cache(m, [a, b])


def test_part9_the_first_decode_merges_before_it_makes_room():
    m = new_manager(num_gpu_blocks=6)
    seed_prefix(m, prompt(4, 300))
    kept = seed_prefix(m, prompt(4, 400))
    a, b = allocated(m, 0, prompt(8)), allocated(m, 1, prompt(8))  # the free list is empty
    prefilled(a), prefilled(b)
    m.append_slot(a)  # a's 9th token needs a block: the older cached prefix goes
    m.append_slot(b)  # b's merge frees its two duplicates first: no eviction is needed
    assert set(kept) <= set(tree_blocks(m)), (
        "b's merge frees its duplicates before room is made for its new block: the cached "
        f"prefix {kept} must not be evicted for it"
    )
    check_prefix_cache(m, [a, b])


def test_part9_a_new_block_is_made_room_for_through_the_tree():
    m = new_manager(num_gpu_blocks=5)
    old, new = seed_prefix(m, prompt(4, 200)), seed_prefix(m, prompt(4, 300))
    a = prefilled(allocated(m, 0, prompt(12, 100)))  # 3 blocks: the free list is empty now
    m.append_slot(a)  # the token opens a block: only cached free blocks are left
    assert len(a.block_table) == 4
    assert m.gpu_allocator.blocks[a.block_table[-1]].content_hash is None
    assert set(old).isdisjoint(tree_blocks(m)) and set(new) <= set(tree_blocks(m)), (
        "the new block comes from the tree's least recently used leaf, evicted first: the "
        "allocator never picks a cached block itself"
    )
    check_prefix_cache(m, [a])


def test_part9_a_copy_on_write_of_a_shared_last_block_makes_room_through_the_tree():
    m = new_manager(num_gpu_blocks=4)
    seed_prefix(m, prompt(4, 200))  # one cached free block
    parent = prefilled(allocated(m, 0, prompt(5, 100)))  # 2 blocks; 6 tokens
    child = Sequence(1, parent.token_ids, BS)
    m.fork(parent, child)
    placed(m, 9, prompt(1, 900))  # takes the last uncached free block
    assert m.num_free_gpu_blocks == 1 and len(m.gpu_allocator.evictor) == 1
    child.num_computed_tokens = child.num_tokens
    child.append_token(3)
    copy = m.append_slot(child)
    assert copy is not None and copy[0] == parent.block_table[-1], (
        "the child writes into the block it shares with its parent: it is copied on write"
    )
    assert m.tree.total_size == 1, "parent's cached block stays"
    check_prefix_cache(m, [parent, child])


def test_part9_a_decode_into_its_own_block_touches_nothing():
    m = new_manager()
    a = prefilled(allocated(m, 0, prompt(9)))
    m.append_slot(a)
    a.num_computed_tokens = a.num_tokens
    a.append_token(4)
    before = manager_snapshot(m)
    assert m.append_slot(a) is None
    assert manager_snapshot(m) == before, "a token that fits its own last block changes nothing"


def test_part9_a_swapped_out_sequence_releases_the_tree():
    m = new_manager()
    a = prefilled(allocated(m, 0, prompt(9)))
    m.append_slot(a)
    m.swap_out([a])
    assert m.tree.protected_size == 0 and m.tree.evictable_size == 2, (
        "a swapped-out sequence gives up its hold: its cached blocks stay cached, evictable"
    )
    assert 0 not in m._locked and 0 not in m._unmerged
    assert all(b.content_hash is None for b in m.cpu_allocator.blocks), "CPU copies: uncached"
    check_prefix_cache(m, [])


def test_part9_a_group_sharing_cached_blocks_with_another_is_not_swapped_alone():
    m = new_manager()
    a = prefilled(allocated(m, 0, prompt(9)))
    m.append_slot(a)
    b = allocated(m, 1, [*prompt(9), 1])
    assert not m.can_swap_out([b]), "b's cached blocks are a's too: recompute it instead"
    assert m.can_swap_out([a, b]), "the two hold their blocks alone together"
    m.swap_out([a, b])
    assert m.tree.protected_size == 0, "both give up their hold"
    check_prefix_cache(m, [])


def test_part9_swap_in_makes_room_and_merges_back_at_the_next_decode():
    m = new_manager(num_gpu_blocks=6)
    old = seed_prefix(m, prompt(8, 300))
    a = prefilled(allocated(m, 0, prompt(9)))
    m.append_slot(a)
    cached = a.block_table[:2]
    m.swap_out([a])  # the free list: 2 blocks; the Evictor: 4
    m.swap_in([a])
    assert set(a.block_table).isdisjoint(cached), "fresh GPU copies"
    assert m._num_cached[0] == 0 and 0 in m._unmerged, "back unmerged, nothing in the tree"
    assert set(cached) <= set(tree_blocks(m)) and set(old).isdisjoint(tree_blocks(m)), (
        "room for the 3 blocks is made through the tree: the older prefix went, a's stays"
    )
    check_prefix_cache(m, [a])
    m.append_slot(a)
    assert a.block_table[:2] == cached, "its next decode puts it back on the tree's blocks"
    check_prefix_cache(m, [a])


@pytest.mark.parametrize("where", ["no blocks", "its blocks on the cpu"])
def test_part9_a_decode_of_a_sequence_not_on_the_gpu_is_refused(where):
    m = new_manager()
    a = Sequence(0, prompt(9), BS)
    if where != "no blocks":
        a = prefilled(allocated(m, 0, prompt(9)))
        m.append_slot(a)
        m.swap_out([a])
    before, table = manager_snapshot(m), list(a.block_table)
    expected = f"sequence 0 has {where}; this operation needs its blocks on the gpu"
    try:
        result = m.append_slot(a)
    except ValueError as error:
        assert re.search(rf"\b{re.escape(expected)}\b", str(error)), (
            f"append_slot of a sequence with {where} is Phase 1's error; expected the message "
            f"{expected!r}, got {str(error)!r}"
        )
    except NotImplementedError:
        raise
    except Exception as error:
        raise AssertionError(
            f"append_slot of a sequence with {where} must raise Phase 1's ValueError "
            f"({expected!r}) before it looks at any block; got {type(error).__name__}: {error}"
        ) from None
    else:
        raise AssertionError(
            f"append_slot of a sequence with {where} must raise ValueError ({expected!r}), as "
            f"Phase 1's does: a decode needs the sequence's blocks on the GPU; it returned "
            f"{result!r}"
        )
    assert manager_snapshot(m) == before and a.block_table == table, (
        "a refused append_slot changes nothing: blocks, counts, tree and records as before"
    )


def check_tree_sizes(m: PrefixCachingBlockManager) -> None:
    """``evictable_size + protected_size`` is the tree's blocks, ``protected_size`` those of
    locked nodes, and a locked node's parent is locked."""
    tree, nodes = m.tree, m.tree._nodes()
    protected = sum(len(node.blocks) for node in nodes if node.lock_ref > 0)
    assert tree.protected_size == protected, (
        f"protected_size {tree.protected_size}, but locked nodes hold {protected} blocks"
    )
    total = sum(len(node.blocks) for node in nodes)
    assert tree.total_size == total, f"the sizes add up to {tree.total_size}, the tree has {total}"


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


def test_part9_a_state_machine_keeps_the_invariants_and_the_content_of_every_slot():
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
        graded_settings(max_examples=150, stateful_step_count=40),
        required,
    )


class NoMetrics:
    """A StatLogger that records nothing (the engine's metrics are Phase 5's)."""

    def __getattr__(self, name: str) -> Callable:
        return lambda *args, **kwargs: None


def test_part9_greedy_output_is_the_same_with_prefix_caching_on_and_off():
    """The engine on your code: the third prompt waits for a free seat and hits the blocks the
    first two computed; not one generated token changes."""
    from vkv import LLM, SamplingParams

    shared = "You are a careful Python programmer.\n"
    prompts = [shared + "def add(x):\n", shared + "def sub(x):\n", shared + "def add(x):\n"]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outputs, engines = {}, {}
    for caching in (False, True):
        llm = LLM(block_size=4, num_gpu_blocks=64, max_num_seqs=2, enable_prefix_caching=caching)
        llm.engine.stat_logger = NoMetrics()  # Phase 5's part: not what this test checks
        results = llm.generate(prompts, params, use_progress=False)
        outputs[caching] = [result["token_ids"] for result in results]
        engines[caching] = llm.engine
    assert outputs[True] == outputs[False], (
        "greedy decoding must give the same tokens with prefix caching on and off: a hit that "
        f"serves another prefix's K/V changes them; off {outputs[False]}, on {outputs[True]}"
    )
    stats = engines[True].stats
    assert stats["prefix_cache_hits"] > 0, f"the third prompt must hit the shared prefix: {stats}"
