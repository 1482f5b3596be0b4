"""The Grafana dashboard of ``vkv serve``, built with Grafana's typed builder, and the files that
start Prometheus and Grafana against it (``vkv monitor init DIR``).

The dashboard has vLLM's core panels (latency, throughput, time to first token, time per output
token, scheduler state, KV-cache usage, finish reasons, request lengths) and what vLLM's lacks:
the prefix-cache hit rate, preemptions and swaps per second, KV usage per pool, KV bytes per token
by cache format, and copy-on-write copies. Every query filters on the ``model_name`` variable.
``PANELS`` lists each panel's queries; the tests run every one of them against a real Prometheus
that scraped a real server and evaluated the rules.

Where a recording rule of ``rules.py`` (Phase 5, parts 5.4 to 5.7) computes a panel's query, the
panel reads the recorded series (``model_name:vkv_generation_tokens:rate1m``): Prometheus
computes it once per evaluation for every viewer, and the alerts read the same series. Those
windows are the rules' (``rules.WINDOW``); the other panels rate over ``$__rate_interval``.
"""

import json
import subprocess
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard, prometheus, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh

from vkv.metrics.rules import WINDOW as RULE_WINDOW
from vkv.metrics.rules import write_rules

DATASOURCE = DataSourceRef(type_val="prometheus", uid="prometheus")
WINDOW = "$__rate_interval"
M = 'model_name=~"$model_name"'


def concrete(expr: str, window: str = "10s") -> str:
    """A panel's query as Prometheus alone runs it: the rate window for ``$__rate_interval``
    (at least 4 scrapes) and every model for ``$model_name``."""
    return expr.replace(WINDOW, window).replace("$model_name", ".*")


def quantiles(metric: str, qs=(0.5, 0.9, 0.99)) -> list[tuple[str, str]]:
    expr = f"sum by(le)(rate({metric}_bucket{{{M}}}[{WINDOW}]))"
    return [(f"histogram_quantile({q}, {expr})", f"p{round(q * 100)}") for q in qs]


def recorded(name: str, **labels: str) -> str:
    """A series recorded by a rule of ``rules.py`` (``RULE_WINDOW``), for the selected models."""
    extra = "".join(f', {key}="{value}"' for key, value in labels.items())
    return f"{name}{{{M}{extra}}}"


def recorded_quantiles(histogram: str) -> list[tuple[str, str]]:
    name = f"model_name:{histogram}:quantile_rate{RULE_WINDOW}"
    return [(recorded(name, quantile=q), f"p{round(float(q) * 100)}") for q in ("0.5", "0.99")]


# title -> (unit, [(PromQL, legend), ...])
PANELS: dict[str, tuple[str, list[tuple[str, str]]]] = {
    "End-to-end request latency": ("s", recorded_quantiles("vkv_e2e_request_latency_seconds")),
    "Token throughput": (
        "tps",
        [
            (recorded(f"model_name:vkv_prompt_tokens:rate{RULE_WINDOW}"), "prompt tokens/s"),
            (
                recorded(f"model_name:vkv_generation_tokens:rate{RULE_WINDOW}"),
                "generation tokens/s",
            ),
        ],
    ),
    "Time to first token": ("s", recorded_quantiles("vkv_time_to_first_token_seconds")),
    "Time per output token": ("s", quantiles("vkv_time_per_output_token_seconds")),
    "Scheduler state": (
        "short",
        [(f"vkv_num_requests_{q}{{{M}}}", q) for q in ("running", "waiting", "swapped")],
    ),
    "KV-cache usage per pool": (
        "percentunit",
        [
            (recorded("model_name:vkv_gpu_cache_usage_perc:max"), "GPU pool (fullest instance)"),
            (recorded("model_name:vkv_cpu_cache_usage_perc:max"), "CPU (swap) pool"),
        ],
    ),
    "Prefix-cache hit rate": (
        "percentunit",
        [
            (
                recorded(f"model_name:vkv_prefix_cache_hits_per_queries:ratio_rate{RULE_WINDOW}"),
                "hit tokens / queried tokens",
            )
        ],
    ),
    "Preemptions and swaps per second": (
        "ops",
        [
            (recorded(f"model_name:vkv_num_preemptions:rate{RULE_WINDOW}"), "preemptions"),
            (f"rate(vkv_blocks_swapped_out_total{{{M}}}[{WINDOW}])", "blocks swapped out"),
            (f"rate(vkv_blocks_swapped_in_total{{{M}}}[{WINDOW}])", "blocks swapped in"),
        ],
    ),
    "Copy-on-write copies per second": (
        "ops",
        [(f"rate(vkv_cow_copies_total{{{M}}}[{WINDOW}])", "blocks copied")],
    ),
    "KV bytes per token by cache format": (
        "bytes",
        [
            (
                f"vkv_kv_cache_bytes_per_token{{{M}}} * on(model_name) group_left("
                "kv_cache_dtype, key_granularity, kv_quant_group) "
                f"vkv_cache_config_info{{{M}}}",
                "{{kv_cache_dtype}} {{key_granularity}} {{kv_quant_group}}",
            )
        ],
    ),
    "Finished requests by reason": (
        "short",
        [
            (
                f"sum by(finished_reason)(increase(vkv_request_success_total{{{M}}}[{WINDOW}]))",
                "{{finished_reason}}",
            )
        ],
    ),
    "Request lengths (median)": (
        "short",
        [
            (quantiles("vkv_request_prompt_tokens", (0.5,))[0][0], "prompt tokens"),
            (quantiles("vkv_request_generation_tokens", (0.5,))[0][0], "generation tokens"),
        ],
    ),
}


