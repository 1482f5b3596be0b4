"""The ``vkv`` command.

    vkv grade [PATH] [--trusted TREE] [--isolate] [--hidden DIR] [--seed N]
              [--require-sandbox | --unsafe-no-sandbox]
              [--format table|json|gradescope|classroom|markdown] [--output FILE]
                                                score a submission, per part
    vkv demo [--record RUN.jsonl]               watch paging and preemption on vkv-tiny
    vkv view RUN.jsonl [--port N]               replay a recorded run in a browser page
    vkv generate PROMPT... [--model PATH]       generate text (default model: vkv-tiny)
    vkv bench e2e                               vkv vs transformers' generate, same requests
    vkv assignment release OUT [--classroom]    write the student edition into OUT
    vkv assignment solve DIR --parts 1.1,1.2    put reference code for those parts into DIR
    vkv assignment check                        prove the assignment sound (see check.py)
    vkv assignment gradescope OUT.zip [--parts 1]
                                                the Gradescope autograder package

The ``assignment`` commands read the reference from the tree this package was installed from,
or from ``--root``.
"""

import argparse
import contextlib
import sys
import threading
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from vkv.assignment.commands import (
    check_command,
    grade_command,
    gradescope_command,
    release_command,
    solve_command,
)
from vkv.cli_options import (
    add_kv_cache_options,
    add_model_options,
    kv_budget_bytes,
    kv_cache_arguments,
    model_arguments,
)

DESCRIPTION = "vkv-engine: a paged-KV inference engine and the course built on it."
GENERATE = "generate text (default model: the built-in vkv-tiny)"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    console = Console()
    try:
        if getattr(args, "tensor_parallel_size", 1) > 1 and _serve_as_worker(args):
            return 0
        return args.run(args, console)
    except NotImplementedError as exc:
        if not str(exc).startswith("part "):  # not a stub of the assignment: a bug
            raise
        return _error(exc)  # a part a student has not done yet, named
    except (FileNotFoundError, FileExistsError, KeyError, ValueError, RuntimeError) as exc:
        return _error(exc)


def _serve_as_worker(args: argparse.Namespace) -> bool:
    """Under a launcher that started every rank (torchrun), ranks other than 0 serve rank 0's
    engine as tensor-parallel workers instead of running the command; True if this one did."""
    from vkv.engine.parallel import launched, run_worker

    launch = launched()
    if launch is None or launch[0] == 0:
        return False
    if launch[1] != args.tensor_parallel_size:
        raise ValueError(
            f"launched as {launch[1]} ranks for --tensor-parallel-size "
            f"{args.tensor_parallel_size}: start as many ranks as the split"
        )
    run_worker(*launch)
    return True


def _error(exc: Exception) -> int:
    """Print ``exc`` as one line on stderr, whatever its length; the exit status 2."""
    error = Console(stderr=True, soft_wrap=True)
    error.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False)
    return 2


def _generate(args: argparse.Namespace, console: Console) -> int:
    from vkv.engine.intake import check_text
    from vkv.llm import LLM
    from vkv.sampling_params import SamplingParams

    for prompt in args.prompts:  # before the model loads and the engine describes itself
        check_text(prompt)
    params = [
        SamplingParams(
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            max_tokens=args.max_tokens,
            seed=args.seed + i,
        )
        for i in range(len(args.prompts))
    ]
    llm = LLM(
        args.model,
        block_size=args.block_size,
        kv_cache_bytes=kv_budget_bytes(args),
        gpu_memory_fraction=args.gpu_memory_fraction,
        max_model_len=args.max_model_len,
        backend=args.backend,
        **model_arguments(args),
        **kv_cache_arguments(args),
    )
    with llm:
        outputs = llm.generate(args.prompts, params, use_progress=console.is_terminal)
    for prompt, output in zip(args.prompts, outputs, strict=True):
        console.print(f"[bold]{prompt}[/bold]", end="")
        console.print(output["text"], markup=False, highlight=False)
    return 0


