"""Hidden tests for Phase 5: instructor-only (left out of the student edition).

They check the rules of ``assignment/phase5.md`` as ``tests/test_phase5.py`` does: scripted
steps (queues, pools, swap and copy maps, prefix-cache totals, sequences, arrival times and a
clock the test moves) drawn from the grade's seed, so a table of the visible tests' answers
cannot pass them. Every test gets its ``rng`` from ``@seeded`` (``test_seed.py``: the seed is
``VKV_GRADE_SEED``, or a fresh one when it is unset, and every failure names it). Expected
values are sums and counts kept here; times are multiples of 1/64 s, so that every sum is exact.
"""

import itertools
import math
import os

import pytest
from metrics_fakes import check_rules, scheduler, seq
from test_seed import seeded

from vkv.engine.scheduler import SchedulerOutput
from vkv.metrics import rules as metric_rules
from vkv.metrics.registry import (
    FINISH_REASONS,
    LATENCY_BUCKETS,
    TPOT_BUCKETS,
    TTFT_BUCKETS,
    EngineMetrics,
    length_buckets,
)
from vkv.metrics.rulecheck import promtool
from vkv.metrics.stats import StatLogger

MAX_MODEL_LEN = 2048


def make_logger(rng) -> tuple[StatLogger, EngineMetrics, dict]:
    name = rng.choice(["vkv-tiny", "qwen3-0.6b", f"model-{rng.randrange(1000)}"])
    metrics = EngineMetrics(max_model_len=MAX_MODEL_LEN, model_name=name)
    return StatLogger(metrics), metrics, {"model_name": name}


def value(metrics: EngineMetrics, labels: dict, name: str, **extra) -> float:
    sample = metrics.registry.get_sample_value(name, {**labels, **extra})
    return 0.0 if sample is None else sample


def histogram(metrics, labels, name: str, bounds) -> tuple[float, float, list[float]]:
    """(count, sum, cumulative bucket counts) of a histogram."""
    buckets = [value(metrics, labels, f"{name}_bucket", le=_le(b)) for b in bounds]
    return value(metrics, labels, f"{name}_count"), value(metrics, labels, f"{name}_sum"), buckets


def _le(bound) -> str:
    return str(float(bound))


def buckets_of(observed: list[float], bounds) -> list[float]:
    return [float(sum(x <= b for x in observed)) for b in bounds]


def a_time(rng, low: int = 0, high: int = 64 * 200) -> float:
    """A time in seconds, a multiple of 1/64 (exact in binary)."""
    return rng.randint(low, high) / 64


# --------------------------------------------------------------------------------------------
# Part 5.1: record_step
# --------------------------------------------------------------------------------------------


@seeded
def test_part1_gauges_hold_the_state_the_last_step_left(rng):
    logger, metrics, labels = make_logger(rng)
    names = ["running", "waiting", "swapped"]
    for step in range(rng.randint(2, 12)):
        queues = [rng.randint(0, 300) for _ in names]
        usage = [rng.randint(0, 256) / 256, rng.randint(0, 256) / 256]
        logger.record_step(SchedulerOutput(), scheduler(*queues, *usage), float(step))
        got = [value(metrics, labels, f"vkv_num_requests_{q}") for q in names]
        got += [value(metrics, labels, f"vkv_{d}_cache_usage_perc") for d in ("gpu", "cpu")]
        want = [*map(float, queues), *usage]
        assert got == want, (
            f"after step {step}: the gauges are set to the queues' lengths and the block "
            f"manager's gpu_usage and cpu_usage as the step left them (set, not added): "
            f"[running, waiting, swapped, gpu, cpu] expected {want}, got {got}"
        )


