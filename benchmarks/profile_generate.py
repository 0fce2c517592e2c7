"""Where the time of offline generation goes: torch.profiler over a throughput-like workload.

Usage: .venv/bin/python benchmarks/profile_generate.py [DTYPE]   (default bfloat16)
Ops called outside torch (the native attention kernel through ctypes, Python) are the wall time
that the table does not account for."""
import sys
import time

import numpy as np
from pagedllm import LLM, SamplingParams
rng = np.random.default_rng(0)
llm = LLM(dtype=sys.argv[1] if len(sys.argv) > 1 else "bfloat16", kv_cache_memory="1GiB")
prompts = [{"prompt_token_ids": rng.integers(100, 40000, int(n)).tolist()} for n in rng.integers(32, 512, 32)]
outs = [int(n) for n in rng.integers(16, 256, 32)]
params = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for o in outs]
llm.generate(prompts[:2], params[:2], use_tqdm=False)
from torch.profiler import profile, ProfilerActivity
t0 = time.perf_counter()
with profile(activities=[ProfilerActivity.CPU]) as prof:
    llm.generate(prompts, params, use_tqdm=False)
el = time.perf_counter() - t0
print(f"elapsed {el:.1f}s, out tok/s {sum(outs)/el:.1f}")
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=40))
