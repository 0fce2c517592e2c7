"""pagedllm at user scale: a Llama-3.2-1B-shaped or Qwen3-0.6B-shaped model (random weights, the
real shape and vocabulary; benchmarks/scale_model.py builds it) against vLLM's CPU build, llama.cpp
and HF transformers. Every engine runs in its own fresh process; each row names the engine, its
dtype or quantization, the figure, and the engine process's peak RSS and start-up time.

1. agreement: greedy tokens of pagedllm (bf16) and llama.cpp (the BF16 GGUF) after one random prompt
   (random weights: near-ties are possible, so the agreement is reported, not required).
2. throughput: `pagedllm bench throughput`'s machinery, pagedllm and vLLM in bfloat16, on
   --num-prompts random requests (--input-len-range, --output-len-range).
3. one stream: `pagedllm bench latency`'s measurement (an --input-len prompt, --output-len greedy
   tokens, median of --num-iters) per pair: bf16 vs llama.cpp BF16, --quantization int8 vs Q8_0,
   --quantization int4 (group 32) vs Q4_0 (llama.cpp's quantizer and its default choices); with
   pagedllm's weight-read roofline: bytes of weights read per decode step / this host's read rate,
   measured just before and after the runs. With --rounds R each pair runs R times, alternating
   which engine goes first: the row shows each engine's median round, the median of the rounds'
   speed-ups, so a memory rate that drifts over minutes moves both engines alike, and the median of
   the rounds' fractions of the weight-read roofline (each round's of the read rate measured around
   that round).
4. prefill: the time to first token of one --prefill-len prompt (bf16): pagedllm, HF transformers,
   llama.cpp's prompt processing (BF16).
5. serve: `pagedllm serve` and `vllm serve` (bf16) launched in turn and driven by `pagedllm bench
   serve`'s client with the same --serve-num-prompts random requests at each --serve-request-rates
   (benchmarks/scale_serve.py): output tok/s, mean / p95 TTFT and TPOT, pagedllm over vLLM.

llama.cpp loads the weights in the GGUF's own layout (its extra buffer types off, as
pagedllm/eval/llamacpp.py loads them) unless --llamacpp-extra-bufts: its AMX buffer type, which
takes the Q8_0 / Q4_0 files, stops the process on this host.

Each part records its own run metadata; --merge keeps the other parts of an existing --output-json,
so the parts can run one at a time.

usage: pagedllm bench scale --shape llama-3.2-1b [--skip-vllm] [--skip-latency] ... [--output-json F]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from pagedllm.benchmarks.scale_model import SHAPES, build_model, shape_config
from pagedllm.benchmarks.script import parser

# pagedllm engine arguments and the llama.cpp file type of each one-stream pair
PAIRS: dict[str, tuple[dict[str, Any], str]] = {
    "bf16": ({}, "BF16"),
    "int8": ({"quantization": "int8"}, "Q8_0"),
    "int4": ({"quantization": "int4", "quantization_group_size": 32}, "Q4_0"),
}


def weight_roofline_fraction(r: dict[str, Any]) -> float:
    """A latency run's decode weight rate over its weight-read roofline: the read rate measured
    around the runs where the run has it, else (results from before it) the copy peak."""
    read = r.get("decode_weight_fraction_of_read_bw")
    return read if read is not None else r["decode_weight_fraction_of_peak_bw"]


def gguf_files(bf16: str, types: list[str], peers_venv: str | None) -> dict[str, dict[str, Any]]:
    """The GGUF of each llama.cpp type: {"ok", "path"} or {"ok": False, "reason"}."""
    import torch

    from pagedllm.benchmarks.gguf_export import llamacpp_quantized_gguf
    from pagedllm.benchmarks.throughput import BackendUnavailable

    out: dict[str, dict[str, Any]] = {}
    for t in types:
        try:
            path = bf16 if t == "BF16" else llamacpp_quantized_gguf(
                bf16, t, peers_venv, torch.get_num_threads(), str(Path(bf16).with_name(f"model.{t}.gguf")))
            out[t] = {"ok": True, "path": path, "bytes": Path(path).stat().st_size}
        except BackendUnavailable as exc:
            out[t] = {"ok": False, "reason": str(exc)}
    return out


def pagedllm_child(spec: dict[str, Any], workdir: str, timeout: float | None) -> dict[str, Any]:
    """One pagedllm or HF measurement (worker.py's `latency` backend) in a fresh process, with that
    process's peak RSS and start-up time (spawn to model ready)."""
    from pagedllm.benchmarks.env import REPO_ROOT
    from pagedllm.benchmarks.throughput import BackendUnavailable, run_child

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    print(f"--- {spec['tag']}: starting ---", file=sys.stderr, flush=True)
    run = run_child([sys.executable, "-m", "pagedllm.benchmarks.worker"], env, {"backend": "latency", **spec},
                    workdir, timeout)
    if run.returncode != 0 or "prefill_ms" not in run.result:
        raise BackendUnavailable(f"{spec['tag']} failed: {run.result.get('error') or f'exit code {run.returncode}'}")
    r = run.result
    return {**r, "peak_rss_bytes": run.peak_rss, "startup_s": r["ready_time"] - run.spawn_time}


def _latency_spec(engine: str, folder: str, engine_kwargs: dict[str, Any], n: tuple[int, int, int, int],
                  tag: str) -> dict[str, Any]:
    return {"engine": engine, "model": folder, "engine_kwargs": engine_kwargs, "input_len": n[0],
            "output_len": n[1], "num_iters": n[2], "num_warmup": n[3], "seed": 0, "tag": tag}


def _llamacpp(folder: str, gguf: dict[str, Any], n: tuple[int, int, int, int], args: Any) -> dict[str, Any]:
    import torch

    from pagedllm.benchmarks.latency import run_llamacpp_latency
    from pagedllm.benchmarks.throughput import BackendUnavailable

    if not gguf["ok"]:
        return gguf
    try:
        return {"ok": True, **run_llamacpp_latency(folder, "bfloat16", *n, 0, args.peers_venv,
                                                   torch.get_num_threads(), gguf["path"], args.llamacpp_extra_bufts)}
    except BackendUnavailable as exc:
        return {"ok": False, "reason": str(exc)}


def _ours(spec: dict[str, Any], workdir: str, args: Any) -> dict[str, Any]:
    from pagedllm.benchmarks.throughput import BackendUnavailable

    try:
        return {"ok": True, **pagedllm_child(spec, workdir, args.timeout)}
    except BackendUnavailable as exc:
        return {"ok": False, "reason": str(exc)}


def run_agreement(folder: str, ggufs: dict[str, dict[str, Any]], args: Any) -> dict[str, Any]:
    """pagedllm's greedy tokens (bf16, in this process) against llama.cpp's on the BF16 GGUF."""
    import torch

    from pagedllm.benchmarks.workloads import random_workload, vocab_info
    from pagedllm.eval.llamacpp import llamacpp_greedy
    from pagedllm.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    n = args.agreement_tokens
    prompt = random_workload(1, (args.input_len, args.input_len), (n, n), vocab_info(folder), 0)[0].prompt_token_ids
    llm = LLM(folder, dtype="bfloat16", seed=0, max_model_len=2048)
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False),
                       use_tqdm=False)
    ours = list(out[0].outputs[0].token_ids)
    del llm
    row: dict[str, Any] = {"prompt_len": len(prompt), "pagedllm_tokens": ours}
    if not ggufs["BF16"]["ok"]:
        return row | {"llama.cpp": ggufs["BF16"]}
    try:
        theirs, top = llamacpp_greedy(ggufs["BF16"]["path"], [prompt], n, torch.get_num_threads())[0]
    except RuntimeError as exc:
        return row | {"llama.cpp": {"ok": False, "reason": str(exc)}}
    same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    row |= {"llama.cpp": {"ok": True, "tokens": theirs, "top5": top}, "agreeing_prefix": same,
            "agreeing_positions": sum(a == b for a, b in zip(ours, theirs)), "compared": min(len(ours), len(theirs))}
    print(f"agreement: the first {same} of {row['compared']} greedy tokens agree (pagedllm {ours}, llama.cpp "
          f"{theirs})", file=sys.stderr, flush=True)
    return row


