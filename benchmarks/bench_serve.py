"""Load on ``vkv serve``: concurrent streaming clients through the official ``openai`` client.

A server over vkv-tiny (prefix caching on, a pool small enough to preempt) runs in this process;
``--clients`` threads stream completions from it for ``--seconds`` seconds (prompts from a small
set, so prefixes repeat; ``max_tokens`` 16 to 96; one client in four asks for 2 samples). Then
8 clients disconnect mid-stream. Reported: requests sent and completed, lost (sent but never
finished) and duplicated (a response id seen twice), malformed streams (no finish reason, or
text after it), latency and time to first token (p50, p99), output tokens per second, and that
no block is held once the clients are gone.

With ``--render PNG`` (Debian's ``prometheus`` on the PATH) a Prometheus scrapes the server every
second during the run, and every panel of the Grafana dashboard (``vkv/metrics/dashboard.py``)
is drawn from its range queries with matplotlib: the README's picture of the dashboard, from
real data (no Grafana server runs here).

    uv run python benchmarks/bench_serve.py [--clients 32] [--seconds 60] [--render PNG]
"""

import argparse
import json
import random
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai
from rich.console import Console
from rich.table import Table

from vkv.engine.llm_engine import LLMEngine
from vkv.metrics.dashboard import PANELS, concrete, start_prometheus
from vkv.net import free_port
from vkv.server import serve_in_thread

ROOT = Path(__file__).resolve().parents[1]
MODEL = "vkv-tiny"
PROMPTS = [
    "def parse(text):\n    ",
    "class Config:\n    def __init__(self, path):\n",
    "import os\nimport sys\n\n\ndef main():\n",
    "    for line in lines:\n        if not line.strip():\n",
]


def client(url: str, worker: int, until: float, records: list, lock: threading.Lock) -> None:
    """Stream completions until ``until``; record each request's outcome."""
    api = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=120)
    rng = random.Random(worker)
    while time.monotonic() < until:
        n = 2 if worker % 4 == 0 else 1
        started, first, ids, finished, malformed, tokens = time.monotonic(), None, set(), {}, 0, 0
        try:
            stream = api.completions.create(
                model=MODEL,
                prompt=rng.choice(PROMPTS),
                max_tokens=rng.randint(16, 96),
                temperature=0.8,
                seed=rng.randrange(2**31),
                n=n,
                stream=True,
            )
            for chunk in stream:
                ids.add(chunk.id)
                for choice in chunk.choices:
                    if choice.index in finished and (choice.text or choice.finish_reason):
                        malformed += 1  # anything after a sample's finish
                    if choice.text:
                        first = first or time.monotonic()
                        tokens += 1
                    if choice.finish_reason:
                        finished[choice.index] = choice.finish_reason
        except Exception as error:  # a lost request: reported, not raised
            with lock:
                records.append({"error": f"{type(error).__name__}: {error}"})
            continue
        record = {
            "samples": n,
            "id": next(iter(ids)) if len(ids) == 1 else None,
            "latency": time.monotonic() - started,
            "ttft": (first or time.monotonic()) - started,
            "chunks": tokens,
            "well_formed": len(ids) == 1 and len(finished) == n and not malformed,
        }
        with lock:
            records.append(record)


def leave_mid_stream(url: str) -> None:
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 500, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i == 3:
                break


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


