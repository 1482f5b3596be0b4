"""KeyResidual: where keys quantized per channel wait, in full precision, for their block to fill.

Keys per channel (KIVI) share one scale and one zero per (head, channel) over all the tokens of a
block, so a block's grid is known only once its last slot is written. Until then its keys are
held as they came out of the model, in a *residual*: a small pool of full-precision blocks
``keys [num_layers, num_slots, block_size, kv_heads, head_dim]``, one residual slot per partial
block. When a step writes a block's last slot, the block's tokens (residual rows and new rows)
are quantized per channel into the block's codes and its slot is given back. This is KIVI's
residual with the group size set to the block size; values are quantized per token as they come.

This module is graded (Phase 3): ``plan`` and ``_group_by_block`` are part 3.3, ``apply`` and
``partial_blocks`` part 3.7; ``_take``, ``_give_back`` and ``_tensor`` are given.

Each ``ModelRunner.execute`` calls ``plan(slots)`` with the step's slot of every new token. For
each block the step writes, in order of its slots:

- written from offset 0: a new block; a residual the block still held (its former owner freed
  it partial) is given back first;
- written from a later offset: the block is partial and must hold a residual (else the cache
  lost keys: ``RuntimeError``);
- its last slot written: *filled*, quantized this step (from the residual if it had one, else
  straight from the new keys); its slot stays until the next step, so a step that runs again
  (``LLMEngine`` re-runs a failed batch one sequence at a time) reads the same rows;
- otherwise still *partial*: its new rows go to its residual slot.

``slot_of_block [num_gpu_blocks]`` (int32, -1 where none) tells the attention kernels where the
step's partial blocks are: for such a block they read keys from the residual, for any other from
the codes. Only the step's own partial blocks are set, so a stale slot is never read.

Between steps (``apply``, after the scheduler has moved blocks), given the *partial blocks*:
for each running sequence (GPU) and each swapped one (CPU), the block that holds the partial
tail of its stored tokens (``partial_blocks``):

1. a block swapped out takes its rows to the CPU if it is a swapped sequence's partial block
   (else, filled or stale, its slot is just given back);
2. every slot of a block that is no running sequence's partial block is given back: blocks that
   filled, blocks their owner freed (finished, aborted, preempted by recompute), even when the
   scheduler has already handed them to a new owner that has not written them yet; a copy's
   source keeps its slot until step 3 has copied it;
3. a block swapped in gets its rows back, and a copy-on-write copies its source's rows, if the
   target is a partial block (a target that still held a slot gives it back first); then a
   source that is no partial block gives its slot back;
4. rows kept on the CPU for a block that is no swapped sequence's partial block are dropped.

Slots are given back before any is taken, so in use are at most one per running sequence
between steps, and during a step two (the block it fills and the new partial one, in a chunked
prefill): a pool of ``2 * max_num_seqs`` slots never runs out.
"""

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from vkv.engine.sequence import Sequence
from vkv.engine.upload import upload


@dataclass(slots=True, frozen=True)
class KeyPlan:
    """One step's key writes (tensors on the cache's device).

    ``residual_tokens`` (batch rows) go to ``residual_rows`` (rows of the residual seen as
    ``[num_slots * block_size, kv_heads, head_dim]``); then the ``fill_blocks`` are quantized per
    channel, the first ones from residual slots ``fill_slots``, the rest from the batch rows
    ``fill_tokens [blocks, block_size]``.
    """

    residual_tokens: torch.Tensor
    residual_rows: torch.Tensor
    fill_blocks: torch.Tensor
    fill_slots: torch.Tensor
    fill_tokens: torch.Tensor


@dataclass(slots=True)
class _BlockWrite:
    first: int  # offset of the step's first token in the block
    last: int  # offset of its last
    tokens: list[int]  # the batch rows written to the block, in slot order


