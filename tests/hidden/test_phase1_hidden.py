"""Hidden tests for Phase 1: instructor-only (left out of the student edition).

``vkv grade SUBMISSION --trusted EDITION --hidden tests/hidden`` adds them; Gradescope shows
them after the due date. They follow the graded tests' naming: ``test_part<N>_...``.
"""

from vkv.engine.block import BlockAllocator, Device
from vkv.engine.block_manager import BlockManager
from vkv.engine.sequence import Sequence


def test_part1_block_of_a_long_sequence_after_many_appends():
    seq = Sequence(0, [1], block_size=7)
    for token in range(2, 101):
        seq.append_token(token)
    assert seq.num_blocks == 15 and seq.last_block_num_tokens == 2
    assert seq.block(14) == [99, 100]


def test_part2_a_large_pool_hands_out_every_block_once():
    pool = BlockAllocator(Device.GPU, 10_000)
    ids = {pool.allocate().block_id for _ in range(10_000)}
    assert ids == set(range(10_000)) and pool.num_free_blocks == 0


def test_part3_many_sequences_fill_the_pool_exactly():
    bm = BlockManager(block_size=16, num_gpu_blocks=64, watermark=0.0)
    for seq_id in range(16):
        bm.allocate(Sequence(seq_id, list(range(64)), 16))
    assert bm.num_free_gpu_blocks == 0 and bm.gpu_usage == 1.0
