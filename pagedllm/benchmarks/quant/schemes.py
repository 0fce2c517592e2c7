"""Quantization table of docs/quantization.md: per scheme, weight memory and perplexity at ctx 512
and 4096 (llama.cpp's convention, few windows; the llama.cpp peer on the same GGUF and windows),
or, with --speed, single-stream decode and throughput on the 128-request workload.

Quality: PAGEDLLM_PEERS_VENV=/work/main/.venv-peers pagedllm bench quant schemes --ppl-only \
     [--chunks512 4] [--chunks4096 1] [--schemes fp32,int8,...]
Speed:   PAGEDLLM_PEERS_VENV=/work/main/.venv-peers flock /tmp/pagedllm-bench.lock \
     pagedllm bench quant schemes --speed [--schemes ...]
  every scheme's decode (`pagedllm bench latency`'s machinery: one request, every step timed) and
  throughput (`pagedllm bench throughput`'s pagedllm run, in this process) on one workload, and
  llama.cpp's decode on the same GGUF files (Q4_1 as shipped, Q8_0 and Q4_0 written by llama.cpp's
  own quantizer), same prompt and threads, one after another in one run.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

from pagedllm import LLM
from pagedllm.benchmarks.ct_export import compressed_folder
from pagedllm.benchmarks.env import run_metadata
from pagedllm.benchmarks.gguf_export import llamacpp_quantized_gguf
from pagedllm.benchmarks.latency import run_latency, run_llamacpp_latency
from pagedllm.benchmarks.throughput import GREEDY
from pagedllm.benchmarks.worker import run_pagedllm
from pagedllm.benchmarks.workloads import dump_workload, random_workload, vocab_info, workload_summary
from pagedllm.eval.corpus import default_corpus
from pagedllm.eval.llamacpp import llamacpp_perplexity
from pagedllm.eval.perplexity import perplexity, summarize, wants_bos, windows_of
from pagedllm.hardware import resolve_dtype
from pagedllm.models.loader import resolve_model
from pagedllm.models.loader.convert import default_hf_folder
from pagedllm.benchmarks.script import parser

# Quality rows run in float32 (bfloat16 for the bf16 row); speed rows run every quantized scheme in
# --dtype auto's choice (SPEED_DTYPE): bfloat16, the activation dtype its kernels take, where the CPU
# has AVX-512 BF16, float32 where bfloat16 would be emulated. "model": a GGUF of the default
# model that llama.cpp's quantizer writes (Q8_0, Q4_0), instead of the shipped Q4_1.
SCHEMES = {
    "fp32": {"dtype": "float32"},
    "bf16": {"dtype": "bfloat16"},
    "int8": {"dtype": "float32", "quantization": "int8"},
    "w8a8": {"dtype": "float32", "quantization": "w8a8"},
    "int4-g32": {"dtype": "float32", "quantization": "int4", "quantization_group_size": 32},
    "int4-g128": {"dtype": "float32", "quantization": "int4", "quantization_group_size": 128},
    "fp8": {"dtype": "float32", "quantization": "fp8"},
    "gguf-q4_1": {"dtype": "float32", "quantization": "gguf"},
    "gguf-q8_0": {"dtype": "float32", "quantization": "gguf", "model": "Q8_0"},
    "gguf-q4_0": {"dtype": "float32", "quantization": "gguf", "model": "Q4_0"},
    "ffn-int8": {"dtype": "float32", "quantization": "int8", "quantization_skip": "attention"},
    "ffn-int4": {"dtype": "float32", "quantization": "int4", "quantization_skip": "attention"},
    # --quantize-embeddings: the token embedding and LM head as codes too.
    "int8-emb": {"dtype": "float32", "quantization": "int8", "quantize_embeddings": True},
    "int4-g32-emb": {"dtype": "float32", "quantization": "int4", "quantization_group_size": 32,
                     "quantize_embeddings": True},
    "int4-g128-emb": {"dtype": "float32", "quantization": "int4", "quantization_group_size": 128,
                      "quantize_embeddings": True},
    "gguf-q4_1-emb": {"dtype": "float32", "quantization": "gguf", "quantize_embeddings": True},
    # compressed-tensors folders of the model written by the compressed-tensors library (llm-compressor's
    # format: "model" is "ct:<preset>[:<group size>]"), loaded as stored.
    "ct-w4a16-g32": {"dtype": "float32", "model": "ct:W4A16:32"},
    "ct-w4a16-asym-g32": {"dtype": "float32", "model": "ct:W4A16_ASYM:32"},
    # Their float twins: every quantized weight replaced by the library's fake_quantize of it.
    "ct-w4a16-g32-twin": {"dtype": "float32", "model": "ct-twin:W4A16:32"},
    "ct-w4a16-asym-g32-twin": {"dtype": "float32", "model": "ct-twin:W4A16_ASYM:32"},
    "ct-w8a8": {"dtype": "float32", "model": "ct:W8A8"},
    "ct-fp8": {"dtype": "float32", "model": "ct:FP8_DYNAMIC"},
    # The same schemes quantized at load from that float folder ("hf"), beside the ct rows: like them,
    # without the int8 LM head the GGUF rows get from the shipped file's Q8_0 output tensor.
    "hf-int4-g32": {"dtype": "float32", "quantization": "int4", "quantization_group_size": 32, "model": "hf"},
    "hf-w8a8": {"dtype": "float32", "quantization": "w8a8", "model": "hf"},
    "hf-fp8": {"dtype": "float32", "quantization": "fp8", "model": "hf"},
}
SPEED_DTYPE = {"fp32": "float32"}  # every other row: --dtype auto's choice (bfloat16 on AVX-512 BF16 CPUs)
# Speed-only row: int8 weights widened to the model dtype on every call, then F.linear.
UNFUSED_INT8 = "int8-unfused"
LLAMACPP_FILES = ("Q4_1", "Q8_0", "Q4_0")


def scheme_model(kwargs: dict) -> tuple[str | None, dict]:
    """(model path, engine kwargs) of a scheme: its "model" names a llama.cpp-quantized GGUF, the
    model's float Hugging Face folder ("hf"), or ("ct:...") a compressed-tensors export of it."""
    kwargs = dict(kwargs)
    qtype = kwargs.pop("model", None)
    if qtype == "hf":
        return default_hf_folder(), kwargs
    if qtype and qtype.startswith(("ct:", "ct-twin:")):
        kind, preset, *group = qtype.split(":")
        return compressed_folder(default_hf_folder(), preset, int(group[0]) if group else None,
                                 twin=kind == "ct-twin"), kwargs
    return (llamacpp_quantized_gguf(resolve_model(None).path, qtype) if qtype else None), kwargs


