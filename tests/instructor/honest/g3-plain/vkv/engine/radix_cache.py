"""RadixCache: which KV blocks already hold a prompt's prefix (Phase 4, graded).

Prompts share prefixes: a system prompt, few-shot examples, the earlier turns of a chat, the
prompt of n parallel samples. The keys and values of a shared prefix are the same for every
request that has it, so they can be computed once and their blocks shared. This tree records,
for every cached prefix, the blocks that hold it (SGLang's RadixAttention, over whole blocks as
vLLM and nano-vLLM cache them).

A node's *edge* is a run of whole blocks: ``key`` holds its tokens (``len(key)`` a multiple of
``block_size``), ``blocks`` the block ids (one per ``block_size`` tokens) and ``hashes`` one
chained hash per block. A path from the root spells a cached prefix; the root's edge is empty.

Hashes chain: block ``i`` of a prefix hashes its own tokens *and* the hash of block ``i - 1``,
so a hash names the whole prefix up to the end of its block (nano-vLLM's and vLLM's rule):

    block_hash(None, tokens)   = xxh64(tokens)                  the first block
    block_hash(parent, tokens) = xxh64(parent (8 bytes) + tokens)   every later block

with each token as 4 little-endian bytes and the parent hash as 8 little-endian bytes. A child
is found in ``children`` by the hash of its first block. A hash is never trusted alone: the
tokens are compared on every hit, and a collision (same hash, other tokens) is a miss.

The hashes are the sequence's, not the tree's (vLLM v1's ``Request.block_hashes``): a sequence
hashes each of its blocks once, when the block is full (``hash_blocks``), and hands the list to
``match_prefix`` and ``insert``; the tree never hashes. ``block_hashes[i]`` is the chained hash
of block ``i`` of ``token_ids``; a call may pass more hashes than it uses, never fewer.

Operations (``n`` = tokens of the prompt):

- ``hash_blocks(hashes, token_ids, block_size, num_blocks)``: extend a sequence's list of
  block hashes to its first ``num_blocks`` blocks, hashing only the blocks not hashed yet.
- ``match_prefix(token_ids, block_hashes)``: the longest cached prefix of whole blocks, never
  covering the last token (its logits must be computed, so at most ``(n - 1) // block_size``
  blocks). A match that ends inside an edge splits the node there, so that the match ends at a node.
  Returns the matched blocks and that node; every node on its path is *used now*.
- ``insert(token_ids, blocks, block_hashes)``: record that ``blocks`` hold ``token_ids``
  (whole blocks). Returns how many leading blocks were cached already: the tree keeps its own
  blocks for those, and the caller frees its duplicates. The new blocks become a leaf (a node
  split if needed).
- ``lock(node)`` / ``unlock(node)``: a sequence using a path locks its last node; a lock counts
  on every node from there up to the root (not the root itself). A locked node is *protected*,
  an unlocked one *evictable*.
- ``evict(num_blocks)``: remove unlocked leaves, least recently used first, until at least
  ``num_blocks`` blocks are out (or nothing evictable is left); a parent that becomes an unlocked
  leaf can go next. Returns the evicted block ids, in eviction order.

Invariants:

- every node but the root has ``len(key) == block_size * len(blocks) == block_size *
  len(hashes)``, at least one block, and sits in its parent's ``children`` under ``hashes[0]``;
  ``hashes`` chain from the parent's last hash (the root has none);
- a block id is in the tree at most once;
- ``lock_ref`` of a node is the number of locks on it or below it; a locked node's parent is
  locked; ``evictable_size + protected_size`` is the number of blocks in the tree, with
  ``protected_size`` the blocks of locked nodes;
- *used now* stamps a node with the next tick of the cache's clock (``last_access``): a parent
  is never older than its children.

Bad input raises ``ValueError`` and changes nothing: matching an empty prompt, inserting a number
of tokens other than ``block_size * len(blocks)``, unlocking a node that is not locked, evicting
a negative number of blocks.
"""

import heapq
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import xxhash

HashFunction = Callable[[int | None, Sequence[int]], int]


