"""``vkv demo``: watch paged KV memory at work on the built-in model.

A batch of Python prompts of mixed lengths is served by vkv-tiny with a KV cache deliberately
too small to hold them all at once, so the scheduler has to queue requests, preempt running
ones (by swapping their blocks to the CPU pool, or by dropping them to recompute later) and
resume them. Every step the view shows the queues, both block pools (each block coloured by the
request that owns it: a request's blocks are scattered, not contiguous) and each request's
progress, at a pace a person can follow (``steps_per_second``; ``--fast``: as fast as the
engine goes). A summary ends the run.

The pool is ``gpu_blocks`` blocks in every KV format, so the same experiment preempts in each;
what a quantized format changes is the bytes those blocks take, which the summary compares with
a 16-bit cache of as many blocks (the README's baseline).
"""

import random
import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from vkv.config import Config
from vkv.engine.cache_engine import sixteen_bit_ratio
from vkv.engine.llm_engine import LLMEngine
from vkv.engine.outputs import FINISH_REASONS
from vkv.engine.sequence import Sequence, SequenceStatus
from vkv.recording import RecordTo
from vkv.sampling_params import SamplingParams

PROMPTS = [
    "import os\n",
    "def fibonacci(n):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "    for line in lines:\n        if not line.strip():\n            continue\n",
    'def read_config(path):\n    """Return the settings stored in the file at path."""\n',
    "        except KeyError:\n            raise ValueError(",
    "import sys\n\n\ndef main(argv=None):\n    if argv is None:\n        argv = sys.argv\n",
    "    def __repr__(self):\n        return ",
    '"""Utilities for parsing and formatting dates."""\n\nimport time\n\n__all__ = [',
    "def _check_arg(value, name):\n    if not isinstance(value, int):\n        raise TypeError(",
    "class Error(Exception):\n    pass\n\n\nclass Parser:\n    def __init__(self, text):\n",
    "    return result\n\n\ndef ",
]
PALETTE = ["red", "green", "yellow", "blue", "magenta", "cyan", "bright_red", "bright_green"]
PALETTE += ["bright_yellow", "bright_blue", "bright_magenta", "bright_cyan", "orange3", "purple"]
REFRESH_SECONDS = 0.25  # --fast: at most one frame per this many seconds
STEPS_PER_SECOND = 8.0  # the live view's default pace: every step drawn, this many a second
STATES = {
    SequenceStatus.WAITING: "waiting",
    SequenceStatus.RUNNING: "running",
    SequenceStatus.SWAPPED: "swapped",
}


@dataclass(slots=True)
class DemoSummary:
    requests: int
    generated_tokens: int
    seconds: float
    steps: int
    preemptions: int
    blocks_swapped_out: int
    blocks_swapped_in: int
    peak_gpu_kv_usage: float
    mean_running: float
    finish_reasons: dict[str, int]
    sample: tuple[str, str]  # the longest completion's prompt and first lines

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds else 0.0


