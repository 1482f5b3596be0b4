"""The load benchmark of ``vkv serve`` with 2 streaming clients for 1 s: nothing lost, duplicated
or malformed, every sample received is one the server finished, the 8 clients that leave
mid-stream are aborted, and no block is held after; with ``--render`` (Debian's ``prometheus``)
the dashboard's panels are drawn to a PNG from Prometheus's range queries."""

import json
import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_serve
from test_monitoring import needs_prometheus

from vkv.metrics.dashboard import PANELS, concrete

KEYS = [
    "clients",
    "seconds",
    "requests_sent",
    "requests_completed",
    "requests_lost",
    "samples_finished_on_the_server",
    "samples_received",
    "duplicated_ids",
    "malformed_streams",
    "latency_p50_s",
    "latency_p99_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "output_tokens_per_s",
    "preemptions",
    "prefix_hit_rate",
    "aborted_by_leaving_clients",
    "blocks_held_after",
]


def serve(monkeypatch, tmp_path, *options) -> dict:
    argv = ["bench_serve.py", "--clients", "2", "--seconds", "1", *options]
    monkeypatch.setattr(sys, "argv", [*argv, "--out", str(tmp_path)])
    bench_serve.main()
    return json.loads((tmp_path / "bench_serve.json").read_text())


def test_two_clients_for_a_second_are_served_whole(monkeypatch, tmp_path):
    result = serve(monkeypatch, tmp_path)
    assert list(result) == KEYS
    assert result["clients"] == 2 and result["seconds"] > 0
    assert result["requests_lost"] == 0 and result["requests_sent"] == result["requests_completed"]
    assert result["requests_completed"] >= 2, "each client sends at least one request"
    assert result["duplicated_ids"] == 0 and result["malformed_streams"] == 0
    assert result["samples_received"] == result["samples_finished_on_the_server"]
    assert result["samples_received"] > result["requests_completed"], "client 0 asks for 2"
    assert 0 < result["ttft_p50_s"] <= result["ttft_p99_s"]
    assert 0 < result["latency_p50_s"] <= result["latency_p99_s"]
    assert result["ttft_p99_s"] <= result["latency_p99_s"], "a first token comes before the end"
    assert result["output_tokens_per_s"] > 0 and result["preemptions"] >= 0
    assert 0 <= result["prefix_hit_rate"] <= 1
    assert result["aborted_by_leaving_clients"] == 8, "each client that leaves is aborted"
    assert result["blocks_held_after"] == 0


@needs_prometheus
@pytest.mark.filterwarnings("ignore:No artists with labels found")  # see below
def test_render_draws_every_panel_from_its_prometheus_queries(monkeypatch, tmp_path):
    """Prometheus scrapes a new target first about 5 s after it starts, so a run of 1 s draws
    empty panels (no legend: the warning filtered): what is checked is that every query of
    every panel is asked over the run and accepted, and that the picture is written.
    ``test_monitoring.py`` checks that every panel gets data."""
    get, start, asked = httpx.get, bench_serve.start_prometheus, []

    def started(*args, **kwargs):
        """The benchmark's Prometheus once it answers: it draws 1 s after the start."""
        process, url = start(*args, **kwargs)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if get(f"{url}/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        return process, url

    def recorded(url, **kwargs):
        response = get(url, **kwargs)
        if url.endswith("/api/v1/query_range"):
            asked.append((kwargs["params"]["query"], response.status_code))
        return response

    monkeypatch.setattr(bench_serve, "start_prometheus", started)
    monkeypatch.setattr(httpx, "get", recorded)
    picture = tmp_path / "dashboard.png"
    result = serve(monkeypatch, tmp_path, "--render", str(picture))
    assert result["requests_lost"] == 0 and result["blocks_held_after"] == 0
    wanted = [concrete(expr) for _, queries in PANELS.values() for expr, _ in queries]
    assert [query for query, _ in asked] == wanted, "every panel's queries, in order"
    assert all(status == 200 for _, status in asked), asked
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", "a PNG of the panels"