def run_throughput_part(folder: str, args: Any) -> dict[str, Any]:
    from pagedllm.benchmarks.throughput import format_table, run_throughput
    from pagedllm.benchmarks.workloads import parse_range, random_workload, vocab_info

    in_range = parse_range(args.input_len_range, "--input-len-range")
    out_range = parse_range(args.output_len_range, "--output-len-range")
    reqs = random_workload(args.num_prompts, in_range, out_range, vocab_info(folder), 0)
    info = {"kind": "random", "seed": 0, "input_len_range": list(in_range), "output_len_range": list(out_range)}
    opts = {"backends": ["pagedllm", *([] if args.skip_vllm else ["vllm"])], "sampling": None,
            "dtypes": ["bfloat16"], "model": folder, "engine_args": {"seed": 0, "max_model_len": 2048}, "seed": 0,
            "hf_batch_sizes": [8, 16, 32], "hf_probe_prompts": None, "peers_venv": args.peers_venv,
            "vllm_kv_cache_space": args.vllm_kv_cache_space, "timeout": args.timeout}
    report = run_throughput(reqs, info, opts)
    print(format_table(report))
    rows = {r["backend"]: r for r in report["results"]}
    if rows.get("vllm", {}).get("ok") and rows["pagedllm"].get("ok"):
        report["output_speedup_vs_vllm"] = rows["pagedllm"]["output_tokens_per_s"] / rows["vllm"]["output_tokens_per_s"]
    return report