def block_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """The chained hash of one block of ``tokens`` after a prefix whose hash is ``parent``
    (None for the first block): ``xxh64`` (seed 0, ``intdigest``) of the parent as 8
    little-endian bytes, if any, then each token as 4 little-endian bytes."""
    ### BEGIN SOLUTION part4.1
    data = b""
    if parent is not None:
        data += struct.pack("<Q", parent)
    for token in tokens:
        data += struct.pack("<i", token)
    return xxhash.xxh64_intdigest(data)
    ### END SOLUTION


def hash_blocks(
    hashes: list[int],
    token_ids: Sequence[int],
    block_size: int,
    num_blocks: int,
    hash_function: HashFunction = block_hash,
) -> list[int]:
    """Extend ``hashes`` in place to the chained hashes of the first ``num_blocks`` blocks of
    ``token_ids``, and return it. ``hashes`` holds the hashes of the leading blocks hashed so
    far (a sequence's ``block_hashes``, tokens only ever appended): those are kept as they are,
    and each missing block is hashed once with ``hash_function``, from the hash before it. A
    list that already holds ``num_blocks`` hashes or more is returned unchanged. Only full
    blocks are hashed: ``ValueError(f"only full blocks are hashed: {num_blocks} blocks of
    {block_size} need {num_blocks * block_size} tokens, the sequence has {len(token_ids)}")``,
    and no change, when the tokens do not fill ``num_blocks`` blocks."""
    ### BEGIN SOLUTION part4.1
    needed_tokens = num_blocks * block_size
    if len(token_ids) < needed_tokens:
        raise ValueError(
            f"only full blocks are hashed: {num_blocks} blocks of {block_size} "
            f"need {needed_tokens} tokens, the sequence has {len(token_ids)}"
        )
    if len(hashes) >= num_blocks:
        return hashes
    for index in range(len(hashes), num_blocks):
        if index == 0:
            parent = None
        else:
            parent = hashes[index - 1]
        start = index * block_size
        end = start + block_size
        block_tokens = token_ids[start:end]
        hashes.append(hash_function(parent, block_tokens))
    return hashes
    ### END SOLUTION


@dataclass(slots=True, eq=False)
class TreeNode:
    """One edge of the tree and the node it ends at (see the module docstring)."""

    key: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    parent: "TreeNode | None" = None
    children: dict[int, "TreeNode"] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0
    node_id: int = 0

    @property
    def last_hash(self) -> int | None:
        """The hash of the prefix that ends at this node (None at the root)."""
        return self.hashes[-1] if self.hashes else None


@dataclass(slots=True, frozen=True)
class MatchResult:
    """What ``match_prefix`` found: the cached blocks of the prefix, and the node it ends at."""

    blocks: list[int]
    node: TreeNode


