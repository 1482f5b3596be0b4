"""The device pool holds no more blocks than the engine can use (``blocks_ever_used``), so that an
engine on a 141 GB GPU builds the same pool as on a laptop, and says why."""

import pytest
import torch

from vkv.config import WATERMARK
from vkv.engine.block_manager import AllocStatus, BlockManager
from vkv.engine.cache_engine import CacheShape, blocks_ever_used, size_device_pool
from vkv.engine.llm_engine import LLMEngine
from vkv.engine.sequence import Sequence
from vkv.models.loader import read_config

H200_FREE_BYTES = 141 * 10**9  # a simulated device: what mem_get_info would say on an H200


@pytest.mark.parametrize(
    ("max_num_seqs", "max_model_len", "block_size", "watermark"),
    [(5, 100, 16, 0.01), (3, 64, 16, 0.0), (7, 33, 4, 0.25), (64, 2048, 16, WATERMARK)],
)
def test_the_bound_admits_every_sequence_at_its_longest(
    max_num_seqs, max_model_len, block_size, watermark
):
    """With the bound's blocks, ``max_num_seqs`` prompts of ``max_model_len`` tokens all get
    their blocks now, the watermark kept: the engine never needs more."""
    bound = blocks_ever_used(max_num_seqs, max_model_len, block_size, watermark, False)
    manager = BlockManager(block_size, bound, watermark=watermark)
    for seq_id in range(max_num_seqs):
        seq = Sequence(seq_id, [1] * max_model_len, block_size)
        assert manager.can_allocate(seq) is AllocStatus.OK, f"sequence {seq_id} of {bound}"
        manager.allocate(seq)
    per_seq = -(-max_model_len // block_size)
    assert bound <= max_num_seqs * per_seq / (1 - watermark) + 1, "and not much more"


def test_prefix_caching_gets_room_for_as_many_cached_prefixes_as_running_sequences():
    plain = blocks_ever_used(8, 256, 16, 0.0, prefix_caching=False)
    assert plain == 8 * 16
    assert blocks_ever_used(8, 256, 16, 0.0, prefix_caching=True) == 2 * plain


def test_a_141_gb_device_sizes_vkv_tiny_by_the_bound_not_by_its_memory():
    c = read_config(None)
    shape = CacheShape(c.num_layers, 16, c.num_kv_heads, c.head_dim, torch.float16)
    bound = blocks_ever_used(64, 2048, 16, WATERMARK, False)
    pool = size_device_pool(shape, int(0.9 * H200_FREE_BYTES), 128, bound)
    assert pool.blocks == bound == 8275 and pool.bounded
    assert pool.memory_blocks == int(0.9 * H200_FREE_BYTES) // shape.block_bytes > 3_000_000


def test_a_huge_budget_builds_the_bounded_pool_and_the_start_line_says_so(capsys):
    engine = LLMEngine(kv_cache_bytes=int(0.9 * H200_FREE_BYTES), device="cpu")
    bound = blocks_ever_used(64, 2048, 16, WATERMARK, False)
    assert engine.config.num_gpu_blocks == bound
    assert engine.scheduler.block_manager.num_gpu_blocks == bound
    line = capsys.readouterr().err
    assert "sized for 64 sequences of 2048 tokens, all this engine can use" in line
    memory_blocks = int(0.9 * H200_FREE_BYTES) // engine.cache_engine.shape.block_bytes
    assert f"the memory budget holds {memory_blocks:,} blocks" in line, line


def test_a_pool_the_memory_sets_says_nothing_of_the_bound_and_a_given_count_is_exact(capsys):
    engine = LLMEngine(kv_cache_bytes=4 << 20, device="cpu")
    assert engine.config.num_gpu_blocks == (4 << 20) // engine.cache_engine.shape.block_bytes
    assert "sized for" not in capsys.readouterr().err
    given = LLMEngine(num_gpu_blocks=20_000, max_num_seqs=2, max_model_len=64, device="cpu")
    assert given.config.num_gpu_blocks == 20_000


def test_the_key_residual_comes_out_of_the_budget_before_the_blocks():
    shape = CacheShape(4, 16, 4, 32, torch.float32, "int8", "per_channel")
    residual = shape.residual_bytes(8)
    pool = size_device_pool(shape, residual + 10 * shape.block_bytes, 8, bound=1_000)
    assert pool.blocks == pool.memory_blocks == 10 and not pool.bounded
    with pytest.raises(ValueError, match=r"the key residual .* fills the KV budget"):
        size_device_pool(shape, residual, 8, bound=1_000)
