"""What the block size trades, on your BlockManager: slots wasted against table entries, and
the blocks that forking saves (Phase 1's experiment).

Each request of a ShareGPT-like trace (the PagedAttention paper's mean lengths, 161 prompt and
338 output tokens) is served alone through ``BlockManager``: ``allocate`` for its prompt, then
``append_slot`` for each generated token, as the scheduler will call them; ``free`` at the end.
Once with one sample, once with ``n = 4`` parallel samples forked after the prompt (``fork``:
the samples share the prompt's blocks; the first token each writes into the shared last block
copies it). For each block size:

- wasted slots: the share of the slots a finished request held that hold no token (only its
  last block is partly empty, so at most ``block_size - 1`` slots a sequence);
- table entries: the mean block-table length of a finished request (the metadata a step sends
  to the attention kernel, one entry a block);
- with 4 samples: the GPU blocks held at the end, against four unshared copies (what forking
  saves), and the copies on write it took.

    uv run python benchmarks/bench_blocks.py [--requests 200]

Runs in a few seconds on one core; prints a table, writes ``bench_blocks.json`` to ``--out``
(default ``benchmarks/results``). Only Phase 1's code runs: no model, no scheduler.
"""

import argparse
import json
import math
from pathlib import Path

from rich.console import Console
from rich.table import Table
from workloads import sharegpt_like

from vkv.engine.block_manager import BlockManager
from vkv.engine.sequence import Sequence

ROOT = Path(__file__).resolve().parents[1]
BLOCK_SIZES = (1, 4, 8, 16, 32, 64, 128, 256)
MAX_MODEL_LEN = 2048
SAMPLES = 4


def serve(manager: BlockManager, prompt: int, output: int, samples: int) -> tuple[int, int]:
    """One request through ``manager``: the GPU blocks it holds when done, and its copies on
    write. Its samples are forked from the first after the prompt."""
    first = Sequence(0, [1] * prompt, manager.block_size)
    manager.allocate(first)
    seqs = [first]
    for k in range(1, samples):
        child = Sequence(k, [1] * prompt, manager.block_size)
        manager.fork(first, child)
        seqs.append(child)
    copies = 0
    for _ in range(output):
        for seq in seqs:
            seq.append_token(1)
            copies += manager.append_slot(seq) is not None
    held = manager.num_gpu_blocks - manager.num_free_gpu_blocks
    for seq in seqs:
        manager.free(seq)
    return held, copies


def measure(requests, block_size: int) -> dict:
    """The figures of one block size over all requests (served one at a time)."""
    blocks = (SAMPLES * MAX_MODEL_LEN) // block_size + SAMPLES
    manager = BlockManager(block_size, blocks, 0, watermark=0.0)
    slots = tokens = entries = shared = unshared = copies = 0
    for request in requests:
        length = request.prompt_len + request.output_len
        held, _ = serve(manager, request.prompt_len, request.output_len, 1)
        slots, tokens, entries = slots + held * block_size, tokens + length, entries + held
        held, cow = serve(manager, request.prompt_len, request.output_len, SAMPLES)
        shared += held
        unshared += SAMPLES * math.ceil(length / block_size)
        copies += cow
    return figures(len(requests), slots, tokens, entries, shared, unshared, copies)


def figures(n, slots, tokens, entries, shared, unshared, copies) -> dict:
    """The reported figures from the counts over n requests: slots and table entries held
    alone, tokens stored, blocks held by 4 forked samples and by 4 unshared copies, copies on
    write."""
    return {
        "wasted_slots_pct": round(100 * (slots - tokens) / slots, 2),
        "table_entries": round(entries / n, 1),
        "blocks_4_samples_forked": round(shared / n, 1),
        "blocks_4_samples_unshared": round(unshared / n, 1),
        "fork_saves_pct": round(100 * (1 - shared / unshared), 1),
        "copies_on_write": round(copies / n, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    requests = sharegpt_like(args.requests, rate=1.0, max_model_len=MAX_MODEL_LEN)
    results = {size: measure(requests, size) for size in BLOCK_SIZES}
    table = Table(title=f"{args.requests} ShareGPT-like requests, each alone; 4 samples forked")
    columns = [
        ("block size", None),
        ("wasted slots", "wasted_slots_pct"),
        ("table entries", "table_entries"),
        ("blocks, 4 forked", "blocks_4_samples_forked"),
        ("4 unshared", "blocks_4_samples_unshared"),
        ("fork saves %", "fork_saves_pct"),
        ("copies on write", "copies_on_write"),
    ]
    for title, _ in columns:
        table.add_column(title, justify="right")
    for size, row in results.items():
        table.add_row(str(size), *(str(row[key]) for _, key in columns[1:]))
    console = Console()
    console.print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_blocks.json"
    path.write_text(json.dumps({str(k): v for k, v in results.items()}, indent=2))
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
