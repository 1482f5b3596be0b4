"""Where a full decode step's time goes outside the model, phase by phase.

``vkv bench e2e`` reports one figure, the share of step time outside the model's forward in decode
steps of ``max_num_seqs`` sequences. This script splits that time: vkv-tiny serves the same 64
requests (windows of the pinned corpus, greedy, ``ignore_eos``) while every phase of
``LLMEngine.step`` is timed:

    schedule      Scheduler.schedule
    block maps    ModelRunner.apply_block_maps (swaps and copies on write)
    prepare       ModelRunner.batch_of and .tensors (token ids, positions, slots, block tables)
    forward       the model (the engine's model time also holds, in a step with a prefill, the
                  gather of each sequence's last logits; a decode step has one row each); on
                  CUDA, a decode step replayed from its graph: the replay's launch alone
    sample        model_runner.draw_tokens, the tokens drawn and read back (on CUDA, also the
                  wait for the step's kernels: the GPU's time less what the host overlapped)
    execute rest  the rest of ModelRunner.execute: the draws' params, the CPU's thread fit, the
                  staging into a CUDA-graph path's buffers
    postprocess   Scheduler.postprocess
    detokenize    LLMEngine._output (incremental detokenizer, RequestOutput; the requests are
                  final-only, as in ``vkv bench e2e``: while one runs, only a check)
    metrics       LLMEngine._record (the Prometheus StatLogger)
    other         what is left of the step (the step's stats, bookkeeping)

Only decode steps of a full batch count. Each round is one whole run; the table gives, per phase,
the median over the rounds of its mean microseconds per step and its share of the step. The
timers cost about half a microsecond a timed call (``_output`` is called once per sequence), so
the steps here run a little slower than in ``vkv bench e2e``, whose share is the reference.

With ``--batch 128`` (``max_num_seqs`` and the requests; the GPU check's batch), the phases
outside the forward estimate what a GPU waits for between two replays of its decode graph: the
host's own work, which a CUDA graph does not take away (on this CPU the forward is the CPU's).
``--gpu-path`` runs that host work as the GPU check's decode step does (``bench_decode_step.py``
on Qwen3-0.6B's shape): decode steps staged into the CUDA-graph path's padded static buffers
(run eagerly here) and nano-vLLM's lengths (prompts and outputs of 100-1024 tokens), with a KV
pool that holds them all (that checkpoint's random weights come with vkv-tiny's byte-level
tokenizer, as here). There the forward also holds the staging into the buffers; "forward" in
the table is the model's alone, so the staging counts in "execute rest". With ``--device cuda
--model vkv/models/shapes/qwen3-0.6b --load-format dummy`` (``gpu_check.sh``'s host stage) the
decode steps replay from the engine's CUDA graphs and the phases are a GPU host's own.

    uv run python benchmarks/bench_step_overhead.py [--rounds 3] [--batch 64] [--gpu-path]
        [--device cuda --model DIR --load-format dummy] [--out DIR]
"""

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

from vkv.bench import WORKLOADS, Workload, is_full_decode, run_vkv
from vkv.engine import model_runner
from vkv.engine.decode_graphs import graph_batch_sizes
from vkv.engine.llm_engine import LLMEngine
from vkv.models.loader import DEFAULT_MODEL

BLOCK_SIZE = 16  # the engine's default
TINY_ON_CPU = {"model": DEFAULT_MODEL, "device": "cpu"}  # the engine unless options say otherwise
PHASES = [
    "schedule",
    "block maps",
    "prepare",
    "forward",
    "sample",
    "execute rest",
    "postprocess",
    "detokenize",
    "metrics",
    "other",
]


class PhaseTimer:
    """Wraps methods of one engine's parts with timers that add up each phase's seconds, until
    ``restore`` puts the methods back."""

    def __init__(self, engine: LLMEngine) -> None:
        self.seconds: dict[str, float] = {}
        self.wrapped: list[tuple[object, str, Callable]] = []  # owner, name, what it had
        runner = engine.runner
        self._wrap(engine.scheduler, "schedule", "schedule")
        self._wrap(runner, "apply_block_maps", "block maps")
        self._wrap(runner, "batch_of", "prepare")
        self._wrap(runner, "tensors", "prepare")
        self._wrap(runner.model, "forward", "forward")
        for graph in getattr(runner.decode_graphs, "graphs", {}).values():  # CUDA: launched only
            self._wrap(graph, "replay", "forward")
        self._wrap(model_runner, "draw_tokens", "sample")
        self._wrap(runner, "execute", "execute")
        self._wrap(engine.scheduler, "postprocess", "postprocess")
        self._wrap(engine, "_output", "detokenize")
        self._wrap(engine, "_record", "metrics")

    def _wrap(self, owner: object, name: str, phase: str) -> None:
        method: Callable = getattr(owner, name)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds[phase] = self.seconds.get(phase, 0.0) + (time.perf_counter() - started)

        self.wrapped.append((owner, name, vars(owner).get(name)))
        setattr(owner, name, timed)  # an instance attribute: the class is left as it was

    def restore(self) -> None:
        """Every method as it was: a module's function put back, an instance's own timer
        removed (its class's method shows through again)."""
        for owner, name, held in reversed(self.wrapped):
            if held is None:
                delattr(owner, name)
            else:
                setattr(owner, name, held)
        self.wrapped = []

    def step_phases(self, step_seconds: float) -> dict[str, float]:
        """The phases of the step just run (execute's own time less prepare, forward and sample;
        what no phase covers is "other"); then start over."""
        seconds = {phase: self.seconds.get(phase, 0.0) for phase in PHASES if phase != "other"}
        execute = self.seconds.get("execute", 0.0)
        inside = ("prepare", "forward", "sample")  # execute's phases
        seconds["execute rest"] = execute - sum(seconds[phase] for phase in inside)
        seconds["other"] = step_seconds - sum(seconds.values())
        self.seconds = {}
        return seconds


