"""The engine's decode step with and without CUDA graphs, and in each KV-cache format.

The same requests (greedy, ``ignore_eos``) go through one engine per variant, one after the
other in one process, each warmed up first: tokens per second over the whole run, the median
time of a full-batch decode step, and on CUDA the share of that step the GPU computes
(``vkv.bench.gpu_busy_share``: torch.profiler's kernel time over the wall time of steps run
without it). Ratios are against the first variant (the 16-bit cache as the engine runs by
default).

- On CUDA: 16-bit replayed from CUDA graphs (the default), 16-bit eager (``enforce_eager``), and
  INT8 and INT4 caches per token (from graphs too, their NaN refusal a flag on the device), INT8
  eager beside them. What issue 43 asks of
  them: tokens/s >= 10,000 for Qwen3-0.6B's shape on nano-vLLM's workload on an H200, the GPU
  busy >= 70 % of a full-batch decode step, INT8's tokens/s >= 16-bit's.
- On a CPU, where nothing is captured: 16-bit, 16-bit on the graphs' padded static buffers run
  eagerly (what the padding costs), and INT8.

    python benchmarks/bench_decode_step.py [--model DIR --load-format dummy] [--requests N]
        [--workload mixed|nano-vllm] [--out DIR]
"""

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from vkv.bench import WORKLOADS, Workload, gpu_busy_share, is_full_decode, run_vkv
from vkv.engine.decode_graphs import graph_batch_sizes
from vkv.engine.llm_engine import LLMEngine
from vkv.models.loader import DEFAULT_MODEL


def variants(device: str) -> dict[str, dict]:
    """Each variant's name and the engine options (plus ``padded``: the CPU's padded buffers)."""
    if device == "cuda":
        return {
            "16-bit, CUDA graphs": {},
            "16-bit, eager": {"enforce_eager": True},
            "int8": {"kv_cache_dtype": "int8"},
            "int8, eager": {"kv_cache_dtype": "int8", "enforce_eager": True},
            "int4": {"kv_cache_dtype": "int4"},
        }
    return {
        "16-bit": {},
        "16-bit, padded buffers": {"padded": True},
        "int8": {"kv_cache_dtype": "int8"},
    }


def measure(engine: LLMEngine, workload: Workload, batch: int) -> dict:
    """One warmed-up run of ``workload``: tokens/s, the median full-batch decode step, and the
    GPU-busy share of such a step (None off CUDA)."""
    run_vkv(engine, Workload(workload.prompts[:2], [4, 4]))
    run = run_vkv(engine, workload)
    full = [s["step_seconds"] for s in run.steps if is_full_decode(s, batch)]
    return {
        "tokens_per_s": workload.output_tokens / run.seconds,
        "seconds": run.seconds,
        "full_decode_step_ms": 1e3 * statistics.median(full) if full else None,
        "gpu_busy_share": gpu_busy_share(engine, workload, batch),
        "completions": run.completions,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--workload", choices=list(WORKLOADS), default="mixed")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--kv-cache-gib", type=float, default=None, help="default: the engine's")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    shape = WORKLOADS[args.workload]
    budget = None if args.kv_cache_gib is None else int(args.kv_cache_gib * 2**30)
    results, first = {}, None
    for name, options in variants(args.device).items():
        padded = options.pop("padded", False)
        engine = LLMEngine(
            args.model,
            device=args.device,
            load_format=args.load_format,
            max_num_seqs=args.max_num_seqs,
            max_model_len=shape.prompt_lens[1] + shape.output_lens[1],
            kv_cache_bytes=budget,
            **options,
        )
        if padded:
            tables = -(-engine.config.max_model_len // engine.config.block_size)
            engine.runner.use_decode_graphs(graph_batch_sizes(args.max_num_seqs), tables, False)
        workload = Workload.mixed(
            lambda text, e=engine: e.tokenizer.encode(text).ids,
            args.requests or shape.num_requests,
            shape.prompt_lens,
            shape.output_lens,
        )
        started = time.perf_counter()
        results[name] = measure(engine, workload, min(args.max_num_seqs, len(workload.prompts)))
        results[name]["bench_seconds"] = time.perf_counter() - started
        graphs = engine.runner.decode_graphs
        results[name]["cuda_graphs"] = graphs is not None and graphs.capture
        first = first or results[name]
        del engine
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    header = ("variant", "graphs", "tokens/s", "x first", "step ms", "GPU busy", "same")
    print("{:28} {:>6} {:>10} {:>8} {:>8} {:>9} {}".format(*header))
    for name, result in results.items():
        step, busy = result["full_decode_step_ms"], result["gpu_busy_share"]
        same = sum(a == b for a, b in zip(result["completions"], first["completions"], strict=True))
        result["same_completions_as_first"] = same
        speed = result["tokens_per_s"]
        print(
            f"{name:28} {'yes' if result['cuda_graphs'] else 'no':>6} {speed:10,.0f} "
            f"{speed / first['tokens_per_s']:8.2f} "
            f"{'-' if step is None else f'{step:.2f}':>8} "
            f"{'-' if busy is None else f'{busy:.0%}':>9} {same}/{len(first['completions'])}"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for result in results.values():
        del result["completions"]
    (out / "decode_step.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
