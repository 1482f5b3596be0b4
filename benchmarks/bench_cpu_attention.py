"""CPU decode attention: the reference (gather every block, then SDPA) against the in-place loop
(``vkv/kernels/paged_decode.c``), side by side in one run.

1. Kernels alone, on decode batches shaped like vkv-tiny's (64 sequences, 8 query and 4 KV heads
   of 32, blocks of 16, contexts uniform in 32..512) and like a 0.6B model's (32 sequences, 16
   and 8 heads of 128, contexts in 256..2048): the same call repeated, so the blocks are in the
   CPU's caches; median milliseconds of interleaved rounds and the ratio.
2. In the engine: vkv-tiny serving ``vkv bench e2e``'s 64 requests with the loop and with the
   reference, interleaved; the median wall time of a run, the time inside decode attention
   (where each layer's K/V come from memory), and the ratios. Completions must be identical.

    uv run python benchmarks/bench_cpu_attention.py [--rounds 5] [--out DIR]
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from vkv.bench import Workload, run_vkv
from vkv.engine.llm_engine import LLMEngine
from vkv.kernels import cpu_attention, reference
from vkv.models.loader import DEFAULT_MODEL

SHAPES = {
    "vkv-tiny batch": dict(batch=64, heads=8, kv_heads=4, head_dim=32, contexts=(32, 512)),
    "0.6B-like batch": dict(batch=32, heads=16, kv_heads=8, head_dim=128, contexts=(256, 2048)),
}
BLOCK_SIZE = 16


def decode_batch(batch, heads, kv_heads, head_dim, contexts, seed=0):
    """A decode batch over a shuffled paged cache: the arguments of paged_decode_attention."""
    generator = torch.Generator().manual_seed(seed)
    lens = torch.randint(contexts[0], contexts[1] + 1, (batch,), generator=generator)
    blocks = [-(-int(n) // BLOCK_SIZE) for n in lens]
    num_blocks = sum(blocks) + 16
    cache_shape = (num_blocks, BLOCK_SIZE, kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=generator)
    v_cache = torch.randn(cache_shape, generator=generator)
    order = torch.randperm(num_blocks, generator=generator).int()
    tables = torch.full((batch, max(blocks)), -1, dtype=torch.int32)
    used = 0
    for i, count in enumerate(blocks):
        tables[i, :count] = order[used : used + count]
        used += count
    query = torch.randn(batch, heads, head_dim, generator=generator)
    return query, k_cache, v_cache, tables, lens.int(), head_dim**-0.5


def kernels_alone(rounds: int) -> dict:
    results = {}
    for name, shape in SHAPES.items():
        args = decode_batch(**shape)
        error = (
            (cpu_attention.paged_decode_attention(*args) - reference.paged_decode_attention(*args))
            .abs()
            .max()
        )
        times = {"reference": [], "in place": []}
        for _ in range(rounds):
            for side, kernel in (
                ("reference", reference.paged_decode_attention),
                ("in place", cpu_attention.paged_decode_attention),
            ):
                started = time.perf_counter()
                for _ in range(20):
                    kernel(*args)
                times[side].append((time.perf_counter() - started) / 20 * 1e3)
        results[name] = {
            "reference_ms": statistics.median(times["reference"]),
            "in_place_ms": statistics.median(times["in place"]),
            "max_abs_difference": float(error),
        }
    return results


def in_the_engine(rounds: int, num_requests: int = 64, lens: tuple[int, int] = (16, 256)) -> dict:
    """``vkv bench e2e``'s workload (``num_requests`` of them, prompts and outputs of ``lens``
    tokens) through the engine with the loop and with the reference, interleaved."""
    engine = LLMEngine(DEFAULT_MODEL, max_num_seqs=64, device="cpu")
    workload = Workload.mixed(
        lambda text: engine.tokenizer.encode(text).ids, num_requests, lens, lens
    )
    warm_up = workload.prompts[:2]
    run_vkv(engine, Workload(warm_up, [4] * len(warm_up)))
    spent = {"seconds": 0.0}
    backend = engine.runner.backend

    class Timed:  # the engine's backend, timing its decode attention
        store_kvcache = staticmethod(backend.store_kvcache)
        paged_prefill_attention = staticmethod(backend.paged_prefill_attention)

        @staticmethod
        def paged_decode_attention(*args):
            started = time.perf_counter()
            out = backend.paged_decode_attention(*args)
            spent["seconds"] += time.perf_counter() - started
            return out

    engine.runner.backend = Timed
    loop = cpu_attention._kernel  # replaced by one that gives None: the reference runs
    runs = {"reference": [], "in place": []}
    completions = {}
    try:
        for _ in range(rounds):
            for side in runs:
                cpu_attention._kernel = loop if side == "in place" else lambda: None
                spent["seconds"] = 0.0
                run = run_vkv(engine, workload)
                runs[side].append((run.seconds, spent["seconds"]))
                completions[side] = run.completions
    finally:
        cpu_attention._kernel = loop
    return {
        side: {
            "run_s": statistics.median(r[0] for r in results),
            "decode_attention_s": statistics.median(r[1] for r in results),
        }
        for side, results in runs.items()
    } | {"identical_completions": completions["reference"] == completions["in place"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    if cpu_attention.kernel_path() is None:
        raise SystemExit("paged_decode.c could not be built (no C compiler?): nothing to compare")
    alone, engine = kernels_alone(args.rounds), in_the_engine(args.rounds)
    console = Console()
    table = Table(title=f"Decode attention on {torch.get_num_threads()} CPU threads, medians")
    for column in ("case", "reference", "in place", "in place / reference"):
        table.add_column(column, justify="left" if column == "case" else "right")
    for name, r in alone.items():
        ratio = r["in_place_ms"] / r["reference_ms"]
        table.add_row(
            f"{name}, one call", f"{r['reference_ms']:.2f} ms", f"{r['in_place_ms']:.2f} ms",
            f"{ratio:.2f}x",
        )  # fmt: skip
    ref, ours = engine["reference"], engine["in place"]
    for label, key in (
        ("engine run, decode attention", "decode_attention_s"),
        ("engine run, wall", "run_s"),
    ):
        table.add_row(
            label, f"{ref[key]:.2f} s", f"{ours[key]:.2f} s", f"{ours[key] / ref[key]:.2f}x"
        )
    console.print(table)
    console.print(f"completions identical: {engine['identical_completions']}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_cpu_attention.json").write_text(
        json.dumps({"kernels": alone, "engine": engine}, indent=2)
    )


if __name__ == "__main__":
    main()