@seeded
def test_part1_each_steps_preemptions_swaps_and_copies_add_up(rng):
    logger, metrics, labels = make_logger(rng)
    totals = {"num_preemptions": 0, "blocks_swapped_out": 0, "blocks_swapped_in": 0}
    totals["cow_copies"] = 0
    for step in range(rng.randint(1, 10)):
        preempted = [seq(i, 5, 1, 0.0) for i in range(rng.randint(0, 6))]
        out_map = {gpu: cpu for cpu, gpu in enumerate(rng.sample(range(500), rng.randint(0, 9)))}
        in_map = {cpu: gpu for gpu, cpu in enumerate(rng.sample(range(500), rng.randint(0, 9)))}
        copies = {
            src: rng.sample(range(1000, 2000), rng.randint(1, 4))
            for src in rng.sample(range(500), rng.randint(0, 5))
        }
        out = SchedulerOutput(
            preempted=preempted,
            blocks_to_swap_out=out_map,
            blocks_to_swap_in=in_map,
            blocks_to_copy=copies,
        )
        logger.record_step(out, scheduler(), float(step))
        totals["num_preemptions"] += len(preempted)
        totals["blocks_swapped_out"] += len(out_map)
        totals["blocks_swapped_in"] += len(in_map)
        totals["cow_copies"] += sum(len(d) for d in copies.values())
        got = {name: value(metrics, labels, f"vkv_{name}_total") for name in totals}
        assert got == {k: float(v) for k, v in totals.items()}, (
            f"after step {step}: one preemption per preempted sequence, one block per entry of "
            f"each swap map, one copy per destination of blocks_to_copy ({copies} this step), "
            f"added up over the steps: expected {totals}, got {got}"
        )


@seeded
def test_part1_prefix_cache_counters_add_what_the_totals_grew_by(rng):
    logger, metrics, labels = make_logger(rng)
    queries = hits = 0
    for step in range(rng.randint(1, 12)):
        grew = rng.choice([0, rng.randint(1, 500)])
        queries += grew
        hits += rng.randint(0, grew)
        for _ in range(rng.randint(1, 2)):  # a step the totals did not move counts nothing
            logger.record_step(SchedulerOutput(), scheduler(queries=queries, hits=hits), step)
        got = [value(metrics, labels, f"vkv_prefix_cache_{n}_total") for n in ("queries", "hits")]
        assert got == [queries, hits], (
            f"after step {step}: num_query_tokens and num_hit_tokens are totals since the start: "
            f"the counters add what they grew by since the last step, so they equal them: "
            f"expected {[queries, hits]}, got {got}"
        )


# --------------------------------------------------------------------------------------------
# Part 5.2: record_tokens
# --------------------------------------------------------------------------------------------


def token_stream(rng):
    """Steps of (time, sequences that gained a token): requests of 1 to 3 samples (the others
    forked from the first, group_id the first's id), arriving and decoding at random times."""
    requests, steps, now = [], [], a_time(rng, 0, 64 * 5)
    next_id = rng.randrange(1000)
    for k in range(rng.randint(1, 6)):
        arrival = a_time(rng, 0, int(now * 64))
        prompt, samples = rng.randint(1, 500), rng.randint(2 if k == 0 else 1, 3)
        group = [next_id + i for i in range(samples)]
        next_id += samples + rng.randint(0, 5)
        requests.append((arrival, prompt, group))
    generated = {sid: 0 for _, _, group in requests for sid in group}
    info = {
        sid: (arrival, prompt, group[0]) for arrival, prompt, group in requests for sid in group
    }
    for step in range(rng.randint(3, 15)):
        now += rng.randint(1, 64 * 3) / 64
        count = len(generated) if step == 0 else rng.randint(1, len(generated))
        chosen = rng.sample(sorted(generated), count)
        batch = []
        for sid in chosen:
            generated[sid] += 1
            arrival, prompt, first = info[sid]
            batch.append(seq(sid, prompt, generated[sid], arrival, first))
        steps.append((now, batch))
    return steps


