"""GPU only: the paged decode kernel's achieved memory bandwidth against the device's copy
bandwidth.

Batch 64, context 4096, 8 KV heads (32 query heads), head_dim 128, fp16, block size 16, block
tables shuffled over the pool. Achieved bandwidth = bytes of K and V the step must read
(batch x context x kv_heads x head_dim x 2 tensors x 2 bytes) / time. The device's bandwidth
is measured in the same run with a 2 GiB device-to-device copy (bytes read + bytes written /
time). Rows: the Triton split-K kernel at its default split and at a few others, the PyTorch
reference (which gathers every block first), and the Triton kernel on the same cache quantized
to INT8 and to INT4 per token and head (Phase 3; fp16 scales and zeros), and with keys per
channel (KIVI: a scale and zero per block, head and channel; every block full, so none is read
from the residual), whose bytes read are the codes plus the scales, with its time against
fp16's; each quantized format also with its per-token scales folded out of the tile
(``fold_scales``), at the default tiles and at tiles of 128 tokens (``TILES_OF_128``; 16-bit
too), each row with its largest difference from the default launch's output. Times are
medians of CUDA-event timings; a launch whose tiles do not fit the GPU is left out, and said so.

``--sweep`` times the launch options instead (``SWEEP``: tokens a tile, warps, pipeline
stages; for keys per channel also ``fold_keys``: folded, a tile is one block, so only warps and
stages; not folded, tiles of every size at the default stages; for a quantized format also
``fold_scales``, at the default stages), for each format, and writes
``decode_sweep.json`` (after each format, so a run cut short keeps what it timed): the fastest
options beside the defaults, for the defaults of ``triton_attention.paged_decode_attention``
to follow.

    python benchmarks/bench_decode_kernel.py [--sweep] [--out DIR]

Without CUDA it says so and exits: there are no GPU figures to report.
"""

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch
from triton.runtime.errors import OutOfResources

from vkv.engine.cache_engine import QuantizedCache
from vkv.engine.quantizer import Quantizer
from vkv.kernels import reference, triton_attention

BATCH, CONTEXT, KV_HEADS, GROUP, HEAD_DIM, BLOCK_SIZE = 64, 4096, 8, 4, 128, 16
SWEEP = {"block_n": (32, 64, 128), "num_warps": (4, 8), "num_stages": (2, 3)}
DEFAULTS = {"block_n": 64, "num_warps": 4, "num_stages": 3}
# The launch `scripts/compile_for_gpu.py --anatomy` ranks first for the folded quantized loops
# (warp instructions a cached token, 4 warps: INT8 46.4 at tiles of 64, 30.1 at 128; INT4 49.8
# and 33.4; INT8 keys per channel 86.1 and 69.3; 16-bit 23.2 and 17.6): timed beside the
# defaults in every run, so that the bars' stage shows it without the sweep (shared memory a
# program: 74 KB in 16 bits, 25-41 KB folded per token, 124-140 KB keys per channel; fits sm_90)
TILES_OF_128 = {"block_n": 128, "num_warps": 4}
QUANTIZED = ((8, "per token"), (4, "per token"), (8, "keys per channel"), (4, "keys per channel"))


def median_ms(run, repeat: int = 20) -> float:
    for _ in range(3):
        run()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def quantized(cache: torch.Tensor, bits: int) -> QuantizedCache:
    """``cache`` quantized per token and head, with fp16 scales and zeros (as the engine)."""
    q = Quantizer(bits).quantize(cache)
    return QuantizedCache(q.codes, q.scale.half(), q.zero.half(), bits)


