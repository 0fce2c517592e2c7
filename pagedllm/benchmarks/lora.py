"""`pagedllm bench lora`: offline throughput of the 128-request workload with N LoRA adapters
(random, rank R, on every linear layer) mixed uniformly over the requests, against the base
model alone on the same workload; and what loading one adapter at run time costs (the front
end's check, and the worker's read and layout into slot form; then, on a real server with
streams running, POST /v1/load_lora_adapter's wall time and the first request with the new
adapter: benchmarks/lora_http.py).

The base engine and the LoRA engine stay loaded side by side and the phases alternate for
--rounds rounds (the best of each kept), so that other load on a shared host slows them alike.

The adapters are written in PEFT's format (adapter_config.json + adapter_model.safetensors) for
a Llama-layout model (q/k/v/o and gate/up/down projections), from the model's config.

--compare vllm runs vLLM's CPU build (the peers' environment, as `bench throughput --compare`
does, through throughput.run_backend and vllm_worker.py) on the same requests with the same
adapter folders, request i with adapter i mod N as in pagedllm's LoRA phase, in the dtype pagedllm
ran, --rounds generate calls in one process (the fastest kept), without prefix caching as pagedllm's
engines run here; then, for scale, vLLM without LoRA on the same requests."""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from pagedllm.benchmarks.script import parser


def write_random_adapter(hf_config: Any, folder: Path, rank: int, seed: int, b_std: float = 0.01) -> str:
    """A random PEFT adapter of rank `rank` on every linear layer of a Llama-layout model: A with
    entries of standard deviation 1 / sqrt(inputs), B's entries of standard deviation `b_std`, alpha = 2 rank."""
    import torch
    from safetensors.torch import save_file

    c = hf_config
    hidden, inter = int(c.hidden_size), int(c.intermediate_size)
    hd = int(getattr(c, "head_dim", None) or hidden // c.num_attention_heads)
    kv = int(getattr(c, "num_key_value_heads", None) or c.num_attention_heads)
    shapes = {"self_attn.q_proj": (hidden, c.num_attention_heads * hd), "self_attn.k_proj": (hidden, kv * hd),
              "self_attn.v_proj": (hidden, kv * hd), "self_attn.o_proj": (c.num_attention_heads * hd, hidden),
              "mlp.gate_proj": (hidden, inter), "mlp.up_proj": (hidden, inter), "mlp.down_proj": (inter, hidden)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(int(c.num_hidden_layers)):
        for mod, (n_in, n_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{mod}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) / n_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * b_std
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(
            {m.split(".")[1] for m in shapes}), "bias": "none", "modules_to_save": None}))
    return str(folder)


def _throughput(llm: Any, reqs: list, loras: list) -> dict[str, float]:
    from pagedllm import SamplingParams

    params = [SamplingParams(max_tokens=r.output_len, temperature=0, ignore_eos=True) for r in reqs]
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    dt = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"  {n_out} output tokens in {dt:.1f} s: {n_out / dt:.1f} tok/s", flush=True)
    return {"seconds": dt, "output_tokens": n_out, "output_tok_s": n_out / dt}


def _vllm(opts: dict[str, Any], workload: str, workdir: str, dtype: str, what: str,
          extra: dict[str, Any]) -> dict[str, Any]:
    """One run of vLLM's CPU build on the workload file (`extra`: vllm_worker.py's "lora" or
    none): its output tok/s, or {"error": why} where it cannot run."""
    from pagedllm.benchmarks.throughput import BackendUnavailable, run_backend

    backend_opts = {"seed": opts["seed"], "model": opts["model"], "peers_venv": opts["peers_venv"], "engine_args": {},
                    "vllm_kv_cache_space": opts["vllm_kv_cache_space"], "timeout": opts["timeout"]}
    try:
        r = run_backend("vllm", backend_opts, workload, workdir, dtype,
                        extra={**extra, "rounds": opts["rounds"], "enable_prefix_caching": False})
    except BackendUnavailable as exc:
        print(f"vLLM {what}: not run: {exc}", flush=True)
        return {"error": str(exc)}
    print(f"vLLM {what}: {r['output_tokens']} output tokens in {r['elapsed_s']:.1f} s: "
          f"{r['output_tokens_per_s']:.1f} tok/s", flush=True)
    return {"output_tok_s": r["output_tokens_per_s"], "seconds": r["elapsed_s"], "output_tokens": r["output_tokens"],
            "round_s": r.get("round_s", [r["elapsed_s"]]), "dtype": r["dtype"], "version": r.get("vllm_version"),
            "startup_s": r["startup_s"], "peak_rss_bytes": r["peak_rss_bytes"]}


