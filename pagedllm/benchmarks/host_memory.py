"""What huge pages and the tuned C heap change on this host (worker/host_memory.py, utils.tune_heap).

1. Reading a weight-sized tensor (torch.sum) from 4 KiB pages and from huge pages, passes
   interleaved so that the host's drifting memory speed hits both alike.
2. Single-stream decode with the weights on 4 KiB pages and in the huge-page arena: two engines in
   one process, requests alternating between them, each request's median step.
3. A step's temporaries (6 tensors of 24 MiB, written and freed) with glibc's default heap and then
   with the tuned one: minor page faults a step.

usage: .venv/bin/pagedllm bench host-memory [--dtype bfloat16] [--requests 8]
"""

from __future__ import annotations

import random
import statistics
import time

import torch

import pagedllm.worker.model_runner as mr
from pagedllm.benchmarks.env import temporaries_faults
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams
from pagedllm.utils import tune_heap
from pagedllm.worker.host_memory import anonymous_zeros, huge_pages_available
from pagedllm.benchmarks.script import parser


def read_rates(nbytes: int, passes: int) -> dict[str, float]:
    tensors = {}
    for name, huge in (("4 KiB pages", False), ("huge pages", True)):
        t, buf = anonymous_zeros((nbytes // 2,), torch.bfloat16, huge=huge)
        t.fill_(1.0)
        tensors[name] = (t, buf)
    times: dict[str, list[float]] = {name: [] for name in tensors}
    for _ in range(passes):
        for name, (t, _) in tensors.items():
            t0 = time.perf_counter()
            t.sum()
            times[name].append(time.perf_counter() - t0)
    return {name: nbytes / statistics.median(ts) / 1e9 for name, ts in times.items()}


def decode_steps(dtype: str, requests: int) -> dict[str, list[float]]:
    engines = {}
    move = mr.move_weights_to_huge_pages
    for name, placed in (("4 KiB pages", lambda m: None), ("huge pages", move)):
        mr.move_weights_to_huge_pages = placed
        engines[name] = LLMEngine.from_engine_args(EngineArgs(model=None, dtype=dtype, enable_prefix_caching=False))
    mr.move_weights_to_huge_pages = move
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    rng = random.Random(0)
    ids = [rng.randrange(1000, 20000) for _ in range(32)]
    medians: dict[str, list[float]] = {name: [] for name in engines}
    for i in range(requests + 1):
        for name, eng in engines.items():
            eng.add_request(f"r{i}", {"prompt_token_ids": ids}, params)
            steps = []
            while eng.has_unfinished_requests():
                t0 = time.perf_counter()
                eng.step()
                steps.append(time.perf_counter() - t0)
            if i:  # the first request of each engine warms it up
                medians[name].append(statistics.median(steps[1:]))
    return medians


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = parser(__doc__, prog)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--requests", type=int, default=8)
    args = ap.parse_args(argv)
    print(f"transparent huge pages offered: {huge_pages_available()}")
    print("step temporaries, minor faults a step, glibc's default heap:", temporaries_faults(5))
    tune_heap()
    print("step temporaries, minor faults a step, tuned heap:          ", temporaries_faults(5))
    for name, rate in read_rates(270 << 20, 30).items():
        print(f"read 270 MiB from {name}: {rate:.1f} GB/s (median of 30 interleaved passes)")
    for name, ms in decode_steps(args.dtype, args.requests).items():
        per = " ".join(f"{1e3 * x:.2f}" for x in ms)
        print(f"{args.dtype} single-stream step, weights on {name}: {1e3 * statistics.median(ms):.2f} ms "
              f"(median of {len(ms)} requests' median steps: {per})")


if __name__ == "__main__":
    raise SystemExit(main())
