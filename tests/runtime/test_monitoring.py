"""``vkv monitor init`` and the dashboard, against a real Prometheus scraping a real ``vkv serve``.

A workload with prefix hits, parallel samples (copies on write) and preemptions runs through the
official ``openai`` client while Debian's ``prometheus`` scrapes the server every second; every
panel's query (the recording rules of ``rules.py`` where one exists, which Prometheus loads and
evaluates every second) must then return a non-empty, finite result, every rule must evaluate
without an error, and the token counters must equal what the clients were told. Without
``prometheus`` and ``promtool`` on the PATH these tests skip, unless ``VKV_REQUIRE_PROMETHEUS=1``
(``.ci/run`` installs them and sets it).
"""

import json
import math
import os
import shutil
import subprocess
import threading
import time

import httpx
import openai
import pytest

from vkv.engine.llm_engine import LLMEngine
from vkv.metrics.dashboard import (
    PANELS,
    build_dashboard,
    concrete,
    start_prometheus,
    write_monitoring,
)
from vkv.metrics.rules import rule_groups
from vkv.net import free_port
from vkv.server import serve_in_thread

MODEL = "vkv-tiny"
HAVE_PROMETHEUS = bool(shutil.which("prometheus") and shutil.which("promtool"))
needs_prometheus = pytest.mark.skipif(
    not HAVE_PROMETHEUS and os.environ.get("VKV_REQUIRE_PROMETHEUS") != "1",
    reason="Debian's prometheus: apt-get install prometheus (VKV_REQUIRE_PROMETHEUS=1 fails)",
)


def test_monitor_init_writes_a_dashboard_provisioning_and_configs(tmp_path):
    written = {p.relative_to(tmp_path).as_posix() for p in write_monitoring(tmp_path, 8123)}
    assert written == {
        "grafana/dashboards/vkv.json",
        "grafana/provisioning/datasources/prometheus.yaml",
        "grafana/provisioning/dashboards/vkv.yaml",
        "prometheus.yml",
        "compose.yaml",
        "rules.yml",
    }
    config = (tmp_path / "prometheus.yml").read_text()
    assert "host.docker.internal:8123" in config and "rules.yml" in config
    rules = json.loads((tmp_path / "rules.yml").read_text())
    assert rules == rule_groups()[0], "the rules of every part, the reference's all written"
    board = json.loads((tmp_path / "grafana/dashboards/vkv.json").read_text())
    assert board["uid"] == "vkv-serve" and len(board["panels"]) == len(PANELS)