class RadixCache:
    """A radix tree of cached block runs; see the module docstring for the rules."""

    def __init__(self, block_size: int) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.block_size = block_size
        self.root = TreeNode()
        self.evictable_size = 0
        self.protected_size = 0
        self._clock = 0
        self._next_node_id = 1

    @property
    def total_size(self) -> int:
        """Blocks in the tree."""
        return self.evictable_size + self.protected_size

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _new_node(self, parent: TreeNode, key: list[int], blocks: list[int], hashes: list[int]):
        """A node under ``parent`` (given: registered in its children, ids in creation order)."""
        node = TreeNode(key, blocks, hashes, parent, node_id=self._next_node_id)
        self._next_node_id += 1
        parent.children[hashes[0]] = node
        return node

    def _tokens(self, token_ids: Sequence[int], first: int, num_blocks: int) -> list[int]:
        """Tokens of ``num_blocks`` blocks of ``token_ids`` from block ``first``, as a list (given:
        the slice of a list is one already, and is not copied a second time)."""
        size = self.block_size
        run = token_ids[first * size : (first + num_blocks) * size]
        return run if isinstance(run, list) else list(run)

    def _child(
        self, node: TreeNode, token_ids: Sequence[int], block_hashes: Sequence[int], index: int
    ) -> TreeNode | None:
        """The child of ``node`` whose edge starts with block ``index`` of ``token_ids``, found
        by that block's hash and tokens compared (a hash collision is a miss); given."""
        child = node.children.get(block_hashes[index])
        if child is None or child.key[: self.block_size] != self._tokens(token_ids, index, 1):
            return None
        return child

    def _shared_blocks(self, node: TreeNode, token_ids: Sequence[int], start: int, limit: int):
        """How many leading blocks of ``node``'s edge equal blocks ``start``, ``start + 1``, ...
        of ``token_ids``, at most ``limit`` (given). Most runs match whole: one comparison of
        the whole run first, block by block only when it differs."""
        size, count = self.block_size, min(limit, len(node.blocks))
        theirs = self._tokens(token_ids, start, count)
        if (node.key if count == len(node.blocks) else node.key[: count * size]) == theirs:
            return count
        shared = 0
        while (
            node.key[shared * size : (shared + 1) * size]
            == theirs[shared * size : (shared + 1) * size]
        ):
            shared += 1
        return shared

    def _touch(self, node: TreeNode) -> None:
        """Stamp ``node`` and its ancestors but the root as used now (given)."""
        now = self._tick()
        while node is not self.root:
            node.last_access = now
            node = node.parent

    def _split(self, node: TreeNode, num_blocks: int) -> TreeNode:
        """Cut ``node``'s edge after its first ``num_blocks`` blocks (``0 < num_blocks <
        len(node.blocks)``): a new node takes that head (key, blocks, hashes) and ``node`` keeps
        the tail, as the new node's only child. The new node takes ``node``'s place in the
        parent's ``children`` and copies its ``lock_ref`` and ``last_access``. Returns it."""
        ### BEGIN SOLUTION part4.2
        size = self.block_size
        parent = node.parent
        head_key = node.key[: num_blocks * size]
        head_blocks = node.blocks[:num_blocks]
        head_hashes = node.hashes[:num_blocks]
        # _new_node puts the head under the same hash as node (hashes[0] is the same)
        head = self._new_node(parent, head_key, head_blocks, head_hashes)
        head.lock_ref = node.lock_ref
        head.last_access = node.last_access
        # node keeps the tail and hangs under the head
        node.key = node.key[num_blocks * size :]
        node.blocks = node.blocks[num_blocks:]
        node.hashes = node.hashes[num_blocks:]
        node.parent = head
        head.children[node.hashes[0]] = node
        return head
        ### END SOLUTION

    def match_prefix(self, token_ids: Sequence[int], block_hashes: Sequence[int]) -> MatchResult:
        """The longest cached prefix of ``token_ids`` in whole blocks, at most ``(len - 1) //
        block_size`` of them, and the node it ends at (a miss: no blocks, the root); splits the
        node a match ends inside. The path is used now: one ``_touch`` of the node the match
        ends at (a split-off tail is not on the path). ``ValueError("cannot match an empty
        prompt")`` for no tokens."""
        ### BEGIN SOLUTION part4.2
        if len(token_ids) == 0:
            raise ValueError("cannot match an empty prompt")
        max_blocks = (len(token_ids) - 1) // self.block_size
        matched_blocks = []
        node = self.root
        index = 0
        while index < max_blocks:
            child = self._child(node, token_ids, block_hashes, index)
            if child is None:
                break
            shared = self._shared_blocks(child, token_ids, index, max_blocks - index)
            if shared < len(child.blocks):
                child = self._split(child, shared)
                matched_blocks.extend(child.blocks)
                node = child
                index += shared
                break
            matched_blocks.extend(child.blocks)
            node = child
            index += shared
        self._touch(node)
        return MatchResult(matched_blocks, node)
        ### END SOLUTION

    def insert(
        self, token_ids: Sequence[int], blocks: Sequence[int], block_hashes: Sequence[int]
    ) -> int:
        """Record that ``blocks`` hold ``token_ids``, whose blocks hash to ``block_hashes``;
        return how many leading blocks were cached already (the caller frees its own copies of
        those). The rest become a new leaf, its ``hashes`` taken from ``block_hashes``, under
        the node where the cached prefix ends (split if it ends inside an edge); if a hash
        collision takes the new leaf's place, nothing more is recorded. The path is used now,
        whatever was recorded: one ``_touch`` of its last node (the new leaf, else the node the
        cached prefix ends at). Checked before anything else: ``ValueError(f"insert takes whole
        blocks: {len(token_ids)} tokens for {len(blocks)} blocks of {block_size}")`` unless
        ``len(token_ids) == block_size * len(blocks)``.
        """
        ### BEGIN SOLUTION part4.3
        size = self.block_size
        num_blocks = len(blocks)
        if len(token_ids) != size * num_blocks:
            raise ValueError(
                f"insert takes whole blocks: {len(token_ids)} tokens "
                f"for {num_blocks} blocks of {size}"
            )
        node = self.root
        index = 0
        while index < num_blocks:
            child = self._child(node, token_ids, block_hashes, index)
            if child is None:
                break
            shared = self._shared_blocks(child, token_ids, index, num_blocks - index)
            if shared < len(child.blocks):
                child = self._split(child, shared)
                node = child
                index += shared
                break
            node = child
            index += shared

        cached_already = index
        if index == num_blocks:
            self._touch(node)
            return cached_already

        new_hashes = list(block_hashes[index:num_blocks])
        if new_hashes[0] in node.children:
            # another edge sits under this hash with other tokens: a collision
            self._touch(node)
            return cached_already

        new_key = self._tokens(token_ids, index, num_blocks - index)
        new_blocks = list(blocks[index:])
        leaf = self._new_node(node, list(new_key), new_blocks, new_hashes)
        self.evictable_size += len(new_blocks)
        self._touch(leaf)
        return cached_already
        ### END SOLUTION

    def lock(self, node: TreeNode) -> None:
        """A sequence uses the path to ``node``: add one to ``lock_ref`` of ``node`` and of
        every ancestor but the root; a node locked for the first time moves its blocks from
        evictable to protected. Locking the root does nothing."""
        ### BEGIN SOLUTION part4.4
        current = node
        while current is not self.root:
            if current.lock_ref == 0:
                self.evictable_size -= len(current.blocks)
                self.protected_size += len(current.blocks)
            current.lock_ref += 1
            current = current.parent
        ### END SOLUTION

    def unlock(self, node: TreeNode) -> None:
        """Undo one ``lock(node)``: the reverse walk; a node whose ``lock_ref`` falls to 0 moves
        its blocks back to evictable. ``ValueError("unlock of a node that is not locked")``, and
        no change, if ``node`` is not locked. Unlocking the root does nothing."""
        ### BEGIN SOLUTION part4.4
        if node is self.root:
            return
        if node.lock_ref <= 0:
            raise ValueError("unlock of a node that is not locked")
        current = node
        while current is not self.root:
            current.lock_ref -= 1
            if current.lock_ref == 0:
                self.protected_size -= len(current.blocks)
                self.evictable_size += len(current.blocks)
            current = current.parent
        ### END SOLUTION

    def evict(self, num_blocks: int) -> list[int]:
        """Remove unlocked leaves, the least recently used first (smallest ``(last_access,
        node_id)``), until at least ``num_blocks`` blocks are out or none is evictable; a
        parent left an unlocked leaf joins the candidates. Returns the evicted block ids, each
        leaf's in edge order. ``ValueError(f"num_blocks must be >= 0, got {num_blocks}")`` for a
        negative ``num_blocks``. A parent joins the candidates with its own ``(last_access,
        node_id)``."""
        ### BEGIN SOLUTION part4.4
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        candidates = []
        for node in self._nodes():
            if len(node.children) == 0 and node.lock_ref == 0:
                heapq.heappush(candidates, (node.last_access, node.node_id, node))
        evicted = []
        while len(evicted) < num_blocks and len(candidates) > 0:
            leaf = heapq.heappop(candidates)[2]
            parent = leaf.parent
            del parent.children[leaf.hashes[0]]
            leaf.parent = None
            self.evictable_size -= len(leaf.blocks)
            evicted.extend(leaf.blocks)
            if parent is not self.root and len(parent.children) == 0 and parent.lock_ref == 0:
                heapq.heappush(candidates, (parent.last_access, parent.node_id, parent))
        return evicted
        ### END SOLUTION

    def _nodes(self) -> list[TreeNode]:
        """Every node but the root (given)."""
        found, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            found.append(node)
            stack.extend(node.children.values())
        return found
