"""Phase 2's scheduler for the tests and its stand-ins, shared by the visible and the hidden
graded tests: ``small_scheduler`` builds the scheduler most tests drive, and
``stand_in_preempt`` replaces part 2.3's ``_preempt`` where part 2.2's tests need a preemption,
so that part 2.2 is graded without part 2.3's code.
"""

from vkv.config import Config
from vkv.engine.scheduler import Scheduler, SchedulerOutput
from vkv.engine.sequence import Sequence, SequenceStatus


def small_scheduler(**options) -> Scheduler:
    """A scheduler over 64 GPU blocks of 4 tokens, no CPU blocks, no watermark, at most 8
    sequences of 64 tokens; ``options`` change any of those or add others."""
    base = {
        "block_size": 4,
        "num_gpu_blocks": 64,
        "num_cpu_blocks": 0,
        "watermark": 0.0,
        "max_model_len": 64,
        "max_num_seqs": 8,
    }
    return Scheduler(Config(**{**base, **options}))


def ids(seqs) -> list[int]:
    return [seq.seq_id for seq in seqs]


def stand_in_preempt(s: Scheduler) -> tuple[list[list[int]], object]:
    """A stand-in for part 2.3's ``_preempt`` (a plain recompute), recording each call's ids."""
    victims: list[list[int]] = []

    def preempt(seqs: list[Sequence], out: SchedulerOutput) -> None:
        victims.append(ids(seqs))
        for seq in reversed(seqs):
            s.block_manager.free(seq)
            seq.num_computed_tokens, seq.is_prefill = 0, True
            seq.group_id = seq.seq_id
            seq.status = SequenceStatus.WAITING
            s.waiting.appendleft(seq)
        out.preempted.extend(seqs)

    return victims, preempt
