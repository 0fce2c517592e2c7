"""Correctness cost of a narrower KV cache: greedy agreement and mean |Δlogprob| of each
--kv-cache-dtype against the model dtype's own cache, on the 64 HF correctness prompts.

usage: pagedllm bench kv-quality [--dtype bfloat16] [--max-tokens 32]
       [--kv-cache-dtypes fp8_e4m3,fp8_e5m2] [--calculate-kv-scales] [--output-json FILE]

For each prompt, both runs decode greedily; the tokens are compared up to the first difference
(agreement = tokens before it / tokens asked); |Δlogprob| is the absolute difference of the
log-probability both runs give to the same chosen token, over the positions where they still agree.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.script import hf_prompts, parser


def generate(dtype: str, kv: str, calc: bool, prompts: list[list[int]], max_tokens: int):
    llm = LLM(dtype=dtype, kv_cache_dtype=kv, calculate_kv_scales=calc, kv_cache_memory=256 << 20,
              max_model_len=512)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(c.token_ids, [d[t].logprob for t, d in zip(c.token_ids, c.logprobs)])
            for c in (o.outputs[0] for o in outs)]


def compare(ref, test, max_tokens: int) -> dict:
    agree, exact, deltas = [], 0, []
    for (rt, rl), (tt, tl) in zip(ref, test):
        n = next((i for i, (a, b) in enumerate(zip(rt, tt)) if a != b), len(rt))
        agree.append(n / max_tokens)
        exact += n == len(rt)
        deltas += [abs(a - b) for a, b in zip(rl[:n], tl[:n])]
    return {"exact_sequences": exact, "num_prompts": len(ref), "mean_agreement": statistics.fmean(agree),
            "mean_abs_delta_logprob": statistics.fmean(deltas) if deltas else 0.0,
            "max_abs_delta_logprob": max(deltas) if deltas else 0.0}


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = parser(__doc__, prog)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-cache-dtypes", default="fp8_e4m3,fp8_e5m2")
    ap.add_argument("--calculate-kv-scales", action="store_true")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    ref_llm = LLM(dtype=args.dtype, kv_cache_memory=64 << 20, max_model_len=512)
    tok = ref_llm.get_tokenizer()
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
               for p in hf_prompts()]
    del ref_llm
    ref = generate(args.dtype, "auto", False, prompts, args.max_tokens)
    rows = []
    for kv in args.kv_cache_dtypes.split(","):
        r = compare(ref, generate(args.dtype, kv, args.calculate_kv_scales, prompts, args.max_tokens),
                    args.max_tokens)
        rows.append({"dtype": args.dtype, "kv_cache_dtype": kv, "calculate_kv_scales": args.calculate_kv_scales, **r})
        print(f"{args.dtype} model, {kv} cache{' (calculated scales)' if args.calculate_kv_scales else ''}: "
              f"{r['exact_sequences']}/{r['num_prompts']} sequences identical over {args.max_tokens} tokens, "
              f"mean agreement {100 * r['mean_agreement']:.1f}%, mean |Δlogprob| {r['mean_abs_delta_logprob']:.4f} "
              f"(max {r['max_abs_delta_logprob']:.3f})", flush=True)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"benchmark": "kv_cache_dtype_quality", "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
