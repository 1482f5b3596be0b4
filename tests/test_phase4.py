"""Graded tests for Phase 4: prefix caching with a radix tree (``vkv/engine/radix_cache.py``).

``uv run pytest tests/test_phase4.py -k part3 -v`` runs the tests of part 4.3. The tests build
their trees by hand (``grow``, through the given ``_new_node``) with an independent hash of
their own (``reference_hash``), so that a part is graded on its own code: only part 4.1's tests
use your ``block_hash``, and only the state machine of part 4.6 runs every part together,
against a model of the cache as a plain dictionary from prefixes to blocks.
"""

from typing import ClassVar

import pytest
import xxhash
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from hypothesis_settings import graded_settings, run_counted_machine

from vkv.engine.radix_cache import MatchResult, RadixCache, TreeNode, block_hash


def reference_hash(parent: int | None, tokens) -> int:
    """An independent chained hash for the tests (Python's tuple hash, made non-negative)."""
    return hash((parent, tuple(tokens))) & (2**63 - 1)


def colliding_hash(parent: int | None, tokens) -> int:
    """Every block hashes alike: only the token comparison tells blocks apart."""
    return 7


def new_cache(block_size: int = 2, hash_function=reference_hash) -> RadixCache:
    return RadixCache(block_size, hash_function)


def grow(cache: RadixCache, parent: TreeNode, tokens: list[int], blocks: list[int]) -> TreeNode:
    """A node under ``parent`` holding ``tokens`` in ``blocks``, made by hand: hashes chained
    from ``parent``, blocks counted as evictable."""
    hashes, last = [], parent.last_hash
    size = cache.block_size
    for i in range(len(blocks)):
        last = cache.hash_function(last, tokens[i * size : (i + 1) * size])
        hashes.append(last)
    node = cache._new_node(parent, list(tokens), list(blocks), hashes)
    cache.evictable_size += len(blocks)
    return node


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


def check_tree(cache: RadixCache) -> None:
    """The module docstring's invariants, each with a message naming the rule."""
    size, seen, total, protected = cache.block_size, set(), 0, 0
    stack = [(cache.root, child) for child in cache.root.children.values()]
    while stack:
        parent, node = stack.pop()
        assert node.parent is parent, f"node {node.key}: its parent link is wrong"
        assert parent.children.get(node.hashes[0]) is node, (
            f"node {node.key} must sit in its parent's children under the hash of its first block"
        )
        assert len(node.blocks) >= 1 and len(node.key) == size * len(node.blocks), (
            f"node {node.key}: {len(node.blocks)} blocks for {len(node.key)} tokens"
        )
        expected, last = [], parent.last_hash
        for i in range(len(node.blocks)):
            last = cache.hash_function(last, node.key[i * size : (i + 1) * size])
            expected.append(last)
        assert node.hashes == expected, f"node {node.key}: hashes must chain from the parent's"
        assert not seen & set(node.blocks), (
            f"blocks {seen & set(node.blocks)} are in the tree twice"
        )
        seen |= set(node.blocks)
        total += len(node.blocks)
        protected += len(node.blocks) if node.lock_ref else 0
        assert node.lock_ref >= 0, f"node {node.key} has lock_ref {node.lock_ref}"
        if node.lock_ref and parent is not cache.root:
            assert parent.lock_ref >= node.lock_ref, (
                "a locked node's parent is locked at least as often"
            )
        assert parent is cache.root or parent.last_access >= node.last_access, (
            "a parent is never older than its children"
        )
        stack.extend((node, child) for child in node.children.values())
    assert cache.protected_size == protected, (
        f"protected_size is {cache.protected_size}, but locked nodes hold {protected} blocks"
    )
    assert cache.evictable_size == total - protected, (
        f"evictable_size is {cache.evictable_size}, but unlocked nodes hold {total - protected}"
    )


# ---- Part 4.1: the chained block hash -----------------------------------------------------


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


# ---- Part 4.2: splitting a node -----------------------------------------------------------


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


# ---- Part 4.3: matching a prefix ------------------------------------------------------------


