"""Embedding throughput: pagedllm's `LLM.embed` against sentence-transformers' `encode` and vLLM's
CPU build (`LLM.embed`, runner "pooling") on the same texts in the same run (texts/s, each after a
warm-up pass), with the ratios and the smallest per-text cosine similarity of each against
pagedllm. Default model: the packaged all-MiniLM-L6-v2.

sentence-transformers encodes in batches of `--batch-size` padded texts (its default, 32);
pagedllm and vLLM take every text at once and batch them by the same token budget
(`--max-num-batched-tokens`), in the same dtype (`--dtype`). vLLM runs in its own process under the
peers' python (`--peers-venv`); where it cannot run, its row says why and the others stand.
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pagedllm.benchmarks.env import run_metadata
from pagedllm.benchmarks.script import parser
from pagedllm.benchmarks.throughput import BackendUnavailable, _failure_reason, peers_python, run_child

_WORDS = ("the model serves embeddings for retrieval with a paged cache and continuous batching of many "
          "short and long texts about cities rivers science music history food travel and software").split()


def make_texts(n: int, seed: int, min_words: int, max_words: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(min_words, max_words))).capitalize() + "."
            for _ in range(n)]


def _st_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sentence-transformers")
    except PackageNotFoundError:
        return None


def run_vllm(args: Any, folder: str, texts: list[str]) -> dict[str, Any]:
    """vLLM's run in its own process (embed_vllm_worker.py under the peers' python): its times and
    embeddings; BackendUnavailable with the reason where it cannot run."""
    env = dict(os.environ)
    env["VLLM_CPU_KVCACHE_SPACE"] = str(args.vllm_kv_cache_space)
    env.pop("PYTHONPATH", None)
    cmd = [str(peers_python(args.peers_venv)), str(Path(__file__).with_name("embed_vllm_worker.py"))]
    with tempfile.TemporaryDirectory(prefix="pagedllm-bench-") as workdir:
        path = Path(workdir) / "texts.json"
        path.write_text(json.dumps(texts))
        spec = {"backend": "vllm", "tag": "embed-vllm", "texts": str(path), "hf_model_dir": folder,
                "dtype": args.dtype, "warmup": args.batch_size, "max_num_batched_tokens": args.max_num_batched_tokens,
                "gpu_memory_utilization": args.vllm_gpu_memory_utilization}
        print("--- vllm: starting ---", file=sys.stderr, flush=True)
        run = run_child(cmd, env, spec, workdir, args.timeout)
    if "elapsed_s" not in run.result:  # written before vLLM's teardown, which may abort (embed_vllm_worker.py)
        raise BackendUnavailable(_failure_reason("vllm", run))
    return {**run.result, "exit_code": run.returncode}


def run_embed(args: Any) -> dict[str, Any]:
    import gc

    import torch
    from sentence_transformers import SentenceTransformer

    from pagedllm import LLM

    texts = make_texts(args.num_texts, args.seed, args.min_words, args.max_words)
    llm = LLM(args.model, dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens,
              kv_cache_memory="256MiB")
    st = SentenceTransformer(llm.llm_engine.model_config.path, device="cpu")
    llm.embed(texts[: args.batch_size], use_tqdm=False)  # warm-up: kernels, allocator
    st.encode(texts[: args.batch_size], batch_size=args.batch_size)
    t0 = time.perf_counter()
    ours = llm.embed(texts, use_tqdm=False)
    t_ours = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref = st.encode(texts, batch_size=args.batch_size, convert_to_tensor=True)
    t_st = time.perf_counter() - t0
    emb = torch.tensor([o.outputs.embedding for o in ours])
    cos = torch.nn.functional.cosine_similarity(emb, ref.float(), dim=1)
    tokens = sum(len(o.prompt_token_ids) for o in ours)
    folder = llm.llm_engine.model_config.path
    del llm, st  # vLLM's process starts with this one's model memory given back
    gc.collect()
    report: dict[str, Any] = {
        "meta": run_metadata({"sentence-transformers": _st_version()}),
        "config": {k: v for k, v in vars(args).items() if k != "output_json"},
        "prompt_tokens": tokens,
        "pagedllm_texts_per_s": len(texts) / t_ours,
        "sentence_transformers_texts_per_s": len(texts) / t_st,
        "ratio": t_st / t_ours,
        "min_cosine": float(cos.min()),
        "torch_threads": torch.get_num_threads(),
    }
    if args.vllm:
        try:
            v = run_vllm(args, folder, texts)
        except BackendUnavailable as exc:
            print(f"--- vllm: skipped: {exc}", file=sys.stderr, flush=True)
            report["vllm"] = {"ok": False, "reason": str(exc)}
        else:
            vcos = torch.nn.functional.cosine_similarity(emb, torch.tensor(v["embeddings"]), dim=1)
            report["meta"]["versions"]["vllm"] = v["vllm_version"]
            report["vllm"] = {"ok": True, "dtype": v["dtype"], "load_s": v["load_s"], "prompt_tokens": v["prompt_tokens"],
                              "texts_per_s": len(texts) / v["elapsed_s"], "ratio": v["elapsed_s"] / t_ours,
                              "min_cosine": float(vcos.min()), "exit_code": v["exit_code"]}
    return report


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    """`pagedllm bench embed`: flags, the run, a line of figures, the JSON report."""
    ap = parser(__doc__, prog)
    ap.add_argument("--model", default="all-minilm-l6-v2", help="a sentence-transformers model pagedllm serves")
    ap.add_argument("--num-texts", type=int, default=1024)
    ap.add_argument("--min-words", type=int, default=8)
    ap.add_argument("--max-words", type=int, default=48)
    ap.add_argument("--batch-size", type=int, default=32, help="sentence-transformers' encode batch size")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048, help="pagedllm's step budget")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="pagedllm's dtype")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-vllm", dest="vllm", action="store_false", help="leave vLLM's CPU build out")
    ap.add_argument("--peers-venv", default=None, help="vLLM's environment (default: .venv-peers)")
    ap.add_argument("--vllm-kv-cache-space", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE in GiB")
    ap.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.1,
                    help="vLLM's memory reservation, a fraction of the host's memory that must be free")
    ap.add_argument("--timeout", type=float, default=900, help="seconds vLLM's process may take")
    ap.add_argument("--output-json", default=None, help="write the report here")
    args = ap.parse_args(argv)
    if not 0 < args.vllm_gpu_memory_utilization <= 1:
        ap.error(f"--vllm-gpu-memory-utilization must be in (0, 1]: {args.vllm_gpu_memory_utilization}")
    if args.vllm_kv_cache_space < 1:
        ap.error(f"--vllm-kv-cache-space must be at least 1 GiB: {args.vllm_kv_cache_space}")
    report = run_embed(args)
    print(f"{args.num_texts} texts, {report['prompt_tokens']} tokens: pagedllm {report['pagedllm_texts_per_s']:.1f} "
          f"texts/s ({args.dtype}), sentence-transformers {report['sentence_transformers_texts_per_s']:.1f} texts/s "
          f"(float32, batch {args.batch_size}): {report['ratio']:.2f}x; smallest cosine {report['min_cosine']:.6f}")
    v = report.get("vllm")
    if v and v["ok"]:
        print(f"vLLM {v['texts_per_s']:.1f} texts/s ({v['dtype']}, same texts and token budget): pagedllm "
              f"{v['ratio']:.2f}x; smallest cosine {v['min_cosine']:.6f}")
    elif v:
        print(f"vLLM: skipped: {v['reason']}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
