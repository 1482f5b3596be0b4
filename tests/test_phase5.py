"""Phase 5 graded tests: the StatLogger writes each step into the engine's Prometheus metrics.

Run one part with ``uv run pytest tests/test_phase5.py -k part1 -v``. The tests drive the logger
with scripted steps: hand-built ``SchedulerOutput``s, queues and sequences with set arrival times
and a clock that the test moves, so that every expected value is known exactly, and read the
values back from the engine's registry as Prometheus would scrape them.
"""

import os

import pytest
from grading_policy import policy_test
from metrics_fakes import check_rules, scheduler, seq

from vkv.engine.scheduler import SchedulerOutput
from vkv.metrics.registry import EngineMetrics
from vkv.metrics.rulecheck import promtool
from vkv.metrics.rules import (
    RATE_STEMS,
    hit_ratio_rule,
    kv_cache_full_alert,
    kv_usage_rules,
    latency_quantile_rules,
    preemption_storm_alert,
    rate_rules,
)
from vkv.metrics.stats import StatLogger

MODEL = {"model_name": "vkv-tiny"}


def make_logger() -> tuple[StatLogger, EngineMetrics]:
    metrics = EngineMetrics(max_model_len=512)
    return StatLogger(metrics), metrics


def value(metrics: EngineMetrics, name: str, **labels) -> float:
    sample = metrics.registry.get_sample_value(name, {**MODEL, **labels})
    return 0.0 if sample is None else sample


def histogram(metrics: EngineMetrics, name: str) -> tuple[float, float]:
    """(count, sum) of a histogram."""
    return value(metrics, f"{name}_count"), value(metrics, f"{name}_sum")


# --------------------------------------------------------------------------------------------
# Part 5.1: the step
# --------------------------------------------------------------------------------------------


# Each part's first test: its regions follow the grading policy (tests/grading_policy.py).
test_part1_follows_the_grading_policy = policy_test("5.1")
test_part2_follows_the_grading_policy = policy_test("5.2")
test_part3_follows_the_grading_policy = policy_test("5.3")
test_part4_follows_the_grading_policy = policy_test("5.4")
test_part5_follows_the_grading_policy = policy_test("5.5")
test_part6_follows_the_grading_policy = policy_test("5.6")
test_part7_follows_the_grading_policy = policy_test("5.7")
test_part8_follows_the_grading_policy = policy_test("5.8")


def test_part1_gauges_hold_the_state_the_step_left():
    logger, metrics = make_logger()
    logger.record_step(SchedulerOutput(), scheduler(3, 5, 2, 0.75, 0.25), 1.0)
    got = [
        value(metrics, f"vkv_{name}")
        for name in (
            "num_requests_running",
            "num_requests_waiting",
            "num_requests_swapped",
            "gpu_cache_usage_perc",
            "cpu_cache_usage_perc",
        )
    ]
    assert got == [3, 5, 2, 0.75, 0.25], (
        "running, waiting, swapped are the queues' lengths and the usages the block manager's "
        f"gpu_usage and cpu_usage: expected [3, 5, 2, 0.75, 0.25], got {got}"
    )


def test_part1_gauges_are_set_not_added_up():
    logger, metrics = make_logger()
    logger.record_step(SchedulerOutput(), scheduler(3, 5, 2, 0.75, 0.25), 1.0)
    logger.record_step(SchedulerOutput(), scheduler(1, 0, 4, 0.5, 0.0), 2.0)
    got = [value(metrics, f"vkv_num_requests_{q}") for q in ("running", "waiting", "swapped")]
    got += [value(metrics, "vkv_gpu_cache_usage_perc"), value(metrics, "vkv_cpu_cache_usage_perc")]
    assert got == [1, 0, 4, 0.5, 0.0], (
        "a gauge is the state after the last step (set it), not a sum: expected "
        f"[1, 0, 4, 0.5, 0.0] after the second step, got {got}"
    )


def test_part1_each_preempted_sequence_counts_once():
    logger, metrics = make_logger()
    out = SchedulerOutput(preempted=[seq(1), seq(2), seq(3)])
    logger.record_step(out, scheduler(), 1.0)
    logger.record_step(SchedulerOutput(preempted=[seq(4)]), scheduler(), 2.0)
    got = value(metrics, "vkv_num_preemptions_total")
    assert got == 4, f"3 then 1 preempted sequences: num_preemptions_total 4, got {got}"


def test_part1_swaps_count_blocks_and_copies_count_destinations():
    logger, metrics = make_logger()
    out = SchedulerOutput(
        blocks_to_swap_out={1: 0, 2: 1, 3: 2},
        blocks_to_swap_in={7: 4},
        blocks_to_copy={5: [8, 9], 6: [10]},
    )
    logger.record_step(out, scheduler(), 1.0)
    got = [
        value(metrics, f"vkv_{name}_total")
        for name in ("blocks_swapped_out", "blocks_swapped_in", "cow_copies")
    ]
    assert got == [3, 1, 3], (
        "a block per swap-map entry (3 out, 1 in) and a copy per destination (block 5 copied "
        f"twice, block 6 once: 3): expected [3, 1, 3], got {got}"
    )


def test_part1_swaps_and_copies_add_up_over_steps():
    logger, metrics = make_logger()
    for _ in range(2):
        out = SchedulerOutput(blocks_to_swap_out={1: 0}, blocks_to_swap_in={2: 3, 4: 5})
        out.blocks_to_copy = {6: [7]}
        logger.record_step(out, scheduler(), 1.0)
    got = [
        value(metrics, f"vkv_{name}_total")
        for name in ("blocks_swapped_out", "blocks_swapped_in", "cow_copies")
    ]
    assert got == [2, 4, 2], f"counters add each step's events: [2, 4, 2], got {got}"


