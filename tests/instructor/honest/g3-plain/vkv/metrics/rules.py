"""The recording rules and alerts that make vkv's metrics useful (Phase 5, parts 5.4 to 5.8).

The engine exports raw series (``registry.py``): counters that only grow, gauges, and histograms
as cumulative buckets. A dashboard or an alert wants rates, ratios and quantiles over a window.
Prometheus computes them with *recording rules* (a PromQL expression evaluated every
``evaluation_interval``, its result stored as a new series) and *alerting rules* (an expression
whose series, once present for a ``for:`` duration, fire an alert). ``vkv monitor init`` writes
the rules these functions build into ``rules.yml``, which ``prometheus.yml`` loads; the
dashboard's panels read the recorded series (``dashboard.py``).

A rule is a dict as Prometheus's rule files hold it:

    {"record": NAME, "expr": PROMQL}                      a recording rule
    {"record": NAME, "expr": PROMQL, "labels": {...}}     ... that adds labels to its series
    {"alert": NAME, "expr": PROMQL, "for": DURATION,
     "labels": {...}, "annotations": {...}}              an alerting rule

Recorded names follow Prometheus's ``level:metric:operations``: the labels the result keeps
(``model_name``: every rule aggregates ``by (model_name)``, so an engine's instances add up and
models stay apart), the metric (a counter's name without ``_total`` once a rate is taken), and
the operations, newest first, each with its window (``rate1m``, ``ratio_rate1m``). A window is
a Prometheus duration such as ``30s``, ``1m`` or ``5m``, written as given.

The names, for ``window = "1m"`` (the contract of each part):

    5.4  model_name:vkv_prompt_tokens:rate1m          prompt tokens per second
         model_name:vkv_generation_tokens:rate1m      generated tokens per second
         model_name:vkv_num_preemptions:rate1m        preemptions per second
    5.5  model_name:vkv_prefix_cache_hits_per_queries:ratio_rate1m
                                                      hit tokens / queried tokens
    5.6  model_name:vkv_time_to_first_token_seconds:quantile_rate1m   label quantile="0.5" ...
         model_name:vkv_e2e_request_latency_seconds:quantile_rate1m
    5.7  model_name:vkv_gpu_cache_usage_perc:max      the fullest instance's pool, now
         model_name:vkv_gpu_cache_usage_perc:max_avg_over_time1m   ... averaged over the window
         (and the same two for cpu_cache_usage_perc)
    5.8  alerts VkvKVCacheNearlyFull and VkvPreemptionStorm, on the rules of 5.7 and 5.4

Where a window holds nothing to measure (no prompt looked up, no request finished), a ratio or
a quantile has **no sample**: never ``NaN``, which a panel draws as a gap that looks like data
and an alert can never compare. A rate of a counter that did not move is a sample, ``0``.

Given here: the templates of an annotation (``MODEL``, ``VALUE``, ``VALUE_PERCENT``),
``is_duration``, and the writer of the rules file (``rule_groups``, ``write_rules``).
"""

import json
import re
from collections.abc import Callable
from pathlib import Path

WINDOW = "1m"  # the window of the rules vkv monitor writes (4 scrapes at vLLM's 15 s; 60 at 1 s)

# Go templates for an alert's annotations, rendered by Prometheus when the alert fires.
MODEL = "{{ $labels.model_name }}"  # the alert series' model_name label
VALUE = "{{ $value | humanize }}"  # the expression's value: 2.5, 1.2k
VALUE_PERCENT = "{{ $value | humanizePercentage }}"  # a ratio as a percentage: 0.95 -> 95%
# The counters of part 5.4, in the order of its rules.
RATE_STEMS = ("prompt_tokens", "generation_tokens", "num_preemptions")

_DURATION = re.compile(r"([0-9]+(ms|s|m|h|d|w|y))+")


def is_duration(text: object) -> bool:
    """Whether ``text`` is a Prometheus duration: ``30s``, ``5m``, ``1h30m`` (not ``0``, ``5``,
    ``1.5m``, ``5 m`` or ``0s``)."""
    if not isinstance(text, str) or not _DURATION.fullmatch(text):
        return False
    return any(digit in text for digit in "123456789")


# -- part 5.4: counters per second ------------------------------------------------------------