def run_latency_part(folder: str, ggufs: dict[str, dict[str, Any]], args: Any) -> dict[str, Any]:
    from pagedllm.benchmarks.env import run_metadata
    from pagedllm.benchmarks.latency import round_result

    n = (args.input_len, args.output_len, args.num_iters, args.num_iters_warmup)
    rows = []
    with tempfile.TemporaryDirectory(prefix="pagedllm-bench-scale-") as workdir:
        for name in args.pairs:
            extra, gguf_type = PAIRS[name]
            spec = _latency_spec("pagedllm", folder, {"dtype": "bfloat16", "seed": 0, **extra}, n, f"pagedllm-{name}")
            runs: dict[str, list[dict[str, Any]]] = {"pagedllm": [], "llama.cpp": []}
            for r in range(args.rounds):
                for engine in ("pagedllm", "llama.cpp") if r % 2 == 0 else ("llama.cpp", "pagedllm"):
                    if engine == "pagedllm":
                        runs[engine].append(_ours(spec, workdir, args))
                    else:
                        runs[engine].append(_llamacpp(folder, ggufs[gguf_type], n, args) if not args.skip_llamacpp
                                            else {"ok": False, "reason": "--skip-llamacpp"})
            ours, peer = (round_result(rs) for rs in runs.values())
            row: dict[str, Any] = {"pagedllm_scheme": name, "llamacpp_type": gguf_type, "pagedllm": ours,
                                   "llama.cpp": peer}
            if ours["ok"]:
                # Each round against the read rate measured around it, as the speed-up is the
                # median of the rounds' ratios (with one round, that round's).
                row["pagedllm_fraction_of_weight_roofline"] = statistics.median(
                    weight_roofline_fraction(a) for a in runs["pagedllm"])
            if ours["ok"] and peer["ok"]:
                row["decode_speedup_vs_llamacpp"] = peer["decode_ms_per_token"] / ours["decode_ms_per_token"]
                if args.rounds > 1:
                    row["rounds"] = [{"first": "pagedllm" if r % 2 == 0 else "llama.cpp",
                                      "pagedllm_decode_tokens_per_s": a["decode_tokens_per_s"],
                                      "llamacpp_decode_tokens_per_s": b["decode_tokens_per_s"],
                                      "pagedllm_fraction_of_weight_roofline": weight_roofline_fraction(a),
                                      "decode_speedup_vs_llamacpp": b["decode_ms_per_token"] / a["decode_ms_per_token"]}
                                     for r, (a, b) in enumerate(zip(runs["pagedllm"], runs["llama.cpp"]))]
                    row["decode_speedup_vs_llamacpp"] = statistics.median(
                        x["decode_speedup_vs_llamacpp"] for x in row["rounds"])
                print(f"one stream {name} vs {gguf_type}: pagedllm {ours['decode_tokens_per_s']:.2f} tok/s "
                      f"({100 * row['pagedllm_fraction_of_weight_roofline']:.0f}% of the weight-read roofline), "
                      f"llama.cpp {peer['decode_tokens_per_s']:.2f} tok/s: {row['decode_speedup_vs_llamacpp']:.2f}x"
                      + _rounds_text(row), file=sys.stderr, flush=True)
            rows.append(row)
    return {"meta": run_metadata(), "input_len": args.input_len, "output_len": args.output_len,
            "num_iters": args.num_iters, "rounds": args.rounds, "rows": rows}


