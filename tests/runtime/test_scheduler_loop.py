"""The reference scheduler's own optimizations (not graded: a student's scheduler need not have
them): a decode's ScheduledSequence is made once per sequence and reused every step."""

import dataclasses

import pytest

from vkv.config import Config
from vkv.engine.scheduler import ScheduledSequence, Scheduler
from vkv.engine.sequence import Sequence
from vkv.sampling_params import SamplingParams

TOKEN = 5


def scheduler() -> Scheduler:
    return Scheduler(Config(block_size=4, num_gpu_blocks=64, max_num_seqs=8, watermark=0.0))


def sequence(seq_id: int, max_tokens: int) -> Sequence:
    return Sequence(seq_id, [1, 2, 3], 4, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def step(s: Scheduler) -> list[ScheduledSequence]:
    out = s.schedule()
    s.postprocess(out.scheduled, [TOKEN] * len(out.scheduled))
    return out.scheduled


def test_a_decode_item_is_made_once_and_cannot_be_changed():
    s = scheduler()
    s.add(sequence(0, 10))
    step(s)  # the prefill
    first, second = step(s), step(s)
    assert first == [ScheduledSequence(s.running[0], 1, False)]
    assert first[0] is second[0], "the same item serves every decode step of a sequence"
    with pytest.raises(dataclasses.FrozenInstanceError):
        first[0].num_tokens = 2


def test_finished_sequences_leave_no_decode_item_behind():
    s = scheduler()
    for seq_id in range(6):
        s.add(sequence(seq_id, 3 + seq_id))
    while not s.is_finished():
        step(s)
    assert s._decodes == {}, "a finished sequence's item is forgotten (a server runs forever)"


def test_a_reused_sequence_id_gets_an_item_of_its_own():
    s = scheduler()
    old = sequence(0, 3)
    s.add(old)
    s.add(sequence(1, 20))  # keeps the loop in decode steps
    while not old.is_finished:
        step(s)
    s._decodes[0] = ScheduledSequence(old, 1, False)  # as if the finish had not forgotten it
    new = sequence(0, 5)
    s.add(new)
    step(s)  # the new prefill
    (item,) = [item for item in step(s) if item.seq.seq_id == 0]
    assert item.seq is new, "an item is only reused for the very sequence it was made for"