def rate_rules(window: str = WINDOW) -> list[dict]:
    """Three recording rules, in this order: prompt tokens, generation tokens and preemptions per
    second over ``window``, each summed over a model's instances (``model_name:vkv_<stem>:rate
    <window>`` for the counters ``vkv_prompt_tokens_total``, ``vkv_generation_tokens_total``,
    ``vkv_num_preemptions_total``). A counter resets to 0 when its engine restarts: that is not
    a drop. An idle counter's rate is 0."""
    ### BEGIN SOLUTION part5.4
    rules = []
    for stem in RATE_STEMS:
        name = f"model_name:vkv_{stem}:rate{window}"
        expr = f"sum by (model_name) (rate(vkv_{stem}_total[{window}]))"
        rules.append({"record": name, "expr": expr})
    return rules
    ### END SOLUTION


# -- part 5.5: the prefix cache's hit ratio ---------------------------------------------------


def hit_ratio_rule(window: str = WINDOW) -> dict:
    """One recording rule, ``model_name:vkv_prefix_cache_hits_per_queries:ratio_rate<window>``:
    of the prompt tokens a model's instances looked up in the prefix cache over ``window``
    (``vkv_prefix_cache_queries_total``), the share found (``vkv_prefix_cache_hits_total``), as
    one ratio over all its instances' tokens. A model that looked nothing up in the window has
    no sample; one that looked up and hit nothing has 0."""
    ### BEGIN SOLUTION part5.5
    name = f"model_name:vkv_prefix_cache_hits_per_queries:ratio_rate{window}"
    hits = f"sum by (model_name) (rate(vkv_prefix_cache_hits_total[{window}]))"
    queries = f"sum by (model_name) (rate(vkv_prefix_cache_queries_total[{window}]))"
    # queries > 0 drops the models that looked nothing up, so there is no 0 / 0
    expr = f"{hits} / ({queries} > 0)"
    return {"record": name, "expr": expr}
    ### END SOLUTION


# -- part 5.6: latency quantiles from histograms ----------------------------------------------


def latency_quantile_rules(window: str = WINDOW, quantiles=(0.5, 0.99)) -> list[dict]:
    """A recording rule per histogram and quantile, histogram by histogram (time to first token,
    then end-to-end latency), each quantile in the given order: the ``q``-quantile of the
    observations a model's instances made over ``window``, from the buckets
    ``vkv_<histogram>_bucket{le=...}``, recorded as ``model_name:vkv_<histogram>:quantile_rate
    <window>`` with the label ``quantile`` set to ``str(q)`` ("0.5", "0.99"). A model that
    observed nothing in the window has no sample."""
    ### BEGIN SOLUTION part5.6
    histograms = ["time_to_first_token_seconds", "e2e_request_latency_seconds"]
    rules = []
    for histogram in histograms:
        name = f"model_name:vkv_{histogram}:quantile_rate{window}"
        buckets = f"sum by (model_name, le) (rate(vkv_{histogram}_bucket[{window}]))"
        observed = f"sum by (model_name) (rate(vkv_{histogram}_count[{window}])) > 0"
        for q in quantiles:
            expr = f"histogram_quantile({q}, {buckets}) and on (model_name) ({observed})"
            rules.append({"record": name, "expr": expr, "labels": {"quantile": str(q)}})
    return rules
    ### END SOLUTION


# -- part 5.7: KV-cache usage -----------------------------------------------------------------


def kv_usage_rules(window: str = WINDOW) -> list[dict]:
    """Four recording rules, the GPU pool's two then the CPU pool's: a model's fullest instance
    now (``model_name:vkv_<pool>_cache_usage_perc:max``, from the gauge
    ``vkv_<pool>_cache_usage_perc``), and the fullest instance's mean over ``window``
    (``model_name:vkv_<pool>_cache_usage_perc:max_avg_over_time<window>``: each instance's
    mean, then the largest)."""
    ### BEGIN SOLUTION part5.7
    rules = []
    for pool in ["gpu", "cpu"]:
        gauge = f"vkv_{pool}_cache_usage_perc"
        rules.append({
            "record": f"model_name:{gauge}:max",
            "expr": f"max by (model_name) ({gauge})",
        })
        rules.append({
            "record": f"model_name:{gauge}:max_avg_over_time{window}",
            "expr": f"max by (model_name) (avg_over_time({gauge}[{window}]))",
        })
    return rules
    ### END SOLUTION


# -- part 5.8: alerts -------------------------------------------------------------------------