@seeded
def test_part2_each_token_counts_once_and_a_first_token_observes_its_time_from_arrival(rng):
    logger, metrics, labels = make_logger(rng)
    tokens, firsts = 0, []
    for now, batch in token_stream(rng):
        logger.record_tokens(batch, now)
        tokens += len(batch)
        firsts += [now - s.arrival_time for s in batch if s.num_completion_tokens == 1]
        got = value(metrics, labels, "vkv_generation_tokens_total")
        assert got == tokens, f"each token counts once: {tokens} so far, got {got}"
    name = "vkv_time_to_first_token_seconds"
    got = histogram(metrics, labels, name, TTFT_BUCKETS)
    want = (float(len(firsts)), sum(firsts), buckets_of(firsts, TTFT_BUCKETS))
    assert got[0] == want[0] and got[1] == pytest.approx(want[1], abs=1e-9), (
        "every sequence's first token (num_completion_tokens == 1), a parallel sample's too, "
        f"observes now - arrival_time: (count, sum) expected {want[:2]}, got {got[:2]}"
    )
    assert got[2] == want[2], f"buckets (le = {TTFT_BUCKETS}): expected {want[2]}, got {got[2]}"


@seeded
def test_part2_a_requests_prompt_counts_once_at_its_first_token(rng):
    logger, metrics, labels = make_logger(rng)
    counted = 0
    for now, batch in token_stream(rng):
        logger.record_tokens(batch, now)
        counted += sum(
            s.num_prompt_tokens
            for s in batch
            if s.num_completion_tokens == 1 and s.group_id == s.seq_id
        )
        got = value(metrics, labels, "vkv_prompt_tokens_total")
        assert got == counted, (
            "a request's prompt counts once, at the first token of its first sequence: not at "
            "later tokens, and not for its other samples (group_id != seq_id): expected "
            f"{counted}, got {got}"
        )


@seeded
def test_part2_a_later_token_observes_the_time_since_the_sequences_previous_one(rng):
    logger, metrics, labels = make_logger(rng)
    last, gaps = {}, []
    for now, batch in token_stream(rng):
        logger.record_tokens(batch, now)
        for s in batch:
            if s.num_completion_tokens > 1:
                gaps.append(now - last[s.seq_id])
            last[s.seq_id] = now
    name = "vkv_time_per_output_token_seconds"
    got = histogram(metrics, labels, name, TPOT_BUCKETS)
    want = (float(len(gaps)), sum(gaps), buckets_of(gaps, TPOT_BUCKETS))
    assert got[0] == want[0] and got[1] == pytest.approx(want[1], abs=1e-9), (
        "each token after a sequence's first observes the time since that sequence's previous "
        f"token (a first token observes none): (count, sum) expected {want[:2]}, got {got[:2]}"
    )
    assert got[2] == want[2], f"buckets (le = {TPOT_BUCKETS}): expected {want[2]}, got {got[2]}"


# --------------------------------------------------------------------------------------------
# Part 5.3: record_finished
# --------------------------------------------------------------------------------------------


@seeded
def test_part3_a_finished_request_counts_under_its_reason(rng):
    logger, metrics, labels = make_logger(rng)
    counts = dict.fromkeys(FINISH_REASONS, 0)
    for k in range(rng.randint(1, 40)):
        reason = rng.choice(FINISH_REASONS)
        logger.record_finished(seq(k, 3, 2, 0.0), reason, a_time(rng))
        counts[reason] += 1
    got = {
        r: value(metrics, labels, "vkv_request_success_total", finished_reason=r) for r in counts
    }
    assert got == {r: float(c) for r, c in counts.items()}, (
        f"request_success counts each finished request under its finished_reason: expected "
        f"{counts}, got {got}"
    )