def _demo(args: argparse.Namespace, console: Console) -> int:
    from vkv.demo import STEPS_PER_SECOND, run_demo
    from vkv.recording import LiveRecording
    from vkv.view import ViewServer

    live_page = LiveRecording() if args.web else None
    server = ViewServer(live_page, port=args.port).start() if live_page else None
    if server is not None:
        console.print(f"the live page: {server.url}")
    record = [sink for sink in (args.record, live_page) if sink is not None]
    run_demo(
        console,
        model=args.model,
        requests=args.requests,
        gpu_blocks=args.gpu_blocks,
        cpu_blocks=args.cpu_blocks,
        block_size=args.block_size,
        preemption_mode=args.preemption_mode,
        max_tokens=args.max_tokens,
        live=console.is_terminal and not args.no_live,
        steps_per_second=None if args.fast else STEPS_PER_SECOND,
        record=record or None,
        watched=args.web,
        **kv_cache_arguments(args),
    )
    if args.record:
        console.print(f"recorded every step in {args.record}: vkv view {args.record}")
    if server is not None:
        console.print(f"the run is over; {server.url} keeps showing it (Ctrl-C stops)")
        with contextlib.suppress(KeyboardInterrupt):
            threading.Event().wait()
        server.stop()
    return 0


def _view(args: argparse.Namespace, console: Console) -> int:
    from vkv.recording import RecordingError, read_recording
    from vkv.view import ViewServer

    try:
        steps = len(read_recording(args.recording).steps)
    except RecordingError as exc:
        console.print(f"[red]vkv view: {escape(str(exc))}[/red]", soft_wrap=True)
        return 2
    server = ViewServer(args.recording, args.host, args.port)
    console.print(f"{steps} steps of {args.recording}: open {server.url} (Ctrl-C stops)")
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()
    return 0


def _serve(args: argparse.Namespace, console: Console) -> int:
    import uvicorn

    from vkv.engine.llm_engine import LLMEngine
    from vkv.engine.startup import model_label
    from vkv.recording import LiveRecording
    from vkv.server import chat_template_of, create_app
    from vkv.view import ViewServer

    live_page = LiveRecording() if args.view_port is not None else None
    engine = LLMEngine(
        args.model,
        block_size=args.block_size,
        kv_cache_bytes=kv_budget_bytes(args),
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        num_cpu_blocks=args.cpu_blocks,
        record=live_page,
        **model_arguments(args),
        **kv_cache_arguments(args),
    )
    app = create_app(engine, model_label(args.model), chat_template_of(args.model))
    console.print(f"vkv serve: http://{args.host}:{args.port}/v1 (metrics at /metrics)")
    if live_page is not None:
        view = ViewServer(live_page, args.host, args.view_port).start()
        console.print(f"the KV cache, live: {view.url}")
    with engine:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def _monitor_init(args: argparse.Namespace, console: Console) -> int:
    from vkv.metrics.dashboard import write_monitoring

    folder = Path(args.dir)
    for path in write_monitoring(folder, args.port):
        console.print(f"wrote {path}")
    console.print(
        f"\nStart everything:\n  uv run vkv serve --host 0.0.0.0 --port {args.port}\n"
        f"  cd {folder} && docker compose up\n"
        "Grafana: http://localhost:3000 (dashboard 'vkv serve'); Prometheus: "
        "http://localhost:9090\nWithout Docker: prometheus --config.file=prometheus.yml, with "
        f"the target changed to 127.0.0.1:{args.port}."
    )
    return 0


