"""`pagedllm bench latency`: one request alone: prefill time, per-token decode time, and what they
achieve against this machine's peaks (matmul FLOP/s in the engine's dtype and copy bandwidth, measured
in the same run).

Each iteration adds one request (random token ids, greedy, ignore_eos, exact output length) to an
LLMEngine with prefix caching off and times every `step()`: the first step computes the whole
prompt and samples the first token (prefill); each later step decodes one token.
Decode bandwidth = bytes of weights one decode step reads (decoder weights + lm_head) / step time;
the KV cache read for the context is reported on top.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from tqdm.auto import tqdm

from pagedllm.benchmarks.env import measure_copy_bandwidth, measure_matmul_peak, measure_read_bandwidth, run_metadata
from pagedllm.benchmarks.flops import ModelShape
from pagedllm.benchmarks.workloads import random_workload, vocab_info
from pagedllm.config import SchedulerConfig

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def run_latency(model: str | None, engine_kwargs: dict[str, Any], input_len: int, output_len: int,
                num_iters: int, num_warmup: int, seed: int = 0) -> dict[str, Any]:
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.sampling_params import SamplingParams

    if input_len < 1 or output_len < 2 or num_iters < 1 or num_warmup < 0:
        raise ValueError(f"need input_len >= 1, output_len >= 2, num_iters >= 1, num_warmup >= 0; got "
                         f"{input_len}, {output_len}, {num_iters}, {num_warmup}")
    meta = run_metadata()
    peak_bw = measure_copy_bandwidth()
    read_before = measure_read_bandwidth()
    kwargs = dict(engine_kwargs)
    kwargs["enable_prefix_caching"] = False
    kwargs["max_num_batched_tokens"] = max(kwargs.get("max_num_batched_tokens") or SchedulerConfig.max_num_batched_tokens, input_len)
    t0 = time.perf_counter()
    engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))
    load_s = time.perf_counter() - t0
    ready = time.time()
    mc = engine.model_config
    peak_flops = measure_matmul_peak(dtype=mc.dtype)  # the GEMM peak of the dtype the engine runs
    shape = ModelShape.from_hf_config(mc.hf_config)
    itemsize = _ITEMSIZE[mc.dtype]
    prompt = random_workload(1, (input_len, input_len), (output_len, output_len), vocab_info(model), seed)[0]
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)

    iters = []
    for it in tqdm(range(num_warmup + num_iters), desc="latency iterations", dynamic_ncols=True):
        engine.add_request(f"latency-{it}", {"prompt_token_ids": prompt.prompt_token_ids}, params)
        steps = []
        while engine.has_unfinished_requests():
            s0 = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - s0)
        if it >= num_warmup:
            iters.append({"prefill_s": steps[0], "decode_s": steps[1:], "total_s": sum(steps)})
    # The weight-read roofline's rate: the host's read rate just before and just after the runs.
    read_after = measure_read_bandwidth()
    read_bw = (read_before + read_after) / 2

    prefill = statistics.median(i["prefill_s"] for i in iters)
    decode = statistics.median(statistics.fmean(i["decode_s"]) for i in iters)
    total = statistics.median(i["total_s"] for i in iters)
    mean_ctx = input_len + output_len / 2  # a decode step's context, averaged over the request
    runner = getattr(engine.core.executor, "runner", None)  # in-process (one rank): the model's own bytes
    weight_bytes = decode_read_bytes(runner.model) if runner is not None else shape.decode_weight_bytes(itemsize)
    kv_bytes = shape.kv_bytes_per_token(itemsize) * mean_ctx
    prefill_flops = shape.prefill_flops(input_len)
    decode_flops = shape.token_flops(int(mean_ctx))
    return {
        "benchmark": "latency",
        "meta": meta,
        "model": {"name": mc.served_model_name, "dtype": mc.dtype, "decoder_params": shape.decoder_params,
                  "total_params": shape.total_params, "decode_weight_bytes": weight_bytes},
        "input_len": input_len,
        "output_len": output_len,
        "num_iters": num_iters,
        "num_warmup": num_warmup,
        "load_s": load_s,
        "ready_time": ready,
        "peak_matmul_flops_per_s": peak_flops,
        "peak_copy_bytes_per_s": peak_bw,
        "read_bytes_per_s": {"before": read_before, "after": read_after},
        "peak_read_bytes_per_s": read_bw,
        "prefill_ms": 1000 * prefill,
        "decode_ms_per_token": 1000 * decode,
        "request_latency_s": total,
        "decode_tokens_per_s": 1 / decode,
        "prefill_flops_per_s": prefill_flops / prefill,
        "prefill_fraction_of_peak_flops": prefill_flops / prefill / peak_flops,
        "decode_flops_per_s": decode_flops / decode,
        "decode_fraction_of_peak_flops": decode_flops / decode / peak_flops,
        "decode_weight_bandwidth": weight_bytes / decode,
        "decode_weight_fraction_of_peak_bw": weight_bytes / decode / peak_bw,
        "decode_weight_fraction_of_read_bw": weight_bytes / decode / read_bw,
        "decode_weight_kv_bandwidth": (weight_bytes + kv_bytes) / decode,
        "iterations": [{"prefill_ms": 1000 * i["prefill_s"], "decode_ms_per_token": 1000 * statistics.fmean(i["decode_s"]),
                        "total_s": i["total_s"]} for i in iters],
    }


def decode_read_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads, from the model's own storage: every tensor of the
    decoder (quantized layers: their codes, scales and zeros) and what the LM head reads for decode
    rows (its codes where it keeps them, else its weight). The embedding table and the rotary
    tables give one row per token and are left out."""
    from pagedllm.layers.embedding import LMHead, VocabEmbedding
    from pagedllm.layers.rotary import RotaryEmbedding

    def own(m: torch.nn.Module) -> list[torch.Tensor]:
        return [*m.parameters(recurse=False), *m.buffers(recurse=False)]

    head = [m for m in model.modules() if isinstance(m, LMHead)]
    skipped = {t.data_ptr() for m in model.modules() if isinstance(m, (LMHead, VocabEmbedding, RotaryEmbedding))
               for t in own(m)}
    read: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() not in skipped:
            read[t.data_ptr()] = t.numel() * t.element_size()
    for h in head:
        q = h.quant_codes
        for t in (q[2:] if q is not None else [h.weight]):
            read[t.data_ptr()] = t.numel() * t.element_size()
    return sum(read.values())