def test_part1_prefix_cache_counters_add_what_the_totals_grew_by():
    logger, metrics = make_logger()
    logger.record_step(SchedulerOutput(), scheduler(queries=40, hits=16), 1.0)
    logger.record_step(SchedulerOutput(), scheduler(queries=100, hits=48), 2.0)
    logger.record_step(SchedulerOutput(), scheduler(queries=100, hits=48), 3.0)
    got = [value(metrics, f"vkv_prefix_cache_{name}_total") for name in ("queries", "hits")]
    assert got == [100, 48], (
        "the block manager's num_query_tokens and num_hit_tokens are totals so far: a step "
        f"adds what they grew by (40, then 60, then 0): expected [100, 48], got {got}"
    )


# --------------------------------------------------------------------------------------------
# Part 5.2: tokens
# --------------------------------------------------------------------------------------------


def test_part2_each_token_counts_once():
    logger, metrics = make_logger()
    logger.record_tokens([seq(1), seq(2)], 101.0)
    logger.record_tokens([seq(1, completion=2)], 102.0)
    got = value(metrics, "vkv_generation_tokens_total")
    assert got == 3, f"2 sequences gained a token, then 1: generation_tokens 3, got {got}"


def test_part2_a_first_token_observes_the_time_from_arrival():
    logger, metrics = make_logger()
    logger.record_tokens([seq(1, arrival=100.0), seq(2, arrival=100.5)], 100.75)
    got = histogram(metrics, "vkv_time_to_first_token_seconds")
    assert got == (2, 1.0), (
        "two first tokens at 100.75 for arrivals at 100.0 and 100.5: time to first token "
        f"0.75 and 0.25, count 2 and sum 1.0; got (count, sum) {got}"
    )
    bucket = value(metrics, "vkv_time_to_first_token_seconds_bucket", le="0.5")
    assert bucket == 1, f"one of them (0.25 s) is at most 0.5 s: bucket le=0.5 is 1, got {bucket}"


def test_part2_the_prompt_counts_at_the_first_token_only():
    logger, metrics = make_logger()
    logger.record_tokens([seq(1, prompt=12)], 101.0)
    logger.record_tokens([seq(1, prompt=12, completion=2)], 102.0)
    logger.record_tokens([seq(2, prompt=30)], 103.0)
    got = value(metrics, "vkv_prompt_tokens_total")
    assert got == 42, (
        "a prompt counts once, at its sequence's first token (12 + 30 = 42); its later tokens "
        f"add no prompt tokens: got {got}"
    )


def test_part2_a_requests_other_samples_share_its_prompt():
    logger, metrics = make_logger()
    logger.record_tokens([seq(1, prompt=12)], 101.0)
    logger.record_tokens([seq(5, prompt=12, group_id=1), seq(6, prompt=12, group_id=1)], 101.0)
    got = value(metrics, "vkv_prompt_tokens_total")
    assert got == 12, (
        "sequences 5 and 6 are parallel samples of request 1 (group_id 1 != their seq_id): "
        f"the prompt is counted once, 12; got {got}"
    )
    count = value(metrics, "vkv_time_to_first_token_seconds_count")
    assert count == 3, f"each sample's first token is a first token: count 3, got {count}"


def test_part2_later_tokens_observe_the_time_since_the_previous_one():
    logger, metrics = make_logger()
    logger.record_tokens([seq(1), seq(2)], 101.0)
    logger.record_tokens([seq(1, completion=2)], 101.25)
    logger.record_tokens([seq(1, completion=3), seq(2, completion=2)], 102.0)
    got = histogram(metrics, "vkv_time_per_output_token_seconds")
    assert got == (3, 2.0), (
        "sequence 1: tokens at 101.0, 101.25, 102.0 (gaps 0.25, 0.75); sequence 2: at 101.0 and "
        f"102.0 (gap 1.0): count 3, sum 2.0; got (count, sum) {got}"
    )
    first = value(metrics, "vkv_time_to_first_token_seconds_count")
    assert first == 2, f"a first token observes no time per output token; TTFT count 2, {first}"


# --------------------------------------------------------------------------------------------
# Part 5.3: finished requests
# --------------------------------------------------------------------------------------------


def test_part3_a_finished_request_counts_under_its_reason():
    logger, metrics = make_logger()
    for reason in ("stop", "length", "length", "abort", "ignored", "error"):
        logger.record_finished(seq(1), reason, 110.0)
    got = {
        reason: value(metrics, "vkv_request_success_total", finished_reason=reason)
        for reason in ("stop", "length", "abort", "ignored", "error")
    }
    assert got == {"stop": 1, "length": 2, "abort": 1, "ignored": 1, "error": 1}, (
        f"request_success_total counts each finished request under its reason, got {got}"
    )


def test_part3_the_latency_and_the_lengths_are_observed():
    logger, metrics = make_logger()
    logger.last_token_time[1] = 101.0  # its last token came at 101.0 (part 5.2 records it)
    logger.record_finished(seq(1, prompt=20, completion=7, arrival=100.0), "stop", 103.5)
    logger.record_finished(seq(2, prompt=40, completion=3, arrival=101.0), "length", 102.0)
    got = [
        histogram(metrics, f"vkv_{name}")
        for name in ("e2e_request_latency_seconds", "request_prompt_tokens")
    ]
    got.append(histogram(metrics, "vkv_request_generation_tokens"))
    assert got == [(2, 4.5), (2, 60), (2, 10)], (
        "end to end from the arrival (not from a token) 3.5 s and 1.0 s, prompts of 20 and 40 "
        "tokens, completions of 7 and 3: "
        f"(count, sum) [(2, 4.5), (2, 60), (2, 10)], got {got}"
    )


