"""Prefix reuse on four workloads: what the RadixCache finds against the offline optimum.

Each workload is a trace of requests (prompt and output tokens), served one at a time in arrival
order the way an engine would use the tree: ``match_prefix`` (the hit), lock the path,
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
time per request.

Then the same four workloads end to end, with prefix caching off and on:

- on vkv-tiny (CPU, ``LLMEngine``, block 16, 16 sequences a step, greedy; ``--rounds`` rounds,
  off and on interleaved, medians): wall time, output tokens per second, mean time to first
  token, tokens the model computed, prompt tokens hit. The chat runs turn by turn (each turn's
  prompt holds the model's own earlier answers); n = 4 uses ``SamplingParams(n=4)`` (sampled),
  and its memory saving (block-table entries served by a shared block, over what the tables
  would take unshared) stands beside the PagedAttention paper's 6.1-9.8 % for parallel sampling
  (Alpaca; its prompts are shorter than its outputs, ours are longer);
- in the simulator (``vkv.engine.simulator``, its cost model, larger traces): steps, computed
  tokens, simulated time to first token;
- nano-vLLM's benchmark trace (256 requests, prompts and outputs of 100 to 1,024 random tokens)
  in the simulator under recompute preemption (a pool of 40,960 tokens, block 256): prefix
  caching keeps a preempted sequence's full blocks, so its recomputation reads them back.

    uv run python benchmarks/bench_prefix.py [--out DIR] [--rounds N] [--skip-engine]

Prints a table, writes ``bench_prefix.json`` and ``bench_prefix.png`` to ``--out`` (default
``benchmarks/results``).
"""

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table
from workloads import nanovllm_trace

