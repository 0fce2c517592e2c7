"""KV memory of one long request with sliding-window layer groups against the same cache keeping
every block (--disable-hybrid-kv-cache-manager): the request's prompt of --context tokens is
computed in chunks of --max-num-batched-tokens, then --max-tokens tokens are decoded. Reported per
mode: the blocks the request holds and their bytes (the engine's own bytes per block) once the
prompt is computed (what a decoding request keeps) and at the peak (right after a step's
allocation, before the window groups give back what the step's queries no longer read), and the
ratio of the two modes.

usage: .venv/bin/pagedllm bench kv-window [--model gemma-3-270m] [--context 8192] [--dtype bfloat16]
"""

from __future__ import annotations

import json
import random
import time

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.script import parser


def measure(args, disable: bool) -> dict[str, float]:
    llm = LLM(args.model, dtype=args.dtype, block_size=args.block_size, max_model_len=args.context + args.max_tokens,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False,
              disable_hybrid_kv_cache_manager=disable, kv_cache_memory=args.kv_cache_memory)
    engine = llm.llm_engine
    kv = engine.scheduler.kv
    block_bytes = engine.core.memory_bound.kv_cache / kv.num_blocks
    peak = 0
    allocate = kv.allocate_slots

    def tracked(request, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        nonlocal peak
        out = allocate(request, *a, **kw)
        peak = max(peak, kv.num_held_blocks(request.request_id))
        return out

    kv.allocate_slots = tracked  # type: ignore[method-assign]
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    prompt = [rng.randrange(100, vocab - 100) for _ in range(args.context)]
    engine.add_request("long", {"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True))
    after_prompt = 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        req = engine.scheduler.requests.get("long")
        if req is not None and req.num_computed_tokens >= args.context and not after_prompt:
            after_prompt = kv.num_held_blocks("long")
    return {"groups": kv.groups.describe(), "block_bytes": block_bytes, "blocks_after_prompt": after_prompt,
            "bytes_after_prompt": after_prompt * block_bytes, "peak_blocks": peak, "peak_bytes": peak * block_bytes,
            "seconds": time.perf_counter() - t0}


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = parser(__doc__, prog)
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-cache-memory", type=int, default=1 << 30)
    ap.add_argument("--output-json")
    args = ap.parse_args(argv)
    result = {"window_groups": measure(args, False), "every_block_kept": measure(args, True)}
    mib = 1 << 20
    for name, r in result.items():
        print(f"{name:18s} {r['groups']}: after the prompt {r['blocks_after_prompt']} blocks = "
              f"{r['bytes_after_prompt'] / mib:.1f} MiB, peak {r['peak_blocks']} blocks = {r['peak_bytes'] / mib:.1f} MiB "
              f"({r['seconds']:.1f} s)")
    w, k = result["window_groups"], result["every_block_kept"]
    result["ratio_after_prompt"] = w["bytes_after_prompt"] / k["bytes_after_prompt"]
    result["ratio_peak"] = w["peak_bytes"] / k["peak_bytes"]
    print(f"window groups / every block kept: {result['ratio_after_prompt']:.3f}x after the prompt, "
          f"{result['ratio_peak']:.3f}x at the peak ({args.context} tokens, chunks of {args.max_num_batched_tokens})")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), **result}, f, indent=2)
