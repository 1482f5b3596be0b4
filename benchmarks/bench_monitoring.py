"""What your rules and alerts say about a run (Phase 5's experiment).

``vkv serve`` runs vkv-tiny on a small KV pool with prefix caching on; Debian's ``prometheus``
scrapes it every second and evaluates *your* rules (parts 5.4 to 5.8) every second, over 10 s
windows, with alerts that wait 10 s (``for: 10s``): the KV alert above 80 % usage, the storm
alert above 0.5 preemptions a second. Clients of the official ``openai`` package drive three
phases: light (one client), heavy (six, one asking for two samples a request: prefix hits,
copies on write, preemptions), then idle. Every 5 s the script asks Prometheus for your recorded
series and the alerts' states and prints a row:

    t, phase, generated tokens/s, prefix-cache hit ratio, TTFT p50 and p99, end-to-end p99,
    GPU KV usage now and its window mean, preemptions/s, alerts (pending or firing)

    uv run python benchmarks/bench_monitoring.py [--light 30] [--heavy 45] [--idle 25]

About two minutes. Needs ``prometheus`` on the PATH (Debian: ``apt-get install prometheus``).
Writes ``bench_monitoring.json`` (the rows) to ``--out`` (default ``benchmarks/results``).
"""

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai
from rich.console import Console
from rich.table import Table

from vkv.engine.llm_engine import LLMEngine
from vkv.metrics import rules
from vkv.metrics.dashboard import start_prometheus
from vkv.net import free_port
from vkv.server import serve_in_thread

ROOT = Path(__file__).resolve().parents[1]
MODEL = "vkv-tiny"
WINDOW = "10s"  # at least 4 scrapes of 1 s
PROMPTS = ["def parse(text):\n    ", "class Config:\n    def __init__(self):\n"]
COLUMNS = {  # column: (PromQL on your recorded series, digits)
    "tokens/s": (f"model_name:vkv_generation_tokens:rate{WINDOW}", 1),
    "hit ratio": (f"model_name:vkv_prefix_cache_hits_per_queries:ratio_rate{WINDOW}", 2),
    "TTFT p50": (
        f'model_name:vkv_time_to_first_token_seconds:quantile_rate{WINDOW}{{quantile="0.5"}}',
        3,
    ),
    "TTFT p99": (
        f'model_name:vkv_time_to_first_token_seconds:quantile_rate{WINDOW}{{quantile="0.99"}}',
        3,
    ),
    "e2e p99": (
        f'model_name:vkv_e2e_request_latency_seconds:quantile_rate{WINDOW}{{quantile="0.99"}}',
        2,
    ),
    "KV now": ("model_name:vkv_gpu_cache_usage_perc:max", 2),
    "KV mean": (f"model_name:vkv_gpu_cache_usage_perc:max_avg_over_time{WINDOW}", 2),
    "preempt/s": (f"model_name:vkv_num_preemptions:rate{WINDOW}", 2),
}


def your_rules() -> dict:
    """The rules file of parts 5.4-5.8, from your functions, with this experiment's windows."""
    written = [
        *rules.rate_rules(WINDOW),
        rules.hit_ratio_rule(WINDOW),
        *rules.latency_quantile_rules(WINDOW, (0.5, 0.99)),
        *rules.kv_usage_rules(WINDOW),
        rules.kv_cache_full_alert(0.8, "10s"),
        rules.preemption_storm_alert(0.5, "10s", WINDOW),
    ]
    return {"groups": [{"name": "vkv", "rules": written}]}


def value(prometheus: str, expr: str) -> float | None:
    """The query's first value, or None when it has no series (no data, or 0/0)."""
    try:
        body = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return None
    result = body.get("data", {}).get("result", [])
    return float(result[0]["value"][1]) if result else None


def alerts(prometheus: str) -> str:
    try:
        body = httpx.get(f"{prometheus}/api/v1/alerts", timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return "?"
    found = body.get("data", {}).get("alerts", [])
    return ", ".join(f"{a['labels']['alertname']} {a['state']}" for a in found) or "-"


def client(url: str, worker: int, samples: int, until: threading.Event) -> None:
    api = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
    i = 0
    while not until.is_set():
        api.completions.create(
            model=MODEL,
            prompt=PROMPTS[(worker + i) % 2] * 3,
            max_tokens=48,
            temperature=0.8,
            seed=worker * 1000 + i,
            n=samples,
        )
        i += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--light", type=int, default=30, help="seconds of one client")
    parser.add_argument("--heavy", type=int, default=45, help="seconds of six clients")
    parser.add_argument("--idle", type=int, default=25, help="seconds of none")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    if shutil.which("prometheus") is None:
        sys.exit("bench_monitoring: needs prometheus on the PATH (apt-get install prometheus)")
    groups = your_rules()  # a part not written yet raises here, naming it
    engine = LLMEngine(
        num_gpu_blocks=20,
        num_cpu_blocks=64,
        max_model_len=512,
        max_num_seqs=8,
        enable_prefix_caching=True,
    )
    server, url = serve_in_thread(engine, MODEL)
    folder = Path(tempfile.mkdtemp(prefix="vkv-monitoring-"))
    prom, prometheus = start_prometheus(url.removeprefix("http://"), folder, free_port(), groups)
    table = Table(title=f"your rules over {WINDOW} windows, every 5 s")
    for title in ["t", "phase", *COLUMNS, "alerts"]:
        table.add_column(title, justify="left" if title in ("phase", "alerts") else "right")
    rows, started = [], time.monotonic()
    phases = [("light", args.light, [1]), ("heavy", args.heavy, [2, 1, 1, 1, 1, 1])]
    phases.append(("idle", args.idle, []))
    try:
        for phase, seconds, samples in phases:
            until = threading.Event()
            workers = [
                threading.Thread(target=client, args=(url, w, n, until), daemon=True)
                for w, n in enumerate(samples)
            ]
            for worker in workers:
                worker.start()
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                time.sleep(5)
                row = {"t": round(time.monotonic() - started), "phase": phase}
                for title, (expr, _) in COLUMNS.items():
                    row[title] = value(prometheus, expr)
                row["alerts"] = alerts(prometheus)
                rows.append(row)
                shown = [
                    "-" if row[title] is None else f"{row[title]:.{digits}f}"
                    for title, (_, digits) in COLUMNS.items()
                ]
                table.add_row(str(row["t"]), phase, *shown, row["alerts"])
            until.set()
            for worker in workers:
                worker.join(timeout=60)
    finally:
        prom.terminate()
        prom.wait(timeout=10)
        server.should_exit = True
    console = Console(width=160)
    console.print(table)
    console.print(f"preemptions in all: {engine.scheduler.num_preemptions}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_monitoring.json"
    path.write_text(json.dumps(rows, indent=2))
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