def kv_cache_full_alert(threshold: float = 0.9, duration: str = "5m") -> dict:
    """The alert ``VkvKVCacheNearlyFull``: a model's fullest GPU pool (the rule
    ``model_name:vkv_gpu_cache_usage_perc:max`` of part 5.7) above ``threshold`` (strictly) for
    ``duration``; label ``severity: warning``; annotations, for 0.9 and 5m:

        summary       "KV cache of {{ $labels.model_name }} is
                      {{ $value | humanizePercentage }} full"   (one line: MODEL, VALUE_PERCENT)
        description   "GPU KV-cache usage above 90% for 5m: new requests wait and running ones
                      are preempted"   (one line; the threshold as a whole percentage)

    Raises ``ValueError(f"threshold must lie between 0 and 1, got {threshold!r}")`` unless
    ``0 < threshold < 1``, and ``ValueError(f"duration must be a Prometheus duration such as 5m,
    got {duration!r}")`` unless ``is_duration(duration)``."""
    ### BEGIN SOLUTION part5.8
    if not (0 < threshold < 1):
        raise ValueError(f"threshold must lie between 0 and 1, got {threshold!r}")
    if not is_duration(duration):
        raise ValueError(f"duration must be a Prometheus duration such as 5m, got {duration!r}")
    percent = round(threshold * 100)
    return {
        "alert": "VkvKVCacheNearlyFull",
        "expr": f"model_name:vkv_gpu_cache_usage_perc:max > {threshold}",
        "for": duration,
        "labels": {"severity": "warning"},
        "annotations": {
            "summary": f"KV cache of {MODEL} is {VALUE_PERCENT} full",
            "description": (
                f"GPU KV-cache usage above {percent}% for {duration}: "
                "new requests wait and running ones are preempted"
            ),
        },
    }
    ### END SOLUTION


def preemption_storm_alert(
    per_second: float = 1.0, duration: str = "2m", window: str = WINDOW
) -> dict:
    """The alert ``VkvPreemptionStorm``: a model preempting more than ``per_second`` sequences a
    second (the rule ``model_name:vkv_num_preemptions:rate<window>`` of part 5.4) for
    ``duration``; label ``severity: critical``; annotations, for 1.0 and 2m:

        summary       "{{ $labels.model_name }} preempts {{ $value | humanize }} sequences a second"
        description   "more than 1 preemptions a second for 2m: the KV cache is too small for the
                      load"   (one line; ``per_second`` written as ``f"{per_second:g}"``)

    Raises ``ValueError(f"per_second must be positive, got {per_second!r}")`` unless
    ``per_second > 0``, and the ``duration`` error of ``kv_cache_full_alert``."""
    ### BEGIN SOLUTION part5.8
    if not per_second > 0:
        raise ValueError(f"per_second must be positive, got {per_second!r}")
    if not is_duration(duration):
        raise ValueError(f"duration must be a Prometheus duration such as 5m, got {duration!r}")
    return {
        "alert": "VkvPreemptionStorm",
        "expr": f"model_name:vkv_num_preemptions:rate{window} > {per_second}",
        "for": duration,
        "labels": {"severity": "critical"},
        "annotations": {
            "summary": f"{MODEL} preempts {VALUE} sequences a second",
            "description": (
                f"more than {per_second:g} preemptions a second for {duration}: "
                "the KV cache is too small for the load"
            ),
        },
    }
    ### END SOLUTION


# -- the rules file (given) -------------------------------------------------------------------

# What writes each part's rules, by part: a stubbed part's rules are left out of the file.
BUILDERS: dict[str, Callable[[], list[dict]]] = {
    "5.4": lambda: rate_rules(WINDOW),
    "5.5": lambda: [hit_ratio_rule(WINDOW)],
    "5.6": lambda: latency_quantile_rules(WINDOW),
    "5.7": lambda: kv_usage_rules(WINDOW),
    "5.8": lambda: [kv_cache_full_alert(), preemption_storm_alert()],
}


def rule_groups(parts=tuple(BUILDERS)) -> tuple[dict, list[str]]:
    """The rules file's content (one group, ``vkv``: recording rules first, so that an alert
    reads the series its own evaluation just recorded) from the given parts, and the parts left
    out because they are not written yet (``NotImplementedError``)."""
    rules, missing = [], []
    for part in parts:
        try:
            rules += BUILDERS[part]()
        except NotImplementedError:
            missing.append(part)
    return {"groups": [{"name": "vkv", "rules": rules}]}, missing


def write_rules(path: Path, parts=tuple(BUILDERS)) -> list[str]:
    """Write the rules file (JSON, which YAML reads as it is, after a comment line that names
    the parts left out, if any) and return the parts left out."""
    groups, missing = rule_groups(parts)
    note = f"# left out, not written yet: parts {', '.join(missing)}\n" if missing else ""
    path.write_text(note + json.dumps(groups, indent=2) + "\n")
    return missing