@seeded
def test_part3_the_latency_from_arrival_and_the_lengths_are_observed(rng):
    logger, metrics, labels = make_logger(rng)
    latencies, prompts, outputs = [], [], []
    for k in range(rng.randint(1, 25)):
        arrival = a_time(rng)
        now = arrival + a_time(rng, 0, 64 * 2000)
        s = seq(k, rng.randint(1, MAX_MODEL_LEN), rng.randint(0, 600), arrival)
        logger.last_token_time[k] = now - a_time(rng, 0, 64)  # what part 5.2 remembers
        logger.record_finished(s, rng.choice(FINISH_REASONS), now)
        latencies.append(now - arrival)
        prompts.append(s.num_prompt_tokens)
        outputs.append(s.num_completion_tokens)
    lengths = length_buckets(MAX_MODEL_LEN)
    for name, observed, bounds, what in (
        ("e2e_request_latency_seconds", latencies, LATENCY_BUCKETS, "now - arrival_time"),
        ("request_prompt_tokens", prompts, lengths, "the prompt's length"),
        ("request_generation_tokens", outputs, lengths, "the completion's length"),
    ):
        got = histogram(metrics, labels, f"vkv_{name}", bounds)
        want = (float(len(observed)), float(sum(observed)), buckets_of(observed, bounds))
        assert got[0] == want[0] and got[1] == pytest.approx(want[1], abs=1e-9), (
            f"{name} observes {what} for each finished request: (count, sum) expected "
            f"{want[:2]}, got {got[:2]}"
        )
        assert got[2] == want[2], f"{name} buckets: expected {want[2]}, got {got[2]}"


@seeded
def test_part3_a_finished_sequence_is_forgotten_and_an_unknown_reason_records_nothing(rng):
    logger, metrics, _labels = make_logger(rng)
    live = {k: a_time(rng) for k in rng.sample(range(1000), rng.randint(2, 20))}
    logger.last_token_time.update(live)
    done = rng.sample(sorted(live), rng.randint(1, len(live) - 1))
    for k in done:
        logger.record_finished(seq(k, 4, 1, 0.0), rng.choice(FINISH_REASONS), 1e3)
    left = {k: t for k, t in live.items() if k not in done}
    assert logger.last_token_time == left, (
        f"record_finished forgets each finished sequence ({sorted(done)}) and only those: "
        f"last_token_time keeps {sorted(left)}, got {sorted(logger.last_token_time)}"
    )
    snapshot = [
        (m.name, s.name, tuple(sorted(s.labels.items())), s.value)
        for m in metrics.registry.collect()
        for s in m.samples
    ]
    reason = rng.choice(["done", "stopped", "STOP", "timeout", "", "finished"])
    victim = rng.choice(sorted(left))
    with pytest.raises(ValueError) as raised:
        logger.record_finished(seq(victim, 4, 1, 0.0), reason, 2e3)
    want = f"unknown finish reason {reason!r}"
    assert str(raised.value) == want, f"expected {want!r}, got {raised.value!r}"
    after = [
        (m.name, s.name, tuple(sorted(s.labels.items())), s.value)
        for m in metrics.registry.collect()
        for s in m.samples
    ]
    changed = [a for a, b in zip(after, snapshot, strict=False) if a != b and "created" not in a[1]]
    assert not changed and len(after) == len(snapshot), (
        f"a refused reason records nothing (check it before counting): changed {changed[:3]}"
    )
    assert logger.last_token_time == left, "and forgets nothing"


# --------------------------------------------------------------------------------------------
# Parts 5.4 to 5.8: rules on drawn series, against oracles computed here
# --------------------------------------------------------------------------------------------
# Series are sampled every 15 s and evaluated at 10m (tick 40); every window ends on a sample
# and starts on one, so Prometheus's rate is the window's increase divided by its seconds.

TICK, END = 15, 40
WINDOWS = {"30s": 30, "1m": 60, "2m": 120, "3m": 180, "5m": 300}
needs_promtool = pytest.mark.skipif(
    promtool() is None and os.environ.get("VKV_REQUIRE_PROMETHEUS") != "1",
    reason="promtool is not installed (Debian: apt-get install prometheus)",
)


def _series(name: str, values, **labels) -> dict:
    body = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{body}}}", "values": " ".join(map(str, values))}


OFFSET = 3e-8  # off a rounding boundary: a value exactly halfway (2.40625) rounds either way


def _round(x: float) -> float:
    return math.floor((x + OFFSET) * 10000 + 0.5) / 10000