def _bench(args: argparse.Namespace, console: Console) -> int:
    import json

    from rich.table import Table

    from vkv.bench import run_e2e

    try:
        result = run_e2e(
            args.model,
            **model_arguments(args),
            workload=args.workload,
            num_requests=args.requests,
            max_num_seqs=args.max_num_seqs,
            hf_batch=args.hf_batch,
            seed=args.seed,
            repeat=args.repeat,
        )
    except ModuleNotFoundError as exc:
        raise RuntimeError(f"vkv bench e2e needs the dev dependencies (uv sync): {exc}") from None
    table = Table(
        title=f"vkv bench e2e: {result.requests} requests, {result.threads} threads, "
        f"fastest of {result.repeat} runs"
    )
    for column in ("system", "seconds", "output tokens/s"):
        table.add_column(column, justify="right")
    table.add_row("vkv", f"{result.vkv_seconds:.2f}", f"{result.vkv_tokens_per_s:,.0f}")
    table.add_row(
        f"transformers (batches of {result.hf_batch})",
        f"{result.hf_seconds:.2f}",
        f"{result.hf_tokens_per_s:,.0f}",
    )
    console.print(table)
    console.print(
        f"speedup {result.speedup:.2f}x (fastest runs); over the {result.repeat} rounds: "
        f"median {result.speedup_median:.2f}x, from {result.speedup_min:.2f}x to "
        f"{result.speedup_max:.2f}x"
    )
    console.print(
        f"step time outside the model: "
        f"{result.overhead_share_full_batch:.1%} at {result.max_num_seqs} running "
        f"({result.full_batch_steps} steps), {result.overhead_share:.1%} over all "
        f"{result.vkv_steps} steps; identical completions "
        f"{result.identical_completions}/{result.requests}"
    )
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result.as_dict(), indent=2) + "\n")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vkv", description=DESCRIPTION)
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    grade = commands.add_parser("grade", help="score a submission, per part")
    grade.add_argument("path", nargs="?", default=".", help="the submission (default: .)")
    grade.add_argument(
        "--trusted", help="the tree whose tests and files are trusted (default: PATH itself)"
    )
    grade.add_argument(
        "--isolate",
        action="store_true",
        help="also grade each part with the reference's code for every other part",
    )
    grade.add_argument("--hidden", help="a folder of hidden tests to add")
    grade.add_argument("--parts", help="grade only these parts: 1.1,1.2 or a phase: 1")
    grade.add_argument("--timeout", type=float, default=300.0, help="seconds per part")
    grade.add_argument(
        "--format",
        choices=["table", "json", "gradescope", "classroom", "markdown"],
        default="table",
    )
    grade.add_argument("--output", help="write that form here (the table is printed too)")
    grade.add_argument("--root", help="the reference tree for --isolate (default: this package's)")
    grade.add_argument(
        "--seed", type=int, help="the tests' VKV_GRADE_SEED (default: drawn at random)"
    )
    sandboxing = grade.add_mutually_exclusive_group()
    sandboxing.add_argument(
        "--require-sandbox",
        action="store_true",
        help="refuse to grade where bubblewrap cannot run the tests in a sandbox",
    )
    sandboxing.add_argument(
        "--unsafe-no-sandbox",
        action="store_true",
        help="allow --hidden and --format gradescope without a sandbox: a progress check only",
    )
    grade.set_defaults(run=grade_command)

    generate = commands.add_parser("generate", help=GENERATE, description=GENERATE)
    generate.add_argument("prompts", nargs="+", metavar="PROMPT")
    add_model_options(generate)
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.8, help="0 means greedy")
    generate.add_argument("--top-k", type=int, default=-1)
    generate.add_argument("--top-p", type=float, default=0.95)
    generate.add_argument("--seed", type=int, default=0, help="per request: prompt i gets seed+i")
    generate.add_argument("--block-size", type=int, default=16)
    generate.add_argument(
        "--kv-budget-mb", type=float, help="KV cache size (default: 256 MiB on a CPU)"
    )
    generate.add_argument(
        "--gpu-memory-fraction",
        type=float,
        default=0.9,
        help="on CUDA without --kv-budget-mb: the share of free GPU memory the KV cache takes",
    )
    generate.add_argument("--max-model-len", type=int, default=2048)
    generate.add_argument("--backend", choices=["torch", "triton"])
    add_kv_cache_options(generate)
    generate.set_defaults(run=_generate)

    demo = commands.add_parser(
        "demo", help="watch a batch share a too-small KV cache: queues, block maps, preemption"
    )
    demo.add_argument("--model", help="a checkpoint folder (default: the built-in vkv-tiny)")
    demo.add_argument("--requests", type=int, default=24)
    demo.add_argument("--gpu-blocks", type=int, default=48, help="the device KV pool, in blocks")
    demo.add_argument("--cpu-blocks", type=int, default=64, help="the CPU swap pool, in blocks")
    demo.add_argument("--block-size", type=int, default=16)
    demo.add_argument("--preemption-mode", choices=["swap", "recompute"], default="swap")
    demo.add_argument("--max-tokens", type=int, default=160, help="the longest completion")
    demo.add_argument("--no-live", action="store_true", help="print only the summary")
    demo.add_argument(
        "--fast",
        action="store_true",
        help="draw the live view as fast as the engine steps (default: 8 steps a second)",
    )
    demo.add_argument(
        "--record", metavar="RUN.jsonl", help="write every step's KV-cache state, for vkv view"
    )
    demo.add_argument(
        "--web",
        action="store_true",
        help="show the run live in a page on 127.0.0.1 (--port), 8 steps a second unless --fast",
    )
    demo.add_argument("--port", type=int, default=8001, help="the live page's port (--web)")
    add_kv_cache_options(demo)
    demo.set_defaults(run=_demo)

    view = commands.add_parser("view", help="replay a recorded run (vkv demo --record) in a page")
    view.add_argument("recording", metavar="RUN.jsonl")
    view.add_argument("--host", default="127.0.0.1")
    view.add_argument("--port", type=int, default=8001)
    view.set_defaults(run=_view)

    serve = commands.add_parser("serve", help="an OpenAI-compatible server, with /metrics")
    add_model_options(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--block-size", type=int, default=16)
    serve.add_argument("--kv-budget-mb", type=float, help="device KV cache size (MiB)")
    serve.add_argument("--cpu-blocks", type=int, default=0, help="the CPU swap pool, in blocks")
    serve.add_argument("--max-model-len", type=int, default=2048)
    serve.add_argument("--max-num-seqs", type=int, default=64)
    serve.add_argument(
        "--view-port", type=int, help="also serve the live page of the KV cache on this port"
    )
    add_kv_cache_options(serve)
    serve.set_defaults(run=_serve)

    monitor = commands.add_parser("monitor", help="Prometheus and Grafana for vkv serve")
    monitor_commands = monitor.add_subparsers(dest="monitor_command", required=True)
    init = monitor_commands.add_parser(
        "init", help="write the dashboard, Grafana provisioning, a Prometheus config, compose.yaml"
    )
    init.add_argument("dir")
    init.add_argument("--port", type=int, default=8000, help="the port vkv serve listens on")
    init.set_defaults(run=_monitor_init)

    bench = commands.add_parser("bench", help="benchmarks of the runtime")
    benchmarks = bench.add_subparsers(required=True, metavar="BENCHMARK")
    e2e = benchmarks.add_parser("e2e", help="vkv vs transformers' generate, same requests")
    add_model_options(e2e)
    e2e.add_argument(
        "--workload",
        default="mixed",
        help="mixed: 64 requests of 16-256 tokens in and out; nano-vllm: nano-vLLM's benchmark, "
        "256 requests of 100-1024 tokens in and out",
    )
    e2e.add_argument("--requests", type=int, help="default: the workload's")
    e2e.add_argument("--max-num-seqs", type=int, default=64)
    e2e.add_argument("--hf-batch", type=int, default=64, help="transformers' static batch size")
    e2e.add_argument("--seed", type=int, default=0)
    e2e.add_argument("--repeat", type=int, default=5, help="interleaved runs; the fastest counts")
    e2e.add_argument("--output", help="also write the result as JSON here")
    e2e.set_defaults(run=_bench)

    assignment = commands.add_parser("assignment", help="instructor tooling")
    tools = assignment.add_subparsers(required=True, metavar="TOOL")
    release = tools.add_parser("release", help="write the student edition into OUT")
    release.add_argument("out")
    release.add_argument(
        "--classroom",
        action="store_true",
        help="add classroom.yml: grade every push and report points to GitHub Classroom",
    )
    release.set_defaults(run=release_command)
    solve = tools.add_parser("solve", help="put reference code for some parts into a tree")
    solve.add_argument("dir")
    solve.add_argument("--parts", required=True, help="e.g. 1.1,1.2 or a phase: 1, or all")
    solve.set_defaults(run=solve_command)
    check = tools.add_parser("check", help="prove the assignment sound")
    check.set_defaults(run=check_command)
    gradescope = tools.add_parser("gradescope", help="write the Gradescope autograder zip")
    gradescope.add_argument("out", help="the zip to write (a new file)")
    gradescope.add_argument("--parts", help="grade only these parts: 1.1,1.2 or a phase: 1")
    gradescope.set_defaults(run=gradescope_command)
    for tool in (release, solve, check, gradescope):
        tool.add_argument("--root", help="the reference tree (default: this package's tree)")
    return parser


if __name__ == "__main__":
    sys.exit(main())