def test_part3_a_finished_sequence_is_forgotten():
    logger, _ = make_logger()
    logger.last_token_time.update({1: 101.0, 2: 101.0})  # what part 5.2 remembers
    logger.record_finished(seq(1, completion=1), "stop", 102.0)
    assert 1 not in logger.last_token_time and 2 in logger.last_token_time, (
        "record_finished forgets the sequence (last_token_time holds only live ones), got "
        f"{sorted(logger.last_token_time)}"
    )


def test_part3_an_unknown_reason_is_refused_and_records_nothing():
    logger, metrics = make_logger()
    logger.last_token_time[1] = 101.0
    with pytest.raises(ValueError, match=r"^unknown finish reason 'done'$"):
        logger.record_finished(seq(1), "done", 102.0)
    got = histogram(metrics, "vkv_e2e_request_latency_seconds")
    counted = value(metrics, "vkv_request_success_total", finished_reason="done")
    assert got == (0, 0) and counted == 0 and 1 in logger.last_token_time, (
        "a refused reason records nothing (check it before counting) and forgets nothing: got "
        f"(count, sum) {got}, request_success_total{{finished_reason='done'}} {counted}"
    )


# --------------------------------------------------------------------------------------------
# Parts 5.4 to 5.8: recording rules and alerts, checked by promtool test rules
# --------------------------------------------------------------------------------------------
#
# Each test feeds input series (promtool's notation, one value every 15 s: '0+60x20' is 0, 60,
# ..., 1200) to the rules your function builds, and compares what a recorded series holds at a
# time, rounded to 4 decimals, or which alerts fire, with what the rule of the handout gives.
# promtool is deterministic: no clock, no scrape. Without it (Debian: apt-get install
# prometheus) these tests skip, unless VKV_REQUIRE_PROMETHEUS=1.

needs_promtool = pytest.mark.skipif(
    promtool() is None and os.environ.get("VKV_REQUIRE_PROMETHEUS") != "1",
    reason="promtool is not installed (Debian: apt-get install prometheus): parts 5.4-5.8 are "
    "checked with promtool test rules (VKV_REQUIRE_PROMETHEUS=1 fails instead of skipping)",
)


def series(name: str, values: str, **labels: str) -> dict:
    """An input series: ``name{labels}`` with promtool's expanding ``values``."""
    body = ",".join(f'{key}="{value}"' for key, value in labels.items())
    return {"series": f"{name}{{{body}}}", "values": values}


def expect(name: str, time: str, samples: dict[str, float]) -> dict:
    """At ``time``, the recorded ``name`` rounded to 4 decimals holds exactly ``samples``
    ({'model_name="a"': 4.0}; {} for no sample at all)."""
    return {
        "expr": f"round({name}, 0.0001)",
        "eval_time": time,
        "exp_samples": [{"labels": f"{{{labels}}}", "value": v} for labels, v in samples.items()],
    }


def built(function, *args):
    """What the student's function returns, or a failure that names what it raised."""
    try:
        return function(*args)
    except NotImplementedError:
        raise
    except Exception as error:  # a teaching message, not a bare traceback
        call = f"{function.__name__}({', '.join(map(repr, args))})"
        pytest.fail(f"{call} raised {type(error).__name__}: {error}", pytrace=False)


def names(rules) -> list:
    return [r.get("record") or r.get("alert") if isinstance(r, dict) else r for r in rules]


RATE = {stem: f"model_name:vkv_{stem}:rate1m" for stem in RATE_STEMS}


# -- part 5.4 ---------------------------------------------------------------------------------


def test_part4_the_rules_are_named_level_metric_operations():
    for window in ("1m", "5m"):
        got = names(built(rate_rules, window))
        want = [f"model_name:vkv_{stem}:rate{window}" for stem in RATE_STEMS]
        assert got == want, (
            f"rate_rules({window!r}) records level:metric:operations names, the level the labels "
            f"kept (model_name), the counter without _total, the operation with its window: "
            f"expected {want}, got {got}"
        )


@needs_promtool
def test_part4_a_counter_gives_its_increase_per_second(tmp_path):
    inputs = [
        series("vkv_prompt_tokens_total", "0+30x20", model_name="a", instance="x"),
        series("vkv_generation_tokens_total", "0+60x20", model_name="a", instance="x"),
        series("vkv_num_preemptions_total", "0+3x20", model_name="a", instance="x"),
    ]
    checks = [
        expect(RATE[stem], "4m", {'model_name="a"': per_second})
        for stem, per_second in zip(RATE_STEMS, (2.0, 4.0, 0.2), strict=True)
    ]
    rule = (
        "a rate is per second over the window: 60 tokens every 15 s are 4 tokens a second "
        "(rate, not increase, which is per window), and the result keeps model_name only"
    )
    check_rules(tmp_path, built(rate_rules, "1m"), rule, inputs, checks)


@needs_promtool
def test_part4_the_instances_of_a_model_add_up(tmp_path):
    inputs = [
        series("vkv_generation_tokens_total", "0+60x20", model_name="a", instance="x"),
        series("vkv_generation_tokens_total", "0+30x20", model_name="a", instance="y"),
        series("vkv_generation_tokens_total", "0+15x20", model_name="b", instance="x"),
    ]
    checks = [expect(RATE["generation_tokens"], "4m", {'model_name="a"': 6.0, 'model_name="b"': 1})]
    rule = (
        "a model's tokens per second add up over its instances (4 + 2 = 6 for model a), and "
        "models stay apart (b: 1): sum by (model_name)"
    )
    check_rules(tmp_path, built(rate_rules, "1m"), rule, inputs, checks)