def _expect(name: str, samples: dict, time: str = "10m") -> dict:
    return {
        "expr": f"round({name} + {OFFSET}, 0.0001)",
        "eval_time": time,
        "exp_samples": [{"labels": f"{{{k}}}", "value": _round(v)} for k, v in samples.items()],
    }


def _counter(rng, per_tick: int, restart_within: int = 0) -> list[int]:
    """A counter growing ``per_tick`` a tick; with ``restart_within`` > 0, restarted (from 0) at
    a drawn one of the last ``restart_within`` ticks, inside a window of as many ticks."""
    reset = rng.randint(END - restart_within + 1, END) if restart_within else None
    values, total = [], 0
    for t in range(END + 1):
        total = per_tick if t == reset else (total + per_tick if t else 0)
        values.append(total)
    return values


def _check(tmp_path, rules, inputs, checks=(), alerts=(), rule=""):
    check_rules(tmp_path, rules, rule, inputs, checks, alerts)


def _drawn_rates(rng, tmp_path, instances: tuple[int, int], restarts: float, rule: str) -> None:
    """Counters of 1 to 3 models, ``instances`` (fewest, most) each, growing a drawn amount a
    tick and restarted inside the window with probability ``restarts``: each model's rate is the
    sum of its instances' increase per tick over 15 s, whatever the window."""
    window = rng.choice(["30s", "1m", "2m", "5m"])
    ticks = WINDOWS[window] // TICK
    inputs, want = [], {stem: {} for stem in metric_rules.RATE_STEMS}
    for m in range(rng.randint(1, 3)):
        for i in range(rng.randint(*instances)):
            for stem in metric_rules.RATE_STEMS:
                k = rng.randint(0, 90)
                values = _counter(rng, k, ticks if rng.random() < restarts else 0)
                inputs.append(_series(f"vkv_{stem}_total", values, model_name=f"m{m}", instance=i))
                key = f'model_name="m{m}"'
                want[stem][key] = want[stem].get(key, 0) + k / TICK
    checks = [_expect(f"model_name:vkv_{s}:rate{window}", want[s]) for s in metric_rules.RATE_STEMS]
    _check(tmp_path, metric_rules.rate_rules(window), inputs, checks, rule=f"over {window}: {rule}")


@needs_promtool
@seeded
def test_part4_drawn_counters_give_their_increase_per_second(rng, tmp_path):
    _drawn_rates(rng, tmp_path, (1, 1), 0.0, "a counter's increase per second, per model")


@needs_promtool
@seeded
def test_part4_drawn_instances_of_a_model_add_up(rng, tmp_path):
    _drawn_rates(rng, tmp_path, (2, 3), 0.0, "the instances' rates summed by model_name")


@needs_promtool
@seeded
def test_part4_drawn_restarts_are_restarts_not_drops(rng, tmp_path):
    _drawn_rates(rng, tmp_path, (1, 2), 1.0, "a counter back at 0 restarted: rate() counts on")


def _drawn_lookups(rng, tmp_path, instances: tuple[int, int], idle: bool, rule: str) -> None:
    """Hit and query counters of 2 to 4 models, ``instances`` each; with ``idle``, model m0
    looks nothing up and m1 hits nothing. One ratio per model that looked something up."""
    window = rng.choice(["30s", "1m", "2m", "5m"])
    inputs, hits, queries = [], {}, {}
    for m in range(rng.randint(2, 4)):
        for i in range(rng.randint(*instances)):
            q = 0 if idle and m == 0 else rng.randint(1, 80)
            h = 0 if idle and m == 1 else rng.randint(0, q)
            key = f'model_name="m{m}"'
            hits[key], queries[key] = hits.get(key, 0) + h, queries.get(key, 0) + q
            for name, per_tick in (("hits", h), ("queries", q)):
                values = _counter(rng, per_tick)
                labels = {"model_name": f"m{m}", "instance": i}
                inputs.append(_series(f"vkv_prefix_cache_{name}_total", values, **labels))
    want = {key: hits[key] / queries[key] for key in hits if queries[key]}
    name = f"model_name:vkv_prefix_cache_hits_per_queries:ratio_rate{window}"
    rule = f"over {window}: {rule}"
    _check(
        tmp_path, [metric_rules.hit_ratio_rule(window)], inputs, [_expect(name, want)], rule=rule
    )


