"""Quantization table of docs/quantization.md: per scheme, weight memory, perplexity at ctx 512
and 4096 (llama.cpp's convention, few windows), single-stream decode and batch throughput; the
llama.cpp peer on the same GGUF and windows in the same run.

Run: PAGEDLLM_PEERS_VENV=/work/main/.venv-peers flock /tmp/pagedllm-bench.lock \
     python benchmarks/bench_quantization.py [--chunks512 4] [--chunks4096 1] [--schemes fp32,int8,...]
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.eval.corpus import default_corpus
from pagedllm.eval.llamacpp import llamacpp_perplexity
from pagedllm.eval.perplexity import perplexity, summarize, wants_bos, windows_of
from pagedllm.models.loader import resolve_model

SCHEMES = {
    "fp32": {"dtype": "float32"},
    "bf16": {"dtype": "bfloat16"},
    "int8": {"dtype": "float32", "quantization": "int8"},
    "w8a8": {"dtype": "float32", "quantization": "w8a8"},
    "int4-g32": {"dtype": "float32", "quantization": "int4", "quantization_group_size": 32},
    "int4-g128": {"dtype": "float32", "quantization": "int4", "quantization_group_size": 128},
    "fp8": {"dtype": "float32", "quantization": "fp8"},
    "gguf-q4_1": {"dtype": "float32", "quantization": "gguf"},
    "ffn-int8": {"dtype": "float32", "quantization": "int8", "quantization_skip": "attention"},
    "ffn-int4": {"dtype": "float32", "quantization": "int4", "quantization_skip": "attention"},
}


def weight_bytes(llm: LLM) -> int:
    """Bytes of all weights as kept in memory: parameters, and the buffers of linear layers (their
    quantized weights), each tensor once; rotary tables are not weights."""
    model = llm.llm_engine.executor.runner.model
    linear_buffers = [b for m in model.modules() if hasattr(m, "quant_method") for b in m.buffers(recurse=False)]
    seen = {id(t): t for t in [*model.parameters(), *linear_buffers]}
    return sum(t.numel() * t.element_size() for t in seen.values())


def measure(label: str, kwargs: dict, args) -> dict:
    t0 = time.perf_counter()
    llm = LLM(max_model_len=4097, enable_prefix_caching=False, **kwargs)
    load_s = time.perf_counter() - t0
    row: dict = {"scheme": label, "load_s": load_s, "weight_mib": weight_bytes(llm) / 2**20}
    r512 = perplexity(ctx=512, chunks=args.chunks512, progress=False, llm=llm)
    row.update(ppl512=r512.ppl, ppl512_err=r512.stderr, ppl512_tok_s=r512.tokens_per_s)
    if args.chunks4096:
        r4k = perplexity(ctx=4096, chunks=args.chunks4096, progress=False, llm=llm)
        row.update(ppl4096=r4k.ppl, ppl4096_err=r4k.stderr)
    if args.ppl_only:
        print(json.dumps(row), flush=True)
        return row
    prompt = "Once upon a time, in a small village at the foot of the mountains, there lived"
    sp = SamplingParams(max_tokens=args.decode_tokens, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], sp, use_tqdm=False)  # warm-up
    t = time.perf_counter()
    llm.generate([prompt], sp, use_tqdm=False)
    row["decode_tok_s"] = args.decode_tokens / (time.perf_counter() - t)
    prompts = [f"Tell me one fact about the number {i}." for i in range(args.requests)]
    sp = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    el = time.perf_counter() - t
    row["throughput_tok_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / el
    print(json.dumps(row), flush=True)
    del llm
    return row


def peer(args) -> dict:
    tok = LLM(max_model_len=4097).get_tokenizer().hf
    tokens = tok.encode(default_corpus().read_text(encoding="utf-8"), add_special_tokens=False)
    bos = wants_bos(tok)
    path = resolve_model(None).path
    w512 = windows_of(tokens, 512, bos, args.chunks512)
    p = llamacpp_perplexity(path, w512, threads=args.threads, decode_tokens=args.decode_tokens)
    s = summarize(p["nlls"], 512, p["seconds"])
    row = {"scheme": "llama.cpp q4_1", "ppl512": s.ppl, "ppl512_err": s.stderr, "ppl512_tok_s": s.tokens_per_s,
           "decode_tok_s": p["decode_tok_s"]}
    if args.peer4096:
        w4k = windows_of(tokens, 4096, bos, args.chunks4096)
        s4 = summarize(llamacpp_perplexity(path, w4k, threads=args.threads)["nlls"], 4096, 1.0)
        row.update(ppl4096=s4.ppl, ppl4096_err=s4.stderr)
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--chunks512", type=int, default=4)
    ap.add_argument("--chunks4096", type=int, default=1)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--peer", action=argparse.BooleanOptionalAction, default=True, help="run llama.cpp too")
    ap.add_argument("--peer4096", action="store_true", help="also llama.cpp's perplexity at ctx 4096")
    ap.add_argument("--ppl-only", action="store_true", help="quality only: no decode/throughput timing")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/quantization.json")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    rows = [peer(args)] if args.peer else []
    for label in args.schemes.split(","):
        rows.append(measure(label, SCHEMES[label], args))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
