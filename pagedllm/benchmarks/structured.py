"""`pagedllm bench structured`: what constrained decoding costs, against the same workload unconstrained
and against vLLM's CPU build on the same constrained workload.

Each engine runs in its own fresh process (`python -m pagedllm.benchmarks.structured SPEC` for
pagedllm; `structured_vllm_worker.py` under the peers' python for vLLM) and does the same thing:
the constrained requests once to warm up (grammars compiled, caches filled), then timed, then the
same prompts unconstrained with `ignore_eos` and each request's `max_tokens` set to the number of
tokens its constrained reply had, so both runs generate exactly the same number of tokens from the
same prompts in the same batch. Decoding is greedy. The parent checks every constrained reply
that ended with "stop" (jsonschema for schemas, `re.fullmatch` for regexes, membership for
choices), and times grammar compilation per schema (cold: a compiler without a cache; cached).
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pagedllm.benchmarks.env import REPO_ROOT, run_metadata
from pagedllm.benchmarks.peer_child import constrained_then_free
from pagedllm.benchmarks.schemas import CHOICES, REGEXES, schema_prompt, varied_schemas
from pagedllm.benchmarks.script import parser
from pagedllm.benchmarks.throughput import (
    BackendUnavailable,
    _failure_reason,
    hf_model_dir,
    peers_python,
    run_child,
)

KINDS = ("json-schema", "regex", "choice")
BACKENDS = ("pagedllm", "vllm")


def build_requests(kind: str, num: int, max_tokens: int, seed: int) -> list[dict[str, Any]]:
    """The constrained requests of a workload (text prompts; tokenized once by the parent)."""
    if kind == "json-schema":
        return [{"prompt": schema_prompt(s), "structured": {"json": s}, "max_tokens": max_tokens}
                for s in varied_schemas(num, seed)]
    if kind == "regex":
        return [{"prompt": f"Reply with text that matches the regular expression {r}\nReply {i}:",
                 "structured": {"regex": r}, "max_tokens": max_tokens} for i, r in
                enumerate(REGEXES[i % len(REGEXES)] for i in range(num))]
    if kind == "choice":
        return [{"prompt": f"Pick one of {', '.join(c)}.\nQuestion {i}:", "structured": {"choice": c},
                 "max_tokens": max_tokens} for i, c in enumerate(CHOICES[i % len(CHOICES)] for i in range(num))]
    raise ValueError(f"--structured must be one of {', '.join(KINDS)}, got {kind!r}")


def check_reply(structured: dict[str, Any], text: str) -> str | None:
    """Why a reply that ended with "stop" breaks its structure (None when it follows it)."""
    import jsonschema

    if "json" in structured:
        try:
            jsonschema.validate(json.loads(text), structured["json"])
        except (ValueError, jsonschema.ValidationError) as e:
            return f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        return None
    if "regex" in structured:
        return None if re.fullmatch(structured["regex"], text) else f"{text!r} does not match {structured['regex']}"
    return None if text in structured["choice"] else f"{text!r} is not one of {structured['choice']}"


def compile_times(schemas: list[dict[str, Any]], model: str | None) -> dict[str, Any]:
    """Per-schema compile time of pagedllm's default backend (xgrammar), cold and cached."""
    import xgrammar as xgr

    from pagedllm.models.loader import load_hf_config, load_tokenizer, resolve_model
    from pagedllm.sampling_params import StructuredOutputsParams
    from pagedllm.structured_output.backends import XgrammarBackend

    source = resolve_model(model)
    vocab = int(load_hf_config(source).vocab_size)
    backend = XgrammarBackend(load_tokenizer(source), vocab, [])
    cold_compiler = xgr.GrammarCompiler(backend.tokenizer_info, max_threads=1, cache_enabled=False)
    cold, cached = [], []
    for s in schemas:
        sop = StructuredOutputsParams(json=s)
        t = time.perf_counter()
        cold_compiler.compile_json_schema(json.dumps(s))
        cold.append(time.perf_counter() - t)
        backend.compile(sop)
        t = time.perf_counter()
        backend.compile(sop)
        cached.append(time.perf_counter() - t)

    def pct(xs: list[float], q: float) -> float:
        return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] * 1e3

    return {"schemas": len(schemas), "cold_p50_ms": pct(cold, 0.5), "cold_p99_ms": pct(cold, 0.99),
            "cached_p50_ms": pct(cached, 0.5), "cached_p99_ms": pct(cached, 0.99),
            "cold_mean_ms": statistics.mean(cold) * 1e3}


