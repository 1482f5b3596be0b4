"""Tensor parallelism side by side: one process against N (``LLMEngine(tensor_parallel_size=N)``).

Both engines serve ``vkv bench e2e``'s workload (64 requests, windows of the pinned corpus,
prompts and outputs of 16 to 256 tokens, greedy, ``ignore_eos``) on the same model, in rounds
whose order alternates (1-N, N-1, ...), each side with its share of the CPU's threads (all of
them for one process, 1/N each for N). The figures: tokens per second and the mean step time of
each side, their ratio (median over the rounds), and what tensor parallelism sends per step:
rank 0's pickled step messages (measured), the all-reduces (2 per layer, one row of
``hidden_size`` per token, each rank's) and the logits gathered to rank 0 (a row of its slice
of the vocabulary per sequence, from each other rank), both counted from the step's shape.

On one CPU the N processes share its cores, so this measures the cost of the split (messages,
collectives, the smaller matrix products), not a speed-up; on a machine with N GPUs (NCCL) the
same script measures the speed-up.

    uv run python benchmarks/bench_tp.py [--size 2] [--rounds 3] [--device cpu] [--out DIR]
"""

import argparse
import json
import math
import os
import pickle
import statistics
from pathlib import Path

import torch

from vkv.bench import Workload, run_vkv
from vkv.engine.llm_engine import LLMEngine
from vkv.models.loader import DEFAULT_MODEL


class Traffic:
    """Counts what rank 0 sends: its step messages' pickled bytes, and the model runs."""

    def __init__(self, engine: LLMEngine) -> None:
        self.message_bytes = self.messages = self.runs = self.tokens = self.rows = 0
        send = engine.parallel.send

        def counted(message: object) -> None:
            self.message_bytes += len(pickle.dumps(message))
            self.messages += 1
            if message[0] == "batch":
                self.runs += 1
                self.tokens += len(message[1].tokens)
                self.rows += len(message[1].context_lens)
            send(message)

        engine.parallel.send = counted


def run(engine: LLMEngine, workload: Workload, threads: int) -> tuple[float, int, int]:
    """One run: seconds, tokens generated, steps."""
    torch.set_num_threads(threads)
    result = run_vkv(engine, workload)
    return result.seconds, sum(map(len, result.completions)), len(result.steps)


def measure(size: int, rounds: int, device: str) -> dict:
    engines = {
        tp: LLMEngine(DEFAULT_MODEL, max_num_seqs=64, device=device, tensor_parallel_size=tp)
        for tp in (1, size)
    }
    cores = os.cpu_count() or 1
    threads = {1: cores, size: max(1, cores // size)}
    workload = Workload.mixed(lambda text: engines[1].tokenizer.encode(text).ids)
    for tp, engine in engines.items():
        run(engine, Workload(workload.prompts[:2], [4, 4]), threads[tp])  # warm-up
    traffic = Traffic(engines[size])
    seconds: dict[int, list[float]] = {1: [], size: []}
    step_ms: dict[int, list[float]] = {1: [], size: []}
    tokens = steps = 0
    for round_ in range(rounds):
        for tp in (1, size) if round_ % 2 == 0 else (size, 1):
            took, tokens, count = run(engines[tp], workload, threads[tp])
            seconds[tp].append(took)
            step_ms[tp].append(1000 * took / count)
            steps = count if tp == size else steps
    c = engines[1].model.config
    element = torch.empty((), dtype=engines[1].model.lm_head.weight.dtype).element_size()
    per_rank_vocab = math.ceil(c.vocab_size / size)
    runs = traffic.runs or 1
    all_reduce_bytes = 2 * c.num_layers * traffic.tokens / runs * c.hidden_size * element
    gather_bytes = (size - 1) * traffic.rows / runs * per_rank_vocab * element
    for engine in engines.values():
        engine.close()
    ratios = [a / b for a, b in zip(seconds[size], seconds[1], strict=True)]
    return {
        "size": size,
        "device": device,
        "rounds": rounds,
        "tokens": tokens,
        "tokens_per_s": {tp: tokens / statistics.median(s) for tp, s in seconds.items()},
        "step_ms": {tp: statistics.median(ms) for tp, ms in step_ms.items()},
        "time_ratio_median": statistics.median(ratios),
        "time_ratios": ratios,
        "message_bytes_per_step": traffic.message_bytes / max(steps * rounds, 1),
        "messages_per_step": traffic.messages / max(steps * rounds, 1),
        "all_reduce_bytes_per_run": all_reduce_bytes,
        "gather_bytes_per_run": gather_bytes,
        "tokens_per_run": traffic.tokens / runs,
        "sequences_per_run": traffic.rows / runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    s = measure(args.size, args.rounds, args.device)
    n = args.size
    print(
        f"{s['tokens']} tokens on {s['device']}: TP=1 {s['tokens_per_s'][1]:.0f} tok/s, "
        f"{s['step_ms'][1]:.1f} ms a step; TP={n} {s['tokens_per_s'][n]:.0f} tok/s, "
        f"{s['step_ms'][n]:.1f} ms a step; time TP={n} / TP=1, median of {s['rounds']} rounds: "
        f"{s['time_ratio_median']:.2f}x ({', '.join(f'{r:.2f}' for r in s['time_ratios'])})\n"
        f"per step: {s['messages_per_step']:.2f} messages, {s['message_bytes_per_step']:,.0f} "
        f"bytes pickled; per model run ({s['tokens_per_run']:.1f} tokens, "
        f"{s['sequences_per_run']:.1f} sequences): all-reduces {s['all_reduce_bytes_per_run']:,.0f}"
        f" bytes per rank, logits gathered {s['gather_bytes_per_run']:,.0f} bytes"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_tp.json").write_text(json.dumps(s, indent=2))


if __name__ == "__main__":
    main()
