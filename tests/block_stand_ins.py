"""Phase 1's stand-in for the Evictor, shared by the visible and the hidden graded tests: part
1.2's pool hands freed blocks that keep a hash to an evictor, and its tests use this one, so that
part 1.2 is graded without part 1.5's code.
"""

from vkv.engine.block import Block, BlockAllocator, Device


class StandInEvictor:
    """A plain stand-in for part 1.5's Evictor (same interface, least recently used first, then
    more hashed tokens, then the smaller id), so that part 1.2's tests do not need it."""

    def __init__(self) -> None:
        self.cached: dict[int, Block] = {}

    def __len__(self) -> int:
        return len(self.cached)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self.cached

    def add(self, block: Block) -> None:
        assert block.block_id not in self.cached, f"block {block.block_id} added twice"
        self.cached[block.block_id] = block

    def remove(self, block_id: int) -> Block:
        return self.cached.pop(block_id)

    def evict(self) -> Block:
        oldest = min(
            self.cached.values(),
            key=lambda b: (b.last_accessed, -b.num_hashed_tokens, b.block_id),
        )
        return self.cached.pop(oldest.block_id)


def with_stand_in(device: Device, num_blocks: int) -> BlockAllocator:
    pool = BlockAllocator(device, num_blocks)
    pool.evictor = StandInEvictor()
    return pool
