"""Synthetic request sets for the benchmarks, seeded and reproducible.

- ShareGPT-like and Alpaca-like: prompt and output lengths drawn from log-normal distributions
  whose means are the PagedAttention paper's (§6.1: ShareGPT 161.31 / 337.99 tokens, Alpaca
  19.31 / 58.45), clipped so that prompt + output fits ``max_model_len``; Poisson arrivals.
- The nano-vLLM trace (its ``bench.py``): prompts and outputs uniform in 100..1024 tokens, all
  arriving at once.
"""

import math
import random

from vkv.engine.simulator import Request

SHAREGPT_MEANS = (161.31, 337.99)
ALPACA_MEANS = (19.31, 58.45)


def lognormal_workload(
    means: tuple[float, float],
    num_requests: int,
    rate: float,
    max_model_len: int,
    seed: int = 0,
    sigma: float = 1.0,
) -> list[Request]:
    """Log-normal prompt/output lengths with the given means; Poisson arrivals at ``rate``/s."""
    rng = random.Random(seed)
    mus = [math.log(mean) - sigma * sigma / 2 for mean in means]
    requests, clock = [], 0.0
    while len(requests) < num_requests:
        prompt = max(1, round(rng.lognormvariate(mus[0], sigma)))
        output = max(1, round(rng.lognormvariate(mus[1], sigma)))
        if prompt + output > max_model_len:
            continue  # the paper's traces, too, drop what the model cannot hold
        clock += rng.expovariate(rate)
        requests.append(Request(clock, prompt, output))
    return requests


def sharegpt_like(num_requests: int, rate: float, max_model_len: int, seed: int = 0):
    return lognormal_workload(SHAREGPT_MEANS, num_requests, rate, max_model_len, seed)


def alpaca_like(num_requests: int, rate: float, max_model_len: int, seed: int = 0):
    return lognormal_workload(ALPACA_MEANS, num_requests, rate, max_model_len, seed)


def nanovllm_trace(num_requests: int = 256, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    return [
        Request(0.0, rng.randint(100, 1024), rng.randint(100, 1024)) for _ in range(num_requests)
    ]


def mean_lengths(requests: list[Request]) -> tuple[float, float]:
    n = len(requests)
    return sum(r.prompt_len for r in requests) / n, sum(r.output_len for r in requests) / n
