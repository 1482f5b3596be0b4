"""The invariants of ``PrefixCachingBlockManager`` (its module docstring), checked whole."""

from vkv.engine.block import Device
from vkv.engine.prefix_caching import PrefixCachingBlockManager
from vkv.engine.radix_cache import TreeNode
from vkv.engine.sequence import Sequence


def path_blocks(node: TreeNode) -> set[int]:
    """Every block from the root down to ``node``."""
    blocks: set[int] = set()
    while node.parent is not None:
        blocks.update(node.blocks)
        node = node.parent
    return blocks


def check_prefix_cache(manager: PrefixCachingBlockManager, on_gpu: list[Sequence]) -> None:
    """Tree blocks carry their tree hash and no other block has one; a locked node's blocks are
    in use and an unlocked node's are free, in the Evictor; each sequence's cached blocks lie on
    the path it locked; ``lock_ref`` of every node counts the sequences locking it or below."""
    tree, allocator = manager.tree, manager.gpu_allocator
    where: dict[int, tuple[TreeNode, int]] = {}
    for node in tree._nodes():
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
    assert len(allocator.evictor) == tree.evictable_size, (
        f"{len(allocator.evictor)} blocks in the Evictor, {tree.evictable_size} evictable"
    )
    locks: dict[int, int] = {}
    for seq in on_gpu:
        assert manager.device_of(seq) is Device.GPU
        node = manager._locked.get(seq.seq_id, tree.root)
        cached = {block_id for block_id in seq.block_table if block_id in where}
        assert cached <= path_blocks(node), (
            f"sequence {seq.seq_id} holds cached blocks {cached - path_blocks(node)} off its path"
        )
        while node.parent is not None:
            locks[id(node)] = locks.get(id(node), 0) + 1
            node = node.parent
    for node in tree._nodes():
        assert node.lock_ref == locks.get(id(node), 0), f"node {node.node_id}: lock_ref off"


def check_tree_sizes(manager: PrefixCachingBlockManager) -> None:
    """``evictable_size + protected_size`` is the tree's blocks, ``protected_size`` those of
    locked nodes, and a locked node's parent is locked."""
    tree, nodes = manager.tree, manager.tree._nodes()
    protected = sum(len(node.blocks) for node in nodes if node.lock_ref > 0)
    assert tree.protected_size == protected, f"protected {tree.protected_size}, locked {protected}"
    assert tree.total_size == sum(len(node.blocks) for node in nodes), "sizes do not add up"
    for node in nodes:
        parent = node.parent
        assert parent is tree.root or parent.lock_ref >= node.lock_ref, "a lock stops midway"
