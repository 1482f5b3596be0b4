"""Prefix reuse on four workloads: what the RadixCache finds against the offline optimum.

Each workload is a trace of requests (prompt and output tokens), served one at a time in arrival
order the way an engine would use the tree: ``match_prefix(prompt)`` (the hit), lock the path,
take fresh blocks for the rest, then ``insert`` the request's whole blocks (prompt and output)
and unlock. The *block-aligned optimum* is computed offline from the trace alone: for each
request, the longest prefix its prompt shares with any earlier request's tokens, in whole blocks,
never the prompt's last token. With room for everything the tree must find exactly the optimum
(100 %); under pressure (a pool of a quarter of the tokens the trace caches), LRU eviction of
unlocked leaves keeps what it can.

Workloads (tokens are ids; the tree never looks at their meaning):

- system prompt: 64 requests, one 256-token system prompt, then a question of 16 to 96 tokens;
- few-shot: 48 requests, one of 4 prompts of 5 examples x 64 tokens, then a question;
- multi-turn chat: 16 conversations of 4 turns, each turn's prompt = the conversation so far
  (earlier prompts and answers) + a new message; answers of 32 to 96 tokens;
- parallel sampling (n = 4): 16 prompts of 96 to 320 tokens, each served 4 times (4 samples).

Per workload and block size (1, 16, 64): hit tokens against the optimum, prefill tokens saved
(share of all prompt tokens), blocks the tree saved (duplicates the caller frees), and the tree's
time per request. The engine does not use the tree yet, so there are no end-to-end figures
(throughput, time to first token) here.

    uv run python benchmarks/bench_prefix.py [--out DIR]

Prints a table, writes ``bench_prefix.json`` and ``bench_prefix.png`` to ``--out`` (default
``benchmarks/results``).
"""

import argparse
import json
import random
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from vkv.engine.radix_cache import RadixCache

ROOT = Path(__file__).resolve().parents[1]
BLOCK_SIZES = (1, 16, 64)
Request = tuple[list[int], list[int]]  # prompt, output


def tokens(rng: random.Random, low: int, high: int) -> list[int]:
    return [rng.randrange(50_000) for _ in range(rng.randint(low, high))]


def system_prompt(rng: random.Random) -> list[Request]:
    system = tokens(rng, 256, 256)
    return [(system + tokens(rng, 16, 96), tokens(rng, 32, 96)) for _ in range(64)]


def few_shot(rng: random.Random) -> list[Request]:
    shots = [tokens(rng, 5 * 64, 5 * 64) for _ in range(4)]  # five examples of 64 tokens
    return [(rng.choice(shots) + tokens(rng, 16, 64), tokens(rng, 32, 96)) for _ in range(48)]


def chat(rng: random.Random) -> list[Request]:
    conversations: list[list[int]] = [[] for _ in range(16)]
    trace = []
    for _ in range(4):
        for history in conversations:
            prompt = history + tokens(rng, 16, 64)
            answer = tokens(rng, 32, 96)
            trace.append((prompt, answer))
            history[:] = prompt + answer
    return trace


def parallel_sampling(rng: random.Random) -> list[Request]:
    return [
        (prompt, tokens(rng, 32, 96))
        for prompt in (tokens(rng, 96, 320) for _ in range(16))
        for _ in range(4)
    ]


