"""The invariants of ``PrefixCachingBlockManager`` (its module docstring), checked whole."""

from radix_trees import cached_blocks

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
    tree, where = manager.tree, cached_blocks(manager)
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