def _compare_vllm(opts: dict[str, Any], reqs: list, paths: list[str], rank: int, dtype: str,
                  workdir: str) -> dict[str, Any]:
    """vLLM's CPU build on the requests with the adapters mixed as pagedllm's adapter phase mixes
    them ("vllm"), then on the same requests without LoRA ("vllm_base")."""
    from pagedllm.benchmarks.workloads import dump_workload

    workload = str(Path(workdir) / "workload.json")
    dump_workload(reqs, workload)
    out = {"vllm": _vllm(opts, workload, workdir, dtype, "with the adapters",
                         {"lora": {"paths": paths, "max_lora_rank": rank}})}
    if "output_tok_s" in out["vllm"]:
        out["vllm_base"] = _vllm(opts, workload, workdir, dtype, "without LoRA", {})
    return out


def run_lora(opts: dict[str, Any]) -> dict[str, Any]:
    from pagedllm import LLM, LoRARequest
    from pagedllm.benchmarks.env import run_metadata
    from pagedllm.benchmarks.workloads import parse_range, random_workload, vocab_info
    from pagedllm.models.loader import load_hf_config, resolve_model

    model, n, rank = opts["model"], opts["num_adapters"], opts["rank"]
    hf_config = load_hf_config(resolve_model(model))
    reqs = random_workload(opts["num_prompts"], parse_range(opts["input_len_range"], "input"),
                           parse_range(opts["output_len_range"], "output"), vocab_info(model), opts["seed"])
    # No prefix caching: every phase of every round computes every prompt (with it, a round's
    # phases would reuse different shares of the blocks earlier rounds left in each engine's cache).
    engine = {"dtype": opts["dtype"], "kv_cache_memory": opts["kv_cache_memory"], "enable_prefix_caching": False}
    report: dict[str, Any] = {"benchmark": "lora", "meta": run_metadata(), "model": model or "default",
                              "num_adapters": n, "rank": rank, "dtype": opts["dtype"], "num_prompts": len(reqs),
                              "prefix_caching": False}
    with tempfile.TemporaryDirectory(prefix="pagedllm-lora-") as tmp:
        paths = [write_random_adapter(hf_config, Path(tmp) / f"a{i}", rank, i) for i in range(n + 1)]
        # Both engines stay loaded and the phases alternate, round after round (best of each
        # kept), so that a busy shared host slows them alike.
        base = LLM(model, **engine)
        llm = LLM(model, enable_lora=True, max_loras=n, max_lora_rank=rank, **engine)
        loras = [LoRARequest(f"a{i}", i + 1, paths[i]) for i in range(n)]
        mixed = [loras[i % n] for i in range(len(reqs))]
        phases = {"base": (base, None), "lora": (llm, mixed), "lora_no_adapter_rows": (llm, None)}
        for rnd in range(opts["rounds"]):
            for name, (engine_llm, lr) in phases.items():
                print(f"round {rnd + 1}, {name}:", end="", flush=True)
                r = _throughput(engine_llm, reqs, lr)
                if name not in report or r["output_tok_s"] > report[name]["output_tok_s"]:
                    report[name] = r
        # Loading one more adapter at run time: the front end's check, then the worker's read + layout.
        extra = LoRARequest("extra", n + 1, paths[n])
        t0 = time.perf_counter()
        llm.llm_engine.processor.check_lora(extra)
        t1 = time.perf_counter()
        runner = llm.llm_engine.core.executor.runner
        runner.lora._weights(extra.lora_int_id, extra.lora_path)
        t2 = time.perf_counter()
        report["load_ms"] = {"check": (t1 - t0) * 1e3, "worker": (t2 - t1) * 1e3}
        dtype = str(llm.llm_engine.model_config.dtype)
        base.llm_engine.shutdown()
        llm.llm_engine.shutdown()
        if opts.get("compare") == "vllm":
            report.update(_compare_vllm(opts, reqs, paths[:n], rank, dtype, tmp))
            if "output_tok_s" in report["vllm"]:
                report["ratio_vs_vllm"] = report["lora"]["output_tok_s"] / report["vllm"]["output_tok_s"]
        if opts.get("http_load", True):  # POST /v1/load_lora_adapter on a real server, streams running
            from pagedllm.benchmarks.lora_http import measure_http_load

            extra = [write_random_adapter(hf_config, Path(tmp) / f"h{i}", rank, 100 + i) for i in range(5)]
            report["http_load"] = measure_http_load(model, opts["dtype"], opts["kv_cache_memory"], [paths[0], *extra],
                                                    rank)
    report["ratio"] = report["lora"]["output_tok_s"] / report["base"]["output_tok_s"]
    report["ratio_no_adapter_rows"] = report["lora_no_adapter_rows"]["output_tok_s"] / report["base"]["output_tok_s"]
    return report