@needs_promtool
@seeded
def test_part5_drawn_lookups_give_hits_over_queries(rng, tmp_path):
    _drawn_lookups(rng, tmp_path, (1, 1), False, "a model's hit tokens over its queried tokens")


@needs_promtool
@seeded
def test_part5_drawn_instances_give_the_ratio_of_the_sums(rng, tmp_path):
    _drawn_lookups(rng, tmp_path, (2, 3), False, "the ratio of the sums, not of the ratios")


@needs_promtool
@seeded
def test_part5_drawn_idle_models_give_no_sample_and_no_hit_is_zero(rng, tmp_path):
    rule = "no sample for a model that looked nothing up (0/0), 0 for one that hit nothing"
    _drawn_lookups(rng, tmp_path, (1, 2), True, rule)


def _quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus's bucketQuantile on (upper bound, cumulative rate) pairs, +Inf last."""
    total = buckets[-1][1]
    rank = q * total
    b = next(i for i, (_, count) in enumerate(buckets) if count >= rank)
    if b == len(buckets) - 1:
        return buckets[-2][0]
    start, before = (0.0, 0.0) if b == 0 else buckets[b - 1]
    end, count = buckets[b]
    return start + (end - start) * ((rank - before) / (count - before))


def _drawn_quantiles(rng, tmp_path, instances: int, shifted: bool, rule: str) -> None:
    """Both latency histograms of 1 to 3 models, ``instances`` each, observed at a drawn pace
    per bucket and tick; with ``shifted``, at another pace before the window starts."""
    window = rng.choice(["1m", "2m", "5m"])
    seconds, ticks = WINDOWS[window], WINDOWS[window] // TICK
    start = END - ticks if shifted else 0  # the tick the window's pace starts
    bounds = {"time_to_first_token_seconds": [0.05, 0.1, 0.25, 0.5, 1.0]}
    bounds["e2e_request_latency_seconds"] = [0.5, 1.0, 2.5, 5.0, 10.0]
    quantiles = tuple(sorted(rng.sample([0.5, 0.75, 0.9, 0.95, 0.99], 2)))
    inputs, checks = [], []
    for histogram, finite in bounds.items():
        want = {}
        for m in range(rng.randint(1, 3)):
            summed = [0.0] * (len(finite) + 1)
            for i in range(instances):
                # No finite bucket of a model is empty in the window (instance 0 fills each):
                # the quantile is then continuous in the rank, so a rank on a bucket's edge,
                # which floating-point sums put on either side of it, gives the same answer on
                # both. Nothing lies past the last bound, or every high quantile would be that
                # bound whatever the rule did with the buckets.
                now = [rng.randint(int(i == 0), 4) for _ in finite] + [0]
                before = [rng.randint(0, 4) for _ in finite] + [0] if shifted else now
                cumulative = list(itertools.accumulate(now))
                earlier = list(itertools.accumulate(before))
                labels = {"model_name": f"m{m}", "instance": i}
                series = [*zip([*map(str, finite), "+Inf"], cumulative, earlier, strict=True)]
                for bound, c, e in series:
                    values = [e * min(t, start) + c * max(0, t - start) for t in range(END + 1)]
                    inputs.append(_series(f"vkv_{histogram}_bucket", values, **labels, le=bound))
                count = [earlier[-1] * min(t, start) + cumulative[-1] * max(0, t - start)
                         for t in range(END + 1)]  # fmt: skip
                inputs.append(_series(f"vkv_{histogram}_count", count, **labels))
                summed = [s + c * ticks / seconds for s, c in zip(summed, cumulative, strict=True)]
            pairs = list(zip([*finite, math.inf], summed, strict=True))
            for q in quantiles:
                want[f'model_name="m{m}",quantile="{q}"'] = _quantile(q, pairs)
        checks.append(_expect(f"model_name:vkv_{histogram}:quantile_rate{window}", want))
    rule = f"histogram_quantile over {window}: {rule}"
    _check(
        tmp_path, metric_rules.latency_quantile_rules(window, quantiles), inputs, checks, rule=rule
    )