def _child_pagedllm(spec: dict[str, Any]) -> dict[str, Any]:
    """The pagedllm child: warm-up, constrained (timed), unconstrained of equal lengths (timed)."""
    t_load = time.perf_counter()
    from pagedllm import LLM, SamplingParams, StructuredOutputsParams

    llm = LLM(model=spec.get("model"), seed=0, **spec["engine_args"])
    load_s = time.perf_counter() - t_load
    return {"load_s": load_s, **constrained_then_free(llm, spec["workload"], SamplingParams, StructuredOutputsParams),
            "dtype": llm.llm_engine.config.model_config.dtype}


def run_backend(backend: str, opts: dict[str, Any], workload: str, workdir: str) -> dict[str, Any]:
    env = dict(os.environ)
    spec: dict[str, Any] = {"backend": backend, "workload": workload, "tag": f"structured-{backend}"}
    if backend == "pagedllm":
        cmd = [sys.executable, "-m", "pagedllm.benchmarks.structured"]
        spec.update(model=opts["model"], engine_args=opts["engine_args"])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    else:
        cmd = [str(peers_python(opts["peers_venv"])), str(Path(__file__).with_name("structured_vllm_worker.py"))]
        spec.update(hf_model_dir=hf_model_dir(opts["model"]), max_model_len=opts["engine_args"].get("max_model_len"))
        env["VLLM_CPU_KVCACHE_SPACE"] = str(opts["vllm_kv_cache_space"])
        env.pop("PYTHONPATH", None)
    print(f"--- {backend}: starting ---", file=sys.stderr, flush=True)
    run = run_child(cmd, env, spec, workdir, opts.get("timeout"))
    if run.returncode != 0 or "constrained_s" not in run.result:
        raise BackendUnavailable(_failure_reason(backend, run))
    return run.result


def run_structured(opts: dict[str, Any]) -> dict[str, Any]:
    """Runs the workload on each backend in `opts['backends']`; returns the JSON-able report."""
    from pagedllm.models.loader import load_tokenizer, resolve_model

    reqs = build_requests(opts["kind"], opts["num_prompts"], opts["max_tokens"], opts["seed"])
    tok = load_tokenizer(resolve_model(opts["model"]))
    for r in reqs:
        r["prompt_token_ids"] = tok.encode(r.pop("prompt"), add_special_tokens=False)
    meta = run_metadata()
    rows = []
    with tempfile.TemporaryDirectory(prefix="pagedllm-bench-") as workdir:
        wl = str(Path(workdir) / "workload.json")
        Path(wl).write_text(json.dumps(reqs))
        for backend in opts["backends"]:
            try:
                r = run_backend(backend, opts, wl, workdir)
            except BackendUnavailable as exc:
                print(f"--- {backend}: skipped: {exc}", file=sys.stderr, flush=True)
                rows.append({"backend": backend, "ok": False, "reason": str(exc)})
                continue
            stopped = [(q, t) for q, t, f in zip(reqs, r["texts"], r["finish"]) if f == "stop"]
            broken = [(i, why) for i, (q, t) in enumerate(stopped) if (why := check_reply(q["structured"], t))]
            row = {"backend": backend, "ok": True, "dtype": r.get("dtype"), "load_s": r["load_s"],
                   "output_tokens": r["output_tokens"],
                   "constrained_tokens_per_s": r["output_tokens"] / r["constrained_s"],
                   "unconstrained_tokens_per_s": r["unconstrained_output_tokens"] / r["unconstrained_s"],
                   "constrained_s": r["constrained_s"], "unconstrained_s": r["unconstrained_s"],
                   "stopped": len(stopped), "length_capped": sum(f == "length" for f in r["finish"]),
                   "invalid": len(broken), "invalid_examples": broken[:3]}
            row["constrained_vs_unconstrained"] = row["constrained_tokens_per_s"] / row["unconstrained_tokens_per_s"]
            if "vllm_version" in r:
                meta["versions"]["vllm"] = r["vllm_version"]
            rows.append(row)
    base = next((r for r in rows if r["backend"] == "pagedllm" and r["ok"]), None)
    for r in rows:
        if base and r["ok"]:
            r["vs_pagedllm"] = r["constrained_tokens_per_s"] / base["constrained_tokens_per_s"]
    report: dict[str, Any] = {
        "benchmark": "structured", "meta": meta,
        "workload": {"kind": opts["kind"], "num_requests": len(reqs), "max_tokens": opts["max_tokens"],
                     "seed": opts["seed"], "prompt_tokens": sum(len(r["prompt_token_ids"]) for r in reqs),
                     "sampling": "greedy"},
        "results": rows,
    }
    if opts["kind"] == "json-schema" and "pagedllm" in opts["backends"]:
        report["compile"] = compile_times([r["structured"]["json"] for r in reqs], opts["model"])
    return report


