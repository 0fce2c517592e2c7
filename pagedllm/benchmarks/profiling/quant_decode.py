"""Where a quantized single-stream decode step's time goes with the fused decode step: the fused
call (embedding, every layer, final norm), the LM head, and the whole engine step (and the same
engine's step with the fused step switched off, alternating), per scheme, on
the default model in bfloat16 (the activation dtype of the quantized kernels); and the LM head as
an int8 weight through the native kernel, as a what-if.

Run: flock /tmp/pagedllm-bench.lock pagedllm bench profile quant-decode [--threads 2] [--schemes int4-g32,int8]
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.env import call_times
from pagedllm.quantization import kernels as K
from pagedllm.quantization import native

from pagedllm.benchmarks.quant.schemes import SCHEMES, scheme_model
from pagedllm.benchmarks.script import parser


def _median_ms(fn, iters: int) -> tuple[float, float]:
    """(median, fastest) of `iters` calls after one warm-up, in ms: on a loaded machine the fastest
    call is the one least disturbed by other work."""
    times = call_times(fn, iters)
    return statistics.median(times) * 1e3, min(times) * 1e3


def profile(label: str, iters: int) -> dict:
    model, kwargs = scheme_model(SCHEMES[label])
    llm = LLM(model, **{**kwargs, "dtype": "bfloat16"}, max_model_len=512, enable_prefix_caching=False)
    runner = llm.llm_engine.core.executor.runner
    nd = runner.native_decode
    row: dict = {"scheme": label, "fused": nd is not None}
    # The whole engine step: a request of 65 output tokens after a 128-token prompt, less one of 1
    # output token (the prompt's step), per decode step.
    prompt = [{"prompt_token_ids": list(range(10, 138))}]

    def request(n: int) -> float:
        sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate(prompt, sp, use_tqdm=False)
        return time.perf_counter() - t0

    request(65)
    # Alternating with the torch path (the fused step switched off on the same engine), so that the
    # machine's load drifts alike for both.
    steps: dict[str, list[float]] = {"fused": [], "torch": []}
    for _ in range(3):
        for path in ("fused", "torch"):
            runner.native_decode = nd if path == "fused" else None
            steps[path].append((request(65) - request(1)) * 1e3 / 64)
    runner.native_decode = nd
    row["engine_step_ms"], row["engine_step_min_ms"] = statistics.median(steps["fused"]), min(steps["fused"])
    row["torch_path_step_ms"], row["torch_path_step_min_ms"] = statistics.median(steps["torch"]), min(steps["torch"])
    hidden = torch.randn(1, runner.model.lm_head.weight.shape[1], dtype=torch.bfloat16)
    row["lm_head_ms"], row["lm_head_min_ms"] = _median_ms(lambda: runner.model.compute_logits(hidden), iters)
    if nd is not None:
        import numpy as np

        ids, pos = np.array([5]), np.array([128])
        slots, table, lens = np.array([128]), np.arange(16, dtype=np.int64)[None], np.array([129])
        row["fused_step_ms"], row["fused_step_min_ms"] = _median_ms(lambda: nd.run(ids, pos, slots, table, lens), iters)
    w = runner.model.lm_head.weight.detach()
    if native.load_quant_kernel() is not None:
        codes, scales = K.quantize_int8_per_channel(w.float())
        packed, s, z = native.pack_int8_native(codes, scales[:, None], torch.zeros(w.shape[0], 1))
        row["lm_head_int8_ms"], row["lm_head_int8_min_ms"] = _median_ms(
            lambda: native.small_m_linear(hidden, packed, s, z, bits=8, n=w.shape[0]), iters)
    row["lm_head_mib"] = w.numel() * w.element_size() / 2**20
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = parser(__doc__, prog)
    ap.add_argument("--schemes", default="int4-g32,int4-g128,int8,gguf-q4_1")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [profile(label, args.iters) for label in args.schemes.split(",")]
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
