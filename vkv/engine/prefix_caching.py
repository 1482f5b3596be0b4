"""PrefixCachingBlockManager: the BlockManager of Phase 1 with a RadixCache of Phase 4 (given).

With prefix caching, a full block whose K/V are computed is recorded in a radix tree under the
tokens it holds (and every token before them), and a new prompt starts from the longest cached
prefix instead of computing it again. This class adds that to the BlockManager; it changes no
rule of Phase 1 for blocks that are not cached.

Which blocks are cached, and when:

- a block enters the tree once it is full and computed: the blocks a prefill (or a chunk of
  one) computed, before the next admission is decided (``can_allocate``, ``num_cached_tokens``
  and ``allocate`` first merge the sequences whose prefill computed more since they were
  allocated or swapped in) or at the sequence's first decode (``append_slot``), whichever
  comes first, so a prompt admitted one step after another reuses its blocks; the blocks its
  decodes fill, when the sequence is freed (finished, aborted, preempted by recompute). If the
  tree already has blocks for that prefix (another sequence computed the same prompt in the
  same step), the sequence switches to the tree's blocks and frees its own copies: identical
  prompts admitted together share their blocks from the next step on (the "late merge" of
  nano-vLLM's issue 219);
- ``allocate`` reuses the blocks of the longest cached prefix (never the last prompt token's:
  its logits are needed) and sets ``seq.num_computed_tokens`` to the tokens they hold, so the
  prefill computes only the rest; ``num_cached_tokens(seq)`` tells the scheduler that number
  beforehand, to charge its token budget only for the rest;
- ``fork(parent, child)``: the child shares the parent's cached path and its other blocks;
- a swap: a group whose GPU blocks another sequence also holds cannot be swapped out
  (Phase 1's ``can_swap_out`` is False: a swap moves only blocks the group holds alone), so
  the scheduler preempts it by recompute, which costs only its unshared blocks: the shared ones
  stay cached and its re-admission hits them. A group that holds its blocks alone is swapped
  out as before and releases its hold on the tree (its cached blocks stay cached, evictable; the
  CPU copies are not cached); after ``swap_in`` its fresh GPU blocks are merged at its next
  decode like a prefill's, so it goes back to sharing the tree's blocks.

Holding and eviction. A sequence holding cached blocks locks the tree node its cached path ends
at (``RadixCache.lock``), so a cached block is locked exactly while some sequence holds it. When
its last holder frees it, the block keeps its content hash and goes to the Phase 1 Evictor: it
still counts as free (``num_free_gpu_blocks``) and a later prompt with the prefix can take it
back (``BlockAllocator.reuse``). Which cached block is given up when new blocks are needed is
the tree's choice: before any allocation, ``_make_room`` evicts the least recently used unlocked
leaves (``RadixCache.evict``) for what the free list lacks, and their blocks return to the free
list without content. So the allocator never picks a victim itself, and the tree never points at
a reused block.

Invariants (``check_prefix_cache`` in the tests asserts them after every step):
- every block in the tree is a GPU block whose ``content_hash`` is its tree hash; no other block
  has one;
- a block of a locked node is in use; a block of an unlocked node is free, in the Evictor:
  ``len(evictor) == tree.evictable_size``;
- every cached block a sequence holds lies on the path of the node that sequence locked.

Stats: ``num_query_tokens`` and ``num_hit_tokens`` count the prompt tokens of first admissions
and the part of them served from the cache; a re-admission after a preemption by recompute is
not counted (its "hits" are its own blocks, vLLM's issue 25780).
"""

from vkv.engine.block import Device, NoFreeBlocksError
from vkv.engine.block_manager import AllocStatus, BlockManager
from vkv.engine.radix_cache import MatchResult, RadixCache, TreeNode
from vkv.engine.sequence import Sequence


