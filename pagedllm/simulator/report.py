"""Metrics of a run (simulated or real, same definitions) and plots.

TTFT = first token time - arrival; TPOT = (finish - first token) / (output_len - 1) for requests
with more than one output token; E2E = finish - arrival. Goodput: requests per second that meet
both SLOs (TTFT <= slo_ttft and TPOT <= slo_tpot).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)


def _stats(name: str, values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {f"mean_{name}_s": 0.0, **{f"p{p}_{name}_s": 0.0 for p in PERCENTILES}}
    a = np.asarray(values, dtype=float)
    out = {f"mean_{name}_s": float(a.mean())}
    for p in PERCENTILES:
        out[f"p{p}_{name}_s"] = float(np.percentile(a, p))
    return out


def summarize(requests: Sequence[Any], elapsed_s: float, slo_ttft_s: float, slo_tpot_s: float) -> dict[str, Any]:
    """`requests`: objects with arrival_s, prompt_len, output_len, first_token_s, finish_s."""
    done = [r for r in requests if r.finish_s >= 0]
    ttft = [r.first_token_s - r.arrival_s for r in done]
    tpot = [(r.finish_s - r.first_token_s) / (r.output_len - 1) for r in done if r.output_len > 1]
    e2e = [r.finish_s - r.arrival_s for r in done]
    out_tok = sum(r.output_len for r in done)
    in_tok = sum(r.prompt_len for r in done)
    good = sum(
        1 for r in done
        if r.first_token_s - r.arrival_s <= slo_ttft_s
        and (r.output_len <= 1 or (r.finish_s - r.first_token_s) / (r.output_len - 1) <= slo_tpot_s)
    )
    el = max(elapsed_s, 1e-12)
    return {
        "num_requests": len(requests),
        "num_finished": len(done),
        "elapsed_s": elapsed_s,
        "output_tok_s": out_tok / el,
        "total_tok_s": (out_tok + in_tok) / el,
        "requests_s": len(done) / el,
        **_stats("ttft", ttft),
        **_stats("tpot", tpot),
        **_stats("e2e", e2e),
        "slo_ttft_s": slo_ttft_s,
        "slo_tpot_s": slo_tpot_s,
        "goodput_requests_s": good / el,
        "slo_attainment": good / len(done) if done else 0.0,
    }


def plot_run(report: dict[str, Any], path: str | Path, title: str) -> None:
    """KV usage and queue lengths over time, and the TTFT / E2E distributions."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = report["timeline"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ax = axes[0]
    ax.plot(tl["t"], [100 * u for u in tl["kv_usage"]], lw=1)
    ax.set(xlabel="simulated time (s)", ylabel="KV cache used (%)", title="KV usage", ylim=(0, 105))
    ax = axes[1]
    for k in ("running", "waiting", "swapped"):
        ax.plot(tl["t"], tl[k], lw=1, label=k)
    ax.set(xlabel="simulated time (s)", ylabel="requests", title="queues")
    ax.legend()
    ax = axes[2]
    for k in ("ttft", "e2e"):
        vals = np.sort(np.asarray(report["per_request"][k]))
        if len(vals):
            ax.plot(vals, np.linspace(0, 1, len(vals)), label=k.upper())
    ax.set(xlabel="seconds", ylabel="fraction of requests", title="latency CDF")
    ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(rows: list[dict[str, Any]], keys: list[str], path: str | Path, title: str) -> None:
    """Throughput, mean TTFT and mean TPOT per grid point (one line per value of the last key)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [("output_tok_s", "output tokens/s"), ("mean_ttft_s", "mean TTFT (s)"),
               ("mean_tpot_s", "mean TPOT (s)"), ("p99_ttft_s", "p99 TTFT (s)")]
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.5 * len(metrics), 4))
    x_key = keys[0]
    line_keys = keys[1:]
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(tuple(r["params"][k] for k in line_keys), []).append(r)
    for ax, (m, label) in zip(axes, metrics):
        for g, rs in groups.items():
            rs = sorted(rs, key=lambda r: r["params"][x_key])
            name = ", ".join(f"{k}={v}" for k, v in zip(line_keys, g)) or m
            ax.plot([str(r["params"][x_key]) for r in rs], [r["summary"][m] for r in rs], marker="o", label=name)
        ax.set(xlabel=x_key, ylabel=label)
    axes[0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
