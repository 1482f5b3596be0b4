"""What a scheduler holds between steps, and the given helpers that read it.

``Scheduler`` (``scheduler.py``) is this state plus the policy you write. The state: the block
manager (prefix-caching or not, as the config says), the three queues (``waiting``, ``running``,
``swapped``: see ``scheduler.py``), every unfinished sequence by id, and the preemption count.
The helpers answer questions about groups (the parallel samples of one request, kept next to
each other in every queue: ``scheduler._by_arrival``) and about what a budget has room for.
"""

from collections import deque

from vkv.config import Config
from vkv.engine.block_manager import BlockManager
from vkv.engine.prefix_caching import PrefixCachingBlockManager
from vkv.engine.scheduler_output import ScheduledSequence, SchedulingBudget
from vkv.engine.sequence import Sequence


class SchedulerState:
    """A scheduler's queues and block manager; ``Scheduler`` adds the policy."""

    def __init__(self, config: Config) -> None:
        self.config = config
        manager = PrefixCachingBlockManager if config.enable_prefix_caching else BlockManager
        self.block_manager = manager(
            config.block_size, config.num_gpu_blocks, config.num_cpu_blocks, config.watermark
        )
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self._unfinished: dict[int, Sequence] = {}
        # Sequence id -> its decode's item, ``ScheduledSequence(seq, 1, False)``: the same every
        # step, so the reference ``_schedule_running`` makes it once (building one per decode was
        # a fifth of the loop's time); ``_finish`` forgets it. Your code may leave this empty.
        self._decodes: dict[int, ScheduledSequence] = {}
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def is_finished(self) -> bool:
        return self.num_unfinished == 0

    @staticmethod
    def _seats(seq: Sequence) -> int:
        """Sequence places an admission takes: ``sampling_params.n`` for a request that has not
        sampled yet (it is forked into n samples once its prompt is computed), else 1 (given)."""
        return seq.sampling_params.n if seq.num_completion_tokens == 0 else 1

    @staticmethod
    def _pop_newest_group(queue: deque[Sequence]) -> list[Sequence]:
        """Take the newest sequence from the back of ``queue``, and the members of its group
        before it; return them in arrival order (given)."""
        group = [queue.pop()]
        while queue and queue[-1].group_id == group[0].group_id:
            group.insert(0, queue.pop())
        return group

    @staticmethod
    def _front_group(seqs: list[Sequence]) -> list[Sequence]:
        """The first sequence of ``seqs`` and the members of its group right after it (given)."""
        end = 1
        while end < len(seqs) and seqs[end].group_id == seqs[0].group_id:
            end += 1
        return seqs[:end]

    def _prefill_chunk(self, seq: Sequence, budget: SchedulingBudget) -> int:
        """How many of the sequence's uncomputed tokens fit in what is left of the token budget.

        Given (swap-in and the chunk pass use it).
        """
        return min(seq.num_tokens - seq.num_computed_tokens, budget.remaining_tokens)
