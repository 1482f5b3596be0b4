"""The quantization benchmark on one window and one prompt of 16 generated tokens: every
format gets a row, the bytes a token costs are Phase 3's (a 16-bit model: 16-bit values, or
codes with 16-bit scales and zeros, at vkv-tiny's 4 layers, 4 KV heads of 32), and the 16-bit
cache agrees with itself."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_quant

BYTES_PER_TOKEN = {
    "16-bit": 2048.0,  # 4 layers x K and V x 4 heads x 32 channels x 2 bytes
    "int8 per token": 1152.0,  # a byte a channel, a scale and a zero a head
    "int4 per token": 640.0,
    "int8 keys per channel": 1216.0,  # plus the keys' scales and zeros per block, a token's share
    "int4 keys per channel": 704.0,
    "int8, one scale per token": 1056.0,  # a scale and a zero for all heads
    "int4, one scale per token": 544.0,
}


def test_one_window_and_one_prompt_give_every_format_its_row(monkeypatch, tmp_path):
    argv = ["bench_quant.py", "--windows", "1", "--prompts", "1", "--tokens", "16", "--rounds", "1"]
    monkeypatch.setattr(sys, "argv", [*argv, "--out", str(tmp_path)])
    bench_quant.main()
    results = json.loads((tmp_path / "bench_quant.json").read_text())
    assert list(results) == list(bench_quant.FORMATS)
    assert {name: row["bytes_per_token"] for name, row in results.items()} == BYTES_PER_TOKEN
    base = results["16-bit"]
    assert base["greedy_prefix_agreement"] == 1.0 and base["greedy_identical"] == "1/1"
    assert base["capacity_ratio"] == 1.0 and base["bits_per_byte_change_pct"] == 0.0
    for name, row in results.items():
        assert 0.5 < row["bits_per_byte"] < 3.0, f"{name}: a trained model's figure"
        assert row["capacity_ratio"] >= 1.0 and row["decode_tokens_per_s"] > 0
    assert (tmp_path / "bench_quant.png").stat().st_size > 0