@needs_promtool
@seeded
def test_part6_drawn_histograms_give_each_models_quantiles(rng, tmp_path):
    _drawn_quantiles(rng, tmp_path, 1, False, "of each model's bucket rates, by le")


@needs_promtool
@seeded
def test_part6_drawn_instances_buckets_add_up_before_the_quantile(rng, tmp_path):
    _drawn_quantiles(rng, tmp_path, 2, False, "of the buckets' rates summed by (model_name, le)")


@needs_promtool
@seeded
def test_part6_drawn_observations_before_the_window_do_not_count(rng, tmp_path):
    _drawn_quantiles(rng, tmp_path, 1, True, "of the rates in the window alone")


def _drawn_usage(rng, tmp_path, rule_kind: str, before: float | None, rule: str) -> None:
    """Usage gauges of both pools, 1 to 3 models of 2 or 3 instances, drawn each tick (with
    ``before``, that value before the window); check only the rule of ``rule_kind``: ``now``
    (the fullest instance now) or ``window`` (the largest of the instances' means)."""
    window = rng.choice(["1m", "2m", "5m"])
    samples = WINDOWS[window] // TICK + 1
    inputs, checks = [], []
    for pool in ("gpu", "cpu"):
        now, mean = {}, {}
        for m in range(rng.randint(1, 3)):
            key = f'model_name="m{m}"'
            for i in range(rng.randint(2, 3)):
                values = [rng.randint(0, 16) / 16 for _ in range(END + 1)]
                if before is not None:
                    values[: END + 1 - samples] = [before] * (END + 1 - samples)
                inputs.append(
                    _series(f"vkv_{pool}_cache_usage_perc", values, model_name=f"m{m}", instance=i)
                )
                now[key] = max(now.get(key, 0.0), values[-1])
                mean[key] = max(mean.get(key, 0.0), sum(values[-samples:]) / samples)
        if rule_kind == "now":
            checks.append(_expect(f"model_name:vkv_{pool}_cache_usage_perc:max", now))
        else:
            name = f"model_name:vkv_{pool}_cache_usage_perc:max_avg_over_time{window}"
            checks.append(_expect(name, mean))
    _check(tmp_path, metric_rules.kv_usage_rules(window), inputs, checks, rule=rule)


@needs_promtool
@seeded
def test_part7_drawn_gauges_give_the_fullest_instance_now(rng, tmp_path):
    _drawn_usage(rng, tmp_path, "now", None, "now: the fullest instance of each model")


@needs_promtool
@seeded
def test_part7_drawn_gauges_give_the_largest_of_the_instances_means(rng, tmp_path):
    rule = "over the window: each instance's mean, then the largest of a model's means"
    _drawn_usage(rng, tmp_path, "window", None, rule)


@needs_promtool
@seeded
def test_part7_drawn_usage_before_the_window_does_not_count(rng, tmp_path):
    rule = "over the window: a full cache before the window is not in its mean"
    _drawn_usage(rng, tmp_path, "window", 1.0, rule)


