"""The block-size benchmark on two requests: every block size gets its row, and each figure is
the one the requests' lengths give (a sequence wastes only its last block's empty slots; four
samples forked after the prompt share its full blocks, and each of the first three copies the
partly filled last one on its first write)."""

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_blocks
from workloads import sharegpt_like


def expected(requests, block_size: int) -> dict:
    """The figures ``bench_blocks.measure`` reports, from the lengths alone."""
    samples = bench_blocks.SAMPLES
    slots = tokens = entries = shared = unshared = copies = 0
    for request in requests:
        length = request.prompt_len + request.output_len
        blocks = math.ceil(length / block_size)
        full_prompt_blocks = request.prompt_len // block_size  # shared by the samples
        slots, tokens, entries = slots + blocks * block_size, tokens + length, entries + blocks
        shared += full_prompt_blocks + samples * (blocks - full_prompt_blocks)
        unshared += samples * blocks
        copies += (samples - 1) if request.prompt_len % block_size else 0
    return bench_blocks.figures(len(requests), slots, tokens, entries, shared, unshared, copies)


def test_two_requests_give_every_block_size_the_figures_their_lengths_give(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "argv", ["bench_blocks.py", "--requests", "2", "--out", str(tmp_path)])
    bench_blocks.main()
    results = json.loads((tmp_path / "bench_blocks.json").read_text())
    assert list(results) == [str(size) for size in bench_blocks.BLOCK_SIZES]
    requests = sharegpt_like(2, rate=1.0, max_model_len=bench_blocks.MAX_MODEL_LEN)
    for size in bench_blocks.BLOCK_SIZES:
        assert results[str(size)] == expected(requests, size), f"block size {size}"
    assert results["1"]["wasted_slots_pct"] == 0.0 and results["1"]["copies_on_write"] == 0.0
