"""Host-side cost of the scheduler: the schedule / postprocess loop alone, no model.

The nano-vLLM benchmark trace (512 sequences, prompts and outputs uniform in 100..1024 tokens,
all at once, every generated token the same stand-in) runs to the end on six configurations:
block sizes 16 and 256, KV pools of 1,048,576 tokens (no preemption), 131,072 and 40,960 tokens
(preemption by recompute). The budgets are nano-vLLM's defaults (512 sequences, 16,384 tokens a
step), the watermark 0 and chunked prefill off, as in nano-vLLM. Timed: ``schedule`` plus
``postprocess``, the whole loop (nothing else runs in it).

vkv runs twice, with prefix caching off and on. With ``--vs-nano-vllm PATH`` (a nano-vLLM
checkout: ``git clone https://github.com/GeeeekExplorer/nano-vllm PATH``; nothing of it is
copied here) nano-vLLM's own ``Scheduler``, ``BlockManager`` and ``Sequence`` run the same trace
in this process, interleaved with vkv's runs round by round (each round starts from the next
side, so none always runs first); the table gives each side's median loop time, the steps and
preemptions of each (equal numbers: the same schedule) and the ratio vkv / nano-vLLM: the median
of the rounds' own ratios, each of runs seconds apart, so that a change in the machine's load
between rounds cancels out; a second table splits each side's time between ``schedule`` and
``postprocess``. nano-vLLM always caches prefixes (it hashes every full block); its modules
import ``xxhash``, ``numpy`` and ``transformers``, all in this project's dev environment.

    uv run python benchmarks/bench_scheduler.py [--vs-nano-vllm PATH] [--rounds 5] [--seqs 512]
"""

import argparse
import gc
import importlib
import json
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table
from workloads import Request, nanovllm_trace

from vkv.config import Config
from vkv.engine.scheduler import Scheduler
from vkv.engine.simulator import STAND_IN_TOKEN, make_sequences

CONFIGS = [
    ("1M tokens, block 16", 16, 1 << 20),
    ("128K tokens, block 16", 16, 1 << 17),
    ("40K tokens, block 16", 16, 40_960),
    ("1M tokens, block 256", 256, 1 << 20),
    ("128K tokens, block 256", 256, 1 << 17),
    ("40K tokens, block 256", 256, 40_960),
]
MAX_NUM_SEQS = 512
MAX_NUM_BATCHED_TOKENS = 16_384


def run_once(
    block_size: int, pool_tokens: int, num_seqs: int, enable_prefix_caching: bool = False
) -> dict:
    """vkv's scheduler on the trace: loop seconds, steps, preemptions."""
    return run_loop(make_scheduler(block_size, pool_tokens, num_seqs, enable_prefix_caching))


def make_scheduler(
    block_size: int, pool_tokens: int, num_seqs: int, enable_prefix_caching: bool = False
) -> Scheduler:
    """vkv's scheduler with nano-vLLM's budgets, the trace's sequences waiting."""
    config = Config(
        block_size=block_size,
        num_gpu_blocks=pool_tokens // block_size,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        max_model_len=4096,
        watermark=0.0,
        enable_prefix_caching=enable_prefix_caching,
    )
    scheduler = Scheduler(config)
    for seq in make_sequences(nanovllm_trace(num_seqs), block_size):
        scheduler.add(seq)
    return scheduler


def run_loop(scheduler: Scheduler) -> dict:
    """The schedule / postprocess loop to the end, every token the stand-in (see ``_timed``)."""

    def schedule():
        out = scheduler.schedule()
        return out.scheduled, len(out.scheduled)

    def postprocess(scheduled) -> None:
        scheduler.postprocess(scheduled, [STAND_IN_TOKEN] * len(scheduled))

    return _timed(schedule, postprocess, scheduler.is_finished, lambda: scheduler.num_preemptions)


