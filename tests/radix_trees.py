"""Phase 4's trees and traces for the tests, shared by the visible and the hidden graded tests.

The tree never hashes: a sequence hashes its blocks (part 4.1) and hands the list to the tree.
So that parts 4.2-4.4 are graded on the tree's code alone, the tests hash with a chained hash of
their own (``reference_hash``, or ``colliding_hash`` where only the token comparison may tell
blocks apart), and ``grow`` builds a node by hand through the given ``_new_node``.
``serve_one_at_a_time`` runs a trace of requests through a manager and gives its hits.
"""

from vkv.engine.block_manager import BlockManager
from vkv.engine.radix_cache import MatchResult, RadixCache, TreeNode
from vkv.engine.sequence import Sequence, SequenceStatus


def reference_hash(parent: int | None, tokens) -> int:
    """An independent chained hash: Python's tuple hash of ints, made non-negative (-1 stands
    for None, whose own hash changes from one process to the next on Python 3.11)."""
    return hash((-1 if parent is None else parent, tuple(tokens))) & (2**63 - 1)


def colliding_hash(parent: int | None, tokens) -> int:
    """Every block hashes alike: only the token comparison tells blocks apart."""
    return 7


class Cache(RadixCache):
    """Your RadixCache, carrying the tests' own chained hash: the tree never hashes, so the
    tests hash each prompt's blocks (as a sequence does) and pass the list to the tree."""

    def __init__(self, block_size: int, hash_function=reference_hash) -> None:
        super().__init__(block_size)
        self.hash_function = hash_function

    def hashes(self, token_ids) -> list[int]:
        """The chained hash of every whole block of ``token_ids``."""
        return chain_hashes(token_ids, self.block_size, self.hash_function)


def match(cache: Cache, token_ids) -> MatchResult:
    """``match_prefix`` with the prompt's block hashes."""
    return cache.match_prefix(token_ids, cache.hashes(token_ids))


def insert(cache: Cache, token_ids, blocks) -> int:
    """``insert`` with the blocks' hashes."""
    return cache.insert(token_ids, blocks, cache.hashes(token_ids))


def grow(cache: RadixCache, parent: TreeNode, tokens: list[int], blocks: list[int]) -> TreeNode:
    """A node made by hand under ``parent``: hashes chained from it, blocks evictable."""
    hashes, last, size = [], parent.last_hash, cache.block_size
    for i in range(len(blocks)):
        last = cache.hash_function(last, tokens[i * size : (i + 1) * size])
        hashes.append(last)
    cache.evictable_size += len(blocks)
    return cache._new_node(parent, list(tokens), list(blocks), hashes)


def new_cache(block_size: int = 2, hash_function=reference_hash) -> Cache:
    return Cache(block_size, hash_function)


def check_structure(cache: RadixCache) -> None:
    """The tree's structural invariants (``radix_cache.py``'s docstring): parent links, blocks
    whole and once, hashes chained, and the sizes counting every block."""
    size, seen, total, protected = cache.block_size, set(), 0, 0
    stack = [(cache.root, child) for child in cache.root.children.values()]
    while stack:
        parent, node = stack.pop()
        assert node.parent is parent, f"node {node.key}: its parent link is wrong"
        assert parent.children.get(node.hashes[0]) is node, (
            f"node {node.key} sits in its parent's children under the hash of its first block"
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
        stack.extend((node, child) for child in node.children.values())
    assert (cache.evictable_size, cache.protected_size) == (total - protected, protected), (
        f"evictable_size + protected_size counts the tree's {total} blocks, {protected} of them "
        f"in locked nodes: got {(cache.evictable_size, cache.protected_size)}"
    )


def serve_one_at_a_time(manager, trace, after_each=lambda: None) -> list[int]:
    """Serve ``trace`` (``(prompt, output)`` pairs) through ``manager`` one request at a time:
    admitted, prefilled, decoded token by token and finished, then ``after_each()``. Returns
    each request's hit: the tokens ``allocate`` found computed."""
    hits = []
    for seq_id, (prompt_ids, output) in enumerate(trace):
        seq = Sequence(seq_id, prompt_ids, manager.block_size)
        manager.allocate(seq)
        hits.append(seq.num_computed_tokens)
        seq.num_computed_tokens = seq.num_tokens
        for token in output:
            seq.append_token(token)
            BlockManager.append_slot(manager, seq)  # Phase 1's: its blocks are cached when freed
            seq.num_computed_tokens = seq.num_tokens - 1
        seq.status = SequenceStatus.FINISHED_STOPPED
        manager.free(seq)
        after_each()
    return hits


def chain_hashes(tokens, block_size: int, hash_function=reference_hash) -> list[int]:
    """The chained hash of every whole block of ``tokens`` (the tests' own, not part 4.1's)."""
    hashes, last = [], None
    for i in range(len(tokens) // block_size):
        last = hash_function(last, list(tokens[i * block_size : (i + 1) * block_size]))
        hashes.append(last)
    return hashes


def seed_prefix(manager, tokens) -> list[int]:
    """Put the whole blocks of ``tokens`` in ``manager``'s tree as cached free blocks (in the
    Evictor), by hand: the tree's parts and Phase 1 only. Returns the tree's blocks for them."""
    size, allocator = manager.block_size, manager.gpu_allocator
    hashes = chain_hashes(tokens, size, manager.hash_function)
    ids = [allocator.allocate().block_id for _ in hashes]
    cached = manager.tree.insert(list(tokens[: len(ids) * size]), ids, hashes)
    for index, block_id in enumerate(ids):
        block = allocator.blocks[block_id]
        if index >= cached:
            block.content_hash, block.num_hashed_tokens = hashes[index], (index + 1) * size
        allocator.free(block)
    return manager.tree.match_prefix([*tokens[: len(ids) * size], 0], hashes).blocks


def cached_blocks(manager) -> dict[int, tuple[TreeNode, int]]:
    """Where each block of ``manager``'s tree sits (its node and index), once the pool and the
    tree are checked to agree: a block is in the tree once; a block outside it has no hash; a
    tree block carries its node's hash and is in use exactly when its node is locked, else it
    waits in the Evictor, which holds as many blocks as the tree calls evictable."""
    allocator, where = manager.gpu_allocator, {}
    for node in manager.tree._nodes():  # the tree's given walk
        for index, block_id in enumerate(node.blocks):
            assert block_id not in where, f"block {block_id} is in the tree twice"
            where[block_id] = (node, index)
    for block in allocator.blocks:
        if block.block_id not in where:
            assert block.content_hash is None, f"block {block.block_id} has a hash, not cached"
            continue
        node, index = where[block.block_id]
        assert block.content_hash == node.hashes[index], f"block {block.block_id}: wrong hash"
        locked = node.lock_ref > 0
        assert locked == (block.ref_count > 0), (
            f"block {block.block_id}: lock_ref {node.lock_ref}, ref_count {block.ref_count}"
        )
        assert locked or block.block_id in allocator.evictor, f"{block.block_id} not evictable"
    assert len(allocator.evictor) == manager.tree.evictable_size, (
        f"{len(allocator.evictor)} blocks in the Evictor, {manager.tree.evictable_size} evictable"
    )
    return where