def _read_share(r: dict[str, Any]) -> str:
    """"NN% of the X GB/s read rate, " where the run measured it (results before it did not)."""
    if r.get("peak_read_bytes_per_s") is None:
        return ""
    return f"{100 * r['decode_weight_fraction_of_read_bw']:.0f}% of the {r['peak_read_bytes_per_s'] / 1e9:.1f} GB/s read rate, "


def format_latency(r: dict[str, Any]) -> str:
    g = 1e9
    return "\n".join([
        f"model {r['model']['name']} ({r['model']['dtype']}), prompt {r['input_len']} tokens, output {r['output_len']} "
        f"tokens, median of {r['num_iters']} iterations after {r['num_warmup']} warm-up",
        f"prefill            {r['prefill_ms']:9.1f} ms    {r['prefill_flops_per_s'] / g:7.1f} GFLOP/s "
        f"({100 * r['prefill_fraction_of_peak_flops']:.0f}% of the {r['peak_matmul_flops_per_s'] / g:.1f} GFLOP/s {r['model']['dtype']} matmul peak)",
        f"decode per token   {r['decode_ms_per_token']:9.2f} ms    {r['decode_flops_per_s'] / g:7.1f} GFLOP/s "
        f"({100 * r['decode_fraction_of_peak_flops']:.0f}% of peak), {r['decode_tokens_per_s']:.1f} tokens/s",
        f"decode bandwidth   {r['decode_weight_bandwidth'] / g:9.2f} GB/s of weights "
        f"({_read_share(r)}{100 * r['decode_weight_fraction_of_peak_bw']:.0f}% of the {r['peak_copy_bytes_per_s'] / g:.1f} GB/s copy peak); "
        f"{r['decode_weight_kv_bandwidth'] / g:.2f} GB/s with the KV cache",
        f"request latency    {r['request_latency_s']:9.2f} s",
    ])