def chain(cache: RadixCache) -> tuple[TreeNode, TreeNode]:
    """root -> [1..4] in blocks 10, 11 -> [5..8] in blocks 12, 13 (block size 2)."""
    top = grow(cache, cache.root, [1, 2, 3, 4], [10, 11])
    return top, grow(cache, top, [5, 6, 7, 8], [12, 13])


def test_part3_an_empty_prompt_is_refused_and_changes_nothing():
    cache = new_cache()
    chain(cache)
    before = snapshot(cache)
    with pytest.raises(ValueError, match=r"^cannot match an empty prompt$"):
        cache.match_prefix([])
    assert snapshot(cache) == before


def test_part3_a_match_follows_the_path_through_several_nodes():
    cache = new_cache()
    _top, bottom = chain(cache)
    result = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert isinstance(result, MatchResult)
    assert result.blocks == [10, 11, 12, 13], f"expected all four blocks, got {result.blocks}"
    assert result.node is bottom, "the match ends at the node of its last block"
    check_tree(cache)


def test_part3_a_match_never_covers_the_last_token():
    cache = new_cache()
    top, bottom = chain(cache)
    result = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    assert result.blocks == [10, 11, 12], (
        f"an 8-token prompt may match (8 - 1) // 2 = 3 blocks, whose last token is not in "
        f"them; got {result.blocks}"
    )
    assert result.node.blocks == [12] and result.node.parent is top
    assert result.node.children == {bottom.hashes[0]: bottom} and bottom.blocks == [13], (
        "the match ended inside [12, 13]: that node must be split after block 12"
    )
    check_tree(cache)


def test_part3_a_partial_last_block_never_matches():
    cache = new_cache()
    chain(cache)
    assert cache.match_prefix([1, 2, 3]).blocks == [10], "3 tokens: at most 1 whole block"
    assert cache.match_prefix([1, 2]).blocks == [], "2 tokens: the last token must be computed"
    assert cache.match_prefix([1]).blocks == []


def test_part3_a_match_that_diverges_inside_an_edge_splits_it():
    cache = new_cache()
    top, _ = chain(cache)
    result = cache.match_prefix([1, 2, 3, 4, 5, 6, 0, 0, 0])
    assert result.blocks == [10, 11, 12], f"three blocks agree, got {result.blocks}"
    assert result.node.parent is top and result.node.blocks == [12]
    assert len(result.node.children) == 1 and next(iter(result.node.children.values())).blocks == [
        13
    ]
    check_tree(cache)


def test_part3_a_miss_returns_the_root_and_no_blocks():
    cache = new_cache()
    chain(cache)
    before = snapshot(cache)[:3]
    result = cache.match_prefix([9, 9, 9, 9, 9])
    assert result.blocks == [] and result.node is cache.root
    assert snapshot(cache)[:3] == before, "a miss changes no node"


def test_part3_a_hash_collision_is_a_miss_not_wrong_blocks():
    cache = new_cache(hash_function=colliding_hash)
    grow(cache, cache.root, [5, 6, 7, 8], [10, 11])
    result = cache.match_prefix([1, 2, 3, 4, 5])
    assert result.blocks == [], (
        f"block [1, 2] hashes like cached block [5, 6] but its tokens differ: a miss, not "
        f"{result.blocks}"
    )
    assert result.node is cache.root


def test_part3_a_match_stamps_its_path_as_used_now():
    cache = new_cache()
    top, bottom = chain(cache)
    other = grow(cache, cache.root, [7, 7], [14])
    cache._clock = 41
    result = cache.match_prefix([1, 2, 3, 4, 9, 9])
    assert result.node is top
    assert top.last_access == 42, (
        f"the matched node must be used now (tick 42), got {top.last_access}"
    )
    assert bottom.last_access == 0 and other.last_access == 0, "nodes off the path keep theirs"


def test_part3_the_tail_a_match_splits_off_keeps_its_stamp():
    cache = new_cache()
    top, bottom = chain(cache)
    top.last_access, bottom.last_access, cache._clock = 3, 3, 41
    result = cache.match_prefix([1, 2, 3, 4, 5, 6, 9, 9])
    assert result.node.blocks == [12] and result.node.last_access == 42
    assert bottom.blocks == [13] and bottom.last_access == 3, (
        f"the split-off tail [13] is not on the matched path: it keeps last_access 3, got "
        f"{bottom.last_access}"
    )