def measure_round(engine: LLMEngine, timer: PhaseTimer, workload: Workload) -> dict:
    """One whole run: each phase's mean microseconds per full decode step, the step's mean, and
    the share outside the model as ``vkv bench e2e`` computes it."""
    full_batch = engine.config.max_num_seqs
    full_steps: list[tuple[dict, dict]] = []  # (the engine's stats, the phases) of each
    step = engine.step

    def timed_step():
        outputs = step()
        phases = timer.step_phases(engine.stats["step_seconds"])
        if is_full_decode(engine.stats, full_batch):
            full_steps.append((engine.stats, phases))
        return outputs

    timer.seconds = {}  # nothing from before the run
    engine.step = timed_step
    try:
        run_vkv(engine, workload)
    finally:
        del engine.step
    if not full_steps:
        raise ValueError("the workload never ran a full decode step")
    count = len(full_steps)
    step_total = sum(stats["step_seconds"] for stats, _ in full_steps)
    model_total = sum(stats["model_seconds"] for stats, _ in full_steps)
    return {
        "steps": count,
        "step_us": step_total / count * 1e6,
        "outside_model": 1.0 - model_total / step_total,
        "phases_us": {
            phase: sum(phases[phase] for _, phases in full_steps) / count * 1e6 for phase in PHASES
        },
    }


def measure(engine: LLMEngine, workload: Workload, rounds: int) -> dict:
    """``rounds`` runs after a warm-up; medians of each figure over the rounds."""
    timer = PhaseTimer(engine)
    try:
        run_vkv(engine, Workload(workload.prompts[:2], [4, 4]))
        results = [measure_round(engine, timer, workload) for _ in range(rounds)]
    finally:
        timer.restore()
    return {
        "rounds": rounds,
        "steps": results[0]["steps"],
        "step_us": statistics.median(r["step_us"] for r in results),
        "outside_model": statistics.median(r["outside_model"] for r in results),
        "phases_us": {
            phase: statistics.median(r["phases_us"][phase] for r in results) for phase in PHASES
        },
    }


def plain(batch: int, **engine_options) -> tuple[LLMEngine, Workload]:
    """An engine as it runs by default (vkv-tiny on a CPU unless ``engine_options`` say
    otherwise: ``model``, ``device``, ``load_format``), and ``batch`` requests of the mixed
    workload (windows of the pinned corpus)."""
    options = TINY_ON_CPU | engine_options
    engine = LLMEngine(max_num_seqs=batch, **options)
    workload = Workload.mixed(lambda text: engine.tokenizer.encode(text).ids, num_requests=batch)
    return engine, workload


def gpu_path(batch: int, **engine_options) -> tuple[LLMEngine, Workload]:
    """The host work of the GPU check's decode step: ``batch`` requests of nano-vLLM's lengths,
    a KV pool that holds them all at once, and decode steps replayed from CUDA graphs (on a
    CPU: staged into the graphs' padded static buffers and run eagerly). vkv-tiny on a CPU
    unless ``engine_options`` say otherwise (``model``, ``device``, ``load_format``)."""
    shape = WORKLOADS["nano-vllm"]
    max_model_len = shape.prompt_lens[1] + shape.output_lens[1]
    tables = -(-max_model_len // BLOCK_SIZE)  # blocks a sequence may need
    options = TINY_ON_CPU | engine_options
    engine = LLMEngine(
        block_size=BLOCK_SIZE,
        num_gpu_blocks=batch * tables,
        max_num_seqs=batch,
        max_model_len=max_model_len,
        **options,
    )
    if engine.runner.decode_graphs is None:  # not captured (a CPU): the buffers, run eagerly
        engine.runner.use_decode_graphs(graph_batch_sizes(batch), tables, capture=False)
    workload = Workload.mixed(
        lambda text: engine.tokenizer.encode(text).ids, batch, shape.prompt_lens, shape.output_lens
    )
    return engine, workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--batch",
        type=int,
        default=64,
        help="max_num_seqs and the number of requests (128: the GPU check's batch)",
    )
    parser.add_argument(
        "--gpu-path",
        action="store_true",
        help="the GPU check's decode step: CUDA graphs (padded buffers), nano-vLLM's lengths",
    )
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="a checkpoint folder")
    parser.add_argument("--load-format", default="auto", help="auto, or dummy: random weights")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    options = {"model": args.model, "device": args.device, "load_format": args.load_format}
    setup = gpu_path if args.gpu_path else plain
    engine, workload = setup(args.batch, **options)
    summary = measure(engine, workload, args.rounds)
    step = summary["step_us"]
    table = Table(
        title=f"Decode steps of {args.batch} sequences ({summary['steps']} a run) on "
        f"{args.device}, median of {args.rounds}{', the GPU path' if args.gpu_path else ''}"
    )
    for column in ("phase", "us per step", "share of the step"):
        table.add_column(column, justify="left" if column == "phase" else "right")
    for phase, micros in summary["phases_us"].items():
        table.add_row(phase, f"{micros:,.0f}", f"{micros / step:.1%}")
    table.add_row("step", f"{step:,.0f}", "100%")
    console = Console(width=100)
    console.print(table)
    console.print(f"outside the model (as vkv bench e2e counts it): {summary['outside_model']:.1%}")
    args.out.mkdir(parents=True, exist_ok=True)
    record = {**summary, **options, "batch": args.batch, "gpu_path": args.gpu_path}
    (args.out / "bench_step_overhead.json").write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
