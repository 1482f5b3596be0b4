"""Phase 5 graded tests: the StatLogger writes each step into the engine's Prometheus metrics.

Run one part with ``uv run pytest tests/test_phase5.py -k part1 -v``. The tests drive the logger
with scripted steps: hand-built ``SchedulerOutput``s, queues and sequences with set arrival times
and a clock that the test moves, so that every expected value is known exactly, and read the
values back from the engine's registry as Prometheus would scrape them.
"""

from types import SimpleNamespace

import pytest

from vkv.engine.scheduler import SchedulerOutput
from vkv.metrics.registry import EngineMetrics
from vkv.metrics.stats import StatLogger

MODEL = {"model_name": "vkv-tiny"}


def make_logger() -> tuple[StatLogger, EngineMetrics]:
    metrics = EngineMetrics(max_model_len=512)
    return StatLogger(metrics), metrics


def value(metrics: EngineMetrics, name: str, **labels) -> float:
    sample = metrics.registry.get_sample_value(name, {**MODEL, **labels})
    return 0.0 if sample is None else sample


def scheduler(running=0, waiting=0, swapped=0, gpu=0.0, cpu=0.0, queries=0, hits=0):
    """What ``record_step`` reads of a scheduler: its queues and its block manager's figures."""
    manager = SimpleNamespace(
        gpu_usage=gpu, cpu_usage=cpu, num_query_tokens=queries, num_hit_tokens=hits
    )
    return SimpleNamespace(
        running=[object()] * running,
        waiting=[object()] * waiting,
        swapped=[object()] * swapped,
        block_manager=manager,
    )


def seq(seq_id, prompt=10, completion=1, arrival=100.0, group_id=None):
    """What the logger reads of a sequence."""
    return SimpleNamespace(
        seq_id=seq_id,
        num_prompt_tokens=prompt,
        num_completion_tokens=completion,
        arrival_time=arrival,
        group_id=seq_id if group_id is None else group_id,
    )


def histogram(metrics: EngineMetrics, name: str) -> tuple[float, float]:
    """(count, sum) of a histogram."""
    return value(metrics, f"{name}_count"), value(metrics, f"{name}_sum")


# --------------------------------------------------------------------------------------------
# Part 5.1: the step
# --------------------------------------------------------------------------------------------


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