def test_part3_a_match_changes_no_size():
    cache = new_cache()
    chain(cache)
    cache.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert_sizes(cache, 4, 0, "a match moves no block between the sizes")
    check_tree(cache)


# ---- Part 4.4: inserting a prefix ---------------------------------------------------------


@pytest.mark.parametrize(("tokens", "blocks"), [([1, 2, 3], [10]), ([1, 2], [10, 11]), ([], [10])])
def test_part4_insert_takes_whole_blocks_only(tokens, blocks):
    cache = new_cache()
    before = snapshot(cache)
    message = f"^insert takes whole blocks: {len(tokens)} tokens for {len(blocks)} blocks of 2$"
    with pytest.raises(ValueError, match=message):
        cache.insert(tokens, blocks)
    assert snapshot(cache) == before


def test_part4_a_refused_insert_does_not_split_a_cached_edge_first():
    cache = new_cache()
    grow(cache, cache.root, [1, 2, 3, 4, 5, 6], [10, 11, 12])
    before = snapshot(cache)
    with pytest.raises(ValueError, match="insert takes whole blocks: 3 tokens for 1 blocks of 2"):
        cache.insert([1, 2, 3], [20])
    assert snapshot(cache) == before, (
        "check the length before walking: [1, 2] would have split the cached edge"
    )


def test_part4_insert_into_an_empty_tree_makes_one_leaf():
    cache = new_cache()
    assert cache.insert([1, 2, 3, 4], [10, 11]) == 0, "nothing was cached before"
    (leaf,) = cache.root.children.values()
    assert (leaf.key, leaf.blocks) == ([1, 2, 3, 4], [10, 11])
    assert cache.evictable_size == 2 and cache.protected_size == 0, "a new leaf is evictable"
    check_tree(cache)


def test_part4_inserting_a_cached_prefix_returns_its_length_and_keeps_the_tree_blocks():
    cache = new_cache()
    cache.insert([1, 2, 3, 4], [10, 11])
    assert cache.insert([1, 2, 3, 4], [20, 21]) == 2, "both blocks were cached already"
    assert paths(cache) == {(1, 2): 10, (1, 2, 3, 4): 11}, (
        "the tree keeps its own blocks; the caller frees its duplicates 20 and 21"
    )
    assert cache.total_size == 2


def test_part4_insert_extends_a_cached_prefix_with_a_new_leaf():
    cache = new_cache()
    cache.insert([1, 2], [10])
    assert cache.insert([1, 2, 3, 4, 5, 6], [20, 21, 22]) == 1
    assert paths(cache) == {(1, 2): 10, (1, 2, 3, 4): 21, (1, 2, 3, 4, 5, 6): 22}
    (top,) = cache.root.children.values()
    (leaf,) = top.children.values()
    assert leaf.blocks == [21, 22] and leaf.parent is top
    assert cache.evictable_size == 3
    check_tree(cache)


def test_part4_insert_that_diverges_inside_an_edge_splits_it():
    cache = new_cache()
    cache.insert([1, 2, 3, 4, 5, 6], [10, 11, 12])
    assert cache.insert([1, 2, 3, 4, 9, 9], [20, 21, 22]) == 2
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


def test_part4_inserting_a_shorter_prefix_cuts_the_edge_where_it_ends():
    cache = new_cache()
    cache.insert([1, 2, 3, 4, 5, 6], [10, 11, 12])
    assert cache.insert([1, 2], [20]) == 1
    (head,) = cache.root.children.values()
    assert head.blocks == [10] and [c.blocks for c in head.children.values()] == [[11, 12]], (
        "an insert that ends inside an edge splits it there, like a match"
    )
    check_tree(cache)


def test_part4_a_new_leaf_under_a_locked_node_is_evictable():
    cache = new_cache()
    top = grow(cache, cache.root, [1, 2], [10])
    top.lock_ref, cache.evictable_size, cache.protected_size = 1, 0, 1
    assert cache.insert([1, 2, 3, 4], [20, 21]) == 1
    assert (cache.evictable_size, cache.protected_size) == (1, 1), (
        "block 21's new leaf is not locked: evictable, whatever its parent"
    )


