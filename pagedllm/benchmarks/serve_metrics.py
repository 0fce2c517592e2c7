"""Serving metrics from per-request timings: TTFT, TPOT, ITL, end-to-end latency, goodput.

Definitions (all per request, times in seconds, reported in ms):
  TTFT  = first streamed token's arrival - request sent
  TPOT  = (latency - TTFT) / (output tokens - 1)        (requests with at least 2 output tokens)
  ITL   = gaps between successive streamed chunks        (pooled over all requests)
  E2E   = last chunk's arrival - request sent
Goodput counts the successful requests that meet every SLO given (TTFT <= --slo-ttft and
TPOT <= --slo-tpot, in ms), per second of benchmark duration.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 95, 99)


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def summarize_ms(values_s: list[float]) -> dict[str, float | None]:
    """mean, median, p90, p95, p99 (linear interpolation) of seconds, in milliseconds."""
    if not values_s:
        return {"mean": None, "median": None, "p90": None, "p95": None, "p99": None}
    a = np.asarray(values_s, dtype=np.float64) * 1000.0
    p50, p90, p95, p99 = np.percentile(a, PERCENTILES)
    return {"mean": float(a.mean()), "median": float(p50), "p90": float(p90), "p95": float(p95), "p99": float(p99)}


def meets_slo(r: RequestResult, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    if not r.ok:
        return False
    if slo_ttft_ms is not None and (r.ttft is None or r.ttft * 1000.0 > slo_ttft_ms):
        return False
    if slo_tpot_ms is not None:
        tpot = r.tpot
        if tpot is not None and tpot * 1000.0 > slo_tpot_ms:
            return False
    return True


def compute_metrics(
    results: list[RequestResult],
    duration_s: float,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    dur = max(duration_s, 1e-9)
    metrics: dict[str, Any] = {
        "duration_s": duration_s,
        "completed": len(ok),
        "failed": len(failed),
        "errors": sorted({r.error for r in failed})[:10],
        "prompt_tokens": in_tokens,
        "output_tokens": out_tokens,
        "request_throughput": len(ok) / dur,
        "output_throughput": out_tokens / dur,
        "total_token_throughput": (in_tokens + out_tokens) / dur,
        "ttft_ms": summarize_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": summarize_ms([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": summarize_ms([g for r in ok for g in r.itl]),
        "e2el_ms": summarize_ms([r.latency for r in ok]),
    }
    if slo_ttft_ms is not None or slo_tpot_ms is not None:
        good = sum(meets_slo(r, slo_ttft_ms, slo_tpot_ms) for r in results)
        metrics["goodput"] = good / dur
        metrics["good_requests"] = good
        metrics["slo"] = {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms}
    return metrics
