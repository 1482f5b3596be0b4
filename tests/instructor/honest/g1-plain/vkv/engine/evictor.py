"""Evictor: free blocks whose content may still be reused, and which of them to give up first.

When a block with a content hash (a full block that prefix caching recorded) loses its last
holder, its K/V are still valid: a later request with the same prefix could reuse them. So
instead of the free list, such a block goes to the evictor. It stays allocatable: when the
free list is empty, the allocator asks the evictor for a victim.

Policy (vLLM's LRU evictor): evict the block with the oldest ``last_accessed``; among equally
old blocks, the one with the *most* ``num_hashed_tokens`` (the deepest block of a prefix, the
least likely to be shared); among those, the smallest ``block_id``, so the order is total.

    key(block) = (last_accessed, -num_hashed_tokens, block_id)   smallest key is evicted first

Contract
- ``add(block)``: a free block (``ref_count == 0``) with a content hash; not already held.
- ``remove(block_id)``: take a block back out for reuse (a prefix-cache hit).
- ``update(block_id, last_accessed)``: record a new access time for a held block.
- ``evict()``: remove and return the block with the smallest key.
Each of ``remove``, ``update`` and ``evict`` raises ``ValueError`` for a block id the evictor
does not hold (or an empty evictor), and changes nothing then.

Invariants
- Every held block has ``ref_count == 0`` and a content hash; each block is held at most once.
- ``len(evictor)`` is the number of held blocks.

The data (provided): ``_blocks`` maps block id to block for the held blocks; ``_keys`` maps block
id to the key the block is ordered by (recorded by ``add`` and ``update``, so that a block changed
behind the evictor's back keeps its place); ``_heap`` is a heap of keys that may hold stale
entries (a removed block, an old access time), which ``evict`` skips. Any structure that keeps
the policy is fine; this one makes every operation O(log n).
"""

import heapq
from typing import Protocol

EvictionKey = tuple[float, int, int]


class Block(Protocol):
    """What the evictor reads and writes of a block: ``vkv.engine.block.Block`` is one (the
    evictor sits below the allocator that owns blocks, and never imports it)."""

    block_id: int
    ref_count: int
    content_hash: int | None
    num_hashed_tokens: int
    last_accessed: float


class Evictor:
    """LRU set of cached free blocks; see the module docstring for the policy."""

    def __init__(self) -> None:
        self._blocks: dict[int, Block] = {}
        self._keys: dict[int, EvictionKey] = {}
        self._heap: list[EvictionKey] = []

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._blocks

    def add(self, block: Block) -> None:
        """Hold a free block that has a content hash.

        Raises ``ValueError`` if the block is in use, has no content hash, or is already held;
        the message names the block and the reason, for block 0 with ``ref_count`` 1, block 1
        without a hash and a held block 2:
        "block 0 has ref_count 1: only free blocks can be cached",
        "block 1 has no content hash: nothing to cache",
        "block 2 is already in the evictor".
        """
        ### BEGIN SOLUTION part1.5
        if block.ref_count != 0:
            raise ValueError(
                f"block {block.block_id} has ref_count {block.ref_count}: only free blocks can be cached"
            )
        if block.content_hash is None:
            raise ValueError(f"block {block.block_id} has no content hash: nothing to cache")
        if block.block_id in self._blocks:
            raise ValueError(f"block {block.block_id} is already in the evictor")
        self._blocks[block.block_id] = block
        self._push(block)
        ### END SOLUTION

    def remove(self, block_id: int) -> Block:
        """Take a held block out (for reuse) and return it.

        Raises ``ValueError`` for an id it does not hold (``_held``); for id 7 the message is
        "block 7 is not in the evictor".
        """
        ### BEGIN SOLUTION part1.5
        block = self._held(block_id)
        del self._blocks[block_id]
        del self._keys[block_id]
        return block
        ### END SOLUTION

    def update(self, block_id: int, last_accessed: float) -> None:
        """Set a held block's access time, which moves it in the eviction order.

        Raises ``ValueError`` for an id it does not hold (``_held``); for id 7 the message is
        "block 7 is not in the evictor".
        """
        ### BEGIN SOLUTION part1.5
        block = self._held(block_id)
        block.last_accessed = last_accessed
        self._push(block)
        ### END SOLUTION

    def evict(self) -> Block:
        """Remove and return the block with the smallest key (see the module docstring).

        Raises ``ValueError`` on an empty evictor, with the message
        "evict() on an empty evictor: no cached block to give up".
        """
        ### BEGIN SOLUTION part1.5
        if len(self._blocks) == 0:
            raise ValueError("evict() on an empty evictor: no cached block to give up")
        while len(self._heap) > 0:
            key = heapq.heappop(self._heap)
            block_id = key[2]
            if block_id not in self._keys:
                # stale: the block was removed or evicted already
                continue
            if self._keys[block_id] != key:
                # stale: the block was updated since this entry was pushed
                continue
            return self.remove(block_id)
        raise ValueError("evict() on an empty evictor: no cached block to give up")
        ### END SOLUTION

    def _held(self, block_id: int) -> Block:
        """The held block with this id; ``ValueError`` if there is none.

        The message names the id; for id 7 it is "block 7 is not in the evictor".
        """
        ### BEGIN SOLUTION part1.5
        if block_id not in self._blocks:
            raise ValueError(f"block {block_id} is not in the evictor")
        return self._blocks[block_id]
        ### END SOLUTION

    def _push(self, block: Block) -> None:
        """Record and push the block's current key; rebuild the heap when stale entries dominate."""
        ### BEGIN SOLUTION part1.5
        key = _key(block)
        self._keys[block.block_id] = key
        heapq.heappush(self._heap, key)
        # too many stale entries: rebuild the heap from the live keys only
        if len(self._heap) > 2 * len(self._keys) + 8:
            self._heap = list(self._keys.values())
            heapq.heapify(self._heap)
        ### END SOLUTION


def _key(block: Block) -> EvictionKey:
    """The eviction order: oldest access, then most hashed tokens, then smallest id."""
    return (block.last_accessed, -block.num_hashed_tokens, block.block_id)
