"""How the engine slows down on a busy machine: idle against beside N busy processes.

Two runs are timed, each alone and beside ``--busy`` processes that spin in a Python loop,
in pairs whose order alternates (idle-busy, busy-idle, ...): the whole ``vkv demo --no-live``
command (its default 24 requests, as a user types it), and the vkv side of ``vkv bench e2e``
(its 64-request workload on an engine built once in this process). The figure is each run's
busy time over its idle time, per pair and the median.

A CPU-bound program that shares C cores with N busy neighbours gets about C / (N + 1) of
each core's time at worst: on 2 cores beside 4 loops, 0.4 of each. Two threads would then take
about 2.5x their idle time if they never waited for each other; but an op split over two
threads ends when its slower half ends, and the kernel sets one or the other aside, so the
engine runs one thread there (``vkv.threads.free_cpus``), which gets 0.4 of one core: about
5x the idle time of two threads on idle cores (2026-12-06: the e2e side 1.57-1.60 s idle,
7.7-8.1 s busy). Far more than that means threads wait for each other while the neighbours
hold the cores (a thread pool that spins long at every barrier): ``vkv.threads`` chooses the
engine's thread settings so that this does not happen.

    uv run python benchmarks/bench_busy.py [--pairs 3] [--busy 4] [--out DIR]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.table import Table

from vkv.bench import Workload, run_vkv
from vkv.engine.llm_engine import LLMEngine
from vkv.models.loader import DEFAULT_MODEL

VKV = Path(sys.executable).with_name("vkv")


@contextmanager
def busy_loops(count: int):
    """``count`` processes that spin until the block ends."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        time.sleep(0.5)  # let them get going
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


def demo_seconds() -> float:
    """The wall time of the whole ``vkv demo --no-live`` command."""
    started = time.perf_counter()
    subprocess.run([str(VKV), "demo", "--no-live"], check=True, capture_output=True)
    return time.perf_counter() - started


def e2e_runner() -> Callable[[], float]:
    """A function that serves ``vkv bench e2e``'s workload on one engine; its seconds."""
    engine = LLMEngine(DEFAULT_MODEL, max_num_seqs=64)
    workload = Workload.mixed(lambda text: engine.tokenizer.encode(text).ids)
    run_vkv(engine, Workload(workload.prompts[:2], [4, 4]))  # warm-up
    return lambda: run_vkv(engine, workload).seconds


def pairs(run: Callable[[], float], count: int, busy: int) -> list[tuple[float, float]]:
    """``count`` (idle, busy) timings, the order alternating from pair to pair."""
    timings = []
    for index in range(count):
        idle = loaded = 0.0
        for side in ("idle", "busy") if index % 2 == 0 else ("busy", "idle"):
            if side == "idle":
                idle = run()
            else:
                with busy_loops(busy):
                    loaded = run()
        timings.append((idle, loaded))
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--busy", type=int, default=4, help="busy processes beside the run")
    parser.add_argument("--out", default="benchmarks/results", help="folder for busy.json")
    args = parser.parse_args()
    console = Console()
    cores = len(os.sched_getaffinity(0))
    results = {}
    for name, run in (("vkv demo --no-live", demo_seconds), ("vkv bench e2e (vkv)", e2e_runner())):
        timings = pairs(run, args.pairs, args.busy)
        results[name] = {
            "idle_s": [idle for idle, _ in timings],
            "busy_s": [busy for _, busy in timings],
            "ratios": [busy / idle for idle, busy in timings],
        }
    table = Table(title=f"{args.busy} busy processes on {cores} cores: busy time / idle time")
    table.add_column("run")
    table.add_column("idle s (pairs)")
    table.add_column("busy s (pairs)")
    table.add_column("ratio (pairs)")
    table.add_column("median ratio", justify="right")
    for name, result in results.items():
        result["median_ratio"] = statistics.median(result["ratios"])
        table.add_row(
            name,
            " ".join(f"{s:.2f}" for s in result["idle_s"]),
            " ".join(f"{s:.2f}" for s in result["busy_s"]),
            " ".join(f"{r:.2f}" for r in result["ratios"]),
            f"{result['median_ratio']:.2f}",
        )
    console.print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    document = {"cores": cores, "busy": args.busy, "pairs": args.pairs, "runs": results}
    (out / "busy.json").write_text(json.dumps(document, indent=2) + "\n")
    console.print(f"written to {out / 'busy.json'}")


if __name__ == "__main__":
    main()
