"""How far two performance bars are from this design's floor: runs with a cost taken out outright.

Neither what-if is a usable engine; each bounds what making that cost smaller could ever give.

1. ``step``: ``vkv bench e2e``'s workload (64 requests on vkv-tiny) three ways, interleaved round
   by round: as it is; without detokenization (every step's new text is empty); without
   detokenization and without metrics (no ``StatLogger`` call). Its requests are final-only
   (``vkv.bench.benchmark_params``): their text is decoded once each, when they finish, so the
   first two ways now differ by that alone. Per way, the median over the
   rounds of the share of full decode step time outside the model's forward (as ``vkv bench
   e2e`` counts it), the step and the host time in it.
2. ``scheduler``: ``bench_scheduler.py``'s six configurations, interleaved round by round: vkv
   with prefix caching off, on, and on with a hash that costs nothing (a block's first and
   last tokens and its parent's hash, through Python's ``hash``: the tree compares tokens on
   every hit, so the schedules stay the same; the table says whether they did), and with
   ``--vs-nano-vllm PATH`` nano-vLLM's own scheduler. Median loop times and each one's ratio
   to nano-vLLM's (to caching off without a checkout).

    uv run python benchmarks/bench_bounds.py [step|scheduler] [--rounds 5] [--vs-nano-vllm PATH]
"""

import argparse
import contextlib
import functools
import statistics
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from bench_scheduler import CONFIGS, NanoVllm, make_scheduler, run_loop, run_once
from rich.console import Console
from rich.table import Table
from workloads import nanovllm_trace

from vkv.bench import VkvRun, Workload, is_full_decode, run_vkv
from vkv.engine.llm_engine import LLMEngine
from vkv.models.loader import DEFAULT_MODEL

NUM_SEQS = 512


def no_text(state, tokens, finished) -> str:
    """Detokenization taken out: no new text, whatever the tokens."""
    return ""


def no_metrics(out, reported) -> None:
    """Metrics taken out: nothing recorded."""


# A way replaces methods, each named by its path from the engine.
NEW_TEXT = "outputs.detokenizer.new_text"
STEP_WAYS: dict[str, dict[str, Callable]] = {
    "as it is": {},
    "no detokenization": {NEW_TEXT: no_text},
    "no detokenization, no metrics": {NEW_TEXT: no_text, "_record": no_metrics},
}


@contextlib.contextmanager
def step_way(engine: LLMEngine, way: str) -> Iterator[None]:
    """The engine with ``way``'s methods in place (instance attributes hide the methods), and
    with its own again afterwards."""
    owners = []
    for path, method in STEP_WAYS[way].items():
        *inner, name = path.split(".")
        owner = functools.reduce(getattr, inner, engine)
        vars(owner)[name] = method
        owners.append((owner, name))
    try:
        yield
    finally:
        for owner, name in owners:
            del vars(owner)[name]


def step_bounds(rounds: int, console: Console) -> None:
    engine = LLMEngine(DEFAULT_MODEL, max_num_seqs=64, device="cpu")
    workload = Workload.mixed(lambda text: engine.tokenizer.encode(text).ids)
    figures = measure_steps(engine, workload, rounds)
    table = Table(title=f"Full decode steps of 64 sequences, median of {rounds} rounds")
    for column in ("way", "outside the model", "step us", "host us"):
        table.add_column(column, justify="left" if column == "way" else "right")
    for way, rows in figures.items():
        share, step, host = (statistics.median(row[i] for row in rows) for i in range(3))
        spread = f"{min(r[0] for r in rows):.1%}-{max(r[0] for r in rows):.1%}"
        table.add_row(way, f"{share:.1%} ({spread})", f"{step:,.0f}", f"{host:,.0f}")
    console.print(table)


def measure_steps(
    engine: LLMEngine, workload: Workload, rounds: int
) -> dict[str, list[tuple[float, float, float]]]:
    """Each way's figures (``_step_figures``) in each round, after a warm-up; the engine is
    left with its own methods."""
    run_vkv(engine, Workload(workload.prompts[:2], [4, 4]))
    figures: dict[str, list[tuple[float, float, float]]] = {way: [] for way in STEP_WAYS}
    for _ in range(rounds):
        for way in STEP_WAYS:
            with step_way(engine, way):
                run = run_vkv(engine, workload)
            figures[way].append(_step_figures(run, engine.config.max_num_seqs))
    return figures


def _step_figures(run: VkvRun, full_batch: int) -> tuple[float, float, float]:
    """Share outside the model, mean step and mean host microseconds of the full decode steps."""
    share = run.overhead_share(full_batch)
    full = [stats for stats in run.steps if is_full_decode(stats, full_batch)]
    step_us = sum(stats["step_seconds"] for stats in full) / len(full) * 1e6
    return share, step_us, share * step_us


def free_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """A block hash that costs next to nothing (and would collide on real prompts)."""
    return hash((parent, tokens[0], tokens[-1]))


def run_free_hash(block_size: int, pool_tokens: int) -> dict:
    scheduler = make_scheduler(block_size, pool_tokens, NUM_SEQS, enable_prefix_caching=True)
    scheduler.block_manager.hash_function = free_hash
    return run_loop(scheduler)


def scheduler_bounds(rounds: int, nano_checkout: Path | None, console: Console) -> None:
    sides: dict[str, Callable[[int, int], dict]] = {
        "caching off": lambda size, pool: run_once(size, pool, NUM_SEQS),
        "caching on": lambda size, pool: run_once(size, pool, NUM_SEQS, True),
        "caching on, free hash": run_free_hash,
    }
    if nano_checkout is not None:
        nano, requests = NanoVllm(nano_checkout), nanovllm_trace(NUM_SEQS)
        sides["nano-vLLM"] = lambda size, pool: nano.run_once(size, pool, requests)
    base = "nano-vLLM" if nano_checkout is not None else "caching off"
    table = Table(title=f"Scheduler loop, median ms of {rounds} rounds (ratio to {base})")
    table.add_column("configuration")
    for side in sides:
        table.add_column(side, justify="right")
    table.add_column("same schedules")
    for name, block_size, pool in CONFIGS:
        runs: dict[str, list[dict]] = {side: [] for side in sides}
        for _ in range(rounds):
            for side, run in sides.items():
                runs[side].append(run(block_size, pool))
        medians = {side: statistics.median(r["seconds"] for r in rs) for side, rs in runs.items()}
        schedules = {(r["steps"], r["preemptions"]) for rs in runs.values() for r in rs}
        cells = [f"{m * 1e3:.0f} ({m / medians[base]:.2f}x)" for m in medians.values()]
        table.add_row(name, *cells, "yes" if len(schedules) == 1 else f"no: {sorted(schedules)}")
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("which", nargs="?", choices=("step", "scheduler"), help="one of the two")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians)")
    parser.add_argument("--vs-nano-vllm", type=Path, metavar="PATH", help="a nano-vLLM checkout")
    args = parser.parse_args()
    console = Console(width=140)
    if args.which in (None, "step"):
        step_bounds(args.rounds, console)
    if args.which in (None, "scheduler"):
        scheduler_bounds(args.rounds, args.vs_nano_vllm, console)


if __name__ == "__main__":
    main()
