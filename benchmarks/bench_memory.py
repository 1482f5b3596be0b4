"""How many requests fit in the same KV memory: paged (vkv) vs static reservation (Orca).

Reproduces the comparison of the PagedAttention paper (§6.2, Fig. 13: on OPT-13B, vLLM batches
2.2x more requests than Orca (Oracle) and 4.3x more than Orca (Max)) in the model-free
simulator, under one KV budget in tokens:

- Orca (Max):    each request reserves ``max_model_len`` slots when it is admitted;
- Orca (Pow2):   the next power of two at or above its true final length;
- Orca (Oracle): exactly its true final length (prompt + output), known in advance;
- vkv paged:     blocks of 16 tokens, allocated as tokens arrive, with preemption.

Per system: the mean number of requests holding KV memory in a busy step, KV utilization (share
of reserved slots that hold a live token), throughput in the cost model, preemptions.

    uv run python benchmarks/bench_memory.py [--requests N] [--kv-tokens T] [--out DIR]

Prints a table, writes ``bench_memory.json`` and ``bench_memory.png`` to ``--out``
(default ``benchmarks/results``).
"""

import argparse
import json
from collections import deque
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.progress import track
from rich.table import Table
from workloads import alpaca_like, mean_lengths, nanovllm_trace, sharegpt_like

from vkv.config import Config
from vkv.engine.simulator import CostModel, Request, simulate

MAX_MODEL_LEN = 2048  # OPT-13B's context
# OPT-13B on a 40 GB A100, as in the paper: 26 GB of weights leave about 12 GiB for the KV
# cache, at 2 (K, V) x 40 layers x 5120 x 2 bytes = 800 KiB per token.
OPT_13B_KV_TOKENS = (12 << 30) // (2 * 40 * 5120 * 2)
BLOCK_SIZE = 16
MAX_NUM_SEQS = 256


def simulate_static(
    requests: list[Request],
    kv_tokens: int,
    reserve: Callable[[Request], int],
    cost_model: CostModel,
) -> dict:
    """Orca-style serving: iteration-level batching, but each request reserves its KV up front.

    Same step policy as the paged scheduler (admit prompts FCFS in a prefill step, else decode
    everyone), so that only the memory scheme differs.
    """
    token_budget = max(MAX_MODEL_LEN, 2048)
    waiting: deque[Request] = deque()
    running: list[list] = []  # [request, tokens so far, reserved slots]
    clock, next_arrival, reserved = 0.0, 0, 0
    steps = generated = 0
    sum_running = sum_live = sum_reserved = 0
    while next_arrival < len(requests) or waiting or running:
        while next_arrival < len(requests) and requests[next_arrival].arrival_time <= clock:
            waiting.append(requests[next_arrival])
            next_arrival += 1
        admitted, prefill_tokens = [], 0
        while waiting and len(running) + len(admitted) < MAX_NUM_SEQS:
            request = waiting[0]
            need = reserve(request)
            if reserved + need > kv_tokens or prefill_tokens + request.prompt_len > token_budget:
                break
            waiting.popleft()
            reserved += need
            prefill_tokens += request.prompt_len
            admitted.append([request, request.prompt_len, need])
        if admitted:
            clock += cost_model.time(prefill_tokens, 0)
            running += admitted
            batch = admitted
        elif running:
            clock += cost_model.time(len(running), sum(entry[1] for entry in running))
            batch = running
        else:
            clock = requests[next_arrival].arrival_time
            continue
        for entry in batch:  # each computed sequence samples one token
            entry[1] += 1
            generated += 1
        steps += 1
        sum_running += len(running)
        sum_live += sum(entry[1] for entry in running)
        sum_reserved += reserved
        done = [e for e in running if e[1] >= e[0].prompt_len + e[0].output_len]
        for entry in done:
            reserved -= entry[2]
        running = [e for e in running if e not in done] if done else running
    return {
        "mean_running": sum_running / steps,
        "kv_utilization": sum_live / sum_reserved,
        "throughput": generated / clock,
        "preemptions": 0,
    }


