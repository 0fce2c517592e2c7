"""Embeddings mixed into a generation load: the mean time per output token (TPOT) of generation
requests arriving at a fixed rate, alone and with a stream of embedding requests on the same
engine, and the ratio of the two. A generate-runner decoder answers both kinds (LAST pooling over
its final hidden states), scheduled in one token budget, so the embedding prompts' prefill shares
the generation's steps.

Both phases replay the same arrivals (Poisson, seeded) of the same prompts; the embedding phase adds
embedding requests at `--embed-rate` per second. Phases alternate for `--rounds` rounds (alone,
mixed, alone, mixed, ...) so that a shared host's drift falls on both; the reported TPOT is the
mean over rounds of each phase's mean over its requests. A request's TPOT is (its last token's
time - its first token's time) / (its output tokens - 1).
"""

from __future__ import annotations

import random
import time
from typing import Any

from pagedllm.benchmarks.embed import make_texts
from pagedllm.benchmarks.env import run_metadata
from pagedllm.benchmarks.gpu_check import write_json
from pagedllm.benchmarks.script import parser


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each of n requests arrives (Poisson at `rate` per second)."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def run_phase(engine: Any, gen: list[tuple[float, str]], emb: list[tuple[float, str]], sampling: Any,
              tag: str) -> dict[str, Any]:
    """Replays the arrivals on `engine` (stepped here, in one thread) until every request is done."""
    from pagedllm.pooling_params import PoolingParams

    queue = sorted([(t, "g", i, p) for i, (t, p) in enumerate(gen)] + [(t, "e", i, p) for i, (t, p) in enumerate(emb)])
    first: dict[str, float] = {}
    done: dict[str, tuple[float, int]] = {}
    emb_latency: list[float] = []
    arrived: dict[str, float] = {}
    t0 = time.perf_counter()
    k = 0
    while k < len(queue) or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while k < len(queue) and queue[k][0] <= now:
            _, kind, i, prompt = queue[k]
            rid = f"{tag}-{kind}{i}"
            arrived[rid] = t0 + queue[k][0]
            engine.add_request(rid, prompt, sampling if kind == "g" else PoolingParams(task="embed"))
            k += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, queue[k][0] - (time.perf_counter() - t0)))
            continue
        outs = engine.step()
        t = time.perf_counter()
        for o in outs:
            rid = o.request_id
            if rid.startswith(f"{tag}-g"):
                n = len(o.outputs[0].token_ids)
                if n and rid not in first:
                    first[rid] = t
                if o.finished:
                    done[rid] = (t, n)
            elif o.finished:
                emb_latency.append(t - arrived[rid])
    tpots = [(end - first[rid]) / (n - 1) for rid, (end, n) in done.items() if n > 1]
    return {
        "generation_requests": len(done),
        "embedding_requests": len(emb_latency),
        "mean_tpot_ms": 1000 * sum(tpots) / len(tpots),
        "mean_embedding_latency_ms": 1000 * sum(emb_latency) / len(emb_latency) if emb_latency else None,
        "wall_s": time.perf_counter() - t0,
    }


def run_embed_mixed(args: Any) -> dict[str, Any]:
    import torch

    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.sampling_params import SamplingParams

    engine = LLMEngine.from_engine_args(EngineArgs(model=args.model, dtype=args.dtype,
                                                   kv_cache_memory=args.kv_cache_memory,
                                                   max_num_batched_tokens=args.max_num_batched_tokens))
    if engine.model_config.runner != "generate":
        raise ValueError(f"{args.model} runs with runner {engine.model_config.runner!r}: the mixed load needs a "
                         "generation model")
    sampling = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    prompts = make_texts(args.num_requests, args.seed, args.prompt_words, args.prompt_words)
    gen_at = arrivals(args.num_requests, args.request_rate, args.seed)
    span = gen_at[-1]  # embeddings arrive while generation requests do
    emb_at = [t for t in arrivals(int(args.embed_rate * span * 2) + 4, args.embed_rate, args.seed + 2) if t <= span]
    texts = make_texts(len(emb_at), args.seed + 1, args.embed_min_words, args.embed_max_words)
    gen = list(zip(gen_at, prompts))
    emb = list(zip(emb_at, texts))
    run_phase(engine, gen[:4], emb[:4], sampling, "warmup")  # kernels, allocator, both paths
    rounds = []
    for r in range(args.rounds):
        alone = run_phase(engine, gen, [], sampling, f"r{r}a")
        mixed = run_phase(engine, gen, emb, sampling, f"r{r}m")
        rounds.append({"alone": alone, "mixed": mixed, "ratio": mixed["mean_tpot_ms"] / alone["mean_tpot_ms"]})
        print(f"round {r}: TPOT alone {alone['mean_tpot_ms']:.2f} ms, with embeddings "
              f"{mixed['mean_tpot_ms']:.2f} ms ({rounds[-1]['ratio']:.3f}x)", flush=True)
    alone_ms = sum(x["alone"]["mean_tpot_ms"] for x in rounds) / len(rounds)
    mixed_ms = sum(x["mixed"]["mean_tpot_ms"] for x in rounds) / len(rounds)
    return {
        "meta": run_metadata(),
        "config": {k: v for k, v in vars(args).items() if k != "output_json"},
        "embedding_requests_per_phase": len(emb),
        "embedding_prompt_tokens_mean": sum(len(engine.tokenize_prompt(t)[1]) for _, t in emb) / max(len(emb), 1),
        "rounds": rounds,
        "mean_tpot_alone_ms": alone_ms,
        "mean_tpot_mixed_ms": mixed_ms,
        "ratio": mixed_ms / alone_ms,
        "torch_threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    """`pagedllm bench embed-mixed`: flags, the run, the figures, the JSON report."""
    ap = parser(__doc__, prog)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a generation model (its decoder embeds)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-cache-memory", default="512MiB")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--num-requests", type=int, default=32, help="generation requests per phase")
    ap.add_argument("--request-rate", type=float, default=2.0, help="generation requests per second")
    ap.add_argument("--prompt-words", type=int, default=48, help="words in each generation prompt")
    ap.add_argument("--output-len", type=int, default=32, help="tokens each generation request produces")
    ap.add_argument("--embed-rate", type=float, default=4.0, help="embedding requests per second (mixed phase)")
    ap.add_argument("--embed-min-words", type=int, default=8)
    ap.add_argument("--embed-max-words", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2, help="alone/mixed phase pairs, alternated")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-json", default=None, help="write the report here")
    args = ap.parse_args(argv)
    for name in ("num_requests", "rounds", "output_len"):
        if getattr(args, name) < (2 if name == "output_len" else 1):
            ap.error(f"--{name.replace('_', '-')} is too small: {getattr(args, name)}")
    if args.request_rate <= 0 or args.embed_rate <= 0:
        ap.error("--request-rate and --embed-rate must be positive")
    report = run_embed_mixed(args)
    print(f"mean TPOT of the generation requests: {report['mean_tpot_alone_ms']:.2f} ms alone, "
          f"{report['mean_tpot_mixed_ms']:.2f} ms with {report['embedding_requests_per_phase']} embedding requests "
          f"({args.embed_rate}/s) mixed in: {report['ratio']:.3f}x")
    if args.output_json:
        write_json(args.output_json, report)
