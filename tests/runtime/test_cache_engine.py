"""CacheEngine: the block copies of swap and copy-on-write move exactly the right data, on each
device (``devices.py``): on CUDA a swap crosses to the pinned CPU pool and back."""

import pytest
import torch

from vkv.engine.cache_engine import CacheEngine, CacheShape

SHAPE = CacheShape(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)


def filled_engine(device: str) -> CacheEngine:
    engine = CacheEngine(SHAPE, num_gpu_blocks=6, num_cpu_blocks=5, device=torch.device(device))
    engine.gpu_cache.copy_(torch.randn_like(engine.gpu_cache))
    return engine


def test_block_bytes_and_budget():
    assert SHAPE.block_bytes == 2 * 2 * 4 * 2 * 8 * 4
    assert SHAPE.num_blocks_for(10 * SHAPE.block_bytes + 5) == 10
    with pytest.raises(ValueError, match="holds no block"):
        SHAPE.num_blocks_for(SHAPE.block_bytes - 1)


def test_layer_views_share_the_cache(device):
    engine = filled_engine(device)
    keys, values = engine.layer(1)
    assert keys.shape == (6, 4, 2, 8)
    keys[3].fill_(7.0)
    assert torch.all(engine.gpu_cache[0, 1, 3] == 7.0) and not torch.all(values[3] == 7.0)


def test_layers_are_every_layer_in_order_and_see_later_writes(device):
    engine = filled_engine(device)
    layers = engine.layers()
    assert len(layers) == SHAPE.num_layers
    for index, (keys, values) in enumerate(layers):
        assert keys.data_ptr() == engine.gpu_cache[0, index].data_ptr()
        assert values.data_ptr() == engine.gpu_cache[1, index].data_ptr()
    engine.swap_in({})  # a step's block maps change the cache, never where its layers lie
    engine.gpu_cache[1, 0, 2].fill_(5.0)
    assert torch.all(engine.layers()[0][1][2] == 5.0)


def test_swap_out_then_in_round_trips_every_layer(device):
    engine = filled_engine(device)
    before = engine.gpu_cache.clone()
    engine.swap_out({4: 0, 1: 3})
    assert torch.equal(engine.cpu_cache[:, :, 0], before[:, :, 4].cpu())
    assert torch.equal(engine.cpu_cache[:, :, 3], before[:, :, 1].cpu())
    engine.gpu_cache.zero_()
    engine.swap_in({0: 2, 3: 5})
    assert torch.equal(engine.gpu_cache[:, :, 2], before[:, :, 4])
    assert torch.equal(engine.gpu_cache[:, :, 5], before[:, :, 1])
    assert engine.gpu_cache[:, :, [0, 1, 3, 4]].abs().sum() == 0, "only the mapped blocks move"


def test_copy_on_write_fans_one_block_out(device):
    engine = filled_engine(device)
    before = engine.gpu_cache.clone()
    engine.apply({}, {}, {1: [2, 5], 0: [4]})
    for src, dst in ((1, 2), (1, 5), (0, 4)):
        assert torch.equal(engine.gpu_cache[:, :, dst], before[:, :, src])
    assert torch.equal(engine.gpu_cache[:, :, 3], before[:, :, 3])
