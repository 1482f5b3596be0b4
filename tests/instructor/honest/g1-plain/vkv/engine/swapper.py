"""Swapper: moves the KV blocks of a group of sequences between the GPU pool and the CPU pool.

When the GPU runs out of blocks, the scheduler can preempt a sequence by *swapping* it out: its
blocks are copied to the CPU pool (host memory) and the GPU blocks freed; later it is swapped
back in. The Swapper does the bookkeeping; it returns a mapping that tells the CacheEngine which
block to copy where:

    swap_out(seqs) -> {gpu_block_id: cpu_block_id}
    swap_in(seqs)  -> {cpu_block_id: gpu_block_id}

A group, not a single sequence, is the unit: sequences forked from one parent share blocks, and
a shared block must move once, with all its holders. So every holder of every block in the
group must be in the group (``ref_count`` equals the number of group tables holding the block);
the moved block keeps that ``ref_count`` in its new pool, and each sequence's ``block_table`` is
rewritten to the new ids, in place of the old, in the same logical order.

    seq A  [3, 5]          swap_out([A, B])          seq A  [0, 1]
    seq B  [3, 8]    ─────────────────────────▶      seq B  [0, 2]
    GPU 3: ref 2            {3: 0, 5: 1, 8: 2}        CPU 0: ref 2 (moved once)

A swap moves K/V, not the prefix-cache record: the new blocks have no ``content_hash``.

Contract
- All or nothing: when a swap cannot complete (too few free blocks in the destination, or the
  group is not closed under sharing), it raises and changes nothing.
- ``can_swap_out``: the group's distinct blocks fit in the free CPU blocks.
- ``can_swap_in``: they fit in the free GPU blocks with ``watermark_blocks`` to spare.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vkv.engine.block import BlockAllocator, NoFreeBlocksError

if TYPE_CHECKING:
    from vkv.engine.sequence import Sequence


class Swapper:
    """Moves groups of sequences between ``gpu_allocator`` and ``cpu_allocator``.

    ``watermark_blocks`` (0 by default) is how many GPU blocks a swap-in must leave free; the
    BlockManager passes its own.
    """

    def __init__(
        self,
        gpu_allocator: BlockAllocator,
        cpu_allocator: BlockAllocator,
        watermark_blocks: int = 0,
    ) -> None:
        self.gpu_allocator = gpu_allocator
        self.cpu_allocator = cpu_allocator
        self.watermark_blocks = watermark_blocks

    def can_swap_out(self, seqs: list[Sequence]) -> bool:
        """Whether the group's distinct GPU blocks fit in the free CPU blocks."""
        ### BEGIN SOLUTION part1.4
        need = self.num_blocks(seqs)
        return need <= self.cpu_allocator.num_free_blocks
        ### END SOLUTION

    def holds_alone(self, seqs: list[Sequence]) -> bool:
        """Whether no sequence outside the group holds one of its GPU blocks: each block's
        ``ref_count`` equals the number of the group's tables holding it (``_move``'s check)."""
        ### BEGIN SOLUTION part1.4
        counts = _distinct_block_ids(seqs)
        for block_id, times_held in counts.items():
            block = self.gpu_allocator.blocks[block_id]
            if block.ref_count != times_held:
                return False
        return True
        ### END SOLUTION

    def num_blocks(self, seqs: list[Sequence]) -> int:
        """The group's distinct blocks: what a swap of it moves (a shared block once)."""
        ### BEGIN SOLUTION part1.4
        return len(_distinct_block_ids(seqs))
        ### END SOLUTION

    def can_swap_in(self, seqs: list[Sequence]) -> bool:
        """Whether the distinct CPU blocks fit in the free GPU blocks, above the watermark."""
        ### BEGIN SOLUTION part1.4
        need = self.num_blocks(seqs)
        return need + self.watermark_blocks <= self.gpu_allocator.num_free_blocks
        ### END SOLUTION

    def swap_out(self, seqs: list[Sequence]) -> dict[int, int]:
        """Move the group's blocks from GPU to CPU; return ``{gpu_block_id: cpu_block_id}``.

        Raises ``NoFreeBlocksError`` if the CPU pool is too small, ``ValueError`` if a block is
        also held outside the group (``_move``); nothing changes then. The first names the
        blocks needed and free; for 3 blocks and 2 free CPU blocks it is
        "swap out needs 3 CPU blocks, 2 are free".
        """
        ### BEGIN SOLUTION part1.4
        need = self.num_blocks(seqs)
        num_free = self.cpu_allocator.num_free_blocks
        if need > num_free:
            raise NoFreeBlocksError(f"swap out needs {need} CPU blocks, {num_free} are free")
        return _move(seqs, self.gpu_allocator, self.cpu_allocator)
        ### END SOLUTION

    def swap_in(self, seqs: list[Sequence]) -> dict[int, int]:
        """Move the group's blocks from CPU to GPU; return ``{cpu_block_id: gpu_block_id}``.

        Raises ``NoFreeBlocksError`` if ``can_swap_in`` is false, ``ValueError`` if a block is
        also held outside the group (``_move``); nothing changes then. The first names the
        blocks needed, the watermark and the free blocks; for 40 blocks, a watermark of 10 and
        49 free GPU blocks it is
        "swap in needs 40 GPU blocks plus a watermark of 10, 49 are free".
        """
        ### BEGIN SOLUTION part1.4
        if not self.can_swap_in(seqs):
            need = self.num_blocks(seqs)
            num_free = self.gpu_allocator.num_free_blocks
            raise NoFreeBlocksError(
                f"swap in needs {need} GPU blocks plus a watermark of {self.watermark_blocks}, "
                f"{num_free} are free"
            )
        return _move(seqs, self.cpu_allocator, self.gpu_allocator)
        ### END SOLUTION


