"""Recordings of the KV cache at work: one JSON line per engine step, replayed by ``vkv view``.

``LLMEngine(record=PATH)`` (``vkv demo --record PATH``) writes a header line, then after every
step a line with the state that step left: what the scheduler decided, both block pools, each
live sequence's block table and queue, and the radix tree when prefix caching is on. The format
is ``vkv-record/1``, described by the JSON Schema ``vkv/view/recording.schema.json``; the page
of ``vkv view`` reads it, and ``read_recording`` checks it line by line. The same lines feed
the live page of ``vkv demo --web`` and ``vkv serve --view-port`` (``LiveRecording``).

Header line::

    {"schema": "vkv-record/1", "kind": "header", "model": ..., "config": {block_size,
     num_gpu_blocks, num_cpu_blocks, watermark_blocks, preemption_mode, kv_cache_dtype,
     key_granularity, kv_quant_group, enable_prefix_caching}, "kv": {dtype, block_bytes,
     bytes_per_token, sixteen_bit_ratio}}

Step line (``step`` counts from 1)::

    {"kind": "step", "step": n,
     "schedule": {"kind": prefill|decode|mixed|idle, "scheduled": [[seq, tokens, is_prefill]],
                  "preempted": [seq], "ignored": [[seq, reason]], "swap_out": [[gpu, cpu]],
                  "swap_in": [[cpu, gpu]], "copy": [[src, dst]], "prefix_hit_tokens": n},
     "gpu": POOL, "cpu": POOL,
     "sequences": [{"id", "status", "prompt_tokens", "completion_tokens", "computed_tokens",
                    "max_tokens", "block_table"}],
     "tree": [{"id", "parent", "blocks", "tokens", "lock", "last_access"}]  (caching on)}

``prefix_hit_tokens`` counts the prompt tokens that the step's first admissions took from the
prefix cache (0 without it). A ``POOL`` is ``{"size": N, "held": [block, ...], "ref_counts":
[[block, n]], "cached": [[block, hash]]}``: the blocks in use, ascending; the reference count
of each block in use whose count is not 1; the blocks that are free but keep cached content
(evictable, prefix caching only; the hash as 16 hex digits); and, implied, the rest: free. A
block's owners are the sequences whose ``block_table`` holds it: the running ones for the GPU
pool, the swapped ones for the CPU pool (so the line does not repeat the tables; a block in
use that no table holds is a leak, and shows as such). A sequence is listed while it is
waiting, running or swapped, and in the step it finishes (its status then
``finished_stopped`` and the like). The radix tree's hold on a cached block is its node's
``lock``.
"""

import json
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SCHEMA = "vkv-record/1"
SCHEMA_FILE = Path(__file__).parent / "view" / "recording.schema.json"


Sink = Callable[[str], None]  # takes each line of a recording
RecordTo = str | Path | Sink | list[str | Path | Sink]  # a file's path, a sink, or several


class RecordingError(ValueError):
    """A recording that cannot be replayed; the message names the file and the line."""


@dataclass(slots=True)
class Recording:
    header: dict
    steps: list[dict]


def header(engine) -> dict:
    """The header line for ``engine``: its KV-cache configuration and format."""
    from vkv.engine.cache_engine import sixteen_bit_ratio  # torch: vkv view reads without it

    config, shape = engine.config, engine.cache_engine.shape
    return {
        "schema": SCHEMA,
        "kind": "header",
        "model": engine.metrics.model_name,
        "config": {
            "block_size": config.block_size,
            "num_gpu_blocks": config.num_gpu_blocks,
            "num_cpu_blocks": config.num_cpu_blocks,
            "watermark_blocks": engine.scheduler.block_manager.watermark_blocks,
            "preemption_mode": config.preemption_mode.value,
            "kv_cache_dtype": config.kv_cache_dtype,
            "key_granularity": config.key_granularity,
            "kv_quant_group": config.kv_quant_group,
            "enable_prefix_caching": config.enable_prefix_caching,
        },
        "kv": {
            "dtype": str(shape.dtype).removeprefix("torch."),
            "block_bytes": shape.block_bytes,
            "bytes_per_token": shape.block_bytes / config.block_size,
            "sixteen_bit_ratio": sixteen_bit_ratio(shape),
        },
    }