def test_part4_a_hash_collision_records_nothing_more():
    cache = new_cache(hash_function=colliding_hash)
    cache.insert([5, 6], [10])
    assert cache.insert([1, 2, 3, 4], [20, 21]) == 0
    assert paths(cache) == {(5, 6): 10}, (
        "[1, 2] collides with [5, 6]: its leaf cannot take that place, nothing is recorded"
    )
    assert cache.total_size == 1


def test_part4_insert_stamps_its_path_as_used_now():
    cache = new_cache()
    cache.insert([1, 2], [10])
    cache._clock = 9
    cache.insert([1, 2, 3, 4], [20, 21])
    (top,) = cache.root.children.values()
    (leaf,) = top.children.values()
    assert leaf.last_access == 10 and top.last_access == 10, (
        f"the inserted path is used now (tick 10): leaf {leaf.last_access}, "
        f"parent {top.last_access}"
    )


def test_part4_an_insert_of_a_cached_prefix_still_stamps_its_path():
    cache = new_cache()
    cache.insert([1, 2, 3, 4], [10, 11])
    (node,) = cache.root.children.values()
    cache._clock = 19
    assert cache.insert([1, 2, 3, 4], [20, 21]) == 2
    assert node.last_access == 20, (
        f"all cached: the path is used now all the same (tick 20), got {node.last_access}"
    )


def test_part4_an_insert_that_meets_a_collision_stamps_where_its_prefix_ends():
    cache = new_cache(hash_function=colliding_hash)
    cache.insert([5, 6, 3, 4], [10, 11])
    cache._clock = 29
    assert cache.insert([5, 6, 1, 2], [20, 21]) == 1, "[5, 6] was cached"
    (head,) = cache.root.children.values()
    assert head.blocks == [10] and head.last_access == 30, (
        "[5, 6] is cached, [1, 2] collides with [3, 4]: nothing is recorded, but the node the "
        f"cached prefix ends at is used now (tick 30), got {head.last_access}"
    )
    (tail,) = head.children.values()
    assert tail.blocks == [11] and tail.last_access < 30, "the colliding node is not on the path"


def test_part4_the_tail_an_insert_splits_off_keeps_its_stamp():
    cache = new_cache()
    cache.insert([1, 2, 3, 4, 5, 6], [10, 11, 12])
    (node,) = cache.root.children.values()
    node.last_access, cache._clock = 5, 9
    cache.insert([1, 2, 7, 8], [20, 21])
    assert node.blocks == [11, 12] and node.last_access == 5, (
        f"the split-off tail [11, 12] is not on the inserted path: it keeps 5, got "
        f"{node.last_access}"
    )


@pytest.mark.parametrize("seed", range(5))
def test_part4_many_inserts_record_what_a_prefix_dictionary_records(seed):
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
        assert cache.insert(tokens, blocks) == expected, (
            f"insert({tokens}) after {len(model)} prefixes"
        )
        assert paths(cache) == model
        check_tree(cache)


# ---- Part 4.5: locks ------------------------------------------------------------------------


def test_part5_lock_counts_on_the_node_and_every_ancestor():
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


def test_part5_each_node_moves_its_own_blocks():
    cache = new_cache()
    top = grow(cache, cache.root, [1, 2], [10])
    bottom = grow(cache, top, [3, 4, 5, 6, 7, 8], [11, 12, 13])
    cache.lock(bottom)
    assert_sizes(cache, 0, 4, "lock moves 1 block of top and 3 of bottom")
    cache.unlock(bottom)
    assert_sizes(cache, 4, 0, "unlock moves them back, each node its own")


def test_part5_locking_a_parent_protects_only_the_path_to_it():
    cache = new_cache()
    top, bottom = chain(cache)
    cache.lock(top)
    assert (top.lock_ref, bottom.lock_ref) == (1, 0)
    assert_sizes(cache, 2, 2, "lock(top) protects top's blocks, not its child's")


def test_part5_unlock_undoes_one_lock():
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


def test_part5_unlocking_a_node_that_is_not_locked_is_refused_and_changes_nothing():
    cache = new_cache()
    top, bottom = chain(cache)
    cache.lock(top)
    before = snapshot(cache)
    with pytest.raises(ValueError, match=r"^unlock of a node that is not locked$"):
        cache.unlock(bottom)
    assert snapshot(cache) == before, "a refused unlock must not touch the ancestors either"