def simulate_paged(requests: list[Request], kv_tokens: int, cost_model: CostModel) -> dict:
    config = Config(
        block_size=BLOCK_SIZE,
        num_gpu_blocks=kv_tokens // BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=MAX_NUM_SEQS,
    )
    result = simulate(config, requests, cost_model)
    return {
        "mean_running": result.mean_running,
        "kv_utilization": result.kv_utilization,
        "throughput": result.throughput,
        "preemptions": result.num_preemptions,
    }


def next_power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()


SYSTEMS: dict[str, Callable] = {
    "Orca (Max)": lambda r: MAX_MODEL_LEN,
    "Orca (Pow2)": lambda r: min(next_power_of_two(r.prompt_len + r.output_len), MAX_MODEL_LEN),
    "Orca (Oracle)": lambda r: r.prompt_len + r.output_len,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument(
        "--kv-tokens",
        type=int,
        default=OPT_13B_KV_TOKENS,
        help=f"the KV budget in tokens (default: {OPT_13B_KV_TOKENS:,}, OPT-13B on a 40 GB A100)",
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    cost = CostModel()
    workloads = {
        "ShareGPT-like": sharegpt_like(args.requests, rate=20.0, max_model_len=MAX_MODEL_LEN),
        "Alpaca-like": alpaca_like(args.requests, rate=100.0, max_model_len=MAX_MODEL_LEN),
        "nano-vLLM trace": nanovllm_trace(256),
    }
    results: dict[str, dict] = {}
    runs = [(w, s) for w in workloads for s in [*SYSTEMS, "vkv paged"]]
    for workload, system in track(runs, description="simulating"):
        requests = workloads[workload]
        if system == "vkv paged":
            stats = simulate_paged(requests, args.kv_tokens, cost)
        else:
            stats = simulate_static(requests, args.kv_tokens, SYSTEMS[system], cost)
        results.setdefault(workload, {"mean_lengths": mean_lengths(requests)})[system] = stats

    console = Console()
    table = Table(title=f"Same KV budget ({args.kv_tokens:,} tokens), block size {BLOCK_SIZE}")
    for column in (
        "workload",
        "system",
        "batched requests",
        "vs Orca (Max)",
        "vs Orca (Oracle)",
        "KV utilization",
        "throughput tok/s",
        "preemptions",
    ):
        table.add_column(column, justify="left" if column in ("workload", "system") else "right")
    for workload, systems in results.items():
        prompt, output = systems["mean_lengths"]
        for system in [*SYSTEMS, "vkv paged"]:
            stats = systems[system]
            table.add_row(
                f"{workload} ({prompt:.0f}/{output:.0f})",
                system,
                f"{stats['mean_running']:.1f}",
                f"{stats['mean_running'] / systems['Orca (Max)']['mean_running']:.2f}x",
                f"{stats['mean_running'] / systems['Orca (Oracle)']['mean_running']:.2f}x",
                f"{stats['kv_utilization']:.1%}",
                f"{stats['throughput']:.0f}",
                str(stats["preemptions"]),
            )
    console.print(table)

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_memory.json").write_text(json.dumps(results, indent=2))
    plot(results, args.out / "bench_memory.png")
    console.print(f"wrote {args.out / 'bench_memory.json'} and {args.out / 'bench_memory.png'}")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = [*SYSTEMS, "vkv paged"]
    fig, axes = plt.subplots(1, len(results), figsize=(4.5 * len(results), 4))
    for ax, (workload, stats) in zip(axes, results.items(), strict=True):
        values = [stats[s]["mean_running"] for s in systems]
        bars = ax.bar(range(len(systems)), values, color=["#bbb", "#999", "#777", "#2a7"])
        ax.bar_label(bars, fmt="%.1f")
        ax.set_xticks(range(len(systems)), systems, rotation=20)
        ax.set_title(workload)
        ax.set_ylabel("batched requests (mean)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
