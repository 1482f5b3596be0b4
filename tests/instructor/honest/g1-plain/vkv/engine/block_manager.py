"""BlockManager: gives each sequence the KV blocks it needs, and takes them back.

It owns a GPU pool and a CPU pool (two BlockAllocators) and writes every sequence's
``block_table``. The scheduler asks it three kinds of question:

- admission: ``can_allocate(seq)`` -> OK / LATER / NEVER, then ``allocate(seq)`` for the prompt;
- growth: ``can_append_slot(seq)``, then ``append_slot(seq)`` before each decode step;
- release: ``free(seq)`` when a sequence finishes, is aborted or is preempted by recompute,
  and ``swap_out`` / ``swap_in`` (through the Swapper) when it is preempted by swap.

The watermark. ``watermark_blocks = int(watermark * num_gpu_blocks)`` GPU blocks are kept free
at admission so that running sequences can still grow; without it, admitting a prompt that
takes the last block would force a preemption at the very next decode step.

    can_allocate(seq), with need = seq.num_blocks:
        NEVER  if num_gpu_blocks - need < watermark_blocks   (not even an empty pool can keep
                                                              the watermark free after it)
        OK     if num_free_gpu_blocks - need >= watermark_blocks
        LATER  otherwise                                      (fits once others free blocks)

The swap-in rule. A swapped-out group comes back only if it can also take its next step: its
distinct blocks, plus one block for each sequence whose next ``append_slot`` may take one: its
newest token has no slot yet, or its last block is shared (a copy on write; vLLM v0 reserves
such a lookahead slot too). ``can_swap_in`` answers like admission, for that need:

    can_swap_in(seqs), with need = distinct blocks + sequences with seq.num_blocks > len(table)
                                   or a last block of ref_count > 1:
        NEVER / OK / LATER   exactly as can_allocate, watermark included

For a single sequence the need is ``seq.num_blocks``, what re-admitting it would take after a
recompute: both preemption modes agree on which sequences can never run again. (Without the
lookahead, a sequence that had outgrown the pool would be swapped in, find no block for its
next token, and be swapped out again, forever.)

The append rule. A sequence's blocks always cover all of its tokens, including the newest one,
appended by the previous step and whose K/V the coming step writes. So ``append_slot`` adds a
block exactly when the newest token does not fit in the blocks the sequence holds:

    seq.num_tokens > len(seq.block_table) * block_size    (the token opens a new block)

which, one token at a time, happens when ``(seq.num_tokens - 1) % block_size == 0``. Otherwise
the token goes into the last block; if that block is shared with another sequence (after
``fork``), it is first copied (copy-on-write) and ``append_slot`` returns ``(src, dst)``: the
CacheEngine must copy block ``src`` into block ``dst`` before the step writes to it.

Contract
- A sequence holds blocks on at most one device; ``allocate``, ``fork`` and ``swap_in`` put them
  on the GPU, ``swap_out`` on the CPU, ``free`` releases them and empties ``block_table``.
- Every method that raises leaves all counts and tables as they were.

Invariants
- On each device: free blocks + blocks in use == pool size.
- A block's ``ref_count`` equals the number of sequences whose table holds it.
- A sequence that was freed holds nothing.
"""

from collections.abc import Callable
from enum import Enum, auto

from vkv.engine.block import BlockAllocator, Device, NoFreeBlocksError
from vkv.engine.sequence import Sequence
from vkv.engine.swapper import Swapper


class AllocStatus(Enum):
    """The answer to "can this prompt get its blocks?" (vLLM's names)."""

    OK = auto()  # now
    LATER = auto()  # not now, once running sequences free blocks
    NEVER = auto()  # not even in an empty pool: the request must be rejected


