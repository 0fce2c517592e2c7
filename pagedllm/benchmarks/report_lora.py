"""docs/benchmarks.md's section on LoRA adapters: one table per result file of `pagedllm bench lora`
(LORA_FILES: benchmarks/results/amx_lora*.json and lora*.json, in name order): output tokens/s of
the base model alone, with N adapters mixed over the requests and with LoRA on but no adapter
rows, each against the base model, vLLM's CPU build with the same adapters where the run had
`--compare vllm`, and what loading one adapter at run time cost."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from pagedllm.benchmarks.report_render import load, run_block, table

LORA_FILES = ("amx_lora*.json", "lora*.json")

INTRO = """## LoRA adapters

`pagedllm bench lora`: the same random requests on the base model alone, with N random adapters
(rank R, on every linear layer) mixed uniformly over the requests, and on the LoRA engine without
adapter rows; both engines stay loaded and the phases alternate round after round (the best of
each kept). With `--compare vllm`, vLLM's CPU build runs the same requests with the same adapter
folders mixed the same way, in the dtype pagedllm ran, the same number of rounds in one process
(the fastest kept), then without LoRA on the same requests. Every engine runs without prefix
caching (each round computes every prompt); a run that had it on says so under its table. docs/lora.md says how the deltas run.
"""


def _file_section(name: str, r: dict[str, Any]) -> str:
    out = [f"\n### `{name}`: {r['num_prompts']} requests, {r['model']} ({r['dtype']}), {r['num_adapters']} adapters "
           f"of rank {r['rank']}\n\n", run_block(r.get("meta")), "\n"]
    base = r["base"]["output_tok_s"]
    rows = [["base model alone (LoRA off)", "base"],
            [f"{r['num_adapters']} adapters of rank {r['rank']} on every linear layer, mixed", "lora"],
            ["LoRA on, no adapter rows", "lora_no_adapter_rows"]]
    vllm, vllm_base = r.get("vllm") or {}, r.get("vllm_base") or {}
    if "output_tok_s" in vllm:
        rows.insert(2, [f"vLLM {vllm['version']} ({vllm['dtype']}): the same adapters, mixed the same way", "vllm"])
    if "output_tok_s" in vllm_base:
        rows.insert(3, [f"vLLM {vllm_base['version']} ({vllm_base['dtype']}): LoRA off", "vllm_base"])
    out.append(table(["phase", "output tok/s", "against the base model"],
                     [[label, f"{r[key]['output_tok_s']:.1f}", f"{r[key]['output_tok_s'] / base:.2f}x"]
                      for label, key in rows]))
    if "output_tok_s" in vllm:
        out.append(f"\npagedllm with the adapters: **{r['lora']['output_tok_s'] / vllm['output_tok_s']:.2f}x** vLLM's "
                   "CPU build with the same adapters.")
        if "output_tok_s" in vllm_base:
            out.append(f" vLLM with the adapters ran at {vllm['output_tok_s'] / vllm_base['output_tok_s']:.2f}x its "
                       "own rate without LoRA.")
    elif vllm:
        out.append(f"\nvLLM with the same adapters did not run: {vllm['error']}")
    load_ms = r.get("load_ms")
    if load_ms:
        out.append(f"\nLoading one adapter in-process: the front end's check {load_ms['check']:.0f} ms, the worker's "
                   f"read and layout {load_ms['worker']:.0f} ms.")
    h = r.get("http_load")
    if h:
        out.append(f" On a server with {h['streams']} streams running, `POST /v1/load_lora_adapter` took "
                   f"{h['load_ms_median']:.0f} ms (median, {h['load_ms_max']:.0f} ms at most, {len(h['load_ms'])} "
                   f"loads); the first request with a new adapter {statistics.median(h['first_request_ms']):.0f} ms.")
    if "prefix_caching" not in r:
        out.append("\n\nRun with prefix caching on: later rounds reused prompt blocks of earlier ones, in different "
                   "shares per engine and phase.")
    out.append("\n")
    if r.get("note"):
        out.append(f"\n{r['note']}\n")
    return "".join(out)


def lora_section(results: Path) -> str | None:
    files = sorted({p for pattern in LORA_FILES for p in results.glob(pattern)})
    parts = [_file_section(p.name, r) for p in files if (r := load(p)) is not None and "lora" in r]
    return INTRO + "".join(parts) if parts else None