WORKLOADS = {
    "system prompt": system_prompt,
    "few-shot": few_shot,
    "multi-turn chat": chat,
    "parallel sampling (n=4)": parallel_sampling,
}


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def optimum(trace: list[Request], block_size: int) -> list[int]:
    """Per request, the hit tokens an oracle with unlimited room would find (offline)."""
    seen: list[list[int]] = []
    best = []
    for prompt, output in trace:
        shared = max((common_prefix(prompt, earlier) for earlier in seen), default=0)
        limit = (len(prompt) - 1) // block_size * block_size
        best.append(min(shared // block_size * block_size, limit))
        seen.append(prompt + output)
    return best


def serve(trace: list[Request], block_size: int, capacity: int | None) -> dict:
    """Serve ``trace`` through a RadixCache; ``capacity`` caps the blocks it keeps."""
    cache, next_block = RadixCache(block_size), 0
    hits, saved_blocks, started = [], 0, time.perf_counter()
    for prompt, output in trace:
        match = cache.match_prefix(prompt)
        hits.append(len(match.blocks) * block_size)
        cache.lock(match.node)
        whole = (prompt + output)[: (len(prompt) + len(output)) // block_size * block_size]
        fresh = len(whole) // block_size - len(match.blocks)
        if capacity is not None and cache.total_size + fresh > capacity:
            cache.evict(cache.total_size + fresh - capacity)
        blocks = match.blocks + list(range(next_block, next_block + fresh))
        next_block += fresh
        saved_blocks += cache.insert(whole, blocks) - len(match.blocks)
        cache.unlock(match.node)
    seconds = time.perf_counter() - started
    return {"hits": hits, "duplicates_freed": saved_blocks, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    console = Console(width=140)
    results = []
    for name, make in WORKLOADS.items():
        trace = make(random.Random(0))
        prompt_tokens = sum(len(prompt) for prompt, _ in trace)
        for block_size in BLOCK_SIZES:
            best = optimum(trace, block_size)
            roomy = serve(trace, block_size, None)
            cached_blocks = sum(len(p + o) // block_size for p, o in trace)
            tight = serve(trace, block_size, max(1, cached_blocks // 4))
            results.append(
                {
                    "workload": name,
                    "block_size": block_size,
                    "requests": len(trace),
                    "prompt_tokens": prompt_tokens,
                    "optimum_hit_tokens": sum(best),
                    "hit_tokens": sum(roomy["hits"]),
                    "hit_share_of_optimum": sum(roomy["hits"]) / max(1, sum(best)),
                    "per_request_equals_optimum": roomy["hits"] == best,
                    "prefill_saved": sum(roomy["hits"]) / prompt_tokens,
                    "duplicate_blocks_freed": roomy["duplicates_freed"],
                    "hit_tokens_quarter_pool": sum(tight["hits"]),
                    "us_per_request": 1e6 * roomy["seconds"] / len(trace),
                }
            )
    show(console, results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_prefix.json").write_text(json.dumps(results, indent=2))
    plot(results, args.out / "bench_prefix.png")
    console.print(f"wrote {args.out / 'bench_prefix.json'} and {args.out / 'bench_prefix.png'}")


def show(console: Console, results: list[dict]) -> None:
    table = Table(title="RadixCache on four traces: hits against the block-aligned optimum")
    for title in (
        "workload",
        "block",
        "hit tokens",
        "optimum",
        "of optimum",
        "prefill saved",
        "quarter pool",
        "us/request",
    ):
        table.add_column(title, justify="left" if title == "workload" else "right")
    for row in results:
        table.add_row(
            row["workload"],
            str(row["block_size"]),
            f"{row['hit_tokens']:,}",
            f"{row['optimum_hit_tokens']:,}",
            f"{row['hit_share_of_optimum']:.1%}",
            f"{row['prefill_saved']:.1%}",
            f"{row['hit_tokens_quarter_pool'] / max(1, row['optimum_hit_tokens']):.1%}",
            f"{row['us_per_request']:.0f}",
        )
    console.print(table)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(WORKLOADS)
    width = 0.8 / len(BLOCK_SIZES)
    for i, block_size in enumerate(BLOCK_SIZES):
        rows = [r for r in results if r["block_size"] == block_size]
        xs = [names.index(r["workload"]) + i * width for r in rows]
        ax.bar(xs, [r["prefill_saved"] for r in rows], width, label=f"block {block_size}")
    ax.set_xticks([n + width for n in range(len(names))], names, fontsize=8)
    ax.set_ylabel("prompt tokens served from the cache")
    ax.set_title("Prefix reuse (equal to the offline optimum)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