class BlockManager:
    """Maps sequences to physical blocks in a GPU pool and a CPU (swap) pool.

    Attributes set by the constructor (the tests and the scheduler use these names):
    - ``block_size``: tokens per block; every sequence it serves must have the same.
    - ``watermark_blocks``: ``int(watermark * num_gpu_blocks)``.
    - ``gpu_allocator``, ``cpu_allocator``: ``BlockAllocator(Device.GPU, num_gpu_blocks)`` and
      ``BlockAllocator(Device.CPU, num_cpu_blocks)``.
    - ``swapper``: ``Swapper(gpu_allocator, cpu_allocator, watermark_blocks)`` (part 1.4).
    - ``_device_of``: sequence id -> the Device holding its blocks, for sequences holding any.

    By default there is no CPU pool (``num_cpu_blocks = 0``: nothing can be swapped out) and the
    watermark is 1 % of the GPU pool (``watermark = 0.01``).

    Raises ``ValueError`` for a block size that is not a positive integer (``True`` and ``2.0``
    are not), a GPU pool below 1, a negative CPU pool (``BlockAllocator``'s error), or a
    watermark outside ``[0, 1)``. The message names the argument and its value; for
    ``block_size = 0``, ``num_gpu_blocks = 0`` and ``watermark = 1.0`` it is
    "block_size must be a positive integer, got 0",
    "num_gpu_blocks must be >= 1, got 0",
    "watermark must be in [0, 1), got 1.0".
    """

    # Prompt tokens looked up in a prefix cache and found there, so far (given: prefix caching,
    # Phase 4, counts them; the metrics of Phase 5 read them).
    num_query_tokens = 0
    num_hit_tokens = 0

    def __init__(
        self,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int = 0,
        watermark: float = 0.01,
    ) -> None:
        ### BEGIN SOLUTION part1.3
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        if num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be >= 1, got {num_gpu_blocks}")
        if watermark < 0 or watermark >= 1:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.block_size = block_size
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.gpu_allocator = BlockAllocator(Device.GPU, num_gpu_blocks)
        self.cpu_allocator = BlockAllocator(Device.CPU, num_cpu_blocks)
        self.swapper = Swapper(self.gpu_allocator, self.cpu_allocator, self.watermark_blocks)
        self._device_of = {}
        ### END SOLUTION

    @property
    def num_gpu_blocks(self) -> int:
        """The size of the GPU pool."""
        ### BEGIN SOLUTION part1.3
        return self.gpu_allocator.num_blocks
        ### END SOLUTION

    @property
    def num_free_gpu_blocks(self) -> int:
        """GPU blocks that can be allocated now."""
        ### BEGIN SOLUTION part1.3
        return self.gpu_allocator.num_free_blocks
        ### END SOLUTION

    @property
    def num_free_cpu_blocks(self) -> int:
        """CPU blocks that can be allocated now."""
        ### BEGIN SOLUTION part1.3
        return self.cpu_allocator.num_free_blocks
        ### END SOLUTION

    @property
    def gpu_usage(self) -> float:
        """Fraction of the GPU pool in use, in [0, 1]."""
        ### BEGIN SOLUTION part1.3
        total = self.gpu_allocator.num_blocks
        used = total - self.gpu_allocator.num_free_blocks
        return used / total
        ### END SOLUTION

    @property
    def cpu_usage(self) -> float:
        """Fraction of the CPU pool in use, in [0, 1] (0 for an empty pool)."""
        ### BEGIN SOLUTION part1.3
        total = self.cpu_allocator.num_blocks
        if total == 0:
            return 0.0
        used = total - self.cpu_allocator.num_free_blocks
        return used / total
        ### END SOLUTION

    def device_of(self, seq: Sequence) -> Device | None:
        """The device that holds the sequence's blocks, or None if it holds none."""
        ### BEGIN SOLUTION part1.3
        return self._device_of.get(seq.seq_id)
        ### END SOLUTION

    def num_cached_tokens(self, seq: Sequence) -> int:
        """Leading prompt tokens whose K/V a prefix cache already holds, which ``allocate``
        reuses instead of new blocks (given: 0 here; prefix caching, Phase 4, overrides it)."""
        return 0

    def can_allocate(self, seq: Sequence) -> AllocStatus:
        """Whether the prompt's blocks fit now, later or never (see the module docstring)."""
        ### BEGIN SOLUTION part1.3
        return self._fit_status(seq.num_blocks)
        ### END SOLUTION

    def _fit_status(self, need: int) -> AllocStatus:
        """NEVER, OK or LATER for ``need`` more GPU blocks, the watermark kept free."""
        ### BEGIN SOLUTION part1.3
        if self.num_gpu_blocks - need < self.watermark_blocks:
            return AllocStatus.NEVER
        if self.num_free_gpu_blocks - need >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER
        ### END SOLUTION

    def allocate(self, seq: Sequence) -> None:
        """Give a sequence that holds no blocks ``seq.num_blocks`` new GPU blocks.

        Raises ``ValueError`` if it already holds blocks (``_require_device``) or if its block
        size is not the manager's (``_require_block_size``), and ``NoFreeBlocksError`` if the
        free GPU blocks are too few (the watermark is ``can_allocate``'s business, not this
        one's). That message names the sequence, its need and the free blocks; for sequence 2
        of 2 blocks with 1 free it is "sequence 2 needs 2 GPU blocks, 1 are free".
        """
        ### BEGIN SOLUTION part1.3
        self._require_block_size(seq)
        self._require_device(seq, None)
        need = seq.num_blocks
        num_free = self.num_free_gpu_blocks
        if need > num_free:
            raise NoFreeBlocksError(f"sequence {seq.seq_id} needs {need} GPU blocks, {num_free} are free")
        block_table = []
        for _ in range(need):
            block = self.gpu_allocator.allocate()
            block_table.append(block.block_id)
        seq.block_table = block_table
        self._device_of[seq.seq_id] = Device.GPU
        ### END SOLUTION

    def can_append_slot(self, seq: Sequence) -> bool:
        """Whether ``append_slot(seq)`` would find the block it may need (no watermark here)."""
        ### BEGIN SOLUTION part1.3
        self._require_device(seq, Device.GPU)
        need = self._blocks_to_append(seq)
        return self.num_free_gpu_blocks >= need
        ### END SOLUTION

    def append_slot(self, seq: Sequence) -> tuple[int, int] | None:
        """Make room for the sequence's newest token (the append rule in the module docstring).

        Returns ``(src, dst)`` when the shared last block was copied on write, else None.
        Raises ``ValueError`` if the sequence is not on the GPU (``_require_device``) or is more
        than one token past its blocks (``_blocks_to_append``), and ``NoFreeBlocksError`` if a
        block is needed and none is free; for sequence 1 that message is
        "sequence 1 needs a GPU block and none is free".
        """
        ### BEGIN SOLUTION part1.3
        self._require_device(seq, Device.GPU)
        need = self._blocks_to_append(seq)
        if need == 0:
            return None
        if self.num_free_gpu_blocks < need:
            raise NoFreeBlocksError(f"sequence {seq.seq_id} needs a GPU block and none is free")
        capacity = len(seq.block_table) * self.block_size
        if seq.num_tokens > capacity:
            # the newest token opens a new block
            new_block = self.gpu_allocator.allocate()
            seq.block_table.append(new_block.block_id)
            return None
        # the last block is shared: copy it before writing (copy-on-write)
        old_block = self.gpu_allocator.blocks[seq.block_table[-1]]
        new_block = self.gpu_allocator.allocate()
        self.gpu_allocator.free(old_block)
        seq.block_table[-1] = new_block.block_id
        return (old_block.block_id, new_block.block_id)
        ### END SOLUTION

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let ``child`` share all of ``parent``'s GPU blocks (no copy, no new block).

        Raises ``ValueError`` if the parent is not on the GPU, the child already holds blocks, or
        the child's block size is not the manager's.
        """
        ### BEGIN SOLUTION part1.3
        self._require_block_size(child)
        self._require_device(parent, Device.GPU)
        self._require_device(child, None)
        for block_id in parent.block_table:
            self.gpu_allocator.share(self.gpu_allocator.blocks[block_id])
        child.block_table = list(parent.block_table)
        self._device_of[child.seq_id] = Device.GPU
        ### END SOLUTION

    def free(self, seq: Sequence) -> None:
        """Release every block the sequence holds; empty its table.

        Raises ``ValueError`` if the sequence holds no blocks (never allocated, or freed twice);
        for sequence 5 the message is
        "free: sequence 5 holds no blocks (never allocated, or already freed)".
        """
        ### BEGIN SOLUTION part1.3
        device = self._device_of.get(seq.seq_id)
        if device is None:
            raise ValueError(
                f"free: sequence {seq.seq_id} holds no blocks (never allocated, or already freed)"
            )
        if device == Device.GPU:
            allocator = self.gpu_allocator
        else:
            allocator = self.cpu_allocator
        for block_id in reversed(seq.block_table):
            allocator.free(allocator.blocks[block_id])
        seq.block_table = []
        del self._device_of[seq.seq_id]
        ### END SOLUTION

    def get_block_table(self, seq: Sequence) -> list[int]:
        """A copy of the sequence's block table (empty if it holds no blocks)."""
        ### BEGIN SOLUTION part1.3
        if self.device_of(seq) is None:
            return []
        return list(seq.block_table)
        ### END SOLUTION

    def get_slot_mapping(self, seq: Sequence, start: int, end: int) -> list[int]:
        """The physical slot of each token position in ``[start, end)``.

        ``slot = block_table[pos // block_size] * block_size + pos % block_size``. Raises
        ``ValueError`` unless the sequence is on the GPU (``_require_device``),
        ``0 <= start <= end <= num_tokens`` and its blocks cover ``end`` (a token appended but
        not yet given a slot has none). The range error names the range, the positions that
        have slots, the sequence and its tokens; for ``[0, 11)`` of sequence 1, of 10 tokens:
        "slot range [0, 11) is outside the 10 positions sequence 1 has slots for (10 tokens)".
        """
        ### BEGIN SOLUTION part1.3
        self._require_device(seq, Device.GPU)
        num_with_slots = min(seq.num_tokens, len(seq.block_table) * self.block_size)
        if start < 0 or start > end or end > num_with_slots:
            raise ValueError(
                f"slot range [{start}, {end}) is outside the {num_with_slots} positions "
                f"sequence {seq.seq_id} has slots for ({seq.num_tokens} tokens)"
            )
        slots = []
        for pos in range(start, end):
            block_id = seq.block_table[pos // self.block_size]
            slots.append(block_id * self.block_size + pos % self.block_size)
        return slots
        ### END SOLUTION

    def can_swap_out(self, seqs: list[Sequence]) -> bool:
        """Whether the group can move to the CPU pool: no sequence outside it holds one of its
        blocks (``Swapper.holds_alone``; a swap moves shared blocks with all their holders, or
        not at all), and its GPU blocks fit in the free CPU blocks.

        Raises ``ValueError`` unless the group is non-empty, lists no sequence twice and is on
        the GPU (``_require_group_on``, whose docstring gives the messages; so do ``swap_out``,
        ``can_swap_in`` and ``swap_in``).
        """
        ### BEGIN SOLUTION part1.4
        self._require_group_on(seqs, Device.GPU)
        if not self.swapper.holds_alone(seqs):
            return False
        return self.swapper.can_swap_out(seqs)
        ### END SOLUTION

    def swap_out(self, seqs: list[Sequence]) -> dict[int, int]:
        """Move the group to the CPU pool; return ``{gpu_block_id: cpu_block_id}`` (see Swapper)."""
        ### BEGIN SOLUTION part1.4
        return self._swap(seqs, Device.GPU, Device.CPU, self.swapper.swap_out)
        ### END SOLUTION

    def can_swap_in(self, seqs: list[Sequence]) -> AllocStatus:
        """Whether the group fits back on the GPU now, later or never (the swap-in rule above).

        Raises ``ValueError`` unless the group is non-empty, lists no sequence twice and is on
        the CPU.
        """
        ### BEGIN SOLUTION part1.4
        self._require_group_on(seqs, Device.CPU)
        need = self.swapper.num_blocks(seqs)
        for seq in seqs:
            if seq.num_blocks > len(seq.block_table):
                # the newest token has no slot yet
                need += 1
            else:
                last_block = self.cpu_allocator.blocks[seq.block_table[-1]]
                if last_block.ref_count > 1:
                    # writing the newest token will copy the shared block first
                    need += 1
        return self._fit_status(need)
        ### END SOLUTION

    def swap_in(self, seqs: list[Sequence]) -> dict[int, int]:
        """Move the group back to the GPU pool; return ``{cpu_block_id: gpu_block_id}``."""
        ### BEGIN SOLUTION part1.4
        return self._swap(seqs, Device.CPU, Device.GPU, self.swapper.swap_in)
        ### END SOLUTION

    def _swap(
        self,
        seqs: list[Sequence],
        src: Device,
        dst: Device,
        move: Callable[[list[Sequence]], dict[int, int]],
    ) -> dict[int, int]:
        """Check the group is on ``src``, let the Swapper ``move`` it, record it on ``dst``."""
        ### BEGIN SOLUTION part1.4
        self._require_group_on(seqs, src)
        mapping = move(seqs)
        for seq in seqs:
            self._device_of[seq.seq_id] = dst
        return mapping
        ### END SOLUTION

    def _require_group_on(self, seqs: list[Sequence], device: Device) -> None:
        """Raise ``ValueError`` unless the group is non-empty, has no repeats, is on ``device``.

        The messages: "a swap needs at least one sequence" for an empty group,
        "a swap group lists a sequence twice" for a repeat, and ``_require_device``'s for a
        sequence that is not on ``device``.
        """
        ### BEGIN SOLUTION part1.4
        if len(seqs) == 0:
            raise ValueError("a swap needs at least one sequence")
        seen_ids = set()
        for seq in seqs:
            if seq.seq_id in seen_ids:
                raise ValueError("a swap group lists a sequence twice")
            seen_ids.add(seq.seq_id)
        for seq in seqs:
            self._require_device(seq, device)
        ### END SOLUTION

    def _require_device(self, seq: Sequence, device: Device | None) -> None:
        """Raise ``ValueError`` unless the sequence's blocks are on ``device`` (None: no blocks).

        The message names the sequence, where its blocks are and where the operation needs
        them, each as "no blocks" or "its blocks on the gpu" (or "cpu"); for sequence 1:
        "sequence 1 has no blocks; this operation needs its blocks on the gpu",
        "sequence 1 has its blocks on the gpu; this operation needs no blocks",
        "sequence 1 has its blocks on the gpu; this operation needs its blocks on the cpu".
        """
        ### BEGIN SOLUTION part1.3
        actual = self._device_of.get(seq.seq_id)
        if actual == device:
            return

        def describe(where):
            if where is None:
                return "no blocks"
            return f"its blocks on the {where.value}"

        raise ValueError(
            f"sequence {seq.seq_id} has {describe(actual)}; this operation needs {describe(device)}"
        )
        ### END SOLUTION

    def _require_block_size(self, seq: Sequence) -> None:
        """Raise ``ValueError`` unless the sequence's block size is the manager's.

        The message says ``block size`` (the tests look for these words).
        """
        ### BEGIN SOLUTION part1.3
        if seq.block_size != self.block_size:
            raise ValueError(
                f"sequence {seq.seq_id} has block size {seq.block_size}, "
                f"but the block manager uses block size {self.block_size}"
            )
        ### END SOLUTION

    def _blocks_to_append(self, seq: Sequence) -> int:
        """GPU blocks ``append_slot`` would allocate: 1 for a new or copied block, else 0.

        Raises ``ValueError`` for a sequence more than one token past its blocks; the message
        names the sequence, its tokens and the tokens its blocks hold; for sequence 1, of 4
        tokens in blocks for 2:
        "sequence 1 has 4 tokens but blocks for 2: append_slot must follow every appended token".
        """
        ### BEGIN SOLUTION part1.3
        capacity = len(seq.block_table) * self.block_size
        if seq.num_tokens > capacity + 1:
            raise ValueError(
                f"sequence {seq.seq_id} has {seq.num_tokens} tokens but blocks for {capacity}: "
                f"append_slot must follow every appended token"
            )
        if seq.num_tokens > capacity:
            return 1
        last_block = self.gpu_allocator.blocks[seq.block_table[-1]]
        if last_block.ref_count > 1:
            return 1
        return 0
        ### END SOLUTION