def step_record(engine, number: int, out, prefix_hit_tokens: int = 0) -> dict:
    """The line for step ``number``, which ran ``out`` (a ``SchedulerOutput``) and took
    ``prefix_hit_tokens`` prompt tokens from the prefix cache."""
    scheduler = engine.scheduler
    manager = scheduler.block_manager
    live = [*scheduler.running, *scheduler.waiting, *scheduler.swapped]
    ended = [item.seq for item in out.scheduled if item.seq.is_finished]
    ended += [item.seq for item in out.ignored]
    sequences = live + ended
    tree = _tree(manager.tree) if engine.config.enable_prefix_caching else None
    record = {
        "kind": "step",
        "step": number,
        "schedule": {
            "kind": out.kind,
            "scheduled": [[i.seq.seq_id, i.num_tokens, i.is_prefill] for i in out.scheduled],
            "preempted": [seq.seq_id for seq in out.preempted],
            "ignored": [[item.seq.seq_id, item.reason] for item in out.ignored],
            "swap_out": sorted(out.blocks_to_swap_out.items()),
            "swap_in": sorted(out.blocks_to_swap_in.items()),
            "copy": sorted((src, dst) for src, dsts in out.blocks_to_copy.items() for dst in dsts),
            "prefix_hit_tokens": prefix_hit_tokens,
        },
        "gpu": _pool(manager.gpu_allocator, scheduler.running, tree),
        "cpu": _pool(manager.cpu_allocator, scheduler.swapped),
        "sequences": [_sequence(seq) for seq in sequences],
    }
    if tree is not None:
        record["tree"] = tree
    return record


def _pool(allocator, holders, tree: list[dict] | None = None) -> dict:
    """One pool's blocks in use and free cached blocks. Those in use are found from the holders'
    tables and the cached ones from the tree's unlocked nodes, without visiting every block of
    a large pool; where those disagree with the allocator's counts (a block that no table
    holds, a table that holds a freed block), every block is visited instead, so the recording
    shows what the allocator holds, a leak included."""
    blocks = allocator.blocks
    in_tables = {block for seq in holders for block in seq.block_table}
    ref_counts = [(b, blocks[b].ref_count) for b in in_tables]
    in_use = allocator.num_blocks - allocator.num_free_blocks
    if len(in_tables) != in_use or not all(count for _, count in ref_counts):
        ref_counts = [(b.block_id, b.ref_count) for b in blocks if b.ref_count]
    unlocked = [b for node in tree or () if node["lock"] == 0 for b in node["blocks"]]
    if len(unlocked) == len(allocator.evictor) and all(
        blocks[b].content_hash is not None and not blocks[b].ref_count for b in unlocked
    ):
        cached = sorted(unlocked)
    else:
        cached = [b.block_id for b in blocks if not b.ref_count and b.content_hash is not None]
    return {
        "size": len(blocks),
        "held": sorted(b for b, _ in ref_counts),
        "ref_counts": sorted([b, count] for b, count in ref_counts if count != 1),
        "cached": [[b, f"{blocks[b].content_hash & (2**64 - 1):016x}"] for b in cached],
    }


def _sequence(seq) -> dict:
    return {
        "id": seq.seq_id,
        "status": seq.status.name.lower(),
        "prompt_tokens": seq.num_prompt_tokens,
        "completion_tokens": seq.num_completion_tokens,
        "computed_tokens": seq.num_computed_tokens,
        "max_tokens": seq.sampling_params.max_tokens,
        "block_table": list(seq.block_table),
    }


def _tree(tree) -> list[dict]:
    nodes, stack = [], [tree.root]
    while stack:
        node = stack.pop()
        nodes.append(
            {
                "id": node.node_id,
                "parent": None if node.parent is None else node.parent.node_id,
                "blocks": list(node.blocks),
                "tokens": len(node.key),
                "lock": node.lock_ref,
                "last_access": node.last_access,
            }
        )
        stack.extend(reversed(node.children.values()))
    return nodes