from vkv import SamplingParams
from vkv.config import Config
from vkv.engine.llm_engine import LLMEngine
from vkv.engine.radix_cache import RadixCache, hash_blocks
from vkv.engine.simulator import Request as SimRequest
from vkv.engine.simulator import simulate

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
        hashes = hash_blocks(
            [], prompt + output, block_size, (len(prompt) + len(output)) // block_size
        )
        match = cache.match_prefix(prompt, hashes)
        hits.append(len(match.blocks) * block_size)
        cache.lock(match.node)
        whole = (prompt + output)[: (len(prompt) + len(output)) // block_size * block_size]
        fresh = len(whole) // block_size - len(match.blocks)
        if capacity is not None and cache.total_size + fresh > capacity:
            cache.evict(cache.total_size + fresh - capacity)
        blocks = match.blocks + list(range(next_block, next_block + fresh))
        next_block += fresh
        saved_blocks += cache.insert(whole, blocks, hashes) - len(match.blocks)
        cache.unlock(match.node)
    seconds = time.perf_counter() - started
    return {"hits": hits, "duplicates_freed": saved_blocks, "seconds": seconds}


PAPER_PARALLEL_SAVING = (0.061, 0.098)  # PagedAttention, section 6.3, Alpaca, parallel sampling
VOCAB = 250  # vkv-tiny has 257 token ids; trace ids are folded into [3, 253)


def engine_workloads(rng: random.Random) -> dict[str, list[list[list[int]]]]:
    """Scaled-down traces for vkv-tiny on a CPU: per workload, its waves of prompts (a wave is
    served after the previous one finished; the chat's later waves are built from answers)."""

    def fold(ids: list[int]) -> list[int]:
        return [3 + t % VOCAB for t in ids]

    system = fold(tokens(rng, 256, 256))
    shots = [fold(tokens(rng, 5 * 64, 5 * 64)) for _ in range(4)]
    return {
        "system prompt": [[system + fold(tokens(rng, 16, 96)) for _ in range(32)]],
        "few-shot": [[rng.choice(shots) + fold(tokens(rng, 16, 64)) for _ in range(24)]],
        "multi-turn chat": [[fold(tokens(rng, 64, 128)) for _ in range(8)]] * 3,
        "parallel sampling (n=4)": [[fold(tokens(rng, 96, 320)) for _ in range(8)]],
    }


def serve_engine(name: str, waves: list[list[list[int]]], caching: bool) -> dict:
    """Serve a workload's waves on vkv-tiny; chat turns append the answers to the history."""
    engine = LLMEngine(
        block_size=16, max_num_seqs=16, max_model_len=2048, enable_prefix_caching=caching
    )
    n = 4 if "n=4" in name else 1
    params = SamplingParams(
        temperature=0.8 if n > 1 else 0.0, n=n, max_tokens=32, ignore_eos=True, seed=0
    )
    histories: list[list[int]] = []
    first: dict[tuple[int, int], float] = {}
    computed = steps = 0
    saving: list[float] = []
    started = time.perf_counter()
    for wave, new in enumerate(waves):
        prompts = [h + p[:48] for h, p in zip(histories, new, strict=True)] if wave else new
        ids = [engine.add_request(prompt, params) for prompt in prompts]
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.new_token_ids:
                    first.setdefault((output.request_id, output.index), time.perf_counter())
            stats, steps = engine.stats, steps + 1
            computed += int(stats["batched_tokens"])
            used = stats["gpu_kv_usage"] * engine.config.num_gpu_blocks
            shared = engine.shared_blocks()
            if shared:
                saving.append(shared / (used + shared))
        histories = [engine.sequence(i).token_ids for i in ids]
    seconds = time.perf_counter() - started
    generated = sum(len(engine.sequence(i).completion_token_ids) for i in engine._samples)
    return {
        "seconds": seconds,
        "tokens_per_s": generated / seconds,
        "mean_ttft_s": sum(t - started for t in first.values()) / len(first),
        "computed_tokens": computed,
        "hit_tokens": int(engine.stats["prefix_cache_hits"]),
        "query_tokens": int(engine.stats["prefix_cache_queries"]),
        "steps": steps,
        "mean_sharing_saving": sum(saving) / len(saving) if saving else 0.0,
    }


def engine_rows(rounds: int) -> list[dict]:
    """Off and on, interleaved, ``rounds`` times per workload; medians of the timed figures."""
    rows = []
    for name, waves in engine_workloads(random.Random(1)).items():
        runs: dict[bool, list[dict]] = {False: [], True: []}
        for _ in range(rounds):
            for caching in (False, True):
                runs[caching].append(serve_engine(name, waves, caching))
        off, on = (median_run(runs[caching]) for caching in (False, True))
        rows.append(
            {
                "workload": name,
                "off": off,
                "on": on,
                "speedup": off["seconds"] / on["seconds"],
                "ttft_ratio": on["mean_ttft_s"] / off["mean_ttft_s"],
                "computed_ratio": on["computed_tokens"] / off["computed_tokens"],
            }
        )
    return rows


def median_run(runs: list[dict]) -> dict:
    """Each timed figure's median over the runs (the counts are the same in every run)."""
    timed = ("seconds", "tokens_per_s", "mean_ttft_s")
    merged = dict(runs[0])
    for key in timed:
        merged[key] = statistics.median(run[key] for run in runs)
    merged["spread_seconds"] = (min(r["seconds"] for r in runs), max(r["seconds"] for r in runs))
    return merged


def simulate_trace(prompts: list[list[int]], outputs: list[int], caching: bool, **config) -> dict:
    """Serve prompts (all at time 0) in the simulator; steps, computed tokens and mean TTFT."""
    options = {"block_size": 16, "num_gpu_blocks": 4096, "max_model_len": 4096}
    options.update(config)
    requests = [SimRequest(0.0, len(p), out) for p, out in zip(prompts, outputs, strict=True)]
    result = simulate(Config(**options, enable_prefix_caching=caching), requests, prompts=prompts)
    ttft = result.first_token_time.values()
    return {
        "steps": len(result.steps),
        "computed_tokens": result.num_computed_tokens,
        "preemptions": result.num_preemptions,
        "mean_ttft_s": sum(ttft) / len(ttft),
        "elapsed_s": result.elapsed,
    }


def simulator_rows() -> list[dict]:
    """The four tree-level traces (block 16) and nano-vLLM's trace with recompute preemption."""
    rows = []
    for name, make in WORKLOADS.items():
        trace = make(random.Random(0))
        prompts, outputs = [p for p, _ in trace], [len(o) for _, o in trace]
        off, on = (simulate_trace(prompts, outputs, caching) for caching in (False, True))
        rows.append({"workload": name, "off": off, "on": on})
    rng = random.Random(0)
    trace = nanovllm_trace(256)
    prompts = [[rng.randint(0, 10_000) for _ in range(r.prompt_len)] for r in trace]
    outputs = [r.output_len for r in trace]
    pool = {"block_size": 256, "num_gpu_blocks": 40_960 // 256, "preemption_mode": "recompute"}
    off, on = (simulate_trace(prompts, outputs, caching, **pool) for caching in (False, True))
    rows.append({"workload": "nano-vLLM trace, recompute", "off": off, "on": on})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--rounds", type=int, default=3, help="engine runs per setting")
    parser.add_argument("--skip-engine", action="store_true", help="no vkv-tiny runs")
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
    simulated = simulator_rows()
    show_simulated(console, simulated)
    engine = [] if args.skip_engine else engine_rows(args.rounds)
    if engine:
        show_engine(console, engine)
    args.out.mkdir(parents=True, exist_ok=True)
    document = {"tree": results, "simulator": simulated, "engine": engine}
    (args.out / "bench_prefix.json").write_text(json.dumps(document, indent=2))
    plot(results, engine, args.out / "bench_prefix.png")
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


def show_simulated(console: Console, rows: list[dict]) -> None:
    table = Table(title="In the simulator (cost model), prefix caching off -> on")
    for title in ("workload", "steps", "computed tokens", "preemptions", "mean TTFT (sim. s)"):
        table.add_column(title, justify="left" if title == "workload" else "right")
    for row in rows:
        off, on = row["off"], row["on"]
        table.add_row(
            row["workload"],
            f"{off['steps']:,} -> {on['steps']:,}",
            f"{off['computed_tokens']:,} -> {on['computed_tokens']:,} "
            f"({on['computed_tokens'] / off['computed_tokens']:.2f}x)",
            f"{off['preemptions']} -> {on['preemptions']}",
            f"{off['mean_ttft_s']:.2f} -> {on['mean_ttft_s']:.2f}",
        )
    console.print(table)


def show_engine(console: Console, rows: list[dict]) -> None:
    table = Table(title="vkv-tiny end to end (CPU), prefix caching off -> on, medians")
    for title in (
        "workload",
        "wall s",
        "speed-up",
        "mean TTFT s",
        "computed tokens",
        "prompt tokens hit",
        "sharing saves",
    ):
        table.add_column(title, justify="left" if title == "workload" else "right")
    for row in rows:
        off, on = row["off"], row["on"]
        saving = max(off["mean_sharing_saving"], on["mean_sharing_saving"])
        table.add_row(
            row["workload"],
            f"{off['seconds']:.2f} -> {on['seconds']:.2f}",
            f"{row['speedup']:.2f}x",
            f"{off['mean_ttft_s']:.2f} -> {on['mean_ttft_s']:.2f}",
            f"{off['computed_tokens']:,} -> {on['computed_tokens']:,}",
            f"{on['hit_tokens'] / max(1, on['query_tokens']):.0%}",
            f"{off['mean_sharing_saving']:.1%} / {on['mean_sharing_saving']:.1%}"
            if saving
            else "-",
        )
    console.print(table)
    low, high = PAPER_PARALLEL_SAVING
    console.print(
        f"sharing saves: mean share of block-table entries served by a shared block (off / on); "
        f"the PagedAttention paper: {low:.1%}-{high:.1%} for parallel sampling (Alpaca)"
    )


def plot(results: list[dict], engine: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 if engine else 1, figsize=(12 if engine else 7, 4))
    ax = axes[0] if engine else axes
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
    if engine:
        right = axes[1]
        names = [row["workload"] for row in engine]
        right.bar(names, [row["speedup"] for row in engine], color="tab:green")
        right.axhline(1.0, color="grey", linewidth=0.8)
        right.set_ylabel("wall time off / on")
        right.set_title("vkv-tiny end to end (CPU): speed-up with prefix caching")
        right.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
