"""Hidden tests for Phase 4: instructor-only (left out of the student edition)."""

import xxhash

from vkv.engine.radix_cache import RadixCache, TreeNode, block_hash


def new_cache(block_size: int = 2) -> RadixCache:
    return RadixCache(block_size, lambda parent, tokens: hash((parent, tuple(tokens))))


def grow(cache: RadixCache, parent: TreeNode, tokens: list[int], blocks: list[int]) -> TreeNode:
    """A node made by hand, as in the graded tests."""
    hashes, last, size = [], parent.last_hash, cache.block_size
    for i in range(len(blocks)):
        last = cache.hash_function(last, tokens[i * size : (i + 1) * size])
        hashes.append(last)
    cache.evictable_size += len(blocks)
    return cache._new_node(parent, list(tokens), list(blocks), hashes)


def test_part1_a_large_vocabulary_token_and_an_empty_block():
    data = (151_643).to_bytes(4, "little")
    assert block_hash(None, [151_643]) == xxhash.xxh64(data).intdigest()
    assert block_hash(None, []) == xxhash.xxh64(b"").intdigest()


def test_part2_split_before_the_last_block_of_four():
    cache = new_cache(block_size=1)
    node = grow(cache, cache.root, [1, 2, 3, 4], [10, 11, 12, 13])
    head = cache._split(node, 3)
    assert (head.blocks, node.blocks) == ([10, 11, 12], [13])
    assert head.children == {node.hashes[0]: node} and cache.root.children == {head.hashes[0]: head}


def test_part3_block_size_one_matches_all_but_the_last_token():
    cache = new_cache(block_size=1)
    top = grow(cache, cache.root, [5], [1])
    grow(cache, grow(cache, top, [6], [2]), [7, 8], [3, 4])
    assert cache.match_prefix([5, 6, 7, 8]).blocks == [1, 2, 3]
    assert cache.match_prefix([5, 6, 7, 8, 9]).blocks == [1, 2, 3, 4]
    assert cache.total_size == 4


def test_part4_block_size_three_splits_after_two_of_three_blocks():
    cache = new_cache(block_size=3)
    cache.insert(list(range(9)), [10, 11, 12])
    assert cache.insert([0, 1, 2, 3, 4, 5, 9, 9, 9], [20, 21, 22]) == 2
    (head,) = cache.root.children.values()
    assert head.blocks == [10, 11]
    assert sorted(child.blocks for child in head.children.values()) == [[12], [22]]
    assert cache.evictable_size == 4


def test_part5_locks_taken_deep_and_released_out_of_order():
    cache = new_cache()
    a = grow(cache, cache.root, [1, 1], [1])
    b = grow(cache, a, [2, 2], [2])
    c = grow(cache, b, [3, 3], [3])
    cache.lock(c)
    cache.lock(a)
    cache.unlock(c)
    assert (a.lock_ref, b.lock_ref, c.lock_ref) == (1, 0, 0)
    assert (cache.evictable_size, cache.protected_size) == (2, 1)


def test_part6_a_cascade_stops_at_a_locked_parent():
    cache = new_cache()
    a = grow(cache, cache.root, [1, 1], [1])
    b = grow(cache, a, [2, 2], [2])
    grow(cache, b, [3, 3], [3])
    a.lock_ref, cache.evictable_size, cache.protected_size = 1, 2, 1  # locked by hand
    assert cache.evict(5) == [3, 2], "the cascade stops at a locked parent"
    assert a.children == {} and cache.protected_size == 1