def _distinct_block_ids(seqs: list[Sequence]) -> dict[int, int]:
    """Each distinct block id in the group's tables, with the number of tables holding it."""
    ### BEGIN SOLUTION part1.4
    counts = {}
    for seq in seqs:
        for block_id in seq.block_table:
            if block_id in counts:
                counts[block_id] += 1
            else:
                counts[block_id] = 1
    return counts
    ### END SOLUTION


def _move(seqs: list[Sequence], src: BlockAllocator, dst: BlockAllocator) -> dict[int, int]:
    """Copy each distinct block once from ``src`` to ``dst``, rewrite the tables, free ``src``.

    The caller has checked that ``dst`` has room; this checks the group is closed under sharing
    before changing anything, and raises ``ValueError`` if it is not. The message names the
    block, its ``ref_count`` and how many of the group's tables hold it, then says what to do;
    for GPU block 0 of ``ref_count`` 2 held by one table of the group it begins
    "gpu block 0 has ref_count 2 but the group holds it 1 time(s)" and ends
    "swap every sequence that shares it together".
    """
    ### BEGIN SOLUTION part1.4
    counts = _distinct_block_ids(seqs)

    # check first: every holder of every block must be in the group
    for block_id, times_held in counts.items():
        block = src.blocks[block_id]
        if block.ref_count != times_held:
            raise ValueError(
                f"{src.device.value} block {block_id} has ref_count {block.ref_count} "
                f"but the group holds it {times_held} time(s): "
                f"swap every sequence that shares it together"
            )

    # take one destination block per distinct source block, with the same ref count
    mapping = {}
    for block_id, times_held in counts.items():
        new_block = dst.allocate()
        for _ in range(times_held - 1):
            dst.share(new_block)
        mapping[block_id] = new_block.block_id

    # rewrite the tables in the same logical order
    for seq in seqs:
        new_table = []
        for block_id in seq.block_table:
            new_table.append(mapping[block_id])
        seq.block_table = new_table

    # give the source blocks back
    for block_id, times_held in counts.items():
        old_block = src.blocks[block_id]
        for _ in range(times_held):
            src.free(old_block)
    return mapping
    ### END SOLUTION
