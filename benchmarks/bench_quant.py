"""KV-cache quantization on vkv-tiny: quality against bytes per token, side by side in one run.

For each KV format (unquantized; INT8 and INT4 per token and head, as the engine stores them;
INT8 and INT4 with KIVI's keys per channel, values per token), on the held-out split of
vkv-tiny's corpus (``scripts/train_vkv_tiny.py``'s path hash over this Python's standard
library):

- held-out bits per byte, teacher-forced over whole windows: each window is prefilled through
  the engine's paged cache, so attention reads every key and value (its own included) as the
  cache stores it, dequantized (the windows are whole blocks, so keys per channel are all
  quantized: none waits in the residual);
- bytes per token (a 16-bit model: 16-bit values, or codes with 16-bit scales and zeros) and
  blocks of 16 tokens in a 256 MiB budget;
- INT8 and INT4 with one scale and zero per token over all KV heads (``kv_quant_group="token"``,
  a group of ``kv_heads * head_dim``): at vkv-tiny's head_dim of 32, per-head scales weigh too
  much to reach 1.9x and 3.5x the blocks of 16-bit KV;
- greedy agreement with the unquantized cache: 32 held-out prompts of 64 bytes, 256 generated
  tokens each (``--tokens``), the share of tokens before the first difference, and how many are
  identical;
- decode throughput of that generation on this machine (the fastest of ``--rounds``
  interleaved runs, after a warm-up; tokens per second and the ratio to unquantized: the
  machines are shared, only ratios within one run mean anything).

    uv run python benchmarks/bench_quant.py [--windows 96] [--prompts 32] [--tokens 256] [--out DIR]

Prints a table, writes ``bench_quant.json`` and ``bench_quant.png`` (quality against bytes per
token) to ``--out`` (default ``benchmarks/results``).
"""

import argparse
import importlib.util
import json
import math
import sysconfig
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from vkv import LLM
from vkv.bench import benchmark_params
from vkv.engine.cache_engine import CacheEngine, CacheShape
from vkv.kernels import reference
from vkv.models.qwen3 import AttentionMetadata

ROOT = Path(__file__).resolve().parents[1]
WINDOW = 256
BLOCK = 16
BUDGET = 256 << 20
FORMATS = {  # name: (kv_cache_dtype, key granularity, quantization group)
    "16-bit": ("auto", "per_token", "head"),
    "int8 per token": ("int8", "per_token", "head"),
    "int4 per token": ("int4", "per_token", "head"),
    "int8 keys per channel": ("int8", "per_channel", "head"),
    "int4 keys per channel": ("int4", "per_channel", "head"),
    "int8, one scale per token": ("int8", "per_token", "token"),
    "int4, one scale per token": ("int4", "per_token", "token"),
}