class KeyResidual:
    """The residual pool of a CacheEngine whose keys are quantized per channel."""

    def __init__(
        self,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        num_gpu_blocks: int,
        num_slots: int,
        device: torch.device,
    ) -> None:
        self.block_size = block_size
        self.device = device
        size = (num_layers, num_slots, block_size, num_kv_heads, head_dim)
        self.keys = torch.zeros(size, dtype=dtype, device=device)
        self.slot_of_block = torch.full((num_gpu_blocks,), -1, dtype=torch.int32, device=device)
        self.current: KeyPlan | None = None
        self._slots: dict[int, int] = {}  # GPU block -> residual slot
        self._free = list(range(num_slots - 1, -1, -1))
        self._swapped: dict[int, torch.Tensor] = {}  # CPU block -> its residual rows, on the CPU

    @property
    def num_slots(self) -> int:
        return self.keys.shape[1]

    @property
    def num_used(self) -> int:
        return len(self._slots)

    @property
    def gpu_blocks(self) -> set[int]:
        """The GPU blocks whose keys wait in a residual slot."""
        return set(self._slots)

    @property
    def cpu_blocks(self) -> set[int]:
        """The CPU blocks that took residual rows with them when they were swapped out."""
        return set(self._swapped)

    def plan(self, slots: list[int]) -> KeyPlan:
        """The step's key writes for the slots of its tokens (-1: padding), by the rules of the
        module docstring; also ``self.current``.

        Every block written from offset 0 gives back the slot it still held before any slot is
        taken; a block written from a later offset without a slot is a ``RuntimeError`` ("block
        7 is written from offset 2 but holds no key residual: its earlier keys are lost").
        A partial block's new rows go to ``residual_rows`` (row ``slot * block_size + offset``
        of the residual seen as rows); a filled block is a ``fill_blocks`` entry: first the
        blocks filled from a residual slot (with ``fill_slots``, in the same order), then the
        blocks written whole this step (their rows in ``fill_tokens``), each group in the order
        of the blocks' first slots. ``slot_of_block`` is -1 but for the step's partial blocks.
        """
        ### BEGIN SOLUTION part3.3
        writes = self._group_by_block(slots)
        for block, write in writes.items():
            if write.first == 0:
                self._give_back(block)
            elif block not in self._slots:
                raise RuntimeError(
                    f"block {block} is written from offset {write.first} but "
                    "holds no key residual: its earlier keys are lost"
                )
        residual_tokens, residual_rows, partial = [], [], {}
        fill_blocks, fill_slots, new_blocks, fill_tokens = [], [], [], []
        for block, write in writes.items():
            filled = write.last == self.block_size - 1
            if filled and write.first == 0:
                new_blocks.append(block)
                fill_tokens.append(write.tokens)
                continue
            slot = self._slots.get(block)
            if slot is None:
                slot = self._take(block)
            residual_tokens += write.tokens
            start = slot * self.block_size + write.first
            residual_rows += range(start, start + len(write.tokens))
            if filled:
                fill_blocks.append(block)
                fill_slots.append(slot)
            else:
                partial[block] = slot
        self.slot_of_block.fill_(-1)
        if partial:
            self.slot_of_block[self._tensor(list(partial))] = self._tensor(
                list(partial.values()), torch.int32
            )
        self.current = KeyPlan(
            self._tensor(residual_tokens),
            self._tensor(residual_rows),
            self._tensor(fill_blocks + new_blocks),
            self._tensor(fill_slots),
            self._tensor(fill_tokens).view(-1, self.block_size),
        )
        return self.current
        ### END SOLUTION

    def _group_by_block(self, slots: list[int]) -> dict[int, _BlockWrite]:
        """Each block the step writes (slots of -1 skipped), in the order of its first slot:
        the offsets of its first and last written slots and the batch rows written to it."""
        ### BEGIN SOLUTION part3.3
        writes: dict[int, _BlockWrite] = {}
        for token, slot in enumerate(slots):
            if slot < 0:
                continue
            block, offset = divmod(slot, self.block_size)
            write = writes.get(block)
            if write is None:
                writes[block] = _BlockWrite(offset, offset, [token])
            else:
                write.last = offset
                write.tokens.append(token)
        return writes
        ### END SOLUTION

    def _tensor(self, values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
        """``values`` on the residual's device, the host not waiting for the copy (``upload``)."""
        return upload(torch.tensor(values, dtype=dtype), self.device)

    def _take(self, block: int) -> int:
        if not self._free:
            raise RuntimeError(f"all {self.num_slots} key residual slots are in use")
        slot = self._free.pop()
        self._slots[block] = slot
        return slot

    def _give_back(self, block: int) -> None:
        slot = self._slots.pop(block, None)
        if slot is not None:
            self._free.append(slot)

    def apply(
        self,
        swap_out: dict[int, int],
        swap_in: dict[int, int],
        copies: list[tuple[int, int]],
        partial_gpu: set[int],
        partial_cpu: set[int],
    ) -> None:
        """Follow the step's swaps and copies, and give back what no partial block holds; the
        order of the module docstring."""
        ### BEGIN SOLUTION part3.7
        for gpu, cpu in swap_out.items():
            slot = self._slots.get(gpu)
            self._swapped.pop(cpu, None)
            if slot is not None and cpu in partial_cpu:
                self._swapped[cpu] = self.keys[:, slot].to("cpu", copy=True)
        sources = {src for src, _ in copies}
        for block in list(self._slots):
            if block not in partial_gpu and block not in sources:
                self._give_back(block)
        for cpu, gpu in swap_in.items():
            rows = self._swapped.pop(cpu, None)
            if rows is not None and gpu in partial_gpu:
                self._give_back(gpu)
                self.keys[:, self._take(gpu)] = rows.to(self.device)
        for src, dst in copies:
            slot = self._slots.get(src)
            if slot is not None and dst in partial_gpu:
                self._give_back(dst)
                self.keys[:, self._take(dst)] = self.keys[:, slot]
        for block in sources - partial_gpu:
            self._give_back(block)
        for cpu in set(self._swapped) - partial_cpu:
            del self._swapped[cpu]
        ### END SOLUTION


def partial_blocks(seqs: Iterable[Sequence], block_size: int) -> set[int]:
    """For each sequence, the block that holds the partial tail of its stored tokens
    (``num_computed_tokens``; none when they fill whole blocks)."""
    ### BEGIN SOLUTION part3.7
    return {
        seq.block_table[seq.num_computed_tokens // block_size]
        for seq in seqs
        if seq.num_computed_tokens % block_size
    }
    ### END SOLUTION
