"""The decode-kernel benchmark's launch sweep, with the timing stubbed (the timings themselves
need a GPU: ``scripts/gpu_check.sh``'s ``decode_sweep`` stage): every combination of
``SWEEP`` is timed once per format, keys per channel also not folded (folded, the tile is
fixed: one block a tile), a quantized format also with its scales folded, fastest first, each
against the defaults."""

import sys
from pathlib import Path

import pytest
import torch
from triton.runtime.errors import OutOfResources

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_decode_kernel


def test_the_sweep_times_every_combination_and_compares_it_with_the_defaults(monkeypatch):
    calls = []

    def fake_ms(run, repeat):
        return run()

    def decode(k, v, block_n, num_warps, num_stages, fold_keys=None, fold_scales=None):
        calls.append((k, block_n, num_warps, num_stages, fold_keys, fold_scales))
        if (block_n, num_stages) == (128, 3):
            raise OutOfResources(262144, 232448, "shared memory")
        made_up_ms = 1.0 + block_n / 64 + num_stages / 10 - num_warps / 100
        return made_up_ms - (0.5 if fold_keys else 0.0) - (0.05 if fold_scales else 0.0)

    monkeypatch.setattr(bench_decode_kernel, "median_ms", fake_ms)
    formats = {"16-bit": ("fp16", None), "int8 KV, keys per channel": ("channel", None)}
    read = {"16-bit": 2e9, "int8 KV, keys per channel": 1e9}
    saved = []
    rows = bench_decode_kernel.sweep(formats, decode, read, lambda rows: saved.append(len(rows)))
    assert saved == [3 * 2 * 2 - 2, len(rows)], "the rows so far, after each format"
    assert len([c for c in calls if c[0] == "fp16"]) == 3 * 2 * 2
    assert len([row for row in rows if row["format"] == "16-bit"]) == 3 * 2 * 2 - 2, (
        "the two that do not fit are left out"
    )
    assert {c[4:] for c in calls if c[0] == "fp16"} == {(None, None)}, "16 bits: nothing to fold"
    assert {c[1] for c in calls if c[0] == "channel" and c[4]} == {64}, "folded: a block a tile"
    unfolded = {c[1:4] for c in calls if c[0] == "channel" and c[4] is False and not c[5]}
    assert unfolded == {(n, w, 3) for n in (32, 64, 128) for w in (4, 8)}, "default stages"
    scaled = [c[1:5] for c in calls if c[0] == "channel" and c[5]]
    assert sorted(scaled) == sorted((*u, False) for u in unfolded), "scales folded: as unfolded"
    assert {c[5] for c in calls if c[0] == "channel" and c[4]} == {False}
    fastest = rows[0]
    assert (fastest["block_n"], fastest["num_warps"], fastest["num_stages"]) == (32, 8, 2)
    default_ms = 1.0 + 1 + 0.3 - 0.04
    assert fastest["speedup_over_defaults"] == pytest.approx(default_ms / fastest["ms"])
    assert fastest["gb_per_s"] == pytest.approx(2e9 / (fastest["ms"] / 1e3) / 1e9)
    channel = [row for row in rows if row["format"] == "int8 KV, keys per channel"]
    assert len(channel) == 2 * 2 + 2 * (3 * 2 - 2) and channel[0]["ms"] <= channel[-1]["ms"]
    assert channel[0]["fold_keys"] is True, "here the made-up fold is faster"
    assert channel[0]["fold_scales"] is False, "keys folded: a block a tile, scales not swept"
    scaled_rows = [row for row in channel if row["fold_scales"]]
    assert bench_decode_kernel.options_text(scaled_rows[0]) == (
        "block_n 32, 8 warps, 3 stages, keys not folded, scales folded"
    ), "the fastest with its scales folded"
    assert channel[0]["speedup_over_defaults"] == pytest.approx(default_ms / channel[0]["ms"]), (
        "against the default launch: not folded"
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU measures instead")
def test_without_cuda_it_says_the_kernel_is_unmeasured(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(sys, "argv", ["bench_decode_kernel.py", "--sweep", "--out", str(tmp_path)])
    assert bench_decode_kernel.main() == 0
    assert "unmeasured" in capsys.readouterr().out
