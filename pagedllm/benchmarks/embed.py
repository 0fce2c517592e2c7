"""Embedding throughput: pagedllm's `LLM.embed` against sentence-transformers' `encode` on the same
texts in the same run (texts/s, both after a warm-up pass), with the ratio and the smallest
per-text cosine similarity between the two. Default model: the packaged all-MiniLM-L6-v2.

sentence-transformers encodes in batches of `--batch-size` padded texts (its default, 32);
pagedllm takes every text at once and batches them by its token budget (`--max-num-batched-tokens`).
"""

from __future__ import annotations

import json
import random
import time
from typing import Any

from pagedllm.benchmarks.env import run_metadata
from pagedllm.benchmarks.script import parser

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


def run_embed(args: Any) -> dict[str, Any]:
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
    return {
        "meta": run_metadata({"sentence-transformers": _st_version()}),
        "config": {k: v for k, v in vars(args).items() if k != "output_json"},
        "prompt_tokens": tokens,
        "pagedllm_texts_per_s": len(texts) / t_ours,
        "sentence_transformers_texts_per_s": len(texts) / t_st,
        "ratio": t_st / t_ours,
        "min_cosine": float(cos.min()),
        "torch_threads": torch.get_num_threads(),
    }


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
    ap.add_argument("--output-json", default=None, help="write the report here")
    args = ap.parse_args(argv)
    report = run_embed(args)
    print(f"{args.num_texts} texts, {report['prompt_tokens']} tokens: pagedllm {report['pagedllm_texts_per_s']:.1f} "
          f"texts/s ({args.dtype}), sentence-transformers {report['sentence_transformers_texts_per_s']:.1f} texts/s "
          f"(float32, batch {args.batch_size}): {report['ratio']:.2f}x; smallest cosine {report['min_cosine']:.6f}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
