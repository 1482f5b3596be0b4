"""Block and BlockAllocator: a fixed pool of physical KV-cache blocks on one device.

A *physical block* is a fixed-size slab of the KV cache that holds the keys and values of
``block_size`` tokens (the tensors themselves live in the CacheEngine; here a block is
bookkeeping). The allocator owns every block of its pool and hands them out and back.

Several sequences may hold one block (a forked sequence shares its parent's blocks), so each
block counts its holders in ``ref_count``. A block with ``ref_count == 0`` is *free*, and sits in
exactly one of two places:

    free list  (deque of block ids)   free blocks with nothing worth keeping
    evictor    (see evictor.py)       free blocks whose content (``content_hash``) may be reused

    allocate():  free list first (O(1) popleft), else evict the least recently used cached
                 block (its hash is dropped), else NoFreeBlocksError
    free(b):     ref_count -= 1; at 0 the block goes to the evictor if it has a content hash,
                 to the back of the free list otherwise

Invariants
- ``0 <= ref_count`` for every block; a block in use is in neither free structure; a free
  block is in exactly one of them.
- ``num_free_blocks + (blocks with ref_count > 0) == num_blocks``.
- A failed call (an error raised) leaves every count as it was.
"""

from collections import deque
from dataclasses import dataclass
from enum import Enum

from vkv.engine.evictor import Evictor


class Device(Enum):
    """Where a block pool lives."""

    GPU = "gpu"
    CPU = "cpu"


class NoFreeBlocksError(RuntimeError):
    """The pool has no block to give: every block is in use."""


class DoubleFreeError(ValueError):
    """A block was freed more times than it was allocated or shared."""


@dataclass(slots=True, eq=False)
class Block:
    """One physical KV-cache block: its identity, holder count and cached-content record.

    ``content_hash`` and ``num_hashed_tokens`` are set by prefix caching (a later phase) once the
    block is full; ``last_accessed`` is the time a sequence last used it (for LRU eviction).
    """

    block_id: int
    device: Device
    ref_count: int = 0
    content_hash: int | None = None
    num_hashed_tokens: int = 0
    last_accessed: float = 0.0