class Recorder:
    """Turns an engine's steps into recording lines and hands each line (JSON text, no newline)
    to every sink: the header now, a line after every step (``LLMEngine.step`` calls ``record``)."""

    def __init__(self, engine, *sinks: Sink) -> None:
        self.sinks = sinks
        self.steps = 0
        self._hits = engine.scheduler.block_manager.num_hit_tokens
        self._write(header(engine))

    def record(self, engine, out) -> None:
        self.steps += 1
        hits, self._hits = self._hits, engine.scheduler.block_manager.num_hit_tokens
        self._write(step_record(engine, self.steps, out, self._hits - hits))

    def _write(self, line: dict) -> None:
        text = json.dumps(line, separators=(",", ":"))
        for sink in self.sinks:
            sink(text)


class RecordingFile:
    """A sink that writes lines to ``path``, each flushed at once, so that a run that stops
    leaves every step it finished readable. The file stays open until ``close``."""

    def __init__(self, path: str | Path) -> None:
        self.file = open(path, "w", encoding="utf-8")  # noqa: SIM115 (open for the run's life)

    def __call__(self, line: str) -> None:
        self.file.write(line + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class LiveRecording:
    """A sink that keeps the lines in memory for ``vkv view``'s live page: the header and the
    last ``max_steps`` steps (older ones are dropped, so a long ``vkv serve`` stays bounded).
    Thread-safe: the engine appends, the page's server threads read and wait for more."""

    def __init__(self, max_steps: int = 5000) -> None:
        self.header: str | None = None
        self.steps: deque[str] = deque(maxlen=max_steps)
        self.count = 0  # steps received, the dropped ones included: the newest step's number
        self._changed = threading.Condition()

    def __call__(self, line: str) -> None:
        with self._changed:
            if self.header is None:
                self.header = line
            else:
                self.steps.append(line)
                self.count += 1
            self._changed.notify_all()

    def text(self) -> str:
        """The lines kept so far, as a recording's text (a header, then steps)."""
        with self._changed:
            return "".join(line + "\n" for line in [self.header or "", *self.steps])

    def after(self, step: int, timeout: float) -> list[tuple[int, str]]:
        """The steps numbered above ``step``, waiting up to ``timeout`` s for one to come."""
        with self._changed:
            self._changed.wait_for(lambda: self.count > step, timeout)
            kept = len(self.steps)
            newer = max(0, min(kept, self.count - step))
            return [(self.count - kept + i + 1, self.steps[i]) for i in range(kept - newer, kept)]


def sinks_for(record: "str | Path | Sink | list[str | Path | Sink]") -> list[Sink]:
    """What ``LLMEngine(record=...)`` takes, as sinks: a path is a ``RecordingFile``, a
    callable (a ``LiveRecording``) is itself, a list is each of its items."""
    items = record if isinstance(record, list) else [record]
    return [item if callable(item) else RecordingFile(item) for item in items]


def read_recording(path: str | Path) -> Recording:
    """The header and steps of a recording; ``RecordingError`` naming the line if it is not
    one (not JSON, cut short, another schema, steps missing or out of order)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RecordingError(f"{path}: cannot read it: {exc}") from exc
    lines = text.splitlines()
    if not lines:
        raise RecordingError(f"{path}: empty, not a vkv recording")
    parsed = []
    for number, line in enumerate(lines, 1):
        try:
            parsed.append(json.loads(line))
        except json.JSONDecodeError as exc:
            cut = number == len(lines) and not text.endswith("\n")
            why = "cut short (the run stopped while writing it?)" if cut else f"not JSON ({exc})"
            raise RecordingError(f"{path}:{number}: {why}") from None
    first = parsed[0]
    if not isinstance(first, dict) or first.get("schema") != SCHEMA:
        got = first.get("schema") if isinstance(first, dict) else type(first).__name__
        raise RecordingError(f"{path}:1: not a {SCHEMA} header (schema {got!r})")
    for number, step in enumerate(parsed[1:], 1):
        if not isinstance(step, dict) or step.get("kind") != "step" or step.get("step") != number:
            raise RecordingError(f"{path}:{number + 1}: expected step {number}")
        for key in ("schedule", "gpu", "cpu", "sequences"):
            if key not in step:
                raise RecordingError(f"{path}:{number + 1}: step {number} has no {key!r}")
    return Recording(first, parsed[1:])