@needs_promtool
def test_part4_a_counter_reset_is_a_restart_not_a_drop(tmp_path):
    # The engine restarts after 2m30s: its counter starts again from 0 (60 after 15 s).
    inputs = [
        series("vkv_generation_tokens_total", "0+60x10 60+60x10", model_name="a", instance="x"),
        series("vkv_num_preemptions_total", "0+6x10 6+6x10", model_name="a", instance="x"),
    ]
    checks = [
        expect(RATE["generation_tokens"], time, {'model_name="a"': 4.0}) for time in ("2m45s", "3m")
    ]
    checks += [expect(RATE["num_preemptions"], "3m", {'model_name="a"': 0.4})]
    rule = (
        "a counter that falls has restarted (a new engine process): the rate counts what it "
        "counted since, never a negative change (rate handles resets; delta does not)"
    )
    check_rules(tmp_path, built(rate_rules, "1m"), rule, inputs, checks)


@needs_promtool
def test_part4_the_rate_is_over_the_given_window(tmp_path):
    # 480 tokens between 3m and 4m, none before or after.
    inputs = [series("vkv_generation_tokens_total", "0x12 120+120x3 480x4", model_name="a")]
    cases = {"2m": 4.0, "1m": 0.0, "5m": 1.6}
    for window, per_second in cases.items():
        name = f"model_name:vkv_generation_tokens:rate{window}"
        rule = (
            f"rate over the window given ({window}): 480 tokens between 3m and 4m are "
            f"{per_second} a second at 5m over {window} (not the last two samples: irate)"
        )
        check_rules(
            tmp_path / window,
            built(rate_rules, window),
            rule,
            inputs,
            [expect(name, "5m", {'model_name="a"': per_second})],
        )


@needs_promtool
def test_part4_an_idle_counter_has_a_rate_of_zero(tmp_path):
    inputs = [
        series("vkv_prompt_tokens_total", "500x20", model_name="a"),
        series("vkv_num_preemptions_total", "7x20", model_name="a"),
    ]
    checks = [
        expect(RATE["prompt_tokens"], "4m", {'model_name="a"': 0.0}),
        expect(RATE["num_preemptions"], "4m", {'model_name="a"': 0.0}),
    ]
    rule = "a counter that did not move has a rate of 0, a sample: the engine is up and idle"
    check_rules(tmp_path, built(rate_rules, "1m"), rule, inputs, checks)


# -- part 5.5 ---------------------------------------------------------------------------------

HIT_RATIO = "model_name:vkv_prefix_cache_hits_per_queries:ratio_rate1m"


def prefix(hits: str, queries: str, **labels) -> list[dict]:
    return [
        series("vkv_prefix_cache_hits_total", hits, **labels),
        series("vkv_prefix_cache_queries_total", queries, **labels),
    ]


def test_part5_the_rule_is_named_level_metric_operations():
    for window in ("1m", "2m"):
        rule = built(hit_ratio_rule, window)
        got = rule.get("record") if isinstance(rule, dict) else rule
        want = f"model_name:vkv_prefix_cache_hits_per_queries:ratio_rate{window}"
        assert got == want, (
            f"hit_ratio_rule({window!r}) records hits per queries, a ratio of rates: expected "
            f"{want!r}, got {got!r}"
        )


@needs_promtool
def test_part5_the_ratio_is_hit_tokens_over_queried_tokens(tmp_path):
    inputs = prefix("0+30x20", "0+40x20", model_name="a", instance="x")
    rule = "30 of every 40 prompt tokens looked up were found: a hit ratio of 0.75"
    checks = [expect(HIT_RATIO, "4m", {'model_name="a"': 0.75})]
    check_rules(tmp_path, [built(hit_ratio_rule, "1m")], rule, inputs, checks)


@needs_promtool
def test_part5_one_ratio_over_all_of_a_models_tokens(tmp_path):
    inputs = prefix("0+10x20", "0+10x20", model_name="a", instance="x")
    inputs += prefix("0x20", "0+30x20", model_name="a", instance="y")
    inputs += prefix("0+5x20", "0+10x20", model_name="b", instance="x")
    rule = (
        "the ratio of the sums, not a mean or a sum of ratios: instance x of model a hit 10 "
        "of 10 tokens, y 0 of 30, so a hit 10 of 40 (0.25, not 0.5 or 1); b 5 of 10 (0.5)"
    )
    checks = [expect(HIT_RATIO, "4m", {'model_name="a"': 0.25, 'model_name="b"': 0.5})]
    check_rules(tmp_path, [built(hit_ratio_rule, "1m")], rule, inputs, checks)


@needs_promtool
def test_part5_no_lookup_is_no_sample_and_no_hit_is_zero(tmp_path):
    # Model a looks up prompt tokens until 2m, then nothing; model b looks up and never hits.
    inputs = prefix("0+10x8 80x12", "0+40x8 320x12", model_name="a")
    inputs += prefix("0x20", "0+40x20", model_name="b")
    rule = (
        "a window without lookups has no ratio (no sample: 0/0 is NaN, which a panel shows as "
        "a gap and an alert cannot compare); lookups without hits are a ratio of 0"
    )
    checks = [
        expect(HIT_RATIO, "1m30s", {'model_name="a"': 0.25, 'model_name="b"': 0}),
        expect(HIT_RATIO, "4m", {'model_name="b"': 0}),
    ]
    check_rules(tmp_path, [built(hit_ratio_rule, "1m")], rule, inputs, checks)


