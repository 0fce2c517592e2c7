"""docs/benchmarks.md's section on what the web page's engine view costs a loaded server, from the
result files of `pagedllm bench ui-cost` (benchmarks/results/*ui_cost*.json, one run each, in name order)."""

from __future__ import annotations

from pathlib import Path

from pagedllm.benchmarks.report_render import fmt, load, run_block, table

INTRO = """## The engine view's cost under load (`bench ui-cost`)

`pagedllm bench ui-cost` launches `pagedllm serve` and sends rounds of completions at full load,
alternating rounds without and with clients reading the engine feed (`GET /v1/engine/state`, the
web page's engine view, parsing every snapshot as the page does). Each pair of rounds gives a drop
in output tokens/s; the feed's own time is read from the snapshots: the engine core's time building
them and the API server's time handing them out, each as a share of the round.
"""


def ui_cost_section(results: Path) -> str | None:
    runs = [r for p in sorted(results.glob("*ui_cost*.json")) if (r := load(p)) is not None]
    if not runs:
        return None
    out = [INTRO]
    for r in runs:
        c = r["config"]
        out.append(f"{c['rounds']} pairs of rounds of {c['requests']} completions ({c['prompt_len']}-token prompts, "
                   f"{c['max_tokens']} output tokens, {c['concurrency']} at a time), {c['viewers']} viewer(s) in a "
                   "round with the feed on:\n")
        rows = [[str(i // 2), "on" if x["viewer"] else "off", fmt(x["tokens_per_s"]),
                 fmt(x.get("snapshots_per_s")), fmt(x.get("engine_core_share_percent"), ".3f"),
                 fmt(x.get("api_server_share_percent"), ".3f")] for i, x in enumerate(r["rounds"])]
        out.append(table(["pair", "feed", "output tok/s", "snapshots/s", "engine core's time building them, %",
                          "API server's time handing them out, %"], rows))
        out.append(f"Median output tokens/s {r['median_tokens_per_s_without_viewer']:.1f} without a viewer and "
                   f"{r['median_tokens_per_s_with_viewer']:.1f} with; median drop over the pairs "
                   f"{r['median_drop_percent']:+.2f}% (by pair: "
                   + ", ".join(f"{d:+.2f}%" for d in r["drop_percent_by_pair"]) + "). The feed took "
                   f"{r['median_engine_core_share_percent']:.3f}% of the engine core's time and "
                   f"{r['median_api_server_share_percent']:.3f}% of the API server's.\n")
        if r.get("note"):
            out.append(r["note"] + "\n")
        out.append(run_block(r))
    return "\n".join(out)
