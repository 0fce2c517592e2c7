"""What the KV cache's first writes cost: the throughput workload run several times in one
process, with the time spent in the native KV write and the process's minor page faults per run.
A block's first write faults its pages in; once every block the workload takes has been written,
the writes cost only the copy.

usage: .venv/bin/pagedllm bench kv-first-writes [--dtype bfloat16] [--runs 5]
                                                                   [--no-prefix-caching]
(the `bench throughput` workload: 128 requests, prompts 32-512, outputs 16-256, seed 0; the prefix
cache is reset between runs, so every run computes every prompt).
"""

from __future__ import annotations

import resource
import time

import torch

import pagedllm.attention.torch_backend as tb
from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.workloads import random_workload, vocab_info
from pagedllm.benchmarks.script import parser


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = parser(__doc__, prog)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--no-prefix-caching", action="store_true")
    args = ap.parse_args(argv)
    spent = {"s": 0.0, "calls": 0}
    write = tb.kv_cache_write

    def timed(*a):  # noqa: ANN002, ANN202
        t0 = time.perf_counter()
        try:
            return write(*a)
        finally:
            spent["s"] += time.perf_counter() - t0
            spent["calls"] += 1

    tb.kv_cache_write = timed
    llm = LLM(dtype=args.dtype, enable_prefix_caching=not args.no_prefix_caching)
    reqs = random_workload(128, (32, 512), (16, 256), vocab_info(None), seed=0)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    params = [SamplingParams(max_tokens=r.output_len, temperature=0, ignore_eos=True) for r in reqs]
    out_tokens = sum(r.output_len for r in reqs)
    llm.generate(prompts[:4], params[:4], use_tqdm=False)
    print("| run | output tok/s | KV writes s (calls) | minor faults |\n|---|---|---|---|")
    for i in range(args.runs):
        llm.reset_prefix_cache()
        spent.update(s=0.0, calls=0)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        print(f"| {i + 1} | {out_tokens / wall:.1f} | {spent['s']:.2f} ({spent['calls']}) | {faults} |", flush=True)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
