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