# GGUF tensor type llama.cpp runs for each pagedllm dtype.
_GGUF_TYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def run_llamacpp_latency(model: str | None, dtype: str, input_len: int, output_len: int, num_iters: int,
                         num_warmup: int, seed: int, peers_venv: str | None, threads: int,
                         gguf_path: str | None = None, extra_bufts: bool = True) -> dict[str, Any]:
    """llama.cpp on the same weights (the model's GGUF rewritten unquantized in `dtype`, or the GGUF
    file `gguf_path` as it is), the same prompt and the same number of threads, in a child process
    of the peers' python; `extra_bufts` False: without llama.cpp's repacked weight layouts."""
    import os
    import sys
    import tempfile
    from pathlib import Path

    from pagedllm.benchmarks.gguf_export import export_unquantized_gguf
    from pagedllm.benchmarks.throughput import BackendUnavailable, peers_python, run_child
    from pagedllm.models.loader import resolve_model

    source = resolve_model(model)
    if gguf_path is None and source.kind != "gguf":
        raise BackendUnavailable(f"llama.cpp needs a GGUF model; {source.path} is a {source.kind} folder")
    python = peers_python(peers_venv)
    path = gguf_path or export_unquantized_gguf(source.path, _GGUF_TYPES[dtype])
    gguf_type = _file_type(path) if gguf_path else _GGUF_TYPES[dtype]
    prompt = random_workload(1, (input_len, input_len), (output_len, output_len), vocab_info(model), seed)[0]
    spec = {"backend": "llama.cpp", "tag": f"llama.cpp-{gguf_type}", "model_path": path,
            "prompt_token_ids": prompt.prompt_token_ids, "output_len": output_len, "num_iters": num_iters,
            "num_warmup": num_warmup, "threads": threads, "extra_bufts": extra_bufts}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    print(f"--- llama.cpp ({gguf_type}, {Path(path).name}): starting ---", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="pagedllm-bench-") as workdir:
        run = run_child([str(python), str(Path(__file__).with_name("llamacpp_worker.py"))], env, spec, workdir,
                        None)
    if run.returncode != 0 or "decode_ms_per_token" not in run.result:
        raise BackendUnavailable(f"llama.cpp failed: {run.result.get('error') or f'exit code {run.returncode}'}")
    return run.result | {"gguf": path, "gguf_type": gguf_type, "extra_bufts": extra_bufts,
                         "peak_rss_bytes": run.peak_rss, "startup_s": run.result["ready_time"] - run.spawn_time}


def _file_type(path: str) -> str:
    """The GGUF's most common tensor type among its matrices (Q4_0, Q8_0, F32, ...)."""
    from collections import Counter

    import gguf

    types = Counter(t.tensor_type.name for t in gguf.GGUFReader(path).tensors if len(t.shape) > 1)
    return types.most_common(1)[0][0]


def run_hf_latency(model: str | None, dtype: str, input_len: int, output_len: int, num_iters: int,
                   num_warmup: int, seed: int) -> dict[str, Any]:
    """HF transformers on the same weights (the model's HF folder) and prompt, in this process:
    prefill = a greedy `generate` of one token (time to the first token); decode = what a
    generate of output_len tokens takes beyond that, per token."""
    import torch
    from transformers import AutoModelForCausalLM

    from pagedllm.benchmarks.throughput import hf_model_dir

    t0 = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(hf_model_dir(model), dtype=getattr(torch, dtype),
                                              local_files_only=True).eval()
    load_s = time.perf_counter() - t0
    ready = time.time()
    prompt = random_workload(1, (input_len, input_len), (output_len, output_len), vocab_info(model), seed)[0]
    ids = torch.tensor([prompt.prompt_token_ids])
    iters = []
    with torch.inference_mode():
        for it in range(num_warmup + num_iters):
            def gen(n: int) -> float:
                s0 = time.perf_counter()
                hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                            do_sample=False, pad_token_id=0)
                return time.perf_counter() - s0

            prefill = gen(1)  # the prompt's forward and the first token
            total = gen(output_len)
            if it >= num_warmup:
                iters.append((prefill, (total - prefill) / (output_len - 1)))
    decode: float | None = statistics.median(d for _, d in iters)
    if decode is not None and decode <= 0:
        decode = None  # a few decode steps hidden in the two calls' noise: not measurable
    del hf
    return {"load_s": load_s, "ready_time": ready, "prefill_ms": 1000 * statistics.median(p for p, _ in iters),
            "decode_ms_per_token": None if decode is None else 1000 * decode,
            "decode_tokens_per_s": None if decode is None else 1 / decode}


