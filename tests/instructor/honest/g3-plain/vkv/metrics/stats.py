"""StatLogger: what one engine step did, written into the engine's Prometheus metrics (Phase 5).

The engine calls the logger at three points of every step, after ``Scheduler.postprocess``
(``LLMEngine.step``; ``now`` is ``time.monotonic()``, the clock of ``Sequence.arrival_time``):

    record_step(out, scheduler, now)    once: the queues and pools as the step left them, and
                                        the step's events (preemptions, swaps, copies, prefix
                                        cache lookups)
    record_tokens(seqs, now)            the sequences that gained a token in this step (one
                                        each; a parallel sample's first token counts too)
    record_finished(seq, reason, now)   each sequence that finished: in the step, or aborted
                                        between steps (``reason`` is the request's
                                        ``finish_reason``: stop, length, abort, ignored, error)

and the metrics (``EngineMetrics``, ``registry.py``; names without the ``vkv_`` prefix) are:

    gauges       num_requests_running / _waiting / _swapped: the queues' lengths
                 gpu_cache_usage_perc / cpu_cache_usage_perc: the pools' usage, 0 to 1
    counters     num_preemptions (per sequence), blocks_swapped_out, blocks_swapped_in,
                 cow_copies (blocks), prefix_cache_queries, prefix_cache_hits (tokens)
                 generation_tokens (per token), prompt_tokens (a request's whole prompt, once,
                 at its first token: recomputing it after a preemption is not a new prompt,
                 and the other samples of a request, ``seq.group_id != seq.seq_id``, share it)
                 request_success, labelled finished_reason
    histograms   time_to_first_token_seconds: first token - arrival
                 time_per_output_token_seconds: each later token - the sequence's previous one
                 e2e_request_latency_seconds: finish - arrival
                 request_prompt_tokens, request_generation_tokens: the lengths at the finish

Every metric carries the ``model_name`` label. The logger binds it once, when it is made (as
vLLM's does): ``self.<name>`` is the engine's series of the metric ``<name>``
(``self.prompt_tokens.inc(12)``, ``self.time_to_first_token_seconds.observe(0.25)``), and
``self.request_success`` maps each finish reason to its series
(``self.request_success["stop"].inc()``). A step never calls ``.labels(...)``: that lookup takes
a lock and hashes the labels, once per token. Prefix-cache lookups are counted by the
BlockManager (``num_query_tokens``, ``num_hit_tokens``, totals so far; 0 without prefix
caching): a step adds what they grew by. The logger keeps only what it needs per live sequence
(the time of its last token) and forgets a sequence when it finishes.
"""

from vkv.engine.scheduler import Scheduler, SchedulerOutput
from vkv.engine.sequence import Sequence
from vkv.metrics.registry import FINISH_REASONS, EngineMetrics

# The metrics with the model_name label only, bound by StatLogger.__init__ to attributes of the
# same names.
BOUND = (
    "num_requests_running", "num_requests_waiting", "num_requests_swapped",
    "gpu_cache_usage_perc", "cpu_cache_usage_perc", "num_preemptions", "blocks_swapped_out",
    "blocks_swapped_in", "cow_copies", "prefix_cache_queries", "prefix_cache_hits",
    "prompt_tokens", "generation_tokens", "time_to_first_token_seconds",
    "time_per_output_token_seconds", "e2e_request_latency_seconds", "request_prompt_tokens",
    "request_generation_tokens",
)  # fmt: skip