def format_table(r: dict[str, Any]) -> str:
    lines = [f"{r['num_prompts']} requests, {r['model']} ({r['dtype']}), {r['num_adapters']} adapters of rank "
             f"{r['rank']} on every linear layer, mixed uniformly",
             f"  base model alone:          {r['base']['output_tok_s']:8.1f} output tok/s",
             f"  with the adapters:         {r['lora']['output_tok_s']:8.1f} output tok/s  ({r['ratio']:.3f}x)",
             f"  LoRA on, no adapter rows:  {r['lora_no_adapter_rows']['output_tok_s']:8.1f} output tok/s  "
             f"({r['ratio_no_adapter_rows']:.3f}x)",
             f"  loading one adapter: check {r['load_ms']['check']:.1f} ms, worker read + layout "
             f"{r['load_ms']['worker']:.1f} ms"]
    v, vb = r.get("vllm"), r.get("vllm_base") or {}
    if v and "output_tok_s" in v:
        lines.insert(3, f"  vLLM {v['version']} ({v['dtype']}), the same adapters: {v['output_tok_s']:8.1f} output tok/s  "
                        f"(pagedllm with the adapters {r['ratio_vs_vllm']:.3f}x)")
        if "output_tok_s" in vb:
            lines.insert(4, f"  vLLM without LoRA:          {vb['output_tok_s']:8.1f} output tok/s")
    elif v:
        lines.insert(3, f"  vLLM with the same adapters: not run: {v['error']}")
    h = r.get("http_load")
    if h:
        lines.append(f"  POST /v1/load_lora_adapter with {h['streams']} streams running: median "
                     f"{h['load_ms_median']:.0f} ms, max {h['load_ms_max']:.0f} ms over {len(h['load_ms'])} loads; "
                     f"first request with a loaded adapter {statistics.median(h['first_request_ms']):.0f} ms "
                     f"(again {h['warm_request_ms']:.0f} ms); streams completed {h['streams_completed']}/"
                     f"{h['streams']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = parser(__doc__, prog)
    ap.add_argument("--model", default=None, help="a Llama-layout model (default: the embedded default model)")
    ap.add_argument("--num-adapters", type=int, default=8, help="adapters mixed over the requests (= --max-loras)")
    ap.add_argument("--rank", type=int, default=16, help="every adapter's rank")
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--input-len-range", default="32:512", help="prompt length LOW:HIGH")
    ap.add_argument("--output-len-range", default="16:256", help="output length LOW:HIGH")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kv-cache-memory", default="2GiB")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the three phases, alternating (best kept)")
    ap.add_argument("--compare", choices=["vllm"], default=None,
                    help="also run vLLM's CPU build (--peers-venv) on the same requests with the same adapters")
    ap.add_argument("--peers-venv", default=None,
                    help="the peers' environment with vLLM (default: $PAGEDLLM_PEERS_VENV, else .venv-peers)")
    ap.add_argument("--vllm-kv-cache-space", type=int, default=2, help="vLLM's VLLM_CPU_KVCACHE_SPACE in GiB")
    ap.add_argument("--timeout", type=float, default=None, help="seconds vLLM's run may take")
    ap.add_argument("--no-http-load", dest="http_load", action="store_false",
                    help="skip timing POST /v1/load_lora_adapter on a real server")
    ap.add_argument("--output-json", default=None, help="write the report here")
    args = ap.parse_args(argv)
    report = run_lora({k: v for k, v in vars(args).items() if k != "output_json"})
    print(format_table(report))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=1) + "\n")