def run_latency_matrix(model: str | None, engine_kwargs: dict[str, Any], dtypes: list[str], compare: list[str],
                       input_len: int, output_len: int, num_iters: int, num_warmup: int, seed: int = 0,
                       peers_venv: str | None = None, repeat: int = 1, llamacpp_extra_bufts: bool = True
                       ) -> dict[str, Any]:
    """pagedllm in each dtype, and each peer in `compare` (llama.cpp, hf) in the same dtype, in one
    run (`llamacpp_extra_bufts` False: llama.cpp without its repacked weight layouts); with repeat > 1, `repeat` rounds, pagedllm first in the odd rounds and last in the even ones,
    summarized by `summarize_rounds` (single-stream decode swings by 20 % between minutes here)."""
    from pagedllm.hardware import resolve_dtype

    if repeat < 1:
        raise ValueError(f"repeat must be at least 1, got {repeat}")
    # --quantization gguf keeps the file's codes: llama.cpp runs that file as it is, not an export.
    gguf_path = None
    if engine_kwargs.get("quantization") == "gguf":
        from pagedllm.models.loader import resolve_model

        gguf_path = resolve_model(model).path
    resolved = [(requested, resolve_dtype(requested)) for requested in dtypes]
    rounds = []
    for r in range(repeat):
        rows = []
        for requested, dtype in resolved:
            def ours() -> dict[str, Any]:
                return run_latency(model, {**engine_kwargs, "dtype": dtype}, input_len, output_len, num_iters,
                                   num_warmup, seed)

            def peers() -> dict[str, Any]:
                return _time_peers(model, dtype, compare, input_len, output_len, num_iters, num_warmup, seed,
                                   peers_venv, gguf_path, llamacpp_extra_bufts)

            if r % 2 == 0:
                mine = ours()
                theirs = peers()
            else:
                theirs = peers()
                mine = ours()
            rows.append({"dtype": dtype, "dtype_requested": requested, "pagedllm": mine,
                         **{peer: _against(p, mine) for peer, p in theirs.items()}})
        rounds.append(rows)
    report = {"benchmark": "latency_matrix", "input_len": input_len, "output_len": output_len,
              "num_iters": num_iters, "repeat": repeat}
    if repeat == 1:
        return report | {"runs": rounds[0]}
    return report | {"runs": summarize_rounds(rounds), "rounds": rounds}


def _time_peers(model: str | None, dtype: str, compare: list[str], input_len: int, output_len: int, num_iters: int,
                num_warmup: int, seed: int, peers_venv: str | None, gguf_path: str | None = None,
                extra_bufts: bool = True) -> dict[str, Any]:
    """Each peer's timing in `dtype`: its result, or {"ok": False, "reason": ...} where it cannot run.
    `gguf_path`: the GGUF file llama.cpp runs as it is (else the model rewritten in `dtype`)."""
    import torch

    from pagedllm.benchmarks.throughput import BackendUnavailable

    out: dict[str, Any] = {}
    for peer in compare:
        try:
            if peer == "llama.cpp":
                p = run_llamacpp_latency(model, dtype, input_len, output_len, num_iters, num_warmup, seed,
                                         peers_venv, torch.get_num_threads(), gguf_path, extra_bufts)
            elif peer == "hf":
                p = run_hf_latency(model, dtype, input_len, output_len, num_iters, num_warmup, seed)
            else:
                raise BackendUnavailable(f"unknown peer {peer!r} (latency compares with llama.cpp, hf)")
            out[peer] = {"ok": True, **p}
        except BackendUnavailable as exc:
            out[peer] = {"ok": False, "reason": str(exc)}
    return out


