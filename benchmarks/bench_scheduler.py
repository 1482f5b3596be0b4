"""Host-side cost of the scheduler: the schedule / postprocess loop alone, no model.

The nano-vLLM benchmark trace (512 sequences, prompts and outputs uniform in 100..1024 tokens,
all at once) runs to the end with a stand-in token, on a KV pool of 1,048,576 tokens at block
sizes 16 and 256 (no preemption) and on a pool of 131,072 tokens (preemptions). Reported per
configuration: steps, preemptions, microseconds per step and per scheduled sequence (the time
of ``schedule`` + ``postprocess``; the loop does nothing else), and the ratio to the first row.

    uv run python benchmarks/bench_scheduler.py [--seqs N] [--repeat R] [--out DIR]
"""

import argparse
import json
import time
from pathlib import Path

from rich.console import Console
from rich.progress import track
from rich.table import Table
from workloads import nanovllm_trace

from vkv.config import Config
from vkv.engine.scheduler import Scheduler
from vkv.engine.simulator import STAND_IN_TOKEN, make_sequences

CONFIGS = [
    ("1M tokens, block 16", 16, 1 << 20),
    ("1M tokens, block 256", 256, 1 << 20),
    ("128K tokens, block 16", 16, 1 << 17),
    ("128K tokens, block 256", 256, 1 << 17),
]


def run_once(block_size: int, pool_tokens: int, num_seqs: int) -> dict:
    config = Config(
        block_size=block_size,
        num_gpu_blocks=pool_tokens // block_size,
        max_num_seqs=512,
        max_num_batched_tokens=16_384,
        max_model_len=4096,
    )
    scheduler = Scheduler(config)
    for seq in make_sequences(nanovllm_trace(num_seqs), block_size):
        scheduler.add(seq)
    steps = scheduled = 0
    elapsed = 0.0
    while not scheduler.is_finished():
        start = time.perf_counter()
        out = scheduler.schedule()
        scheduler.postprocess(out.scheduled, [STAND_IN_TOKEN] * len(out.scheduled))
        elapsed += time.perf_counter() - start
        steps += 1
        scheduled += len(out.scheduled)
    return {
        "steps": steps,
        "preemptions": scheduler.num_preemptions,
        "us_per_step": elapsed / steps * 1e6,
        "us_per_seq_step": elapsed / scheduled * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=3, help="runs per configuration (best kept)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    runs = [(name, bs, pool) for name, bs, pool in CONFIGS for _ in range(args.repeat)]
    best: dict[str, dict] = {}
    for name, block_size, pool in track(runs, description="scheduling"):
        result = run_once(block_size, pool, args.seqs)
        if name not in best or result["us_per_step"] < best[name]["us_per_step"]:
            best[name] = result
    table = Table(title=f"Scheduler host cost, nano-vLLM trace of {args.seqs} sequences")
    for column in ("configuration", "steps", "preemptions", "µs/step", "µs/seq-step", "ratio"):
        table.add_column(column, justify="left" if column == "configuration" else "right")
    base = best[CONFIGS[0][0]]["us_per_seq_step"]
    for name, stats in best.items():
        table.add_row(
            name,
            str(stats["steps"]),
            str(stats["preemptions"]),
            f"{stats['us_per_step']:.0f}",
            f"{stats['us_per_seq_step']:.2f}",
            f"{stats['us_per_seq_step'] / base:.2f}x",
        )
    Console().print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_scheduler.json").write_text(json.dumps(best, indent=2))


if __name__ == "__main__":
    main()