def run_demo(
    console: Console,
    *,
    model: str | None = None,
    requests: int = 24,
    gpu_blocks: int = 48,
    cpu_blocks: int = 64,
    block_size: int = 16,
    preemption_mode: str = "swap",
    max_tokens: int = 160,
    live: bool = True,
    steps_per_second: float | None = STEPS_PER_SECOND,
    kv_cache_dtype: str = "auto",
    key_granularity: str = "per_token",
    kv_quant_group: str = "head",
    enable_prefix_caching: bool = False,
    record: RecordTo | None = None,
    watched: bool = False,
    tensor_parallel_size: int = 1,
) -> DemoSummary:
    """Serve ``requests`` prompts and show each step; return what happened.

    ``gpu_blocks`` is the device pool's size in blocks, whatever the KV format (keys per
    channel add their full-precision residual on top). In the live view every step is drawn,
    ``steps_per_second`` of them a second; ``None`` draws at most a frame every
    ``REFRESH_SECONDS`` and never waits. ``record`` takes the run's recording, as
    ``LLMEngine``'s does (a file for ``vkv view``, a ``LiveRecording`` for the live page);
    ``watched``: a live page shows the run, so it keeps the pace without the terminal view.
    """
    if requests < 1:
        raise ValueError(f"the demo needs at least one request, got {requests}")
    if max_tokens < 1:
        raise ValueError(f"the longest completion (--max-tokens) must be >= 1, got {max_tokens}")
    if gpu_blocks < 1:
        raise ValueError(f"the device KV pool (--gpu-blocks) must be >= 1 block, got {gpu_blocks}")
    if steps_per_second is not None and not steps_per_second > 0:
        raise ValueError(f"the pace (steps per second) must be > 0, got {steps_per_second}")
    engine = LLMEngine(
        model,
        block_size=block_size,
        num_gpu_blocks=gpu_blocks,
        num_cpu_blocks=cpu_blocks,
        preemption_mode=preemption_mode,
        max_model_len=gpu_blocks * block_size,
        max_num_seqs=requests,
        kv_cache_dtype=kv_cache_dtype,
        key_granularity=key_granularity,
        kv_quant_group=kv_quant_group,
        enable_prefix_caching=enable_prefix_caching,
        record=record,
        tensor_parallel_size=tensor_parallel_size,
    )
    lengths = random.Random(0)
    for i in range(requests):
        params = SamplingParams(
            temperature=0.7,
            top_p=0.95,
            max_tokens=lengths.randint(max(1, max_tokens // 4), max_tokens),
            seed=i,
        )
        engine.add_request(PROMPTS[i % len(PROMPTS)], params)
    seqs = [engine.sequence(i) for i in range(requests)]
    history: list[dict[str, float]] = []
    started = shown = time.perf_counter()
    paced = steps_per_second is not None and (live or watched)
    with Live(console=console, auto_refresh=False) if live else nullcontext() as view:
        while engine.has_unfinished_requests():
            engine.step()
            history.append(dict(engine.stats))
            if paced:
                if live:
                    view.update(_render(engine, seqs, history, started), refresh=True)
                time.sleep(max(0.0, shown + 1 / steps_per_second - time.perf_counter()))
                shown = time.perf_counter()
            elif live and time.perf_counter() - shown >= REFRESH_SECONDS:
                view.update(_render(engine, seqs, history, started), refresh=True)
                shown = time.perf_counter()
        if live:
            view.update(_render(engine, seqs, history, started), refresh=True)
    summary = _summarize(engine, seqs, history, time.perf_counter() - started)
    console.print(_summary_table(summary, engine))
    engine.close()
    return summary


def _summarize(
    engine: LLMEngine, seqs: list[Sequence], history: list[dict], seconds: float
) -> DemoSummary:
    return DemoSummary(
        requests=len(seqs),
        generated_tokens=sum(seq.num_completion_tokens for seq in seqs),
        seconds=seconds,
        steps=len(history),
        preemptions=engine.scheduler.num_preemptions,
        blocks_swapped_out=int(sum(s["blocks_swapped_out"] for s in history)),
        blocks_swapped_in=int(sum(s["blocks_swapped_in"] for s in history)),
        peak_gpu_kv_usage=max(s["gpu_kv_usage"] for s in history),
        mean_running=sum(s["running"] for s in history) / len(history),
        finish_reasons=dict(Counter(FINISH_REASONS[seq.status] for seq in seqs)),
        sample=_longest(engine, seqs),
    )


def _longest(engine: LLMEngine, seqs: list[Sequence], lines: int = 12) -> tuple[str, str]:
    """The prompt and the first ``lines`` lines of the longest completion."""
    seq = max(seqs, key=lambda seq: seq.num_completion_tokens)
    completion = engine.decode(seq.completion_token_ids)
    return engine.decode(seq.prompt_token_ids), "\n".join(completion.split("\n")[:lines])


def _render(engine: LLMEngine, seqs: list[Sequence], history: list[dict], started: float) -> Group:
    stats = history[-1]
    finished = sum(seq.is_finished for seq in seqs)
    generated = sum(seq.num_completion_tokens for seq in seqs)
    elapsed = time.perf_counter() - started
    header = Text.assemble(
        (f"step {len(history)}", "bold"),
        f"   running {stats['running']:.0f}   waiting {stats['waiting']:.0f}"
        f"   swapped {stats['swapped']:.0f}   finished {finished}/{len(seqs)}"
        f"   preemptions {stats['preemptions']:.0f}"
        f"   {generated / elapsed if elapsed else 0:.0f} tokens/s",
    )
    manager = engine.scheduler.block_manager
    gpu = _block_map(seqs, SequenceStatus.RUNNING, manager.num_gpu_blocks)
    cpu = _block_map(seqs, SequenceStatus.SWAPPED, engine.config.num_cpu_blocks)
    pools = Group(
        Text(
            f"GPU blocks, here on {engine.device} ({stats['gpu_kv_usage']:.0%} used)", style="bold"
        ),
        gpu,
        Text(f"CPU swap blocks ({stats['cpu_kv_usage']:.0%} used)", style="bold"),
        cpu,
    )
    return Group(header, Panel(pools, title="KV cache"), _request_table(engine, seqs))


def _block_map(seqs: list[Sequence], status: SequenceStatus, num_blocks: int) -> Text:
    """One cell per physical block of a pool, coloured by the request holding it."""
    owner = {block: seq.seq_id for seq in seqs if seq.status == status for block in seq.block_table}
    text = Text()
    for block in range(num_blocks):
        if block in owner:
            text.append("■ ", style=PALETTE[owner[block] % len(PALETTE)])
        else:
            text.append("· ", style="dim")
        if block % 32 == 31 and block + 1 < num_blocks:
            text.append("\n")
    return text


def _request_table(engine: LLMEngine, seqs: list[Sequence], rows: int = 12) -> Table:
    table = Table(box=None, pad_edge=False, expand=True)
    for column in ("req", "state", "prompt", "generated", "blocks", "latest text"):
        table.add_column(column, no_wrap=True, overflow="ellipsis")
    active = [seq for seq in seqs if not seq.is_finished]
    active.sort(key=lambda seq: (seq.status != SequenceStatus.RUNNING, seq.seq_id))
    for seq in active[:rows]:
        tail = engine.decode(seq.completion_token_ids[-48:]).replace("\n", "⏎")
        table.add_row(
            Text(str(seq.seq_id), style=PALETTE[seq.seq_id % len(PALETTE)]),
            STATES.get(seq.status, "finished"),
            str(len(seq.prompt_token_ids)),
            f"{seq.num_completion_tokens}/{seq.sampling_params.max_tokens}",
            str(len(seq.block_table)),
            Text(tail),
        )
    return table


def _summary_table(summary: DemoSummary, engine: LLMEngine) -> Table:
    config = engine.config
    table = Table(title="vkv demo: summary", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    rows = {
        "KV cache": f"{config.num_gpu_blocks} GPU blocks + {config.num_cpu_blocks} CPU blocks "
        f"of {config.block_size} tokens ({config.kv_cache_dtype}{_keys_note(config)}), "
        "preemption by "
        f"{config.preemption_mode.value}",
        "GPU KV bytes": _bytes_note(engine),
        "requests": f"{summary.requests}, finished by "
        + ", ".join(
            f"{reason} {count}" for reason, count in sorted(summary.finish_reasons.items())
        ),
        "generated tokens": f"{summary.generated_tokens:,}",
        "wall time": f"{summary.seconds:.1f} s ({summary.tokens_per_second:,.0f} tokens/s)",
        "steps": f"{summary.steps} (mean running batch {summary.mean_running:.1f})",
        "preemptions": str(summary.preemptions),
        "blocks swapped out / in": f"{summary.blocks_swapped_out} / {summary.blocks_swapped_in}",
        "peak GPU KV usage": f"{summary.peak_gpu_kv_usage:.0%}",
        "prefix cache": _prefix_note(engine),
        "longest completion": Text.assemble((summary.sample[0], "bold"), summary.sample[1]),
    }
    for name, value in rows.items():
        table.add_row(name, value)
    return table


def _prefix_note(engine: LLMEngine) -> str:
    """Prompt tokens served from the prefix cache (first admissions), or that it is off."""
    if not engine.config.enable_prefix_caching:
        return "off (--enable-prefix-caching shares the blocks of repeated prompt prefixes)"
    queries, hits = engine.stats["prefix_cache_queries"], engine.stats["prefix_cache_hits"]
    return f"{hits:,} of {queries:,} prompt tokens hit ({hits / max(queries, 1):.0%})"


def _bytes_note(engine: LLMEngine) -> str:
    """The device pool's bytes (a rank's, with tensor parallelism); for a quantized cache,
    against 16-bit blocks as many."""
    shape = engine.cache_engine.shape
    pool = engine.config.num_gpu_blocks * shape.block_bytes
    size = f"{pool / 2**20:.1f} MiB" + (" per rank" if engine.parallel else "")
    if not shape.quantized:
        return f"{size} ({shape.dtype})"
    return f"{size}, {sixteen_bit_ratio(shape):.2f}x less than 16-bit"


def _keys_note(config: Config) -> str:
    """The quantized format's options that differ from the default, as the summary names them."""
    keys = ", keys per channel" if config.key_granularity == "per_channel" else ""
    return keys + (", one scale per token" if config.kv_quant_group == "token" else "")