def weight_bytes(llm: LLM) -> int:
    """Bytes of all weights as kept in memory: parameters, and the buffers of linear layers and of the
    embedding and LM head (their quantized weights), each tensor once; rotary tables are not weights."""
    model = llm.llm_engine.executor.runner.model
    linear_buffers = [b for m in model.modules() if hasattr(m, "quant_method") or hasattr(m, "quant_codes")
                      for b in m.buffers(recurse=False)]
    seen = {id(t): t for t in [*model.parameters(), *linear_buffers]}
    return sum(t.numel() * t.element_size() for t in seen.values())


def measure(label: str, kwargs: dict, args) -> dict:
    model, kwargs = scheme_model(kwargs)
    t0 = time.perf_counter()
    llm = LLM(model, max_model_len=4097, enable_prefix_caching=False, **kwargs)
    load_s = time.perf_counter() - t0
    row: dict = {"scheme": label, "load_s": load_s, "weight_mib": weight_bytes(llm) / 2**20}
    r512 = perplexity(ctx=512, chunks=args.chunks512, progress=False, llm=llm)
    row.update(ppl512=r512.ppl, ppl512_err=r512.stderr, ppl512_tok_s=r512.tokens_per_s)
    if args.chunks4096:
        r4k = perplexity(ctx=4096, chunks=args.chunks4096, progress=False, llm=llm)
        row.update(ppl4096=r4k.ppl, ppl4096_err=r4k.stderr)
    print(json.dumps(row), flush=True)
    del llm
    return row