def held_out_stream() -> torch.Tensor:
    """vkv-tiny's held-out token stream, as its training script splits the corpus."""
    path = ROOT / "scripts" / "train_vkv_tiny.py"
    spec = importlib.util.spec_from_file_location("train_vkv_tiny", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    _, held_out, _ = script.encode_corpus(Path(sysconfig.get_paths()["stdlib"]))
    return held_out


@torch.inference_mode()
def bits_per_byte(llm: LLM, windows: torch.Tensor, kv: str, keys: str, group: str) -> float:
    """Teacher-forced next-token loss over ``windows`` [n, WINDOW + 1], in bits per byte."""
    model, config = llm.engine.model, llm.engine.model.config
    per_window = WINDOW // BLOCK
    total = 0.0
    for batch in windows.split(8):
        shape = CacheShape(
            config.num_layers,
            BLOCK,
            config.num_kv_heads,
            config.head_dim,
            torch.float32,
            kv,
            keys,
            group,
        )
        cache = CacheEngine(shape, len(batch) * per_window, 0, torch.device("cpu"), len(batch))
        cache.plan_step(list(range(len(batch) * WINDOW)))
        tables = torch.arange(len(batch) * per_window, dtype=torch.int32).view(len(batch), -1)
        meta = AttentionMetadata(
            is_prefill=True,
            slot_mapping=torch.arange(len(batch) * WINDOW),
            block_tables=tables,
            context_lens=torch.full((len(batch),), WINDOW, dtype=torch.int32),
            cu_seqlens_q=torch.arange(len(batch) + 1, dtype=torch.int32) * WINDOW,
        )
        positions = torch.arange(WINDOW).repeat(len(batch))
        caches = [cache.layer(i) for i in range(config.num_layers)]
        logits = model(batch[:, :-1].flatten(), positions, caches, meta, reference)
        total += torch.nn.functional.cross_entropy(
            logits.float(), batch[:, 1:].flatten(), reduction="sum"
        ).item()
    return total / (windows.numel() - len(windows)) / math.log(2)


def generate_all(
    prompts: list[list[int]], rounds: int, max_tokens: int = 256
) -> dict[str, tuple[list[list[int]], float]]:
    """Each format's greedy completions of ``max_tokens`` and its fastest decode speed (tokens
    per second) over ``rounds`` interleaved runs, after one warm-up run each."""
    params = benchmark_params(max_tokens)
    engines = {
        name: LLM(
            kv_cache_dtype=kv,
            key_granularity=keys,
            kv_quant_group=group,
            block_size=BLOCK,
            num_gpu_blocks=1024,
            max_num_seqs=64,
        )
        for name, (kv, keys, group) in FORMATS.items()
    }
    tokens: dict[str, list[list[int]]] = {}
    fastest = dict.fromkeys(engines, 0.0)
    for round_ in range(rounds + 1):
        for kv, llm in engines.items():
            started = time.perf_counter()
            outputs = llm.generate(prompts, params, use_progress=False)
            speed = max_tokens * len(prompts) / (time.perf_counter() - started)
            tokens[kv] = [o["token_ids"] for o in outputs]
            if round_:  # the first round warms up
                fastest[kv] = max(fastest[kv], speed)
    return {kv: (tokens[kv], fastest[kv]) for kv in engines}


def agreement(ours: list[list[int]], base: list[list[int]]) -> tuple[float, int]:
    """The mean share of tokens before the first difference, and how many are identical."""
    shares, same = [], 0
    for a, b in zip(ours, base, strict=True):
        prefix = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(b))
        shares.append(prefix / len(b))
        same += a == b
    return sum(shares) / len(shares), same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", type=int, default=96)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=256, help="generated a prompt")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timed generations")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    console = Console(width=140)
    stream = held_out_stream()
    stride = (len(stream) - WINDOW - 1) // args.windows
    windows = torch.stack(
        [stream[i * stride : i * stride + WINDOW + 1] for i in range(args.windows)]
    )
    step = len(stream) // args.prompts
    prompts = [stream[i * step + 7 : i * step + 71].tolist() for i in range(args.prompts)]
    llm = LLM(block_size=BLOCK, num_gpu_blocks=8)
    config = llm.engine.model.config
    generated = generate_all(prompts, args.rounds, args.tokens)
    base_tokens, base_speed = generated["16-bit"]
    results = {}
    for name, (kv, keys, group) in FORMATS.items():
        shape = CacheShape(
            config.num_layers,
            BLOCK,
            config.num_kv_heads,
            config.head_dim,
            torch.float16,
            kv,
            keys,
            group,
        )
        cost = shape.block_bytes / BLOCK  # a 16-bit model: 16-bit scales
        row = {
            "bits_per_byte": round(bits_per_byte(llm, windows, kv, keys, group), 4),
            "bytes_per_token": cost,
            "blocks_in_256MiB": int(BUDGET // (cost * BLOCK)),  # 16-bit model and scales
        }
        tokens, speed = generated[name]
        share, same = agreement(tokens, base_tokens)
        row |= {
            "greedy_prefix_agreement": round(share, 4),
            "greedy_identical": f"{same}/{len(prompts)}",
            "decode_tokens_per_s": round(speed, 1),
            "decode_speed_ratio": round(speed / base_speed, 3),
        }
        results[name] = row
    base = results["16-bit"]
    for row in results.values():
        row["bits_per_byte_change_pct"] = round(
            100 * (row["bits_per_byte"] / base["bits_per_byte"] - 1), 3
        )
        row["capacity_ratio"] = round(row["blocks_in_256MiB"] / base["blocks_in_256MiB"], 3)
    show(console, results, args.windows, f"{args.prompts} prompts x {args.tokens}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_quant.json").write_text(json.dumps(results, indent=2))
    plot(results, args.out / "bench_quant.png")
    console.print(f"wrote {args.out / 'bench_quant.json'} and {args.out / 'bench_quant.png'}")


def show(console: Console, results: dict, windows: int, generation: str) -> None:
    table = Table(title=f"vkv-tiny, held out: {windows} windows of {WINDOW} bytes; {generation}")
    columns = [
        ("format", None),
        ("bits/byte", "bits_per_byte"),
        ("change", "bits_per_byte_change_pct"),
        ("bytes/token", "bytes_per_token"),
        ("blocks in 256 MiB", "blocks_in_256MiB"),
        ("vs 16-bit", "capacity_ratio"),
        ("greedy prefix", "greedy_prefix_agreement"),
        ("identical", "greedy_identical"),
        ("decode speed", "decode_speed_ratio"),
    ]
    for title, _ in columns:
        table.add_column(title, justify="left" if title == "format" else "right")
    for name, row in results.items():
        table.add_row(name, *(str(row.get(key, "-")) for _, key in columns[1:]))
    console.print(table)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for index, (name, row) in enumerate(results.items()):
        point = (row["bytes_per_token"], row["bits_per_byte"])
        ax.scatter(*point)
        offset = (6, 8 if index % 2 else -12)  # neighbours (int8 both ways) apart
        ax.annotate(name, point, xytext=offset, textcoords="offset points", fontsize=8)
    ax.set_xlabel("KV bytes per token (16-bit scales counted)")
    ax.set_ylabel("held-out bits per byte")
    ax.set_title("vkv-tiny: KV-cache quantization, quality against memory")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