@needs_promtool
def test_part5_a_restart_keeps_the_ratio(tmp_path):
    inputs = prefix("0+30x10 30+30x10", "0+40x10 40+40x10", model_name="a")
    rule = "a restart resets both counters; the ratio over the window stays 30 of 40 (0.75)"
    checks = [expect(HIT_RATIO, t, {'model_name="a"': 0.75}) for t in ("2m45s", "3m")]
    check_rules(tmp_path, [built(hit_ratio_rule, "1m")], rule, inputs, checks)


@needs_promtool
def test_part5_the_ratio_is_over_the_given_window(tmp_path):
    # 160 hits between 3m and 4m; 40 queried tokens every 15 s throughout.
    inputs = prefix("0x12 40+40x3 160x4", "0+40x20", model_name="a")
    for window, ratio in {"2m": 0.5, "1m": 0.0, "5m": 0.2}.items():
        name = f"model_name:vkv_prefix_cache_hits_per_queries:ratio_rate{window}"
        rule = f"the ratio over the window given: at 5m over {window}, {ratio}"
        check_rules(
            tmp_path / window,
            [built(hit_ratio_rule, window)],
            rule,
            inputs,
            [expect(name, "5m", {'model_name="a"': ratio})],
        )


# -- part 5.6 ---------------------------------------------------------------------------------

TTFT = "model_name:vkv_time_to_first_token_seconds:quantile_rate1m"
E2E = "model_name:vkv_e2e_request_latency_seconds:quantile_rate1m"


def histogram_series(metric: str, steps: list[dict], restart_at=None, **labels) -> list[dict]:
    """A histogram's cumulative series from each 15 s step's observations ({bound: how many},
    bounds as strings, '+Inf' last), restarting from 0 before step ``restart_at``."""
    bounds = list(steps[0])
    totals = dict.fromkeys(bounds, 0)
    values: dict[str, list[int]] = {b: [] for b in bounds}
    for i, step in enumerate(steps):
        if i == restart_at:
            totals = dict.fromkeys(bounds, 0)
        running = 0
        for bound in bounds:
            running += step[bound]
            totals[bound] += running if i else 0
            values[bound].append(totals[bound])
    out = [
        series(f"{metric}_bucket", " ".join(map(str, values[b])), **labels, le=b) for b in bounds
    ]
    out.append(series(f"{metric}_count", " ".join(map(str, values["+Inf"])), **labels))
    return out


def per_step(counts: dict, n: int = 21) -> list[dict]:
    return [counts] * n


def quantile_samples(model: str, p50: float, p99: float) -> dict:
    return {
        f'model_name="{model}",quantile="0.5"': p50,
        f'model_name="{model}",quantile="0.99"': p99,
    }


def test_part6_the_rules_are_named_and_labelled_by_quantile():
    rules = built(latency_quantile_rules, "1m", (0.5, 0.99))
    got = [(r.get("record"), r.get("labels")) if isinstance(r, dict) else r for r in rules]
    want = [(TTFT, {"quantile": "0.5"}), (TTFT, {"quantile": "0.99"})]
    want += [(E2E, {"quantile": "0.5"}), (E2E, {"quantile": "0.99"})]
    assert got == want, (
        "a rule per histogram and quantile, time to first token first, each named "
        "level:metric:operations and labelled quantile=str(q): expected (record, labels) "
        f"{want}, got {got}"
    )
    rules = built(latency_quantile_rules, "2m", (0.9,))
    got = [(r.get("record"), r.get("labels")) if isinstance(r, dict) else r for r in rules]
    want = [
        ("model_name:vkv_time_to_first_token_seconds:quantile_rate2m", {"quantile": "0.9"}),
        ("model_name:vkv_e2e_request_latency_seconds:quantile_rate2m", {"quantile": "0.9"}),
    ]
    assert got == want, f"latency_quantile_rules('2m', (0.9,)): expected {want}, got {got}"


@needs_promtool
def test_part6_a_quantile_interpolates_inside_its_bucket(tmp_path):
    # Every 15 s: TTFT 2 observations in (0.1, 0.25], 1 in (0.25, 0.5], 1 in (0.5, 1];
    # end to end 1 in (0.5, 1], 3 in (1, 2.5].
    ttft = {"0.1": 0, "0.25": 2, "0.5": 1, "1": 1, "+Inf": 0}
    e2e = {"0.5": 0, "1": 1, "2.5": 3, "+Inf": 0}
    inputs = histogram_series("vkv_time_to_first_token_seconds", per_step(ttft), model_name="a")
    inputs += histogram_series("vkv_e2e_request_latency_seconds", per_step(e2e), model_name="a")
    rule = (
        "histogram_quantile over the buckets' rates: of 16 observations a window, the median "
        "(rank 8) is the top of (0.1, 0.25], and p99 (rank 15.84) lies 0.96 of the way into "
        "(0.5, 1]: 0.98; end to end, p50 (rank 8) is 1 + 1.5 * (8 - 4) / 12 = 1.5, p99 2.48"
    )
    checks = [
        expect(TTFT, "4m", quantile_samples("a", 0.25, 0.98)),
        expect(E2E, "4m", quantile_samples("a", 1.5, 2.48)),
    ]
    check_rules(tmp_path, built(latency_quantile_rules, "1m", (0.5, 0.99)), rule, inputs, checks)