def speed(label: str, kwargs: dict, args, workload: str) -> dict:
    """Decode tok/s of one request (median of --decode-iters, after one warm-up) and output tok/s of
    the workload, one fresh engine each, in this process."""
    model, kwargs = scheme_model(kwargs)
    kwargs = {**kwargs, "dtype": SPEED_DTYPE.get(label) or resolve_dtype("auto")}
    patch = contextlib.nullcontext()
    if label == UNFUSED_INT8:
        from pagedllm.quantization import kernels as K
        from pagedllm.quantization.methods import Int8LinearMethod, _PerChannel

        def unfused(self, layer, x, bias):  # noqa: ANN001, ANN202
            y = K.int8_dequant_linear(x, layer.qweight, layer.wscale)
            return y if bias is None else y + bias

        kwargs["quantization"] = "int8"
        # int8 codes [N, K] and scales [N] (not the native kernel's tiles), widened on every call
        patch = contextlib.ExitStack()
        patch.enter_context(mock.patch.object(Int8LinearMethod, "apply", unfused))
        patch.enter_context(mock.patch.object(Int8LinearMethod, "quantize", _PerChannel.quantize))
    row: dict = {"scheme": label, "speed_dtype": kwargs["dtype"]}
    with patch:
        lat = run_latency(model, kwargs, args.input_len, args.decode_tokens, args.decode_iters, 1)
        row.update(decode_tok_s=lat["decode_tokens_per_s"], decode_ms_per_token=lat["decode_ms_per_token"],
                   prefill_ms=lat["prefill_ms"])
        gc.collect()
        if args.throughput_schemes and label not in args.throughput_schemes.split(","):
            print(json.dumps(row), flush=True)
            return row
        tp = run_pagedllm({"model": model, "engine_args": kwargs, "workload": workload, "sampling": GREEDY})
        row.update(throughput_tok_s=tp["output_tokens"] / tp["elapsed_s"],
                   throughput_total_tok_s=(tp["prompt_tokens"] + tp["output_tokens"]) / tp["elapsed_s"],
                   throughput_s=tp["elapsed_s"])
        gc.collect()
    print(json.dumps(row), flush=True)
    return row


def llamacpp_speed(qtype: str, args) -> dict:
    """llama.cpp's decode on a GGUF of the default model, the prompt and threads of the pagedllm rows."""
    src = resolve_model(None).path
    path = src if qtype == "Q4_1" else llamacpp_quantized_gguf(src, qtype)
    r = run_llamacpp_latency(None, "float32", args.input_len, args.decode_tokens, args.decode_iters, 1, 0, None,
                             args.threads, gguf_path=path)
    row = {"scheme": f"llama.cpp {qtype.lower()}", "decode_tok_s": r["decode_tokens_per_s"],
           "decode_ms_per_token": r["decode_ms_per_token"], "prefill_ms": r["prefill_ms"],
           "llama_cpp_version": r.get("llama_cpp_version")}
    print(json.dumps(row), flush=True)
    return row


def speed_run(args, save) -> dict:
    reqs = random_workload(args.num_prompts, tuple(map(int, args.input_len_range.split(":"))),
                           tuple(map(int, args.output_len_range.split(":"))), vocab_info(None), 0)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="pagedllm-quant-") as tmp:
        path = str(Path(tmp) / "workload.json")
        dump_workload(reqs, path)
        for label in args.schemes.split(","):
            if label.startswith("llama.cpp-"):  # a peer row, in the order given
                rows.append(llamacpp_speed(label.removeprefix("llama.cpp-").upper(), args))
            else:
                rows.append(speed(label, SCHEMES.get(label, {}), args, path))
            save({"rows": rows})  # what is measured so far survives an interrupted run
    by = {r["scheme"]: r for r in rows}
    ratios = {}
    for ours, peer in (("int4-g32", "llama.cpp q4_0"), ("gguf-q4_0", "llama.cpp q4_0"),
                       ("gguf-q4_1", "llama.cpp q4_1"), ("gguf-q8_0", "llama.cpp q8_0")):
        if ours in by and peer in by:
            ratios[f"{ours} / {peer} decode"] = by[ours]["decode_tok_s"] / by[peer]["decode_tok_s"]
    if "w8a8" in by and UNFUSED_INT8 in by:
        ratios["w8a8 / int8-unfused throughput"] = by["w8a8"]["throughput_tok_s"] / by[UNFUSED_INT8]["throughput_tok_s"]
    if "w8a8" in by and "int8" in by:
        ratios["w8a8 / int8 throughput"] = by["w8a8"]["throughput_tok_s"] / by["int8"]["throughput_tok_s"]
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x", flush=True)
    return {"workload": workload_summary(reqs) | {"input_len_range": args.input_len_range,
                                                  "output_len_range": args.output_len_range},
            "ratios": ratios, "rows": rows}


