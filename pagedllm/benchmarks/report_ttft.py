"""docs/benchmarks.md's section on time to first token under concurrent chat streams, from the
result files of `pagedllm bench ttft` (benchmarks/results/ttft*.json, one run each, in name order)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagedllm.benchmarks.report_render import load, run_block
from pagedllm.benchmarks.ttft import format_table

INTRO = """## Time to first token under concurrent chat streams (guidellm)

`pagedllm bench ttft` launches each engine in turn and runs guidellm 0.8.1 (its own environment,
`.venv-guidellm`) against it on /v1/chat/completions: synthetic prompts and fixed output lengths,
each stream sending its next request as soon as its last one ends, for a fixed time per number of
streams (requests still running when the time is up are left out). The scheduler's prompt-token
cap of a shared step (`--max-num-shared-prefill-tokens`, [scheduling.md](scheduling.md)) is what
these runs tune; each run names its flags.
"""


def ttft_section(results: Path) -> str | None:
    runs = [r for p in sorted({*results.glob("ttft*.json"), *results.glob("*_ttft*.json")}) if (r := load(p)) is not None]
    if not runs:
        return None
    out = [INTRO]
    for r in runs:
        engines = ", ".join(f"{e['engine']} ({' '.join(e['server_args'])})" for e in r["engines"])
        out.append(f"### {r.get('label') or 'Run'}\n")
        out.append(f"{r['prompt_tokens']}-token prompts, {r['output_tokens']} output tokens, {r['seconds']:g} s per "
                   f"level; engines and their flags: {engines}.\n")
        out.append(format_table(r) + "\n")
        if r.get("note"):
            out.append(r["note"] + "\n")
        out.append(run_block(r.get("meta")))
    return "\n".join(out)