def _timed(
    schedule: Callable[[], tuple[object, int]],
    postprocess: Callable[[object], None],
    done: Callable[[], bool],
    preemptions: Callable[[], int],
) -> dict:
    """Run the loop to the end: its seconds, and the seconds in ``schedule`` (which returns a
    step's batch and how many sequences it holds) and in ``postprocess`` (of that batch)."""
    gc.collect()
    steps = scheduled = 0
    schedule_seconds = postprocess_seconds = 0.0
    start = time.perf_counter()
    while not done():
        began = time.perf_counter()
        batch, size = schedule()
        scheduled_at = time.perf_counter()
        postprocess(batch)
        schedule_seconds += scheduled_at - began
        postprocess_seconds += time.perf_counter() - scheduled_at
        scheduled += size
        steps += 1
    elapsed = time.perf_counter() - start
    return {
        "seconds": elapsed,
        "schedule_seconds": schedule_seconds,
        "postprocess_seconds": postprocess_seconds,
        "steps": steps,
        "preemptions": preemptions(),
        "us_per_seq_step": elapsed / scheduled * 1e6,
    }


class NanoVllm:
    """nano-vLLM's scheduler modules, imported from a checkout without its package ``__init__``
    (which loads the model runner, CUDA kernels and flash-attn)."""

    def __init__(self, checkout: Path) -> None:
        package = checkout / "nanovllm"
        if not (package / "engine" / "scheduler.py").is_file():
            raise SystemExit(f"{checkout} is not a nano-vLLM checkout (no nanovllm/engine/)")
        stub = types.ModuleType("nanovllm")
        stub.__path__ = [str(package)]
        sys.modules["nanovllm"] = stub
        self.scheduler = importlib.import_module("nanovllm.engine.scheduler")
        self.sequence = importlib.import_module("nanovllm.engine.sequence")
        self.sampling = importlib.import_module("nanovllm.sampling_params")
        self.revision = _git_revision(checkout)

    def run_once(self, block_size: int, pool_tokens: int, requests: list[Request]) -> dict:
        config = types.SimpleNamespace(
            max_num_seqs=MAX_NUM_SEQS,
            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
            eos=-1,
            kvcache_block_size=block_size,
            num_kvcache_blocks=pool_tokens // block_size,
        )
        self.sequence.Sequence.block_size = block_size
        scheduler = _counting(self.scheduler.Scheduler)(config)
        for seq_id, request in enumerate(requests):
            prompt = [(seq_id + i) % 50_000 + 8 for i in range(request.prompt_len)]
            params = self.sampling.SamplingParams(max_tokens=request.output_len, ignore_eos=True)
            scheduler.add(self.sequence.Sequence(prompt, params))

        def schedule():
            seqs, is_prefill = scheduler.schedule()
            return (seqs, is_prefill), len(seqs)

        def postprocess(batch) -> None:
            seqs, is_prefill = batch
            scheduler.postprocess(seqs, [STAND_IN_TOKEN] * len(seqs), is_prefill)

        return _timed(
            schedule, postprocess, scheduler.is_finished, lambda: scheduler.num_preemptions
        )


def _counting(scheduler_class: type) -> type:
    """nano-vLLM's Scheduler, counting its preemptions (it keeps no count)."""

    class CountingScheduler(scheduler_class):
        num_preemptions = 0

        def preempt(self, seq) -> None:
            self.num_preemptions += 1
            super().preempt(seq)

    return CountingScheduler


