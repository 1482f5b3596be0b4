"""PrefixCachingBlockManager: the BlockManager of Phase 1 with a RadixCache (Phase 4, graded).

With prefix caching, a full block whose K/V are computed is recorded in a radix tree under the
tokens it holds (and every token before them), and a new prompt starts from the longest cached
prefix instead of computing it again. This class adds that to the BlockManager; it changes no
rule of Phase 1 for blocks that are not cached.

Parts 4.5-4.9 (``assignment/phase4.md``): caching what a prefill computed (4.5), eviction
through the tree (4.6), allocate with a hit (4.7), free into the tree and fork (4.8), decode and
swap (4.9). With prefix caching off the engine never uses this class.

Hashes: a sequence's block hashes are its own (``seq.block_hashes``), each computed once when the
block is full (``_block_hashes``, given, through part 4.1's ``hash_blocks``) and handed to the
tree, which never hashes.

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
from vkv.engine.radix_cache import (
    HashFunction,
    MatchResult,
    RadixCache,
    TreeNode,
    block_hash,
    hash_blocks,
)
from vkv.engine.sequence import Sequence


class PrefixCachingBlockManager(BlockManager):
    """A BlockManager whose full, computed GPU blocks are shared through a RadixCache.

    The data it owns (given; the tests read it by these names):
    - ``tree``: the RadixCache of the cached blocks;
    - ``hash_function``: the chained hash the sequences' blocks are hashed with (``block_hash``);
    - ``_locked``: seq id -> the tree node its cached path ends at, for every sequence on the GPU
      (the root for one that holds no cached block);
    - ``_num_cached``: seq id -> how many leading blocks of its table are the tree's blocks;
    - ``_unmerged``: seq id -> sequence, for those allocated or swapped in whose computed blocks
      are not all merged into the tree yet (their prefill goes on, or they have not decoded);
    - ``_counted``: the ids of the sequences counted in ``num_query_tokens``/``num_hit_tokens``.
    """

    def __init__(
        self,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int = 0,
        watermark: float = 0.01,
    ) -> None:
        super().__init__(block_size, num_gpu_blocks, num_cpu_blocks, watermark)
        self.tree = RadixCache(block_size)
        self.hash_function: HashFunction = block_hash
        self._locked: dict[int, TreeNode] = {}
        self._num_cached: dict[int, int] = {}
        self._unmerged: dict[int, Sequence] = {}
        self._counted: set[int] = set()
        self.num_query_tokens = 0
        self.num_hit_tokens = 0

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """The sequence's ``block_hashes``, extended to its first ``num_blocks`` full blocks
        (given: ``hash_blocks`` of part 4.1 hashes only the blocks not hashed yet)."""
        return hash_blocks(
            seq.block_hashes, seq.token_ids, self.block_size, num_blocks, self.hash_function
        )

    # -- part 4.5: caching the blocks a prefill computed -------------------------------------

    def _merge_computed(self) -> None:
        """Merge (``_merge``) every unmerged sequence whose computed tokens fill more blocks than
        it has in the tree (``_num_cached``), or whose prefill is done (``seq.is_prefill`` is
        False: the scheduler ends it once every prompt token is computed). Called before every
        admission decision, so a prompt admitted a step after another reuses its blocks."""
        ### BEGIN SOLUTION part4.5
        for seq in list(self._unmerged.values()):
            num_full_blocks = seq.num_computed_tokens // self.block_size
            if num_full_blocks > self._num_cached[seq.seq_id] or not seq.is_prefill:
                self._merge(seq)
        ### END SOLUTION

    def _cache(self, seq: Sequence) -> MatchResult:
        """Insert the sequence's computed full blocks into the tree; return the tree's path for
        them (``MatchResult``: the tree's blocks for those tokens, and the node they end at).

        Blocks the tree did not have become cached: their ``content_hash`` is set to the block's
        hash and ``num_hashed_tokens`` to the tokens up to the end of the block. Where the tree
        had blocks already, its own ones are on the returned path and the sequence's are
        duplicates, left uncached. Only blocks the sequence holds alone can become cached: the
        offer stops before an uncached block another sequence holds too (a fork's, whose other
        holder locks no path to it)."""
        ### BEGIN SOLUTION part4.5
        size = self.block_size
        table = seq.block_table
        num_full_blocks = seq.num_computed_tokens // size
        if num_full_blocks > len(table):
            num_full_blocks = len(table)

        # stop before the first uncached block that another sequence holds too
        num_offered = 0
        while num_offered < num_full_blocks:
            block = self.gpu_allocator.blocks[table[num_offered]]
            if block.content_hash is None and block.ref_count > 1:
                break
            num_offered += 1

        hashes = self._block_hashes(seq, num_offered)
        offered_tokens = seq.token_ids[: num_offered * size]
        self.tree.insert(offered_tokens, table[:num_offered], hashes)

        # walk the tree again to find its blocks for these tokens, and the node they end at
        path_blocks = []
        node = self.tree.root
        index = 0
        while index < num_offered:
            child = self.tree._child(node, offered_tokens, hashes, index)
            if child is None:
                break
            path_blocks.extend(child.blocks)
            index += len(child.blocks)
            node = child

        # our own blocks on the path that have no hash yet are the ones the tree just took
        for position in range(len(path_blocks)):
            block_id = path_blocks[position]
            if block_id != table[position]:
                continue
            block = self.gpu_allocator.blocks[block_id]
            if block.content_hash is None:
                block.content_hash = hashes[position]
                block.num_hashed_tokens = (position + 1) * size
        return MatchResult(path_blocks, node)
        ### END SOLUTION

    def _merge(self, seq: Sequence) -> None:
        """Cache a running sequence's computed blocks (``_cache``) and switch it to the tree's
        copies: a duplicate in its table is replaced by the tree's block (one more holder) and
        freed. It then locks the path's end instead of the node it locked before, and stays
        unmerged while its prefill goes on (``seq.is_prefill``)."""
        ### BEGIN SOLUTION part4.5
        hit = self._cache(seq)
        table = seq.block_table
        for position in range(len(hit.blocks)):
            tree_block_id = hit.blocks[position]
            own_block_id = table[position]
            if tree_block_id == own_block_id:
                continue
            # our block is a duplicate: hold the tree's copy instead and free ours
            self.gpu_allocator.reuse(tree_block_id)
            table[position] = tree_block_id
            self.gpu_allocator.free(self.gpu_allocator.blocks[own_block_id])

        old_node = self._locked.get(seq.seq_id, self.tree.root)
        self.tree.lock(hit.node)
        self.tree.unlock(old_node)
        self._locked[seq.seq_id] = hit.node
        self._num_cached[seq.seq_id] = len(hit.blocks)
        if seq.is_prefill:
            self._unmerged[seq.seq_id] = seq
        else:
            self._unmerged.pop(seq.seq_id, None)
        ### END SOLUTION

    def _release(self, seq: Sequence) -> None:
        """Unlock the sequence's cached path and forget its records (``_locked``,
        ``_num_cached``, ``_unmerged``): it is about to drop or move its GPU blocks. A sequence
        without a record is left as it is."""
        ### BEGIN SOLUTION part4.5
        seq_id = seq.seq_id
        if seq_id not in self._locked:
            return
        node = self._locked.pop(seq_id)
        self.tree.unlock(node)
        self._num_cached.pop(seq_id, None)
        self._unmerged.pop(seq_id, None)
        ### END SOLUTION

    # -- part 4.6: eviction through the tree --------------------------------------------------

    def _make_room(self, num_blocks: int) -> None:
        """Make the free list (the free blocks without content) hold at least ``num_blocks``
        blocks, by evicting the tree's least recently used unlocked leaves (``RadixCache.evict``)
        for what it lacks, and no more. Each evicted block leaves the Evictor, loses its content
        (``content_hash`` None, ``num_hashed_tokens`` 0) and goes to the free list, so the
        allocator never picks a victim of its own. Asking for more than can be made free evicts
        everything evictable (the allocation after it then fails as Phase 1's would)."""
        ### BEGIN SOLUTION part4.6
        free_list_size = self.num_free_gpu_blocks - self.tree.evictable_size
        missing = num_blocks - free_list_size
        if missing <= 0:
            return
        evicted_ids = self.tree.evict(missing)
        for block_id in evicted_ids:
            block = self.gpu_allocator.reuse(block_id)
            block.content_hash = None
            block.num_hashed_tokens = 0
            self.gpu_allocator.free(block)
        ### END SOLUTION

    # -- part 4.7: allocate with a hit -----------------------------------------------------

    def _match(self, seq: Sequence) -> MatchResult:
        """The tree's longest cached prefix of the sequence's tokens (at most ``(num_tokens - 1)
        // block_size`` blocks, never the last token's), once the prefills computed since the
        last admission are merged (``_merge_computed``)."""
        ### BEGIN SOLUTION part4.7
        self._merge_computed()
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(seq, max_blocks)
        return self.tree.match_prefix(seq.token_ids, hashes)
        ### END SOLUTION

    def _need(self, seq: Sequence, hit: MatchResult) -> int:
        """Free GPU blocks the prompt takes: all its blocks but the cached ones in use (a cached
        block in the Evictor is free, and taking it back costs a free block)."""
        ### BEGIN SOLUTION part4.7
        need = seq.num_blocks
        for block_id in hit.blocks:
            if self.gpu_allocator.blocks[block_id].ref_count > 0:
                need -= 1
        return need
        ### END SOLUTION

    def num_cached_tokens(self, seq: Sequence) -> int:
        """Leading tokens of the prompt whose blocks the tree holds (what ``allocate`` reuses)."""
        ### BEGIN SOLUTION part4.7
        hit = self._match(seq)
        return len(hit.blocks) * self.block_size
        ### END SOLUTION

    def can_allocate(self, seq: Sequence) -> AllocStatus:
        """As Phase 1's, but cached blocks that are in use cost nothing: the need is the prompt's
        blocks less those (``_need``). NEVER still compares the whole prompt with the pool; a
        prompt that fits whole is OK without a look at the tree (hits only lower the need)."""
        ### BEGIN SOLUTION part4.7
        whole_status = self._fit_status(seq.num_blocks)
        if whole_status != AllocStatus.LATER:
            return whole_status
        hit = self._match(seq)
        return self._fit_status(self._need(seq, hit))
        ### END SOLUTION

    def allocate(self, seq: Sequence) -> None:
        """Phase 1's ``allocate``, starting from the longest cached prefix (``_match``): its
        blocks are taken back (``BlockAllocator.reuse``) and its path locked, the other blocks
        are new (room made first, ``_make_room``), and ``seq.num_computed_tokens`` is the tokens
        the cached blocks hold. The sequence is recorded (``_locked``, ``_num_cached``,
        ``_unmerged``) and, on its first admission only, counted: ``num_query_tokens`` gains its
        tokens and ``num_hit_tokens`` the cached ones. Phase 1's errors, checked first; the
        ``NoFreeBlocksError`` compares ``_need`` with the free blocks ("sequence 2 needs 2 GPU
        blocks, 1 are free") and changes nothing."""
        ### BEGIN SOLUTION part4.7
        self._require_device(seq, None)
        self._require_block_size(seq)
        hit = self._match(seq)
        need = self._need(seq, hit)
        num_free = self.num_free_gpu_blocks
        if need > num_free:
            raise NoFreeBlocksError(
                f"sequence {seq.seq_id} needs {need} GPU blocks, {num_free} are free"
            )

        table = []
        for block_id in hit.blocks:
            self.gpu_allocator.reuse(block_id)
            table.append(block_id)
        self.tree.lock(hit.node)

        num_new_blocks = seq.num_blocks - len(hit.blocks)
        self._make_room(num_new_blocks)
        for _ in range(num_new_blocks):
            block = self.gpu_allocator.allocate()
            table.append(block.block_id)

        seq.block_table = table
        self._device_of[seq.seq_id] = Device.GPU
        cached_tokens = len(hit.blocks) * self.block_size
        seq.num_computed_tokens = cached_tokens
        self._locked[seq.seq_id] = hit.node
        self._num_cached[seq.seq_id] = len(hit.blocks)
        self._unmerged[seq.seq_id] = seq

        if seq.seq_id not in self._counted:
            self._counted.add(seq.seq_id)
            self.num_query_tokens += seq.num_tokens
            self.num_hit_tokens += cached_tokens
        ### END SOLUTION

    # -- part 4.8: free into the tree, fork ------------------------------------------------

    def free(self, seq: Sequence) -> None:
        """Phase 1's ``free``; a sequence on the GPU first offers its computed full blocks to the
        tree (``_cache``: its duplicates of blocks the tree has are freed as usual, its cached
        blocks go to the Evictor) and gives up its hold (``_release``). A finished sequence
        leaves ``_counted`` (a re-admission after a preemption by recompute is not counted)."""
        ### BEGIN SOLUTION part4.8
        if self.device_of(seq) == Device.GPU:
            self._cache(seq)
            self._release(seq)
        super().free(seq)
        if seq.is_finished:
            self._counted.discard(seq.seq_id)
        ### END SOLUTION

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Phase 1's ``fork``; the parent's computed full blocks are merged first (all of them,
        also those computed since its first decode), and the child locks the parent's cached
        path and takes its ``_num_cached``: every full block the two share is on a path both
        lock (a later write to a shared partial block copies it)."""
        ### BEGIN SOLUTION part4.8
        self._require_device(parent, Device.GPU)
        self._require_device(child, None)
        self._require_block_size(child)
        self._merge(parent)
        super().fork(parent, child)
        node = self._locked[parent.seq_id]
        self.tree.lock(node)
        self._locked[child.seq_id] = node
        self._num_cached[child.seq_id] = self._num_cached[parent.seq_id]
        if parent.seq_id in self._unmerged:
            self._unmerged[child.seq_id] = child
        ### END SOLUTION

    # -- part 4.9: decode (copy-on-write) and swap -----------------------------------------

    def append_slot(self, seq: Sequence) -> tuple[int, int] | None:
        """Phase 1's ``append_slot``; at a sequence's first decode, its computed blocks are merged
        into the tree first (if no admission did it), and a token that needs a block (a new one,
        or a copy of the shared last one) first makes room for it (``_make_room``): a copy on
        write never fails while a cached free block could be evicted."""
        ### BEGIN SOLUTION part4.9
        if seq.seq_id in self._unmerged:
            self._merge(seq)
        if self.device_of(seq) == Device.GPU:
            blocks_needed = self._blocks_to_append(seq)
            if blocks_needed > 0:
                self._make_room(blocks_needed)
        return super().append_slot(seq)
        ### END SOLUTION

    def swap_out(self, seqs: list[Sequence]) -> dict[int, int]:
        """Phase 1's ``swap_out`` (which refuses a group sharing blocks with another sequence,
        ``can_swap_out``); each sequence first gives up its hold on the tree (``_release``):
        its cached blocks stay cached, evictable, and the CPU copies are not cached."""
        ### BEGIN SOLUTION part4.9
        if self.can_swap_out(seqs):
            for seq in seqs:
                self._release(seq)
        return super().swap_out(seqs)
        ### END SOLUTION

    def swap_in(self, seqs: list[Sequence]) -> dict[int, int]:
        """Phase 1's ``swap_in``, after making room for the group's blocks; each sequence comes
        back with no block in the tree (``_num_cached`` 0) and unmerged, so that its next decode
        merges it back onto the tree's blocks."""
        ### BEGIN SOLUTION part4.9
        self._require_group_on(seqs, Device.CPU)
        distinct_blocks = set()
        for seq in seqs:
            for block_id in seq.block_table:
                distinct_blocks.add(block_id)
        self._make_room(len(distinct_blocks))
        mapping = super().swap_in(seqs)
        for seq in seqs:
            self._locked[seq.seq_id] = self.tree.root
            self._num_cached[seq.seq_id] = 0
            self._unmerged[seq.seq_id] = seq
        return mapping
        ### END SOLUTION