class PrefixCachingBlockManager(BlockManager):
    """A BlockManager whose full, computed GPU blocks are shared through a RadixCache."""

    def __init__(
        self,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int = 0,
        watermark: float = 0.01,
    ) -> None:
        super().__init__(block_size, num_gpu_blocks, num_cpu_blocks, watermark)
        self.tree = RadixCache(block_size)
        self._locked: dict[int, TreeNode] = {}  # seq id -> the node of its cached path
        self._num_cached: dict[int, int] = {}  # seq id -> leading table blocks in the tree
        self._unmerged: dict[int, Sequence] = {}  # allocated or swapped in, prefill not merged
        self._counted: set[int] = set()  # sequences counted in the hit stats
        self.num_query_tokens = 0
        self.num_hit_tokens = 0

    def num_cached_tokens(self, seq: Sequence) -> int:
        """Leading tokens of the prompt whose blocks the tree holds (what ``allocate`` reuses)."""
        return len(self._match(seq).blocks) * self.block_size

    def can_allocate(self, seq: Sequence) -> AllocStatus:
        """As Phase 1's, but cached blocks that are in use cost nothing: the need is the prompt's
        blocks less those. NEVER still compares the whole prompt with the pool; a prompt that
        fits whole is OK without a look at the tree (hits only lower the need)."""
        status = self._fit_status(seq.num_blocks)
        if status is not AllocStatus.LATER:
            return status
        return self._fit_status(self._need(seq, self._match(seq)))

    def allocate(self, seq: Sequence) -> None:
        """Phase 1's ``allocate``, starting from the longest cached prefix (see the module doc)."""
        self._require_device(seq, None)
        self._require_block_size(seq)
        hit = self._match(seq)
        need = self._need(seq, hit)
        if need > self.num_free_gpu_blocks:
            raise NoFreeBlocksError(
                f"sequence {seq.seq_id} needs {need} GPU blocks, "
                f"{self.num_free_gpu_blocks} are free"
            )
        for block_id in hit.blocks:
            self.gpu_allocator.reuse(block_id)
        self.tree.lock(hit.node)
        num_new = seq.num_blocks - len(hit.blocks)
        self._make_room(num_new)
        new_blocks = [self.gpu_allocator.allocate().block_id for _ in range(num_new)]
        seq.block_table = hit.blocks + new_blocks
        self._device_of[seq.seq_id] = Device.GPU
        self._locked[seq.seq_id] = hit.node
        self._num_cached[seq.seq_id] = len(hit.blocks)
        self._unmerged[seq.seq_id] = seq
        seq.num_computed_tokens = len(hit.blocks) * self.block_size
        if seq.seq_id not in self._counted:
            self._counted.add(seq.seq_id)
            self.num_query_tokens += seq.num_tokens
            self.num_hit_tokens += seq.num_computed_tokens

    def append_slot(self, seq: Sequence) -> tuple[int, int] | None:
        """Phase 1's ``append_slot``; at a sequence's first decode, its computed blocks are merged
        into the tree first (if no admission did it), and a token that needs a block (a new one,
        or a copy of the shared last one) first makes room for it."""
        if self._device_of.get(seq.seq_id) is not self.gpu_allocator.device:  # as Phase 1's
            self._require_device(seq, Device.GPU)  # raises: its blocks are not on the GPU
        if seq.seq_id in self._unmerged:
            self._merge(seq)
        table = seq.block_table
        last = self.gpu_allocator.blocks[table[-1]]
        if seq.num_tokens <= len(table) * self.block_size and last.ref_count == 1:
            return None  # Phase 1's common case, checked here as there: nothing to allocate
        self._make_room(self._blocks_to_append(seq))
        return super().append_slot(seq)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Phase 1's ``fork``; the parent's computed full blocks are merged first (all of them,
        also those computed since its first decode), and the child locks the parent's cached
        path: every full block the two share is on a path both lock (a later write to a shared
        partial block copies it)."""
        self._require_device(parent, Device.GPU)
        self._require_device(child, None)
        self._require_block_size(child)
        self._merge(parent)
        super().fork(parent, child)
        node = self._locked[parent.seq_id]
        self.tree.lock(node)
        self._locked[child.seq_id] = node
        self._num_cached[child.seq_id] = self._num_cached[parent.seq_id]

    def free(self, seq: Sequence) -> None:
        """Phase 1's ``free``; a sequence on the GPU first offers its computed full blocks to the
        tree (its duplicates of blocks the tree has are freed as usual)."""
        if self._device_of.get(seq.seq_id) is Device.GPU:
            self._cache(seq)
            self._release(seq)
        super().free(seq)
        if seq.is_finished:
            self._counted.discard(seq.seq_id)

    def swap_out(self, seqs: list[Sequence]) -> dict[int, int]:
        """Phase 1's ``swap_out``; each sequence first gives up its hold on the tree."""
        self._require_group_on(seqs, Device.GPU)
        for seq in seqs:
            self._release(seq)
        return super().swap_out(seqs)

    def swap_in(self, seqs: list[Sequence]) -> dict[int, int]:
        """Phase 1's ``swap_in``, after making room for the group's blocks."""
        self._require_group_on(seqs, Device.CPU)
        self._make_room(self.swapper.num_blocks(seqs))
        mapping = super().swap_in(seqs)
        for seq in seqs:
            self._num_cached[seq.seq_id] = 0
            self._unmerged[seq.seq_id] = seq
        return mapping

    def _match(self, seq: Sequence) -> MatchResult:
        """The tree's longest cached prefix of the sequence's tokens, once the prefills computed
        since the last admission are in the tree (``_merge_computed``)."""
        self._merge_computed()
        return self.tree.match_prefix(seq.token_ids)

    def _merge_computed(self) -> None:
        """Merge every unmerged sequence whose prefill computed a full block more, or all."""
        for seq in list(self._unmerged.values()):
            full = seq.num_computed_tokens // self.block_size
            if full > self._num_cached[seq.seq_id] or seq.num_computed_tokens >= seq.num_tokens - 1:
                self._merge(seq)

    def _need(self, seq: Sequence, hit: MatchResult) -> int:
        """Free GPU blocks the prompt takes: all its blocks but the cached ones in use."""
        in_use = sum(self.gpu_allocator.blocks[block_id].ref_count > 0 for block_id in hit.blocks)
        return seq.num_blocks - in_use

    def _make_room(self, num_blocks: int) -> None:
        """Evict cached blocks (the tree's LRU leaves) until the free list holds ``num_blocks``."""
        uncached_free = self.num_free_gpu_blocks - self.tree.evictable_size
        if num_blocks <= uncached_free:
            return
        for block_id in self.tree.evict(num_blocks - uncached_free):
            block = self.gpu_allocator.reuse(block_id)
            block.content_hash, block.num_hashed_tokens = None, 0
            self.gpu_allocator.free(block)

    def _cache(self, seq: Sequence) -> MatchResult:
        """Insert the sequence's computed full blocks; return the tree's path for them.

        Blocks the tree did not have become cached (their content hash is set); where it had
        blocks already, its own ones are on the returned path and the sequence's are duplicates.
        Only blocks the sequence holds alone can become cached: the offer stops before an
        uncached block another sequence holds too (a fork's, whose holder locks no path to it).
        """
        blocks, num_blocks = self.gpu_allocator.blocks, seq.num_computed_tokens // self.block_size
        for index, block_id in enumerate(seq.block_table[:num_blocks]):
            if blocks[block_id].ref_count > 1 and blocks[block_id].content_hash is None:
                num_blocks = index
                break
        tokens = seq.token_ids[: num_blocks * self.block_size]
        self.tree.insert(tokens, seq.block_table[:num_blocks])
        path = self.tree.match_prefix([*tokens, 0])  # one more token: the match may take all
        hashes = _path_hashes(path.node)
        for index, block_id in enumerate(path.blocks):
            block = blocks[block_id]
            if block_id == seq.block_table[index] and block.content_hash is None:
                block.content_hash = hashes[index]
                block.num_hashed_tokens = (index + 1) * self.block_size
        return path

    def _merge(self, seq: Sequence) -> None:
        """Cache a running sequence's computed blocks and switch it to the tree's copies."""
        path = self._cache(seq)
        for index, block_id in enumerate(path.blocks):
            own = seq.block_table[index]
            if own != block_id:
                self.gpu_allocator.reuse(block_id)
                self.gpu_allocator.free(self.gpu_allocator.blocks[own])
                seq.block_table[index] = block_id
        self.tree.lock(path.node)
        self._release(seq)
        self._locked[seq.seq_id] = path.node
        self._num_cached[seq.seq_id] = len(path.blocks)
        if seq.num_computed_tokens < seq.num_tokens - 1:  # its prefill goes on
            self._unmerged[seq.seq_id] = seq

    def _release(self, seq: Sequence) -> None:
        """Unlock the sequence's cached path (it is about to drop or move its GPU blocks)."""
        self.tree.unlock(self._locked.pop(seq.seq_id, self.tree.root))
        self._num_cached.pop(seq.seq_id, None)
        self._unmerged.pop(seq.seq_id, None)


def _path_hashes(node: TreeNode) -> list[int]:
    """The chained hash of every block from the root down to ``node``."""
    hashes: list[int] = []
    while node.parent is not None:
        hashes[:0] = node.hashes
        node = node.parent
    return hashes