def run(clients: int, seconds: float, render: Path | None) -> dict:
    engine = LLMEngine(
        num_gpu_blocks=64,
        num_cpu_blocks=128,
        max_model_len=512,
        max_num_seqs=32,
        enable_prefix_caching=True,
    )
    server, url = serve_in_thread(engine, MODEL)
    folder = Path(tempfile.mkdtemp())
    target = url.removeprefix("http://")
    prometheus = start_prometheus(target, folder, free_port()) if render else None
    records: list[dict] = []
    lock = threading.Lock()
    started = time.monotonic()
    threads = [
        threading.Thread(target=client, args=(url, w, started + seconds, records, lock))
        for w in range(clients)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - started
    leavers = [threading.Thread(target=leave_mid_stream, args=(url,)) for _ in range(8)]
    for thread in leavers:
        thread.start()
    for thread in leavers:
        thread.join()
    deadline = time.monotonic() + 30
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.1)
    lost = [r["error"] for r in records if "error" in r]
    records = [r for r in records if "error" not in r]
    ids = [r["id"] for r in records]
    finished = sum(
        engine.metrics.value("request_success_total", finished_reason=reason)
        for reason in ("length", "stop")
    )
    result = {
        "clients": clients,
        "seconds": round(elapsed, 1),
        "requests_sent": len(records) + len(lost),
        "requests_completed": len(records),
        "requests_lost": len(lost),
        "samples_finished_on_the_server": int(finished),
        "samples_received": sum(r["samples"] for r in records),
        "duplicated_ids": len(ids) - len(set(ids)),
        "malformed_streams": sum(not r["well_formed"] for r in records),
        "latency_p50_s": percentile([r["latency"] for r in records], 50),
        "latency_p99_s": percentile([r["latency"] for r in records], 99),
        "ttft_p50_s": percentile([r["ttft"] for r in records], 50),
        "ttft_p99_s": percentile([r["ttft"] for r in records], 99),
        "output_tokens_per_s": sum(r["chunks"] for r in records) / elapsed,
        "preemptions": engine.scheduler.num_preemptions,
        "prefix_hit_rate": engine.metrics.value("prefix_cache_hits_total")
        / max(1.0, engine.metrics.value("prefix_cache_queries_total")),
        "aborted_by_leaving_clients": engine.metrics.value(
            "request_success_total", finished_reason="abort"
        ),
        "blocks_held_after": engine.scheduler.block_manager.num_gpu_blocks
        - engine.scheduler.block_manager.num_free_gpu_blocks,
    }
    if prometheus is not None:
        process, prom_url = prometheus
        draw_dashboard(prom_url, started, time.monotonic(), render)
        process.terminate()
        process.wait(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)
    server.should_exit = True
    return result


def draw_dashboard(prometheus: str, start: float, end: float, path: Path) -> None:
    """Every dashboard panel, from Prometheus range queries over the run (wall-clock times)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    now = time.time()
    t0, t1 = now - (time.monotonic() - start), now - (time.monotonic() - end)
    rows = (len(PANELS) + 1) // 2
    fig, axes = plt.subplots(rows, 2, figsize=(14, 2.6 * rows), sharex=True)
    for ax, (title, (unit, queries)) in zip(axes.flat, PANELS.items(), strict=False):
        for expr, legend in queries:
            response = httpx.get(
                f"{prometheus}/api/v1/query_range",
                params={"query": concrete(expr), "start": t0, "end": t1, "step": 2},
                timeout=30,
            ).json()
            for series in response["data"]["result"]:
                xs = [float(t) - t0 for t, _ in series["values"]]
                ys = [float(v) for _, v in series["values"]]
                label = legend
                for key, value in series["metric"].items():
                    label = label.replace("{{" + key + "}}", value)
                ax.plot(xs, ys, label=label, linewidth=1.2)
        ax.set_title(f"{title} ({unit})", fontsize=9)
        ax.legend(fontsize=6, loc="upper left")
        ax.tick_params(labelsize=7)
    for ax in axes.flat[len(PANELS) :]:
        ax.axis("off")
    fig.suptitle("vkv serve under load: the Grafana dashboard's panels, from Prometheus", y=1.0)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90, bbox_inches="tight")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--render", type=Path, help="draw the dashboard's panels to this PNG")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    if args.render and not shutil.which("prometheus"):
        parser.error("--render needs Debian's prometheus on the PATH (apt-get install prometheus)")
    result = run(args.clients, args.seconds, args.render)
    table = Table(title=f"vkv serve: {args.clients} streaming clients for {args.seconds:.0f} s")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for key, value in result.items():
        table.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
    Console().print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_serve.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