def _rounds_text(row: dict[str, Any]) -> str:
    speedups = [f"{x['decode_speedup_vs_llamacpp']:.2f}x" for x in row.get("rounds", [])]
    return f" (median of rounds {', '.join(speedups)})" if speedups else ""



def run_prefill_part(folder: str, ggufs: dict[str, dict[str, Any]], args: Any) -> dict[str, Any]:
    from pagedllm.benchmarks.env import run_metadata

    n = (args.prefill_len, 2, args.prefill_iters, args.prefill_warmup)
    kwargs = {"dtype": "bfloat16", "seed": 0, "max_model_len": args.prefill_len + 64}
    with tempfile.TemporaryDirectory(prefix="pagedllm-bench-scale-") as workdir:
        ours = _ours(_latency_spec("pagedllm", folder, kwargs, n, "pagedllm-prefill"), workdir, args)
        hf = (_ours(_latency_spec("hf", folder, {"dtype": "bfloat16"}, n, "hf-prefill"), workdir, args)
              if not args.skip_hf else {"ok": False, "reason": "--skip-hf"})
    peer = _llamacpp(folder, ggufs["BF16"], n, args) if not args.skip_llamacpp else \
        {"ok": False, "reason": "--skip-llamacpp"}
    out: dict[str, Any] = {"meta": run_metadata(), "prompt_len": args.prefill_len, "num_iters": args.prefill_iters,
                           "num_warmup": args.prefill_warmup, "pagedllm": ours, "hf": hf, "llama.cpp": peer}
    for name, p in (("hf", hf), ("llama.cpp", peer)):
        if ours["ok"] and p["ok"]:
            out[f"ttft_speedup_vs_{name}"] = p["prefill_ms"] / ours["prefill_ms"]
            print(f"prefill {args.prefill_len} tokens: pagedllm {ours['prefill_ms'] / 1e3:.2f} s, {name} "
                  f"{p['prefill_ms'] / 1e3:.2f} s: {out[f'ttft_speedup_vs_{name}']:.2f}x", file=sys.stderr, flush=True)
    return out


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = parser(__doc__, prog)
    ap.add_argument("--shape", required=True, choices=SHAPES)
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the real model's)")
    ap.add_argument("--hidden", type=int, default=None, help="hidden size; heads and MLP scale with it (default: real)")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len-range", default="32:512")
    ap.add_argument("--output-len-range", default="16:256")
    ap.add_argument("--vllm-kv-cache-space", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE in GiB (default 4)")
    ap.add_argument("--input-len", type=int, default=32, help="one stream's prompt (default 32)")
    ap.add_argument("--output-len", type=int, default=128, help="one stream's output tokens (default 128)")
    ap.add_argument("--num-iters", type=int, default=3)
    ap.add_argument("--num-iters-warmup", type=int, default=1)
    ap.add_argument("--pairs", type=lambda s: [p for p in s.split(",") if p], default=list(PAIRS),
                    help=f"one-stream pairs (default {','.join(PAIRS)})")
    ap.add_argument("--rounds", type=int, default=1,
                    help="one stream: runs of each pair, alternating which engine goes first; each engine's median "
                         "round, the median of the rounds' speed-ups and the median of the rounds' fractions of "
                         "the weight-read roofline are reported (default 1)")
    ap.add_argument("--agreement-tokens", type=int, default=8)
    ap.add_argument("--prefill-len", type=int, default=4000)
    ap.add_argument("--prefill-iters", type=int, default=1)
    ap.add_argument("--prefill-warmup", type=int, default=1)
    ap.add_argument("--serve-num-prompts", type=int, default=32, help="served requests per rate (default 32)")
    ap.add_argument("--serve-request-rates", default="inf,1",
                    help="served request rates per second, Poisson arrivals; inf = all at once (default inf,1)")
    ap.add_argument("--launch-timeout", type=float, default=900.0, help="seconds to wait for a server's /health")
    for part in ("agreement", "throughput", "latency", "prefill", "serve", "vllm", "llamacpp", "hf"):
        ap.add_argument(f"--skip-{part}", action="store_true")
    ap.add_argument("--llamacpp-extra-bufts", action="store_true",
                    help="llama.cpp with its repacked weight layouts (AMX, AVX-512); off by default: its AMX "
                         "buffer type stops the process on the quantized files where the kernel gives no AMX tile state")
    ap.add_argument("--peers-venv", default=None)
    ap.add_argument("--timeout", type=float, default=None, help="seconds one engine process may take")
    ap.add_argument("--output-json")
    ap.add_argument("--merge", action="store_true", help="keep the parts of an existing --output-json not run now")
    args = ap.parse_args(argv)
    bad = [p for p in args.pairs if p not in PAIRS]
    if bad:
        ap.error(f"unknown pair(s) {', '.join(bad)}; choose from {', '.join(PAIRS)}")
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.merge and not args.output_json:
        ap.error("--merge needs --output-json")
    if not args.skip_serve:
        from pagedllm.benchmarks.scale_serve import parse_rates

        try:
            parse_rates(args.serve_request_rates)
        except ValueError as exc:
            ap.error(str(exc))
    cfg = shape_config(args.shape, args.layers, args.hidden)
    folder, bf16 = build_model(cfg)
    print(f"model: {folder}", file=sys.stderr, flush=True)
    from pagedllm.benchmarks.env import run_metadata

    types = sorted({"BF16", *(PAIRS[p][1] for p in args.pairs)})
    ggufs = gguf_files(bf16, types if not args.skip_llamacpp else ["BF16"], args.peers_venv)
    result: dict[str, Any] = {}
    if args.merge and Path(args.output_json).exists():
        result = json.loads(Path(args.output_json).read_text())
    result |= {"benchmark": "scale", "shape": args.shape, "meta": run_metadata(), "args": vars(args),
               "model": {"folder": folder, "config": cfg, "gguf": ggufs,
                         "tokenizer_vocab": "the default model's (49152 tokens); prompts are random ids below it"}}
    if not args.skip_agreement and not args.skip_llamacpp:
        result["agreement"] = run_agreement(folder, ggufs, args)
    if not args.skip_throughput:
        result["throughput"] = run_throughput_part(folder, args)
    if not args.skip_latency:
        result["single_stream"] = run_latency_part(folder, ggufs, args)
    if not args.skip_prefill:
        result["prefill"] = run_prefill_part(folder, ggufs, args)
    if not args.skip_serve:
        from pagedllm.benchmarks.scale_serve import run_serve_part

        result["serve"] = run_serve_part(folder, args)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2, default=str))