@needs_promtool
def test_part6_the_instances_buckets_add_up_before_the_quantile(tmp_path):
    fast = {"0.1": 4, "0.25": 0, "0.5": 0, "1": 0, "+Inf": 0}
    slow = {"0.1": 0, "0.25": 0, "0.5": 0, "1": 4, "+Inf": 0}
    metric = "vkv_time_to_first_token_seconds"
    inputs = histogram_series(metric, per_step(fast), model_name="a", instance="x")
    inputs += histogram_series(metric, per_step(slow), model_name="a", instance="y")
    inputs += histogram_series(metric, per_step(slow), model_name="b", instance="x")
    rule = (
        "a model's quantile is over all its instances' observations: sum the bucket rates by "
        "(model_name, le), then histogram_quantile (a quantile per instance is not the "
        "model's, and without le the buckets are lost): model a p50 0.1, p99 0.99; b 0.75, 0.995"
    )
    checks = [
        expect(
            TTFT, "4m", {**quantile_samples("a", 0.1, 0.99), **quantile_samples("b", 0.75, 0.995)}
        )
    ]
    check_rules(tmp_path, built(latency_quantile_rules, "1m", (0.5, 0.99)), rule, inputs, checks)


@needs_promtool
def test_part6_only_the_windows_observations_count(tmp_path):
    fast = {"0.1": 4, "0.25": 0, "0.5": 0, "1": 0, "+Inf": 0}
    slow = {"0.1": 0, "0.25": 0, "0.5": 0, "1": 4, "+Inf": 0}
    steps = [slow] * 13 + [fast] * 8  # slow until 3m, fast after
    inputs = histogram_series("vkv_time_to_first_token_seconds", steps, model_name="a")
    rule = (
        "the quantile is over the window's observations only: slow first tokens until 3m "
        "(0.5 to 1 s), fast ones after (under 0.1 s); at 5m over 1m p50 0.05, p99 0.099; "
        "over 5m the 48 slow ones of 80 weigh in (p50 0.5833, p99 0.9917)"
    )
    checks = [expect(TTFT, "5m", quantile_samples("a", 0.05, 0.099))]
    check_rules(tmp_path, built(latency_quantile_rules, "1m", (0.5, 0.99)), rule, inputs, checks)
    name = "model_name:vkv_time_to_first_token_seconds:quantile_rate5m"
    checks = [expect(name, "5m", quantile_samples("a", 0.5833, 0.9917))]
    check_rules(
        tmp_path / "5m", built(latency_quantile_rules, "5m", (0.5, 0.99)), rule, inputs, checks
    )


@needs_promtool
def test_part6_a_restart_is_not_a_drop(tmp_path):
    steps = per_step({"0.1": 0, "0.25": 2, "0.5": 1, "1": 1, "+Inf": 0})
    inputs = histogram_series(
        "vkv_time_to_first_token_seconds", steps, restart_at=11, model_name="a"
    )
    rule = (
        "an engine that restarts starts its buckets from 0: rates over the window still count "
        "every observation (rate of the buckets, not delta), p50 0.25 and p99 0.98"
    )
    checks = [expect(TTFT, t, quantile_samples("a", 0.25, 0.98)) for t in ("2m45s", "3m")]
    check_rules(tmp_path, built(latency_quantile_rules, "1m", (0.5, 0.99)), rule, inputs, checks)


@needs_promtool
def test_part6_a_window_without_observations_has_no_sample(tmp_path):
    busy = {"0.5": 0, "1": 1, "2.5": 3, "+Inf": 0}
    idle = dict.fromkeys(busy, 0)
    steps = [busy] * 9 + [idle] * 12  # requests finish until 2m, none after
    inputs = histogram_series("vkv_e2e_request_latency_seconds", steps, model_name="a")
    inputs += histogram_series("vkv_e2e_request_latency_seconds", per_step(busy), model_name="b")
    rule = (
        "a window in which no request finished has no quantile: no sample (histogram_quantile "
        "of all-zero buckets is NaN, which a panel draws as a gap and an alert cannot compare)"
    )
    checks = [
        expect(
            E2E, "1m30s", {**quantile_samples("a", 1.5, 2.48), **quantile_samples("b", 1.5, 2.48)}
        ),
        expect(E2E, "4m", quantile_samples("b", 1.5, 2.48)),
    ]
    check_rules(tmp_path, built(latency_quantile_rules, "1m", (0.5, 0.99)), rule, inputs, checks)


# -- part 5.7 ---------------------------------------------------------------------------------


def usage_names(window: str) -> list[str]:
    return [
        name
        for pool in ("gpu", "cpu")
        for name in (
            f"model_name:vkv_{pool}_cache_usage_perc:max",
            f"model_name:vkv_{pool}_cache_usage_perc:max_avg_over_time{window}",
        )
    ]


def test_part7_the_rules_are_named_level_metric_operations():
    for window in ("1m", "2m"):
        got, want = names(built(kv_usage_rules, window)), usage_names(window)
        assert got == want, (
            f"kv_usage_rules({window!r}): the GPU pool's two rules then the CPU pool's, the "
            f"operations newest first: expected {want}, got {got}"
        )


