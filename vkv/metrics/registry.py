"""EngineMetrics: the Prometheus metrics of one engine, in a registry of its own (given).

Names carry the ``vkv_`` prefix and vLLM's stems (``vllm:num_requests_running`` is
``vkv_num_requests_running`` here). vLLM writes ``vllm:``, but Prometheus reserves colons for
recording rules and ``promtool check metrics`` flags every such name, so vkv uses an underscore.
Counters are declared without ``_total``: the client appends it (``vkv_prompt_tokens_total``).
Each engine has its own ``CollectorRegistry``: two engines in one process (the tests make many)
would collide in the client's global registry.

Gauges (state after the last step): requests running, waiting and swapped; GPU and CPU KV-cache
usage in [0, 1]; the KV bytes per token and the cache format (an info-style gauge set to 1).
Counters (events so far): prompt and generation tokens, preemptions, blocks swapped out and in,
blocks copied on write, prefix-cache queries and hits (tokens), finished requests by reason.
Histograms (per request): time to first token, time per output token, end-to-end latency, in
seconds, with vLLM v1's bucket bounds; prompt and generation lengths, in tokens, with 1-2-5
bounds up to ``max_model_len`` (vLLM's). The graded ``StatLogger`` (``stats.py``) updates them.
"""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# vLLM v1's bucket bounds (vllm/v1/metrics/loggers.py), in seconds.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
TPOT_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort", "ignored", "error")


def length_buckets(max_model_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_model_len`` (vLLM's ``build_1_2_5_buckets``)."""
    bounds, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > max_model_len:
                return bounds
            bounds.append(step * scale)
        scale *= 10


class EngineMetrics:
    """The metric objects of one engine (attributes named as the metrics, without ``vkv_``)."""

    def __init__(self, max_model_len: int, model_name: str = "vkv-tiny") -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
            return Gauge(f"vkv_{name}", doc, [*labels, *extra], registry=self.registry)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"vkv_{name}", doc, [*labels, *extra], registry=self.registry)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"vkv_{name}", doc, labels, buckets=buckets, registry=self.registry)

        self.num_requests_running = gauge("num_requests_running", "Sequences running on the GPU.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Sequences waiting.")
        self.num_requests_swapped = gauge("num_requests_swapped", "Sequences swapped to the CPU.")
        self.gpu_cache_usage_perc = gauge("gpu_cache_usage_perc", "GPU KV blocks used, 0 to 1.")
        self.cpu_cache_usage_perc = gauge("cpu_cache_usage_perc", "CPU KV blocks used, 0 to 1.")
        self.kv_cache_bytes_per_token = gauge(
            "kv_cache_bytes_per_token", "KV-cache bytes per token, scales included."
        )
        self.cache_config_info = gauge(
            "cache_config_info",
            "The KV cache's format (1 for the engine's).",
            ("kv_cache_dtype", "key_granularity", "kv_quant_group", "block_size"),
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that began.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.num_preemptions = counter("num_preemptions", "Sequences preempted.")
        self.blocks_swapped_out = counter("blocks_swapped_out", "Blocks moved GPU to CPU.")
        self.blocks_swapped_in = counter("blocks_swapped_in", "Blocks moved CPU to GPU.")
        self.cow_copies = counter("cow_copies", "Blocks copied on write.")
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )
        self.request_success = counter(
            "request_success", "Requests finished, by reason.", ("finished_reason",)
        )
        self.time_to_first_token_seconds = histogram(
            "time_to_first_token_seconds", "From arrival to the first token.", TTFT_BUCKETS
        )
        self.time_per_output_token_seconds = histogram(
            "time_per_output_token_seconds", "Between consecutive tokens.", TPOT_BUCKETS
        )
        self.e2e_request_latency_seconds = histogram(
            "e2e_request_latency_seconds", "From arrival to the last token.", LATENCY_BUCKETS
        )
        lengths = length_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens per finished request.", lengths
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Tokens generated per finished request.", lengths
        )

    def value(self, name: str, **labels: str) -> float:
        """A sample's current value (``vkv_`` + ``name``), 0.0 if it has none yet."""
        sample = self.registry.get_sample_value(
            f"vkv_{name}", {"model_name": self.model_name, **labels}
        )
        return 0.0 if sample is None else sample