def build_dashboard() -> dict:
    """The dashboard as Grafana's JSON model (two panels a row, 12 columns each)."""
    board = (
        dashboard.Dashboard("vkv serve")
        .uid("vkv-serve")
        .tags(["vkv", "llm", "kv-cache"])
        .refresh("5s")
        .time("now-15m", "now")
        .with_variable(
            dashboard.QueryVariable("model_name")
            .label("model")
            .datasource(DATASOURCE)
            .query("label_values(vkv_num_requests_running, model_name)")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .include_all(True)
            .multi(True)
        )
    )
    for number, (title, (unit, queries)) in enumerate(PANELS.items(), start=1):
        panel = (
            timeseries.Panel()
            .id(number)
            .title(title)
            .unit(unit)
            .datasource(DATASOURCE)
            .height(8)
            .span(12)
        )
        for ref, (expr, legend) in zip("ABCDEFGH", queries, strict=False):
            panel = panel.with_target(
                prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref)
            )
        board = board.with_panel(panel)
    return json.loads(JSONEncoder(sort_keys=True, indent=2).encode(board.build()))


PROMETHEUS_CONFIG = """\
# Prometheus scrapes vkv serve every 5 s (vLLM's example uses the same interval) and evaluates
# the recording and alerting rules of rules.yml (vkv/metrics/rules.py; a path relative to this
# file) every 15 s.
global:
  scrape_interval: 5s
  evaluation_interval: 15s
rule_files: [{rules}]
scrape_configs:
  - job_name: vkv
    static_configs:
      - targets: ["{target}"]
"""

DATASOURCE_YAML = """\
apiVersion: 1
datasources:
  - name: Prometheus
    uid: prometheus
    type: prometheus
    access: proxy
    url: http://prometheus:9090
    isDefault: true
"""

PROVIDER_YAML = """\
apiVersion: 1
providers:
  - name: vkv
    folder: vkv
    type: file
    options:
      path: /var/lib/grafana/dashboards
"""

COMPOSE_YAML = """\
# Prometheus (http://localhost:9090) and Grafana (http://localhost:3000, admin / admin) against
# vkv serve on the host's port {port}: docker compose up
services:
  prometheus:
    image: prom/prometheus:v2.53.0
    volumes:
      - ./prometheus.yml:/etc/prometheus/prometheus.yml:ro
      - ./rules.yml:/etc/prometheus/rules.yml:ro
    ports: ["9090:9090"]
    extra_hosts: ["host.docker.internal:host-gateway"]
  grafana:
    image: grafana/grafana:11.6.0
    environment:
      GF_AUTH_ANONYMOUS_ENABLED: "true"
      GF_AUTH_ANONYMOUS_ORG_ROLE: Viewer
    volumes:
      - ./grafana/provisioning:/etc/grafana/provisioning:ro
      - ./grafana/dashboards:/var/lib/grafana/dashboards:ro
    ports: ["3000:3000"]
    depends_on: [prometheus]
"""


def write_monitoring(folder: Path, port: int = 8000) -> list[Path]:
    """Write the dashboard, Grafana's provisioning, the rules (``rules.yml``: those of the parts
    written so far; a part still to write is named in the file's first line and its panels stay
    empty), a Prometheus config that loads them and scrapes vkv serve on the host's ``port``,
    and a ``compose.yaml`` that starts both; return the files."""
    files = {
        "grafana/dashboards/vkv.json": json.dumps(build_dashboard(), indent=2) + "\n",
        "grafana/provisioning/datasources/prometheus.yaml": DATASOURCE_YAML,
        "grafana/provisioning/dashboards/vkv.yaml": PROVIDER_YAML,
        "prometheus.yml": PROMETHEUS_CONFIG.format(
            target=f"host.docker.internal:{port}", rules="rules.yml"
        ),
        "compose.yaml": COMPOSE_YAML.format(port=port),
    }
    folder.mkdir(parents=True, exist_ok=True)
    write_rules(folder / "rules.yml")
    written = [folder / "rules.yml"]
    for name, text in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written


def start_prometheus(
    target: str, folder: Path, port: int, groups: dict | None = None
) -> tuple[subprocess.Popen, str]:
    """Debian's ``prometheus`` on 127.0.0.1:``port``, scraping ``target`` (host:port) and
    evaluating every second the rules of ``rules.py`` (or ``groups``, a rules file's content),
    its data in ``folder`` (checks and pictures; ``terminate()`` the process)."""
    config = folder / "prometheus.yml"
    if groups is None:
        write_rules(folder / "rules.yml")
    else:
        (folder / "rules.yml").write_text(json.dumps(groups, indent=2) + "\n")
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"rule_files: ['{folder / 'rules.yml'}']\n"
        "scrape_configs:\n  - job_name: vkv\n"
        f"    static_configs: [{{targets: ['{target}']}}]\n"
    )
    process = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={folder / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return process, f"http://127.0.0.1:{port}"