@needs_promtool
def test_part7_the_fullest_instance_counts(tmp_path):
    inputs = [
        series("vkv_gpu_cache_usage_perc", "0.5x20", model_name="a", instance="x"),
        series("vkv_gpu_cache_usage_perc", "0.75x20", model_name="a", instance="y"),
        series("vkv_gpu_cache_usage_perc", "0.25x20", model_name="b", instance="x"),
        series("vkv_cpu_cache_usage_perc", "0.125x20", model_name="a", instance="x"),
        series("vkv_cpu_cache_usage_perc", "0x20", model_name="a", instance="y"),
    ]
    gpu, cpu = usage_names("1m")[0], usage_names("1m")[2]
    rule = (
        "a model's KV usage is its fullest instance's (max by model_name): one full pool "
        "preempts even when the others are empty; a mean or a sum hides it"
    )
    checks = [
        expect(gpu, "4m", {'model_name="a"': 0.75, 'model_name="b"': 0.25}),
        expect(cpu, "4m", {'model_name="a"': 0.125}),
    ]
    check_rules(tmp_path, built(kv_usage_rules, "1m"), rule, inputs, checks)


@needs_promtool
def test_part7_the_mean_over_the_window_then_the_fullest(tmp_path):
    # Instance x swings between 0.5 and 1 in the last minute (mean 0.75, now 1); y holds 0.625.
    inputs = [
        series("vkv_gpu_cache_usage_perc", "0x15 0.75 0.5 1 0.5 1", model_name="a", instance="x"),
        series("vkv_gpu_cache_usage_perc", "0.625x20", model_name="a", instance="y"),
        series("vkv_cpu_cache_usage_perc", "0x15 0.75 0.5 1 0.5 1", model_name="a", instance="x"),
    ]
    now, mean = usage_names("1m")[:2]
    rule = (
        "max_avg_over_time: each instance's mean over the window (x: 0.75, y: 0.625), then the "
        "largest, 0.75 (not the largest sample, 1, nor the mean of the now values); now: 1"
    )
    checks = [
        expect(mean, "5m", {'model_name="a"': 0.75}),
        expect(now, "5m", {'model_name="a"': 1}),
        expect(usage_names("1m")[3], "5m", {'model_name="a"': 0.75}),
    ]
    check_rules(tmp_path, built(kv_usage_rules, "1m"), rule, inputs, checks)


@needs_promtool
def test_part7_the_mean_is_over_the_given_window(tmp_path):
    # From 3m: 0.625, then 1, 1, then 0.5 to the end (mean 0.625 over [3m, 5m], 0.5 over [4m, 5m]).
    inputs = [
        series("vkv_gpu_cache_usage_perc", "0x11 0.625 1 1 0.5x6", model_name="a"),
        series("vkv_cpu_cache_usage_perc", "0x20", model_name="a"),
    ]
    for window, mean in {"2m": 0.625, "1m": 0.5}.items():
        rule = f"avg_over_time over the window given: at 5m over {window}, {mean}"
        check_rules(
            tmp_path / window,
            built(kv_usage_rules, window),
            rule,
            inputs,
            [expect(usage_names(window)[1], "5m", {'model_name="a"': mean})],
        )


# -- part 5.8 ---------------------------------------------------------------------------------

KV_ALERT, STORM = "VkvKVCacheNearlyFull", "VkvPreemptionStorm"
USAGE_NOW = "model_name:vkv_gpu_cache_usage_perc:max"


def kv_description(percent: int, duration: str) -> str:
    return (
        f"GPU KV-cache usage above {percent}% for {duration}: new requests wait and running "
        "ones are preempted"
    )


def storm_description(per_second: str, duration: str) -> str:
    return (
        f"more than {per_second} preemptions a second for {duration}: the KV cache is too "
        "small for the load"
    )


def firing(alert: str, time: str, *alerts: tuple[dict, dict]) -> dict:
    """At ``time``, exactly ``alerts`` (labels, annotations) fire under ``alert``."""
    return {
        "alertname": alert,
        "eval_time": time,
        "exp_alerts": [{"exp_labels": lab, "exp_annotations": ann} for lab, ann in alerts],
    }


def kv_firing(model: str, percent_now: str, percent: int = 90, duration: str = "5m"):
    labels = {"model_name": model, "severity": "warning"}
    summary = f"KV cache of {model} is {percent_now} full"
    return labels, {"summary": summary, "description": kv_description(percent, duration)}


def test_part8_the_alerts_carry_for_labels_and_annotations():
    got = built(kv_cache_full_alert, 0.9, "5m")
    want = {
        "alert": KV_ALERT,
        "expr": got.get("expr") if isinstance(got, dict) else None,
        "for": "5m",
        "labels": {"severity": "warning"},
        "annotations": {
            "summary": "KV cache of {{ $labels.model_name }} is "
            "{{ $value | humanizePercentage }} full",
            "description": kv_description(90, "5m"),
        },
    }
    assert got == want, (
        "kv_cache_full_alert(0.9, '5m'): the alert's name, its for: duration, the severity "
        f"label and the annotations of the contract: expected\n{want}\ngot\n{got}"
    )
    got = built(preemption_storm_alert, 2.5, "10m", "1m")
    want = {
        "alert": STORM,
        "expr": got.get("expr") if isinstance(got, dict) else None,
        "for": "10m",
        "labels": {"severity": "critical"},
        "annotations": {
            "summary": "{{ $labels.model_name }} preempts {{ $value | humanize }} sequences a "
            "second",
            "description": storm_description("2.5", "10m"),
        },
    }
    assert got == want, (
        "preemption_storm_alert(2.5, '10m', '1m'): the alert's name, its for: duration, the "
        f"severity label and the annotations of the contract: expected\n{want}\ngot\n{got}"
    )


def test_part8_the_alerts_default_to_90_percent_for_5m_and_1_a_second_for_2m():
    for function, defaults in (
        (kv_cache_full_alert, (0.9, "5m")),
        (preemption_storm_alert, (1.0, "2m", "1m")),
    ):
        got, want = built(function), built(function, *defaults)
        assert got == want, (
            f"{function.__name__}() is the alert vkv monitor init writes: its defaults are "
            f"{defaults} (the signature's); expected\n{want}\ngot\n{got}"
        )