class StatLogger:
    """Writes each step into ``metrics`` (vLLM v1's ``PrometheusStatLogger``, in small parts)."""

    def __init__(self, metrics: EngineMetrics) -> None:
        self.metrics = metrics
        self.labels = {"model_name": metrics.model_name}
        # Each metric's series for this engine, bound once here (vLLM's PrometheusStatLogger
        # binds its labels in its constructor too): ``metric.labels(...)`` looks the child up
        # under a lock, and a step would otherwise pay it for every token.
        for name in BOUND:
            setattr(self, name, getattr(metrics, name).labels(**self.labels))
        self.request_success = {
            reason: metrics.request_success.labels(**self.labels, finished_reason=reason)
            for reason in FINISH_REASONS
        }
        self.last_token_time: dict[int, float] = {}  # seq id -> when it gained its last token
        self.query_tokens_seen = 0  # the BlockManager's prefix-cache totals already counted
        self.hit_tokens_seen = 0

    # -- part 5.1: the step -------------------------------------------------------------------

    def record_step(self, out: SchedulerOutput, scheduler: Scheduler, now: float) -> None:
        """Set the gauges to the state the step left; add the step's events to the counters:
        one preemption per sequence in ``out.preempted``, one block per entry of the swap maps,
        one copy per destination in ``out.blocks_to_copy``, and the growth of the block
        manager's ``num_query_tokens`` and ``num_hit_tokens`` since the last step."""
        ### BEGIN SOLUTION part5.1
        # gauges: the state the step left
        self.num_requests_running.set(len(scheduler.running))
        self.num_requests_waiting.set(len(scheduler.waiting))
        self.num_requests_swapped.set(len(scheduler.swapped))
        block_manager = scheduler.block_manager
        self.gpu_cache_usage_perc.set(block_manager.gpu_usage)
        self.cpu_cache_usage_perc.set(block_manager.cpu_usage)

        # counters: the step's events
        if len(out.preempted) > 0:
            self.num_preemptions.inc(len(out.preempted))
        if len(out.blocks_to_swap_out) > 0:
            self.blocks_swapped_out.inc(len(out.blocks_to_swap_out))
        if len(out.blocks_to_swap_in) > 0:
            self.blocks_swapped_in.inc(len(out.blocks_to_swap_in))
        num_copies = 0
        for destinations in out.blocks_to_copy.values():
            num_copies += len(destinations)
        if num_copies > 0:
            self.cow_copies.inc(num_copies)

        # prefix cache: only what the totals grew by since the last step
        query_total = block_manager.num_query_tokens
        hit_total = block_manager.num_hit_tokens
        new_queries = query_total - self.query_tokens_seen
        new_hits = hit_total - self.hit_tokens_seen
        if new_queries > 0:
            self.prefix_cache_queries.inc(new_queries)
        if new_hits > 0:
            self.prefix_cache_hits.inc(new_hits)
        self.query_tokens_seen = query_total
        self.hit_tokens_seen = hit_total
        ### END SOLUTION

    # -- part 5.2: tokens ---------------------------------------------------------------------

    def record_tokens(self, seqs: list[Sequence], now: float) -> None:
        """Each sequence gained one token at ``now``: count it; its first (``num_completion_
        tokens == 1``) observes the time to first token and counts the prompt (not for a
        request's other samples: ``seq.group_id != seq.seq_id``); a later one observes the time
        since the sequence's previous token."""
        ### BEGIN SOLUTION part5.2
        for seq in seqs:
            self.generation_tokens.inc()
            if seq.num_completion_tokens == 1:
                self.time_to_first_token_seconds.observe(now - seq.arrival_time)
                if seq.group_id == seq.seq_id:
                    self.prompt_tokens.inc(seq.num_prompt_tokens)
            else:
                previous_time = self.last_token_time.get(seq.seq_id)
                if previous_time is not None:
                    self.time_per_output_token_seconds.observe(now - previous_time)
            self.last_token_time[seq.seq_id] = now
        ### END SOLUTION

    # -- part 5.3: finished requests ----------------------------------------------------------

    def record_finished(self, seq: Sequence, reason: str, now: float) -> None:
        """A sequence finished at ``now`` for ``reason``: count it under that reason, observe its
        end-to-end latency (from arrival) and its prompt and generation lengths, and forget it.
        Raises ``ValueError(f"unknown finish reason {reason!r}")`` for a reason not in
        ``FINISH_REASONS``, recording nothing."""
        ### BEGIN SOLUTION part5.3
        if reason not in FINISH_REASONS:
            raise ValueError(f"unknown finish reason {reason!r}")
        self.request_success[reason].inc()
        self.e2e_request_latency_seconds.observe(now - seq.arrival_time)
        self.request_prompt_tokens.observe(seq.num_prompt_tokens)
        self.request_generation_tokens.observe(seq.num_completion_tokens)
        self.last_token_time.pop(seq.seq_id, None)
        ### END SOLUTION