class BlockAllocator:
    """Hands out and takes back the ``num_blocks`` blocks of one device, in O(1).

    ``blocks[i]`` is the block whose ``block_id`` is ``i``. The allocator never creates or
    destroys blocks after construction. Raises ``ValueError`` for a negative ``num_blocks``;
    for ``num_blocks = -1`` the message is "num_blocks must be >= 0, got -1".
    """

    def __init__(self, device: Device, num_blocks: int) -> None:
        ### BEGIN SOLUTION part1.2
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.device = device
        self.blocks = []
        for block_id in range(num_blocks):
            self.blocks.append(Block(block_id, device))
        self.free_block_ids = deque(range(num_blocks))
        self.evictor = Evictor()
        ### END SOLUTION

    @property
    def num_blocks(self) -> int:
        """The size of the pool."""
        ### BEGIN SOLUTION part1.2
        return len(self.blocks)
        ### END SOLUTION

    @property
    def num_free_blocks(self) -> int:
        """Blocks that ``allocate`` can hand out: the free list plus the evictor."""
        ### BEGIN SOLUTION part1.2
        return len(self.free_block_ids) + len(self.evictor)
        ### END SOLUTION

    def allocate(self) -> Block:
        """Take a free block and return it with ``ref_count == 1``.

        Draws from the free list first; only when it is empty evicts a cached block (whose
        content record is then cleared). Raises ``NoFreeBlocksError`` when the pool is exhausted,
        with a message that names the device and the pool's size; for a GPU pool of 2 it is
        "the gpu pool has no free block: all 2 are in use".
        """
        ### BEGIN SOLUTION part1.2
        if len(self.free_block_ids) > 0:
            block_id = self.free_block_ids.popleft()
            block = self.blocks[block_id]
        elif len(self.evictor) > 0:
            block = self.evictor.evict()
            # the old content is overwritten, so forget it
            block.content_hash = None
            block.num_hashed_tokens = 0
        else:
            raise NoFreeBlocksError(
                f"the {self.device.value} pool has no free block: all {self.num_blocks} are in use"
            )
        block.ref_count = 1
        return block
        ### END SOLUTION

    def share(self, block: Block) -> None:
        """Add one holder to a block that is in use (``ref_count += 1``).

        Raises ``ValueError`` if the block is not of this pool (``_check_owned``) or is free;
        for block 0 of a GPU pool the message is then
        "gpu block 0 is free: allocate it, do not share it".
        """
        ### BEGIN SOLUTION part1.2
        self._check_owned(block)
        if block.ref_count == 0:
            raise ValueError(
                f"{self.device.value} block {block.block_id} is free: allocate it, do not share it"
            )
        block.ref_count += 1
        ### END SOLUTION

    def free(self, block: Block) -> None:
        """Drop one holder; at ``ref_count == 0`` the block becomes free (see the module doc).

        Raises ``ValueError`` for a block of another pool (``_check_owned``) and
        ``DoubleFreeError`` for a block that is already free; the pool is unchanged in both
        cases. The double free's message names the device and the block; for block 3 of a GPU
        pool it is "double free: gpu block 3 is already free".
        """
        ### BEGIN SOLUTION part1.2
        self._check_owned(block)
        if block.ref_count == 0:
            raise DoubleFreeError(
                f"double free: {self.device.value} block {block.block_id} is already free"
            )
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.content_hash is not None:
                self.evictor.add(block)
            else:
                self.free_block_ids.append(block.block_id)
        ### END SOLUTION

    def reuse(self, block_id: int) -> Block:
        """Take back a cached block by id, keeping its content (a prefix-cache hit).

        A free block leaves the evictor with ``ref_count == 1``; a block in use gains a holder.
        Raises ``ValueError`` for an id outside the pool, with a message that names the id and
        the valid range; for id 5 and a GPU pool of 2 it is
        "block id 5 is outside the gpu pool (0..1)".
        Raises ``ValueError`` for a free block that holds no content; for block 0 of a GPU pool
        the message is "gpu block 0 is free and holds no cached content".
        """
        ### BEGIN SOLUTION part1.2
        if block_id < 0 or block_id >= self.num_blocks:
            raise ValueError(
                f"block id {block_id} is outside the {self.device.value} pool (0..{self.num_blocks - 1})"
            )
        block = self.blocks[block_id]
        if block.ref_count > 0:
            block.ref_count += 1
            return block
        if block_id not in self.evictor:
            raise ValueError(
                f"{self.device.value} block {block_id} is free and holds no cached content"
            )
        self.evictor.remove(block_id)
        block.ref_count = 1
        return block
        ### END SOLUTION

    def _check_owned(self, block: Block) -> None:
        """Raise ``ValueError`` unless ``block`` is one of this pool's blocks.

        A block of another device, an id outside the pool (negative, or ``num_blocks`` and up)
        and a block object that is not ``blocks[block_id]`` are all foreign. The message names
        the block's device and id, then this pool's device and size. Given to a GPU pool of 4
        blocks, a CPU block 0 and a GPU block 4 give
        "cpu block 0 does not belong to this gpu pool of 4 blocks" and
        "gpu block 4 does not belong to this gpu pool of 4 blocks".
        """
        ### BEGIN SOLUTION part1.2
        is_owned = True
        if block.device != self.device:
            is_owned = False
        elif block.block_id < 0 or block.block_id >= self.num_blocks:
            is_owned = False
        elif self.blocks[block.block_id] is not block:
            is_owned = False
        if not is_owned:
            raise ValueError(
                f"{block.device.value} block {block.block_id} does not belong to this "
                f"{self.device.value} pool of {self.num_blocks} blocks"
            )
        ### END SOLUTION
