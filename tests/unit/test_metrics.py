"""Prometheus stat logger: cumulative scheduler counters become counter increments."""

from __future__ import annotations

from prometheus_client import generate_latest

from pagedllm.core.scheduler import SchedulerStats
from pagedllm.engine.stats import IterationStats
from pagedllm.metrics import PrometheusStatLogger


def samples(logger: PrometheusStatLogger) -> dict[str, float]:
    out = {}
    for line in generate_latest(logger.registry).decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_preemptions_by_mode_and_swapped_gauge():
    log = PrometheusStatLogger("m", 512, 16, 10, True)
    log.record(SchedulerStats(1, 2, 3, 0.5, 10, 5, 4, {"swap": 3, "recompute": 1}), IterationStats())
    log.record(SchedulerStats(1, 0, 1, 0.25, 30, 20, 6, {"swap": 4, "recompute": 2}), IterationStats())
    s = samples(log)
    assert s['pagedllm:num_preemptions_total{model_name="m"}'] == 6
    assert s['pagedllm:num_preemptions_by_mode_total{mode="swap",model_name="m"}'] == 4
    assert s['pagedllm:num_preemptions_by_mode_total{mode="recompute",model_name="m"}'] == 2
    assert s['pagedllm:num_requests_swapped{model_name="m"}'] == 1
    assert s['pagedllm:prefix_cache_queries_total{model_name="m"}'] == 30
    assert s['pagedllm:prefix_cache_hits_total{model_name="m"}'] == 20
    assert s['pagedllm:kv_cache_usage_perc{model_name="m"}'] == 0.25


def test_spec_decode_counters():
    from pagedllm.core.spec_decode import SpecDecodeStats

    log = PrometheusStatLogger("m", 512, 16, 10, True)
    log.record(SchedulerStats(1, 0, 0, 0.1, 0, 0, 0), IterationStats())
    assert not any(k.startswith("pagedllm:spec_decode") and "_total{" in k for k in samples(log))
    log.record(SchedulerStats(1, 0, 0, 0.1, 0, 0, 0, spec_decode=SpecDecodeStats(2, 6, 3, [2, 1, 0])),
               IterationStats())
    log.record(SchedulerStats(1, 0, 0, 0.1, 0, 0, 0, spec_decode=SpecDecodeStats(5, 15, 9, [5, 3, 1])),
               IterationStats())
    s = samples(log)
    assert s['pagedllm:spec_decode_num_drafts_total{model_name="m"}'] == 5
    assert s['pagedllm:spec_decode_num_draft_tokens_total{model_name="m"}'] == 15
    assert s['pagedllm:spec_decode_num_accepted_tokens_total{model_name="m"}'] == 9
    assert s['pagedllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"}'] == 3
    assert s['pagedllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"}'] == 1