def peers_of(row: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The (peer, its result) pairs of a latency-matrix row, in the order they ran."""
    return [(k, v) for k, v in row.items() if k not in ("dtype", "dtype_requested", "pagedllm")]


def _against(p: dict[str, Any], ours: dict[str, Any]) -> dict[str, Any]:
    """A peer's timing with its roofline fraction and pagedllm's speed-ups over it (same round)."""
    if not p["ok"]:
        return p
    measured = p["decode_ms_per_token"] is not None
    return p | {
        "decode_weight_fraction_of_peak_bw": (
            ours["model"]["decode_weight_bytes"] / (p["decode_ms_per_token"] / 1000) / ours["peak_copy_bytes_per_s"]
            if measured else None),
        "pagedllm_decode_speedup": p["decode_ms_per_token"] / ours["decode_ms_per_token"] if measured else None,
        "pagedllm_prefill_speedup": p["prefill_ms"] / ours["prefill_ms"],
    }


def median_round(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The result of median decode time among rounds of one engine (the lower middle for an even
    count; a result without a decode time ranks first)."""
    ranked = sorted(results, key=lambda x: x["decode_ms_per_token"] if x.get("decode_ms_per_token") else 0.0)
    return ranked[(len(ranked) - 1) // 2]


def round_result(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine's result over several rounds: the first failure where a round failed, else its
    median round."""
    return next((x for x in results if not x["ok"]), None) or median_round(results)


def summarize_rounds(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per dtype from several rounds: each engine's figures from its median round (by decode
    time; the lower middle for an even count), and each peer's speed-ups as the median of the
    per-round ratios (each round's pagedllm against the same round's peer), listed under
    `*_speedup_rounds`. A peer that failed in any round keeps that round's failure."""
    summary = []
    for i, first in enumerate(rounds[0]):
        per_round = [rows[i] for rows in rounds]
        row: dict[str, Any] = {"dtype": first["dtype"], "dtype_requested": first["dtype_requested"],
                               "pagedllm": median_round([r["pagedllm"] for r in per_round])}
        for peer, _ in peers_of(first):
            results = [r[peer] for r in per_round]
            row[peer] = dict(round_result(results))
            if not row[peer]["ok"]:
                continue
            for kind in ("decode", "prefill"):
                ratios = [p[f"pagedllm_{kind}_speedup"] for p in results]
                row[peer][f"pagedllm_{kind}_speedup_rounds"] = ratios
                known = [x for x in ratios if x is not None]
                row[peer][f"pagedllm_{kind}_speedup"] = statistics.median(known) if known else None
        summary.append(row)
    return summary


def format_latency_matrix(m: dict[str, Any]) -> str:
    lines = []
    for row in m["runs"]:
        lines.append(format_latency(row["pagedllm"]))
        lines.append("")
    lines.append(f"{'dtype':10s} {'engine':10s} {'prefill ms':>11s} {'decode tok/s':>13s} {'weight roofline':>16s} "
                 f"{'pagedllm speed-up (decode, prefill)':>36s}")
    for row in m["runs"]:
        r = row["pagedllm"]
        lines.append(f"{row['dtype']:10s} {'pagedllm':10s} {r['prefill_ms']:11.1f} {r['decode_tokens_per_s']:13.1f} "
                     f"{100 * r['decode_weight_fraction_of_peak_bw']:15.0f}% {'':>36s}")
        for peer, p in peers_of(row):
            if not p["ok"]:
                lines.append(f"{row['dtype']:10s} {peer:10s} skipped: {p['reason']}")
                continue
            if p["decode_tokens_per_s"] is None:  # too few decode steps to time
                lines.append(f"{row['dtype']:10s} {peer:10s} {p['prefill_ms']:11.1f} {'-':>13s} {'-':>16s} "
                             f"{'-':>17s}, {p['pagedllm_prefill_speedup']:.2f}x")
                continue
            lines.append(f"{row['dtype']:10s} {peer:10s} {p['prefill_ms']:11.1f} {p['decode_tokens_per_s']:13.1f} "
                         f"{100 * p['decode_weight_fraction_of_peak_bw']:15.0f}% "
                         f"{p['pagedllm_decode_speedup']:17.2f}x, {p['pagedllm_prefill_speedup']:.2f}x")
    if m.get("repeat", 1) > 1:
        lines.append(f"\n{m['repeat']} rounds (pagedllm first in odd rounds, last in even ones); each engine's row is "
                     "its median round, each speed-up the median of the per-round ratios:")
        lines.extend(speedup_round_lines(m))
    return "\n".join(lines)


def speedup_round_lines(m: dict[str, Any]) -> list[str]:
    """'float32 llama.cpp: decode 1.02x, 1.15x, 1.08x; prefill ...' for each measured peer row."""
    def cells(xs: list[float | None]) -> str:
        return ", ".join("-" if x is None else f"{x:.2f}x" for x in xs)

    return [f"{row['dtype']} {peer}: decode {cells(p['pagedllm_decode_speedup_rounds'])}; "
            f"prefill {cells(p['pagedllm_prefill_speedup_rounds'])}"
            for row in m["runs"] for peer, p in peers_of(row) if p.get("pagedllm_decode_speedup_rounds") is not None]
