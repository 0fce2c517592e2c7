"""Where the time of offline generation goes: torch.profiler's table of ops over a throughput-like
workload (32 requests, prompts 32-512 tokens, outputs 16-256, greedy, seed 0).

Ops called outside torch (the native attention kernel through ctypes, Python) are the wall time
that the table does not account for."""

from __future__ import annotations

import time

from pagedllm.benchmarks.script import parser


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = parser(__doc__, prog)
    ap.add_argument("dtype", nargs="?", default="bfloat16", help="model dtype (default bfloat16)")
    args = ap.parse_args(argv)

    import numpy as np
    from torch.profiler import ProfilerActivity, profile

    from pagedllm import LLM, SamplingParams

    rng = np.random.default_rng(0)
    llm = LLM(dtype=args.dtype, kv_cache_memory="1GiB")
    prompts = [{"prompt_token_ids": rng.integers(100, 40000, int(n)).tolist()} for n in rng.integers(32, 512, 32)]
    outs = [int(n) for n in rng.integers(16, 256, 32)]
    params = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for o in outs]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
    el = time.perf_counter() - t0
    print(f"elapsed {el:.1f}s, out tok/s {sum(outs) / el:.1f}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=40))


if __name__ == "__main__":
    raise SystemExit(main())