def format_table(report: dict[str, Any]) -> str:
    out = ["backend   dtype     constrained tok/s  unconstrained tok/s  ratio   valid (of stopped)  vs pagedllm"]
    for r in report["results"]:
        if not r["ok"]:
            out.append(f"{r['backend']:<9} skipped: {r['reason']}")
            continue
        out.append(f"{r['backend']:<9} {str(r['dtype']):<9} {r['constrained_tokens_per_s']:>17.1f}  "
                   f"{r['unconstrained_tokens_per_s']:>19.1f}  {r['constrained_vs_unconstrained']:>5.3f}   "
                   f"{r['stopped'] - r['invalid']:>5}/{r['stopped']:<12} {r.get('vs_pagedllm', 0):>6.2f}x")
    wl = report["workload"]
    out.append(f"workload: {wl['num_requests']} {wl['kind']} requests, greedy, up to {wl['max_tokens']} tokens each; "
               "unconstrained = the same prompts with each reply's token count and ignore_eos")
    c = report.get("compile")
    if c:
        out.append(f"grammar compile per schema ({c['schemas']} schemas, xgrammar): cold p50 {c['cold_p50_ms']:.2f} ms, "
                   f"p99 {c['cold_p99_ms']:.2f} ms; cached p50 {c['cached_p50_ms']:.3f} ms, "
                   f"p99 {c['cached_p99_ms']:.3f} ms")
    return "\n".join(out)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    """`pagedllm bench structured`: flags, the run, the table, and the JSON report."""
    ap = parser(__doc__, prog)
    ap.add_argument("--structured", choices=KINDS, default="json-schema", help="the workload's structure")
    ap.add_argument("--num-prompts", type=int, default=64, help="requests, all submitted at once")
    ap.add_argument("--max-tokens", type=int, default=256, help="most tokens per reply")
    ap.add_argument("--seed", type=int, default=0, help="picks the bundled schemas (pagedllm/benchmarks/schemas.py)")
    ap.add_argument("--backend", default="pagedllm,vllm", help="comma-separated: pagedllm, vllm")
    ap.add_argument("--model", default=None, help="model (default: the embedded default model)")
    ap.add_argument("--kv-cache-memory", default="2GiB", help="pagedllm's KV cache")
    ap.add_argument("--vllm-kv-cache-space", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE in GiB")
    ap.add_argument("--peers-venv", default=None, help="vLLM's environment (default: .venv-peers)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds each engine may take")
    ap.add_argument("--output-json", default=None, help="write the report here")
    args = ap.parse_args(argv)
    backends = [b.strip() for b in args.backend.split(",") if b.strip()]
    bad = [b for b in backends if b not in BACKENDS]
    if bad:
        ap.error(f"--backend {','.join(bad)} is not one of {', '.join(BACKENDS)}")
    report = run_structured({
        "kind": args.structured, "num_prompts": args.num_prompts, "max_tokens": args.max_tokens, "seed": args.seed,
        "model": args.model, "engine_args": {"kv_cache_memory": args.kv_cache_memory}, "backends": backends,
        "peers_venv": args.peers_venv, "vllm_kv_cache_space": args.vllm_kv_cache_space, "timeout": args.timeout})
    print(format_table(report))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":  # the pagedllm child of a run (the CLI calls main)
    from pagedllm.benchmarks.peer_child import child_main

    sys.exit(child_main(sys.argv[1:], _child_pagedllm))
