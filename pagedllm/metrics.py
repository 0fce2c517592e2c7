"""Prometheus metrics with vLLM's names (prefix `pagedllm:`), fed by the engine's stat loggers.

Each `PrometheusStatLogger` owns a `CollectorRegistry`, so several servers (or test apps) can live
in one process. Scheduler counters (prefix cache queries and hits, preemptions) are cumulative in
`SchedulerStats`; the logger adds the difference since the previous record.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pagedllm.core.scheduler import SchedulerStats
from pagedllm.engine.stats import IterationStats

PREFIX = "pagedllm:"

# Latency buckets (seconds) and token-count buckets like vLLM's.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0]


def token_buckets(max_value: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (e.g. 8192 -> [1, 2, 5, ..., 5000])."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(float(value))
        exponent += 1


class PrometheusStatLogger:
    """A stat logger (record after each step, log every loop turn) that updates Prometheus metrics."""

    def __init__(
        self,
        model_name: str,
        max_model_len: int,
        block_size: int,
        num_gpu_blocks: int,
        enable_prefix_caching: bool,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            # prometheus_client appends `_total`: "prompt_tokens" is exposed as pagedllm:prompt_tokens_total.
            return Counter(PREFIX + name, doc, [*labels, *extra], registry=r)

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=r)

        self.num_requests_running = gauge("num_requests_running", "Number of requests running (in the batch).")
        self.num_requests_waiting = gauge("num_requests_waiting", "Number of requests waiting to be scheduled.")
        self.num_requests_swapped = gauge("num_requests_swapped", "Number of requests swapped out to host memory.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "KV cache usage: 1 means all blocks are in use.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.request_success = counter("request_success", "Requests finished.", ("finished_reason",))
        self.api_requests = counter("api_requests", "Inference requests received, by endpoint.", ("endpoint",))
        self.num_preemptions = counter("num_preemptions", "Preemptions of running requests.")
        self.num_preemptions_by_mode = counter(
            "num_preemptions_by_mode", "Preemptions of running requests by how they were done.", ("mode",)
        )
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        # Speculative decoding (vLLM's spec_decode_* counters); exposed once a step has speculated.
        self.spec_drafts = counter("spec_decode_num_drafts", "Steps in which a request verified proposed tokens.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Proposed tokens verified.")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Proposed tokens accepted.")
        self.spec_accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos", "Proposed tokens accepted, by their position among a "
            "step's proposals (0: the first).", ("position",))
        self._last_spec: tuple[int, int, int, list[int]] = (0, 0, 0, [])
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between successive tokens.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Request latency, arrival to finish.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Time waiting before first scheduled.",
                                    REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "Time from first scheduled to first token.",
                                      REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "Time from first token to finish.",
                                     REQUEST_LATENCY_BUCKETS)
        self.step_time = histogram("engine_step_time_seconds", "Time of one engine-core step "
                                   "(schedule, execute, update).", ITL_BUCKETS)
        tb = token_buckets(max_model_len)
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens computed in one engine step.",
                                          token_buckets(max(max_model_len, 16384)))
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt length of finished requests.", tb)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated length of finished requests.", tb
        )
        info = Gauge(
            PREFIX + "cache_config_info",
            "KV cache configuration.",
            ["model_name", "block_size", "num_gpu_blocks", "enable_prefix_caching"],
            registry=r,
        )
        info.labels(model_name, str(block_size), str(num_gpu_blocks), str(enable_prefix_caching)).set(1)
        # Label-bound children, and the cumulative scheduler counters seen last.
        m = model_name
        self._gauges = (
            self.num_requests_running.labels(m),
            self.num_requests_waiting.labels(m),
            self.num_requests_swapped.labels(m),
            self.kv_cache_usage.labels(m),
        )
        self._last_queries = self._last_hits = self._last_preemptions = 0
        self._last_by_mode: dict[str, int] = {}
        for metric in (self.prompt_tokens, self.generation_tokens, self.num_preemptions, self.prefix_cache_queries,
                       self.prefix_cache_hits):
            metric.labels(m)  # exposed as 0 before the first request
        for gauge_child in self._gauges:
            gauge_child.set(0)

    def reset_gauges(self) -> None:
        """Running, waiting, swapped and KV usage back to 0 (the model's engine has been unloaded)."""
        for gauge_child in self._gauges:
            gauge_child.set(0)

    def count_request(self, endpoint: str) -> None:
        """One request on `endpoint` (completions, chat_completions, responses, messages)."""
        self.api_requests.labels(self.model_name, endpoint).inc()

    def record_scheduler(self, s: SchedulerStats) -> None:
        running, waiting, swapped, usage = self._gauges
        running.set(s.num_running)
        waiting.set(s.num_waiting)
        swapped.set(s.num_swapped)
        usage.set(s.kv_cache_usage)
        m = self.model_name
        self.prefix_cache_queries.labels(m).inc(max(s.prefix_cache_queries - self._last_queries, 0))
        self.prefix_cache_hits.labels(m).inc(max(s.prefix_cache_hits - self._last_hits, 0))
        self.num_preemptions.labels(m).inc(max(s.num_preemptions - self._last_preemptions, 0))
        self._last_queries, self._last_hits = s.prefix_cache_queries, s.prefix_cache_hits
        self._last_preemptions = s.num_preemptions
        for mode, count in s.num_preemptions_by_mode.items():
            last = self._last_by_mode.get(mode, 0)
            self.num_preemptions_by_mode.labels(m, mode).inc(max(count - last, 0))
            self._last_by_mode[mode] = count
        sd = s.spec_decode
        if sd is not None and sd.num_drafts:
            drafts, proposed, accepted, per_pos = self._last_spec
            self.spec_drafts.labels(m).inc(max(sd.num_drafts - drafts, 0))
            self.spec_draft_tokens.labels(m).inc(max(sd.num_draft_tokens - proposed, 0))
            self.spec_accepted_tokens.labels(m).inc(max(sd.num_accepted_tokens - accepted, 0))
            for pos, count in enumerate(sd.accepted_per_position):
                last = per_pos[pos] if pos < len(per_pos) else 0
                self.spec_accepted_per_pos.labels(m, str(pos)).inc(max(count - last, 0))
            self._last_spec = (sd.num_drafts, sd.num_draft_tokens, sd.num_accepted_tokens,
                               list(sd.accepted_per_position))

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        self.record_scheduler(scheduler_stats)
        m = self.model_name
        it = iteration_stats
        if it.num_prompt_tokens:
            self.prompt_tokens.labels(m).inc(it.num_prompt_tokens)
        if it.num_generation_tokens:
            self.generation_tokens.labels(m).inc(it.num_generation_tokens)
        ttft, itl = self.ttft.labels(m), self.itl.labels(m)
        for t in it.time_to_first_tokens:
            ttft.observe(t)
        for t in it.inter_token_latencies:
            itl.observe(t)
        if it.num_scheduled_tokens:
            self.iteration_tokens.labels(m).observe(it.num_scheduled_tokens)
            self.step_time.labels(m).observe(it.step_time)
        for f in it.finished:  # one per request, whatever its n
            self.request_success.labels(m, f.finish_reason).inc()
            self.e2e.labels(m).observe(f.e2e_latency)
            self.queue_time.labels(m).observe(f.queue_time)
            self.prefill_time.labels(m).observe(f.prefill_time)
            self.decode_time.labels(m).observe(f.decode_time)
            self.request_prompt_tokens.labels(m).observe(f.num_prompt_tokens)
            self.request_generation_tokens.labels(m).observe(f.num_generation_tokens)

    def log(self) -> None:
        pass  # Prometheus is scraped; nothing to print


class MergedRegistry:
    """Several registries exposed as one (a server with several models: one stat logger each).
    Metric families of the same name are merged into one, so that each name has one HELP and TYPE."""

    def __init__(self, registries: list[CollectorRegistry]) -> None:
        self.registries = registries

    def collect(self):  # type: ignore[no-untyped-def]
        merged: dict[str, object] = {}
        for registry in self.registries:
            for family in registry.collect():
                first = merged.get(family.name)
                if first is None:
                    merged[family.name] = family
                else:
                    first.samples.extend(family.samples)  # type: ignore[attr-defined]
        return iter(merged.values())