def test_the_panels_have_unique_ids_and_do_not_overlap():
    panels = build_dashboard()["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells = set()
    for panel in panels:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24
        area = {
            (x, y)
            for x in range(pos["x"], pos["x"] + pos["w"])
            for y in range(pos["y"], pos["y"] + pos["h"])
        }
        assert not cells & area, f"{panel['title']} overlaps another panel"
        cells |= area
    refs = [[t["refId"] for t in p["targets"]] for p in panels]
    assert all(len(r) == len(set(r)) for r in refs)


def test_every_metric_a_panel_uses_is_exported_or_recorded():
    engine_metrics = LLMEngine(num_gpu_blocks=8).metrics
    names = {m.name for m in engine_metrics.registry.collect()}
    recorded = {r["record"] for r in rule_groups()[0]["groups"][0]["rules"] if "record" in r}
    reads_a_rule = 0
    for title, (_, queries) in PANELS.items():
        for expr, _ in queries:
            used = {w for w in expr.replace("(", " ").replace("{", " ").split() if "vkv_" in w}
            for word in used:
                if ":" in word:
                    assert word in recorded, f"{title}: {word} is not recorded by rules.py"
                    reads_a_rule += 1
                    continue
                stem = word.removesuffix("_total").removesuffix("_bucket")
                assert stem in names, f"{title}: {word} is not exported"
    assert reads_a_rule >= 9, "the panels read the recording rules where one exists"


@needs_prometheus
def test_promtool_accepts_the_rules_file(tmp_path):
    write_monitoring(tmp_path)
    check = subprocess.run(
        ["promtool", "check", "rules", str(tmp_path / "rules.yml")], capture_output=True
    )
    assert check.returncode == 0, check.stdout.decode() + check.stderr.decode()
    assert b"SUCCESS" in check.stdout


@needs_prometheus
def test_promtool_accepts_the_prometheus_config(tmp_path):
    write_monitoring(tmp_path)
    check = subprocess.run(
        ["promtool", "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True
    )
    assert check.returncode == 0, check.stdout.decode() + check.stderr.decode()


def query(prometheus: str, expr: str) -> list:
    response = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=10)
    body = response.json()
    assert response.status_code == 200 and body["status"] == "success", (expr, body)
    return body["data"]["result"]


@needs_prometheus
def test_every_panel_returns_data_from_prometheus_scraping_vkv_serve(tmp_path):
    engine = LLMEngine(
        num_gpu_blocks=20,
        num_cpu_blocks=64,
        max_model_len=512,
        max_num_seqs=8,
        enable_prefix_caching=True,
    )
    server, url = serve_in_thread(engine, MODEL)
    prom, prometheus = start_prometheus(url.removeprefix("http://"), tmp_path, free_port())
    usage = {"prompt": 0, "completion": 0, "samples": 0}
    lock, stop = threading.Lock(), threading.Event()

    def client(worker: int) -> None:
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
        prompts = ["def parse(text):\n    ", "class Config:\n    def __init__(self):\n"]
        i = 0
        while not stop.is_set():
            result = api.completions.create(
                model=MODEL,
                prompt=prompts[(worker + i) % 2] * 3,
                max_tokens=48,
                temperature=0.8,
                seed=worker * 1000 + i,
                n=2 if worker == 0 else 1,
            )
            with lock:
                usage["prompt"] += result.usage.prompt_tokens
                usage["completion"] += result.usage.completion_tokens
                usage["samples"] += len(result.choices)
            i += 1

    try:
        workers = [threading.Thread(target=client, args=(w,)) for w in range(6)]
        for worker in workers:
            worker.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            time.sleep(1)
            try:
                scrapes = query(prometheus, 'count_over_time(up{job="vkv"}[1m])')
            except (httpx.HTTPError, ValueError, AssertionError):
                continue
            if scrapes and float(scrapes[0]["value"][1]) >= 12:
                break
        assert query(prometheus, 'up{job="vkv"} == 1'), "Prometheus scrapes vkv serve"
        assert engine.scheduler.num_preemptions > 0, "the workload is meant to preempt"
        hits = query(prometheus, "vkv_prefix_cache_hits_total")
        assert float(hits[0]["value"][1]) > 0, "and to hit the prefix cache"
        groups = httpx.get(f"{prometheus}/api/v1/rules", timeout=10).json()["data"]["groups"]
        loaded = [rule for group in groups for rule in group["rules"]]
        assert len(loaded) == len(rule_groups()[0]["groups"][0]["rules"]), "every rule loaded"
        unhealthy = [(r["name"], r.get("lastError")) for r in loaded if r["health"] != "ok"]
        assert not unhealthy, f"rules that failed to evaluate: {unhealthy}"
        for title, (_, queries) in PANELS.items():
            for expr, _ in queries:
                result = query(prometheus, concrete(expr))
                assert result, f"{title}: {concrete(expr)} returned no series"
                values = [float(series["value"][1]) for series in result]
                assert all(math.isfinite(v) for v in values), f"{title}: {expr} -> {values}"
        stop.set()
        for worker in workers:
            worker.join(timeout=60)
        time.sleep(2.5)  # two more scrapes
        totals = {
            name: float(query(prometheus, f"vkv_{name}_tokens_total")[0]["value"][1])
            for name in ("prompt", "generation")
        }
        assert totals == {"prompt": usage["prompt"], "generation": usage["completion"]}
        finished = query(prometheus, "sum(vkv_request_success_total)")
        assert float(finished[0]["value"][1]) == usage["samples"], "one per sample, all finished"
    finally:
        stop.set()
        prom.terminate()
        prom.wait(timeout=10)
        server.should_exit = True
