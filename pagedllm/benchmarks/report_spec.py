"""docs/benchmarks.md's section on speculative decoding: one table per result file of `pagedllm
bench spec` (SPEC_FILES: benchmarks/results/*spec*.json, in name order): each configuration's
single-stream and concurrent output tokens/s against speculation off in the same run, acceptance,
draft passes, and llama.cpp's own speculative decoding where the run compared it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pagedllm.benchmarks.report_render import fmt, load, run_block, table

SPEC_FILES = "*spec*.json"

INTRO = """## Speculative decoding

`pagedllm bench spec`: greedy requests with each `--speculative-config` against speculation off,
each part on an engine of its own in one run; the single stream runs the tasks one at a time, the
concurrent part runs them together (docs/speculative.md says how each method proposes and how
the adaptive lengths turn it off). Every table below says whether greedy outputs were the same
token for token as without speculation (single stream, and the concurrent batch where there is
one); in bf16 on the AMX host a single stream's are not (its one-row steps and its verification
steps of several rows take different GEMM forms: docs/speculative.md). Under `--compare llama.cpp`, llama.cpp runs the same
prompt tokens one at a time on the model's GGUF rewritten unquantized in the same dtype, with
llama-cpp-python's speculative decoding: its prompt lookup (`LlamaPromptLookupDecoding`) and a
draft model through its `LlamaDraftModel` interface (the same GGUF quantized by llama.cpp).
"""


def _config(spec: dict[str, Any] | None) -> str:
    return f"`{json.dumps(spec)}`" if spec else "off"


def _file_section(name: str, r: dict[str, Any]) -> str:
    conc = r.get("concurrency", 0)
    kind = "chat questions" if r.get("workload") == "chat" else "edit / quote tasks"
    out = [f"\n### `{name}`: {kind}, {r['model']} ({r['dtype']}), up to {r['max_tokens']} tokens\n\n",
           run_block(r.get("meta")), "\n"]
    head = ["speculative config", "single stream tok/s", "ratio"]
    if conc:
        head += [f"{conc} concurrent tok/s", "ratio"]
    head += ["acceptance", "tokens per speculating step", "draft pass ms",
             "same greedy tokens" + (" (single / concurrent)" if conc else "")]
    rows = []
    for run in r["runs"]:
        a, d = run.get("acceptance"), run.get("draft")
        row = [_config(run["speculative_config"]), fmt(run["single"]["output_tok_s"]),
               f"{run['ratio']['single']:.2f}x"]
        if conc:
            row += [fmt(run["concurrent"]["output_tok_s"]), f"{run['ratio']['concurrent']:.2f}x"]
        same = run["same_greedy_tokens"]
        yes = {True: "yes", False: "NO"}
        row += [f"{100 * a['acceptance_rate']:.1f}%" if a else "-", f"{a['mean_acceptance_length']:.2f}" if a else "-",
                fmt(d["ms_per_pass"], ".2f") if d else "-",
                f"{yes[same['single']]} / {yes[same['concurrent']]}" if conc else yes[same["single"]]]
        rows.append(row)
    out.append(table(head, rows))
    peers = r.get("llamacpp")
    if peers:
        off = r["runs"][0]["single"]["output_tok_s"]
        out.append(f"\nllama.cpp on the same {r['num_prompts']} prompts, one at a time ({peers[0]['gguf']}, "
                   f"llama-cpp-python {peers[0]['llama_cpp_version']}):\n\n")
        best = max(x["single"]["output_tok_s"] for x in r["runs"])
        rows = [[f"`{json.dumps(p['draft'])}`" if p["draft"] else "off", fmt(p["output_tok_s"]),
                 f"{p['output_tok_s'] / peers[0]['output_tok_s']:.2f}x", f"{off / p['output_tok_s']:.2f}x",
                 f"{best / p['output_tok_s']:.2f}x", f"{p['same_tokens_as_pagedllm']} of {r['num_prompts']}"]
                for p in peers]
        out.append(table(["llama.cpp speculative decoding", "tok/s", "against its own off",
                          "pagedllm off against it", "pagedllm's best config against it",
                          "outputs the same as pagedllm's"], rows))
    return "".join(out)


def spec_section(results: Path) -> str | None:
    runs = [(p.name, r) for p in sorted(results.glob(SPEC_FILES)) if (r := load(p)) is not None and "runs" in r]
    if not runs:
        return None
    return INTRO + "".join(_file_section(name, r) for name, r in runs)