def peer(args, qtype: str) -> dict:
    """llama.cpp's perplexity on a GGUF of the default model (the shipped Q4_1, or llama.cpp's own
    Q8_0/Q4_0 of it) on the windows pagedllm scores."""
    tok = LLM(max_model_len=4097).get_tokenizer().hf
    tokens = tok.encode(default_corpus().read_text(encoding="utf-8"), add_special_tokens=False)
    bos = wants_bos(tok)
    src = resolve_model(None).path
    path = src if qtype == "Q4_1" else llamacpp_quantized_gguf(src, qtype)
    w512 = windows_of(tokens, 512, bos, args.chunks512)
    p = llamacpp_perplexity(path, w512, threads=args.threads)
    s = summarize(p["nlls"], 512, p["seconds"])
    row = {"scheme": f"llama.cpp {qtype.lower()}", "ppl512": s.ppl, "ppl512_err": s.stderr,
           "ppl512_tok_s": s.tokens_per_s}
    if args.peer4096:
        w4k = windows_of(tokens, 4096, bos, args.chunks4096)
        s4 = summarize(llamacpp_perplexity(path, w4k, threads=args.threads)["nlls"], 4096, 1.0)
        row.update(ppl4096=s4.ppl, ppl4096_err=s4.stderr)
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = parser(__doc__, prog)
    ap.add_argument("--schemes", default=",".join(SCHEMES),
                    help="comma-separated rows, in order; with --speed also llama.cpp-q4_1, llama.cpp-q8_0, "
                         "llama.cpp-q4_0 (llama.cpp's decode on that GGUF); default: every row")
    ap.add_argument("--chunks512", type=int, default=4)
    ap.add_argument("--chunks4096", type=int, default=1)
    ap.add_argument("--speed", action="store_true",
                    help="decode and throughput per scheme (and llama.cpp's decode) instead of perplexity")
    ap.add_argument("--decode-tokens", type=int, default=32, help="speed: tokens of the timed request")
    ap.add_argument("--decode-iters", type=int, default=2, help="speed: timed requests (median), after one warm-up")
    ap.add_argument("--input-len", type=int, default=128, help="speed: prompt tokens of the timed request")
    ap.add_argument("--num-prompts", type=int, default=128, help="speed: requests of the throughput workload")
    ap.add_argument("--throughput-schemes", default=None,
                    help="speed: the rows whose throughput is measured (default: every pagedllm row)")
    ap.add_argument("--input-len-range", default="32:512")
    ap.add_argument("--output-len-range", default="16:256")
    ap.add_argument("--peer", action=argparse.BooleanOptionalAction, default=True, help="run llama.cpp too")
    ap.add_argument("--peer4096", action="store_true", help="also llama.cpp's perplexity at ctx 4096")
    ap.add_argument("--peer-files", default="Q4_1",
                    help="quality: llama.cpp's perplexity on these GGUFs of the model (Q4_1 shipped; Q8_0, Q4_0 "
                         "written by llama.cpp's quantizer)")
    ap.add_argument("--ppl-only", action="store_true", help="(the default without --speed; kept for old commands)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None,
                    help="default: benchmarks/results/quantization_speed.json with --speed, else quantization_ppl.json")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    meta = run_metadata()  # the run's command, CPU, versions and commit, for the report's provenance
    if args.speed:
        if args.schemes == ",".join(SCHEMES):
            peers = [f"llama.cpp-{q.lower()}" for q in LLAMACPP_FILES] if args.peer else []
            args.schemes = ",".join([*peers, *SCHEMES, UNFUSED_INT8])
        out = Path(args.out or "benchmarks/results/quantization_speed.json")

        def save(report: dict) -> None:
            out.write_text(json.dumps({"meta": meta, "args": vars(args), "load_avg_at_end": list(os.getloadavg()),
                                       **report},
                                      indent=1))

        save(speed_run(args, save))
        return
    args.out = args.out or "benchmarks/results/quantization_ppl.json"
    rows = [peer(args, q) for q in args.peer_files.split(",")] if args.peer else []
    for label in [] if args.schemes == "none" else args.schemes.split(","):  # none: the peer's rows only
        rows.append(measure(label, SCHEMES[label], args))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