def _check_kv_alert(tmp_path, values, threshold, duration, quiet, fires, rule) -> None:
    """The KV alert on ``values`` of the fullest-instance series: silent at the times of
    ``quiet``, firing at ``fires`` (seconds) with the labels and annotations of the handout."""
    inputs = [_series("model_name:vkv_gpu_cache_usage_perc:max", values, model_name="a")]
    annotations = {
        "summary": f"KV cache of a is {round(values[fires // TICK] * 100)}% full",
        "description": f"GPU KV-cache usage above {round(threshold * 100)}% for {duration}: "
        "new requests wait and running ones are preempted",
    }
    alerts = [
        *(
            {"alertname": "VkvKVCacheNearlyFull", "eval_time": f"{t}s", "exp_alerts": []}
            for t in sorted(set(quiet))
        ),
        {
            "alertname": "VkvKVCacheNearlyFull",
            "eval_time": f"{fires}s",
            "exp_alerts": [
                {
                    "exp_labels": {"model_name": "a", "severity": "warning"},
                    "exp_annotations": annotations,
                }
            ],
        },
    ]
    _check(
        tmp_path,
        [metric_rules.kv_cache_full_alert(threshold, duration)],
        inputs,
        alerts=alerts,
        rule=rule,
    )


@needs_promtool
@seeded
def test_part8_drawn_thresholds_fire_after_their_duration(rng, tmp_path):
    threshold = rng.choice([0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9])
    duration = rng.choice(["1m", "2m", "3m"])
    wait = WINDOWS[duration] // TICK
    start = rng.randint(1, 10)  # the tick usage goes above the threshold
    above = rng.choice([0.96, 0.97, 0.98, 0.99])
    values = [threshold] * start + [above] * (start + wait + 5)
    fires = (start + wait) * TICK
    rule = (
        f"above {threshold} from {start * TICK}s for {duration}: firing from {fires}s, not before"
    )
    _check_kv_alert(tmp_path, values, threshold, duration, [fires - TICK], fires, rule)


@needs_promtool
@seeded
def test_part8_drawn_storms_fire_after_their_duration(rng, tmp_path):
    per_second = rng.choice([0.5, 1.0, 2.0])
    duration, window = rng.choice(["1m", "2m", "3m"]), rng.choice(["1m", "5m"])
    wait = WINDOWS[duration] // TICK
    start = rng.randint(1, 10)
    value = per_second + rng.choice([0.5, 1.0, 1.5])
    values = [per_second] * start + [value] * (start + wait + 5)
    inputs = [_series(f"model_name:vkv_num_preemptions:rate{window}", values, model_name="a")]
    fires = (start + wait) * TICK
    labels = {"model_name": "a", "severity": "critical"}
    annotations = {
        "summary": f"a preempts {value:g} sequences a second",
        "description": f"more than {per_second:g} preemptions a second for {duration}: "
        "the KV cache is too small for the load",
    }
    alerts = [
        {"alertname": "VkvPreemptionStorm", "eval_time": f"{fires - TICK}s", "exp_alerts": []},
        {
            "alertname": "VkvPreemptionStorm",
            "eval_time": f"{fires}s",
            "exp_alerts": [{"exp_labels": labels, "exp_annotations": annotations}],
        },
    ]
    rule = f"above {per_second}/s from {start * TICK}s for {duration}: firing from {fires}s"
    _check(
        tmp_path,
        [metric_rules.preemption_storm_alert(per_second, duration, window)],
        inputs,
        alerts=alerts,
        rule=rule,
    )


@needs_promtool
@seeded
def test_part8_drawn_a_dip_to_the_threshold_restarts_the_wait(rng, tmp_path):
    threshold = rng.choice([0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9])
    duration = rng.choice(["1m", "2m", "3m"])
    wait = WINDOWS[duration] // TICK
    start = rng.randint(1, 5)  # the tick usage goes above the threshold
    dip = start + rng.randint(1, wait - 1)  # back at the threshold (not above) for one tick
    above = rng.choice([0.96, 0.97, 0.98, 0.99])
    values = [threshold] * start + [above] * (dip - start) + [threshold] + [above] * (wait + 6)
    fires = (dip + 1 + wait) * TICK
    quiet = [(start + wait) * TICK, fires - TICK]  # without the dip, it fired at the first
    rule = (
        f"above {threshold} from {start * TICK}s, at it at {dip * TICK}s, above again: the "
        f"{duration} of for: start again, firing from {fires}s"
    )
    _check_kv_alert(tmp_path, values, threshold, duration, quiet, fires, rule)