def channel_keys(cache: torch.Tensor, bits: int) -> QuantizedCache:
    """Keys quantized per channel over each block (the engine's format once a block is full),
    with an empty residual: no block is partial."""
    q = Quantizer(bits, "per_channel").quantize(cache.transpose(0, 1))  # the block's tokens first
    scale, zero = (t.transpose(0, 1).half() for t in (q.scale, q.zero))
    residual = torch.zeros_like(cache[:1])
    none_partial = torch.full((len(cache),), -1, dtype=torch.int32, device=cache.device)
    codes = q.codes.transpose(0, 1).contiguous()
    return QuantizedCache(
        codes, scale.contiguous(), zero.contiguous(), bits, residual, none_partial
    )


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 2 GiB device-to-device copy."""
    source = torch.empty(1 << 30, dtype=torch.float16, device="cuda")
    target = torch.empty_like(source)
    ms = median_ms(lambda: target.copy_(source))
    return 2 * source.numel() * source.element_size() / (ms / 1e3)


def launches(name: str) -> list[dict]:
    """The launch options a format is timed at: every combination of ``SWEEP``; for keys per
    channel, folded at the one tile a block allows, and not folded at each tile and warps with
    the default stages; a quantized format also with its per-token scales folded (``fold_scales``;
    keys per channel: the values'), at each tile and warps with the default stages (each launch
    compiles anew: the stage's minutes are few)."""
    combinations = [dict(zip(SWEEP, o, strict=True)) for o in itertools.product(*SWEEP.values())]
    if name == "16-bit":
        return combinations
    at_default_stages = [o for o in combinations if o["num_stages"] == DEFAULTS["num_stages"]]
    keys = {}
    if "per channel" in name:
        keys = {"fold_keys": False}
        tile = DEFAULTS["block_n"]
        combinations = [o | {"fold_keys": True} for o in combinations if o["block_n"] == tile]
        combinations += [o | keys for o in at_default_stages]
    return [o | {"fold_scales": False} for o in combinations] + [
        o | keys | {"fold_scales": True} for o in at_default_stages
    ]


def sweep(formats: dict, decode, kv_bytes: dict, save=None) -> list[dict]:
    """Each format's median time at each of its ``launches``, fastest first within a format,
    each with its speed against the defaults (keys per channel: not folded); ``save`` gets the rows
    so far after each format. A combination whose tiles do not fit the GPU's shared memory is
    left out, and said so."""
    rows = []
    for name, (k, v) in formats.items():
        timed = []
        for launch in launches(name):
            try:
                ms = median_ms(lambda k=k, v=v, o=launch: decode(k, v, **o), repeat=10)
            except OutOfResources as error:
                print(f"{name:>28}: {launch} left out: {error}")
                continue
            timed.append(launch | {"format": name, "ms": ms})
        defaults = DEFAULTS | ({"fold_keys": False} if "per channel" in name else {})
        defaults |= {} if name == "16-bit" else {"fold_scales": False}
        default = next(row for row in timed if row.items() >= defaults.items())["ms"]
        for row in sorted(timed, key=lambda row: row["ms"]):
            row["gb_per_s"] = kv_bytes[name] / (row["ms"] / 1e3) / 1e9
            row["speedup_over_defaults"] = default / row["ms"]
            rows.append(row)
        best = rows[-len(timed)]
        print(
            f"{name:>28}: defaults {default:.3f} ms; best {best['ms']:.3f} ms "
            f"({best['speedup_over_defaults']:.2f}x) at {options_text(best)}"
        )
        if save is not None:
            save(rows)
    return rows


def options_text(row: dict) -> str:
    """A timed launch's options in words."""
    text = f"block_n {row['block_n']}, {row['num_warps']} warps, {row['num_stages']} stages"
    if "fold_keys" in row:
        text += ", keys folded" if row["fold_keys"] else ", keys not folded"
    if row.get("fold_scales"):
        text += ", scales folded"
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true", help="time the launch options")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: the decode kernel's bandwidth is unmeasured here")
        return 0
    torch.manual_seed(0)
    blocks_per_seq = CONTEXT // BLOCK_SIZE
    num_blocks = BATCH * blocks_per_seq
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, dtype=torch.float16, device="cuda")
    v_cache = torch.randn(shape, dtype=torch.float16, device="cuda")
    tables = torch.randperm(num_blocks, device="cuda").view(BATCH, blocks_per_seq).int()
    lens = torch.full((BATCH,), CONTEXT, dtype=torch.int32, device="cuda")
    query = torch.randn(BATCH, KV_HEADS * GROUP, HEAD_DIM, dtype=torch.float16, device="cuda")
    scale = HEAD_DIM**-0.5
    kv_bytes = 2 * BATCH * CONTEXT * KV_HEADS * HEAD_DIM * 2

    formats = {"16-bit": (k_cache, v_cache)}
    for bits, keys in QUANTIZED:
        k_q = quantized(k_cache, bits) if keys == "per token" else channel_keys(k_cache, bits)
        formats[f"int{bits} KV, {keys}"] = (k_q, quantized(v_cache, bits))
    read = {
        name: sum(t.numel() * t.element_size() for c in kv for t in (c.codes, c.scale, c.zero))
        for name, kv in formats.items()
        if name != "16-bit"
    } | {"16-bit": kv_bytes}

    def decode(k, v, **options):
        return triton_attention.paged_decode_attention(query, k, v, tables, lens, scale, **options)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    if args.sweep:
        path = out / "decode_sweep.json"
        sweep(
            formats,
            decode,
            read,
            lambda rows: path.write_text(json.dumps({"device": device, "rows": rows})),
        )
        return 0
    expected = reference.paged_decode_attention(query, k_cache, v_cache, tables, lens, scale)
    error = float((decode(k_cache, v_cache).float() - expected.float()).abs().max())
    peak = copy_bandwidth()
    rows = []

    def timed(name: str, k, v, options: dict, bytes_read: int) -> dict | None:
        """A row for ``decode(k, v, **options)``: its median time, bandwidth and largest
        difference from the default launch's output; None (and said) where its tiles do not
        fit the GPU."""
        try:
            ms = median_ms(lambda: decode(k, v, **options))
        except OutOfResources as error:
            print(f"{name}: left out: {error}")
            return None
        differs = (decode(k, v, **options).float() - decode(k, v).float()).abs().max()
        row = {"kernel": name, "ms": ms, "gb_per_s": bytes_read / (ms / 1e3) / 1e9}
        return row | {"max_diff_from_defaults": float(differs)}

    candidates = [("triton, default split", {})]
    candidates += [(f"triton, {n} splits", {"num_splits": n}) for n in (1, 4, 8, 16, 32)]
    candidates += [("triton, tiles of 128", TILES_OF_128)]
    for name, options in candidates:
        rows.append(timed(name, k_cache, v_cache, options, kv_bytes))
    ms = median_ms(
        lambda: reference.paged_decode_attention(query, k_cache, v_cache, tables, lens, scale)
    )
    rows.append({"kernel": "torch reference", "ms": ms, "gb_per_s": kv_bytes / (ms / 1e3) / 1e9})
    fp16_ms = rows[0]["ms"]
    variants = {"": {}, ", scales folded": {"fold_scales": True}}
    variants[", scales folded, tiles of 128"] = {"fold_scales": True, **TILES_OF_128}
    for (name, (k, v)), said in itertools.product(list(formats.items())[1:], variants):
        row = timed(f"triton, {name}{said}", k, v, variants[said], read[name])
        rows.append(row if row is None else row | {"speedup_over_fp16": fp16_ms / row["ms"]})
    rows = [row for row in rows if row is not None]
    print(f"{device}: copy bandwidth {peak / 1e9:,.0f} GB/s")
    print(f"K/V read per step: {kv_bytes / 2**30:.2f} GiB; max |triton - torch| = {error:.2e}")
    for row in rows:
        row["share_of_copy_bandwidth"] = row["gb_per_s"] * 1e9 / peak
        print(
            f"{row['kernel']:>24}: {row['ms']:8.3f} ms  {row['gb_per_s']:8,.0f} GB/s  "
            f"{row['share_of_copy_bandwidth']:6.1%} of copy"
        )
    result = {"device": device, "copy_gb_per_s": peak / 1e9, "rows": rows}
    (out / "decode_kernel.json").write_text(json.dumps(result | {"max_error": error}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
