"""What drawing a step's tokens costs, against greedy's argmax, side by side in one run.

``ModelRunner.execute`` draws every token of a step together (``draw_tokens``: temperature,
top-k, top-p and one search of the cumulative probabilities for the whole batch, one read of the
device; it drew row by row before, a read a row). This
script times it on random logits of ``--vocab`` tokens (Qwen3's 151,936 by default) for a few
batch sizes, for five kinds of batch: greedy (``greedy_tokens``, the floor), temperature only,
temperature with top-k and top-p, top-p alone, and every row seeded (a generator a row).
Reported: the median milliseconds a batch over ``--repeat`` calls, and each kind's ratio to
greedy's.

The logits are normal with standard deviation ``--spread``. How much of the vocabulary a top-p
cut keeps depends on it, and so does top-p alone's cost on a CPU (``top_p_cut`` sorts the 1,024
likeliest tokens first and the whole row only when they sum to less than ``top_p``): at 1 the
rows are nearly flat and a cut at 0.9 keeps most of the vocabulary; at 4, peaked as a trained
model's usually are, it keeps a few tokens.

    uv run python benchmarks/bench_sampling.py [--device cpu|cuda] [--vocab N] [--spread S]
"""

import argparse
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from vkv.engine.model_runner import Draw, draw_tokens, greedy_tokens
from vkv.sampling_params import SamplingParams

KINDS = {
    "temperature": SamplingParams(temperature=0.8),
    "top-k + top-p": SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
    "top-p": SamplingParams(temperature=0.8, top_p=0.9),
    "seeded": SamplingParams(temperature=0.8, seed=1),
}


def median_ms(call, repeat: int) -> float:
    call()  # warm-up: the first call allocates
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        call()  # returns host lists: the device's work is done when it returns
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--spread", type=float, default=1.0, help="the logits' standard deviation")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 128])
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    title = f"drawing a step's tokens, vocabulary {args.vocab}, logits' spread {args.spread}"
    table = Table(title=f"{title}, on {args.device}")
    table.add_column("batch", justify="right")
    table.add_column("greedy ms", justify="right")
    for kind in KINDS:
        table.add_column(f"{kind} ms (x greedy)", justify="right")
    for batch in args.batches:
        generator = torch.Generator().manual_seed(batch)
        logits = torch.randn(batch, args.vocab, generator=generator) * args.spread
        logits = logits.to(args.device)
        greedy = median_ms(lambda logits=logits: greedy_tokens(logits), args.repeat)
        cells = [str(batch), f"{greedy:.3f}"]
        for params in KINDS.values():
            draws = [Draw(row, params, [], 100 + row) for row in range(batch)]
            took = median_ms(lambda d=draws, x=logits: draw_tokens(x, d), args.repeat)
            cells.append(f"{took:.3f} ({took / greedy:.1f}x)")
        table.add_row(*cells)
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