def _git_revision(checkout: Path) -> str:
    done = subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return done.stdout.strip() if done.returncode == 0 else "unknown revision"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vs-nano-vllm", type=Path, metavar="PATH", help="a nano-vLLM checkout")
    parser.add_argument("--seqs", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    nano = NanoVllm(args.vs_nano_vllm) if args.vs_nano_vllm else None
    requests = nanovllm_trace(args.seqs)
    sides: dict[str, Callable[[int, int], dict]] = {
        "vkv": lambda bs, pool: run_once(bs, pool, args.seqs),
        "vkv+caching": lambda bs, pool: run_once(bs, pool, args.seqs, True),
    }
    if nano is not None:
        sides["nano-vLLM"] = lambda bs, pool: nano.run_once(bs, pool, requests)
    runs: dict[tuple[str, str], list[dict]] = {}
    console = Console(width=140)
    order = list(sides.items())
    for round_ in range(args.rounds):
        for name, block_size, pool in CONFIGS:
            for side, run in order[round_ % len(order) :] + order[: round_ % len(order)]:
                runs.setdefault((name, side), []).append(run(block_size, pool))
        console.print(f"round {round_ + 1} of {args.rounds} done")
    summary = _summarize(runs, sides)
    title = f"Scheduler loop, nano-vLLM's trace of {args.seqs} sequences, median of {args.rounds}"
    if nano is not None:
        title += f" (nano-vLLM {nano.revision})"
    console.print(_table(summary, list(sides), title))
    console.print(_split_table(summary, list(sides)))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_scheduler.json").write_text(json.dumps(summary, indent=2))


def _summarize(runs: dict[tuple[str, str], list[dict]], sides: dict) -> dict:
    summary: dict[str, dict] = {}
    for name, _, _ in CONFIGS:
        row = summary[name] = {}
        for side in sides:
            results = runs[(name, side)]
            row[side] = {
                "median_s": statistics.median(r["seconds"] for r in results),
                "schedule_s": statistics.median(r["schedule_seconds"] for r in results),
                "postprocess_s": statistics.median(r["postprocess_seconds"] for r in results),
                "steps": sorted({r["steps"] for r in results}),
                "preemptions": sorted({r["preemptions"] for r in results}),
                "us_per_seq_step": statistics.median(r["us_per_seq_step"] for r in results),
            }
        if "nano-vLLM" in sides:
            base = [r["seconds"] for r in runs[(name, "nano-vLLM")]]
            for side in sides:
                mine = [r["seconds"] for r in runs[(name, side)]]
                ratios = [a / b for a, b in zip(mine, base, strict=True)]
                row[side]["ratio"] = statistics.median(ratios)
    return summary


def _table(summary: dict, sides: list[str], title: str) -> Table:
    """One row per configuration: the schedule (steps / preemptions; every side's if they
    differ), each side's median loop time, and each vkv side's ratio to nano-vLLM's (the
    median of the rounds' ratios)."""
    nano = "nano-vLLM" in sides
    table = Table(title=title)
    table.add_column("configuration")
    table.add_column("steps / preemptions", justify="right")
    for side in sides:
        table.add_column(f"{side} ms", justify="right")
    if nano:
        for side in sides[:2]:
            table.add_column(f"{side} / nano-vLLM", justify="right")
    for name, row in summary.items():
        schedules = {
            side: f"{'/'.join(map(str, row[side]['steps']))} / "
            f"{'/'.join(map(str, row[side]['preemptions']))}"
            for side in sides
        }
        same = len(set(schedules.values())) == 1
        cells = [
            name,
            schedules[sides[0]] if same else "; ".join(f"{k} {v}" for k, v in schedules.items()),
        ]
        cells += [f"{row[side]['median_s'] * 1e3:.0f}" for side in sides]
        if nano:
            cells += [f"{row[side]['ratio']:.2f}x" for side in sides[:2]]
        table.add_row(*cells)
    return table


def _split_table(summary: dict, sides: list[str]) -> Table:
    """Where each side's loop time goes: median milliseconds in ``schedule`` and in
    ``postprocess`` (the rest of the loop, checking whether it is done, is negligible)."""
    table = Table(title="Median ms in schedule / postprocess")
    table.add_column("configuration")
    for side in sides:
        table.add_column(side, justify="right")
    for name, row in summary.items():
        cells = [
            f"{row[s]['schedule_s'] * 1e3:.0f} / {row[s]['postprocess_s'] * 1e3:.0f}" for s in sides
        ]
        table.add_row(name, *cells)
    return table


if __name__ == "__main__":
    main()