@pytest.mark.parametrize(
    ("call", "args", "message"),
    [
        ("kv", (1.0, "5m"), "threshold must lie between 0 and 1, got 1.0"),
        ("kv", (0, "5m"), "threshold must lie between 0 and 1, got 0"),
        ("kv", (0.9, "5"), "duration must be a Prometheus duration such as 5m, got '5'"),
        ("kv", (0.9, "0s"), "duration must be a Prometheus duration such as 5m, got '0s'"),
        ("storm", (0.0, "2m", "1m"), "per_second must be positive, got 0.0"),
        (
            "storm",
            (1.0, "2 m", "1m"),
            "duration must be a Prometheus duration such as 5m, got '2 m'",
        ),
    ],
)
def test_part8_a_threshold_or_duration_that_cannot_work_is_refused(call, args, message):
    function = kv_cache_full_alert if call == "kv" else preemption_storm_alert
    try:
        got = function(*args)
    except ValueError as error:
        assert str(error) == message, (
            f"{function.__name__}{args}: the ValueError's message is {message!r}, got {error}"
        )
        return
    pytest.fail(
        f"{function.__name__}{args} returned {got!r}: a usage threshold outside (0, 1) never "
        "or always fires, a rate of 0 always fires, and a duration must be one is_duration "
        "accepts (one Prometheus reads, not 0s, which would fire on a single evaluation); "
        f"expected ValueError({message!r})",
        pytrace=False,
    )


@needs_promtool
def test_part8_a_full_cache_fires_only_after_its_duration(tmp_path):
    # Model a: 0.95 from 45 s on; model b: 0.95 from 45 s, a dip to 0.5 at 3m, 0.95 after;
    # model c: exactly at the threshold, 0.9, throughout.
    inputs = [
        series(USAGE_NOW, "0.5x2 0.95x40", model_name="a"),
        series(USAGE_NOW, "0.5x2 0.95x8 0.5 0.95x30", model_name="b"),
        series(USAGE_NOW, "0.9x42", model_name="c"),
    ]
    alerts = [
        firing(KV_ALERT, "5m30s"),
        firing(KV_ALERT, "5m45s", kv_firing("a", "95%")),
        firing(KV_ALERT, "8m", kv_firing("a", "95%")),
        firing(KV_ALERT, "8m15s", kv_firing("a", "95%"), kv_firing("b", "95%")),
    ]
    rule = (
        "the alert fires once usage has stayed above the threshold (strictly: 0.9 is not above "
        "0.9) for the whole for: duration (a at 45s + 5m = 5m45s), a dip below starts the wait "
        "again (b, back above at 3m15s, fires at 8m15s), and each model alerts on its own"
    )
    check_rules(tmp_path, [built(kv_cache_full_alert, 0.9, "5m")], rule, inputs, alerts=alerts)


@needs_promtool
def test_part8_the_kv_alert_takes_its_threshold_and_duration(tmp_path):
    inputs = [series(USAGE_NOW, "0.5x2 0.8x40", model_name="a")]
    alerts = [
        firing(KV_ALERT, "2m30s"),
        firing(KV_ALERT, "2m45s", kv_firing("a", "80%", 75, "2m")),
    ]
    rule = "kv_cache_full_alert(0.75, '2m'): above 0.75 from 45 s, firing from 2m45s"
    check_rules(tmp_path, [built(kv_cache_full_alert, 0.75, "2m")], rule, inputs, alerts=alerts)


def storm_firing(model: str, value: str, per_second="1", duration="2m"):
    labels = {"model_name": model, "severity": "critical"}
    summary = f"{model} preempts {value} sequences a second"
    return labels, {"summary": summary, "description": storm_description(per_second, duration)}


@needs_promtool
def test_part8_a_preemption_storm_fires_after_its_duration(tmp_path):
    rate = RATE["num_preemptions"]
    inputs = [
        series(rate, "0x3 2.5x40", model_name="a"),
        series(rate, "1x43", model_name="b"),  # at the threshold: no storm
        series("vkv_num_preemptions_total", "1000x43", model_name="c"),  # many, long ago
    ]
    alerts = [
        firing(STORM, "2m45s"),
        firing(STORM, "3m", storm_firing("a", "2.5")),
    ]
    rule = (
        "the storm alert reads the rate of preemptions (the rule of part 5.4, not the counter: "
        "1000 preemptions long ago are no storm) and fires once it stayed above per_second "
        "(strictly) for the duration: a from 1m, firing from 3m"
    )
    check_rules(
        tmp_path, [built(preemption_storm_alert, 1.0, "2m", "1m")], rule, inputs, alerts=alerts
    )


@needs_promtool
def test_part8_the_storm_alert_takes_its_rate_duration_and_window(tmp_path):
    inputs = [
        series("model_name:vkv_num_preemptions:rate5m", "0x3 0.5x40", model_name="a"),
        series(RATE["num_preemptions"], "9x43", model_name="a"),
    ]
    alerts = [
        firing(STORM, "5m45s"),
        firing(STORM, "6m", storm_firing("a", "500m", "0.25", "5m")),
    ]
    rule = (
        "preemption_storm_alert(0.25, '5m', '5m') reads the 5m rate rule: above 0.25 from 1m, "
        "firing from 6m"
    )
    check_rules(
        tmp_path, [built(preemption_storm_alert, 0.25, "5m", "5m")], rule, inputs, alerts=alerts
    )
