"""The monitoring benchmark: every column reads a series that the rules it gives Prometheus
record, and a run of 1 s a phase (rows every 0.5 s instead of 5 s) against Debian's
``prometheus`` gives each phase its rows, in order, each with a value or None in every column,
the KV usage read from the first row on and every column by the last. Without ``prometheus``
on the PATH the run skips, unless ``VKV_REQUIRE_PROMETHEUS=1`` (``.ci/run`` installs it)."""

import json
import math
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_monitoring
from test_monitoring import needs_prometheus

ALERTS = {"VkvKVCacheNearlyFull", "VkvPreemptionStorm"}
SHARES = {"hit ratio", "KV now", "KV mean"}  # between 0 and 1
KV_NOW = bench_monitoring.COLUMNS["KV now"][0]


def test_every_column_reads_a_series_the_rules_record_and_both_alerts_are_given():
    rules = bench_monitoring.your_rules()["groups"][0]["rules"]
    recorded = {rule["record"] for rule in rules if "record" in rule}
    for title, (expr, _) in bench_monitoring.COLUMNS.items():
        assert expr.split("{")[0] in recorded, f"{title}: {expr} is recorded by no rule"
    assert {rule["alert"] for rule in rules if "alert" in rule} == ALERTS


@needs_prometheus
def test_a_second_a_phase_gives_every_phase_its_rows_of_every_column(monkeypatch, tmp_path):
    """Prometheus applies the targets it discovers every 5 s, so its first scrape comes about
    5 s after it starts: the benchmark's first wait lasts until Prometheus has recorded the KV
    usage (a scrape and a rule evaluation), and each wait after it a tenth of its 5 s. About
    10 s in all, most of it Prometheus's first 5."""
    start, prometheus, waited = bench_monitoring.start_prometheus, [], []

    def started(*args, **kwargs):
        process, url = start(*args, **kwargs)
        prometheus.append(url)
        return process, url

    def sleep(seconds: float) -> None:
        deadline = time.monotonic() + 30
        while not waited and time.monotonic() < deadline:
            if bench_monitoring.value(prometheus[0], KV_NOW) is not None:
                break
            time.sleep(0.1)
        waited.append(seconds)
        time.sleep(seconds / 10)

    monkeypatch.setattr(bench_monitoring, "start_prometheus", started)
    fast = types.SimpleNamespace(monotonic=time.monotonic, sleep=sleep)
    monkeypatch.setattr(bench_monitoring, "time", fast)
    argv = ["bench_monitoring.py", "--light", "1", "--heavy", "1", "--idle", "1"]
    monkeypatch.setattr(sys, "argv", [*argv, "--out", str(tmp_path)])
    bench_monitoring.main()
    rows = json.loads((tmp_path / "bench_monitoring.json").read_text())
    phases = [row["phase"] for row in rows]
    assert phases == sorted(phases, key=["light", "heavy", "idle"].index), phases
    assert set(phases) == {"light", "heavy", "idle"}, phases
    assert [row["t"] for row in rows] == sorted(row["t"] for row in rows)
    for row in rows:
        assert list(row) == ["t", "phase", *bench_monitoring.COLUMNS, "alerts"]
        for title in bench_monitoring.COLUMNS:
            value = row[title]
            assert value is None or (math.isfinite(value) and value >= 0), (title, row)
            assert value is None or title not in SHARES or value <= 1, (title, row)
        assert row["KV now"] is not None, f"the recorded KV usage, read: {row}"
        shown = [] if row["alerts"] == "-" else row["alerts"].split(", ")
        for alert in shown:
            name, state = alert.split(" ")
            assert name in ALERTS and state in ("pending", "firing"), row["alerts"]
    missing = [title for title, value in rows[-1].items() if value is None]
    assert not missing, f"the last row, after a second of each phase, lacks {missing}: {rows}"