def test_part5_the_root_cannot_be_locked_or_unlocked():
    cache = new_cache()
    chain(cache)
    before = snapshot(cache)
    cache.lock(cache.root)
    cache.unlock(cache.root)
    assert snapshot(cache) == before


# ---- Part 4.6: eviction, and the whole tree -------------------------------------------------


def fan(cache: RadixCache) -> tuple[TreeNode, list[TreeNode]]:
    """root -> [1, 2] (block 10) -> three leaves [3, 4] (11), [5, 6] (12), [7, 8, 9, 9] (13, 14)."""
    top = grow(cache, cache.root, [1, 2], [10])
    leaves = [grow(cache, top, [3, 4], [11]), grow(cache, top, [5, 6], [12])]
    leaves.append(grow(cache, top, [7, 8, 9, 9], [13, 14]))
    return top, leaves


def test_part6_a_negative_count_is_refused_and_zero_evicts_nothing():
    cache = new_cache()
    fan(cache)
    before = snapshot(cache)
    with pytest.raises(ValueError, match=r"^num_blocks must be >= 0, got -1$"):
        cache.evict(-1)
    assert cache.evict(0) == [] and snapshot(cache) == before


def test_part6_the_least_recently_used_leaf_goes_first():
    cache = new_cache()
    top, (a, b, c) = fan(cache)
    top.last_access, a.last_access, b.last_access, c.last_access = 9, 5, 3, 8
    assert cache.evict(1) == [12], "the leaf used longest ago (last_access 3) goes first"
    assert cache.evict(1) == [11]
    assert cache.evict(1) == [13, 14], "a leaf goes whole, its blocks in edge order"
    assert cache.evictable_size == 1 and set(top.children) == set()
    check_tree(cache)


def test_part6_equally_old_leaves_go_in_creation_order():
    cache = new_cache()
    _top, (_a, _b, _c) = fan(cache)
    assert cache.evict(2) == [11, 12], "ties on last_access go to the smaller node_id"


def test_part6_ties_follow_creation_order_not_block_ids():
    cache = new_cache()
    for block in (30, 20, 10):
        grow(cache, cache.root, [block, block], [block])
    assert cache.evict(1) == [30], "equally old: the node made first goes, whatever its blocks"


def test_part6_a_parent_left_a_leaf_keeps_its_own_age():
    cache = new_cache()
    parent = grow(cache, cache.root, [1, 2], [10])
    leaf = grow(cache, parent, [3, 4], [11])
    other = grow(cache, cache.root, [5, 6], [12])
    parent.last_access, leaf.last_access, other.last_access = 5, 1, 3
    assert cache.evict(2) == [11, 12], (
        "after leaf [11] (last_access 1) the candidates are [12] (3) and its parent [10] (5): "
        "the parent joins with its own last_access, so [12] goes first"
    )


def test_part6_eviction_goes_on_until_enough_blocks_are_out():
    cache = new_cache()
    _, (a, b, c) = fan(cache)
    a.last_access, b.last_access, c.last_access = 2, 2, 1
    assert cache.evict(1) == [13, 14], "at least one block: the whole leaf, two"
    assert cache.evict(2) == [11, 12]
    check_tree(cache)


def test_part6_a_parent_left_a_leaf_can_go_in_the_same_call():
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


def test_part6_locked_nodes_are_never_evicted():
    cache = new_cache()
    top, (a, _b, _c) = fan(cache)
    a.lock_ref = top.lock_ref = 1  # locked by hand: this part's tests do not run part 4.5
    cache.evictable_size, cache.protected_size = 3, 2
    assert cache.evict(10) == [12, 13, 14], "a and its parent are locked: only b and c can go"
    assert cache.root.children == {top.hashes[0]: top} and top.children == {a.hashes[0]: a}
    assert_sizes(cache, 0, 2, "the locked path's two blocks stay, protected")
    check_tree(cache)


def test_part6_eviction_stops_when_nothing_is_evictable():
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
        self.cache = RadixCache(2)
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
        assert self.cache.insert(whole, blocks) == cached
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
        result = self.cache.match_prefix(tokens)
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


def test_part6_a_state_machine_keeps_every_invariant():
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
