"""Where one request's decode step goes: per-part time of single-stream decode steps, with the
fused LM head on and off, interleaved in one run.

usage: pagedllm bench single-stream [--dtype bfloat16] [--input-len 32]
                                               [--output-len 128] [--rounds 3] [--output-json PATH]

Each round runs one greedy request (random prompt, ignore_eos) through LLMEngine.step() once per
variant: `head` (the native decode call runs on to the LM head and the argmax) and `no-head` (the
call ends at the final norm; the LM head and the sampler run in torch). Every decode step (all but
the first) is timed whole and in parts, by wrapping the functions that do them; `other` is the
step minus its parts (Python glue between them). Reported: the fastest and the median
microseconds per step and part (the fastest is the least disturbed by other load on the machine).
"""

from __future__ import annotations

import functools
import json
import time
from collections import defaultdict
from typing import Any

import numpy as np
from pagedllm.benchmarks.env import command_line
from pagedllm.benchmarks.script import parser

# part -> (module, class, method)
PARTS = {
    "schedule": ("pagedllm.core.scheduler", "Scheduler", "schedule"),
    "update_states": ("pagedllm.worker.model_runner", "ModelRunner", "_update_states"),
    "prepare": ("pagedllm.worker.input_batch", "InputBatch", "prepare"),
    "native_head": ("pagedllm.worker.native_decode", "NativeDecode", "run_head"),
    "native_step": ("pagedllm.worker.native_decode", "NativeDecode", "run"),
    "lm_head": ("pagedllm.models.llama", "LlamaForCausalLM", "compute_logits"),
    "sampling_metadata": ("pagedllm.worker.model_runner", "ModelRunner", "_sampling_metadata"),
    "sampler": ("pagedllm.worker.sample.sampler", "Sampler", "forward"),
    "update_from_output": ("pagedllm.core.scheduler", "Scheduler", "update_from_output"),
    "process_outputs": ("pagedllm.engine.output_processor", "OutputProcessor", "process_outputs"),
}
current: dict[str, int] = defaultdict(int)
depth = {"n": 0}


def _wrap(part: str, owner: Any, attr: str) -> None:
    fn = getattr(owner, attr)

    @functools.wraps(fn)
    def timed(*a: Any, **k: Any) -> Any:
        # Only the outermost timed part counts (the metadata also runs inside the head check).
        depth["n"] += 1
        t0 = time.perf_counter_ns()
        try:
            return fn(*a, **k)
        finally:
            depth["n"] -= 1
            if depth["n"] == 0:
                current[part] += time.perf_counter_ns() - t0

    setattr(owner, attr, timed)


def install() -> None:
    import importlib

    for part, (mod, cls, attr) in PARTS.items():
        _wrap(part, getattr(importlib.import_module(mod), cls), attr)


def run_request(engine: Any, prompt: list[int], output_len: int, rid: str) -> list[dict[str, int]]:
    from pagedllm.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    steps = []
    while engine.has_unfinished_requests():
        current.clear()
        t0 = time.perf_counter_ns()
        engine.step()
        parts = dict(current)
        parts["step"] = time.perf_counter_ns() - t0
        steps.append(parts)
    return steps[1:]


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = parser(__doc__, prog)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--output-json")
    args = ap.parse_args(argv)
    install()
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(dtype=args.dtype, enable_prefix_caching=False,
                                                   kv_cache_memory="1GiB"))
    paths = engine.executor.runner.paths
    head = paths.native_head
    variants: dict[str, Any] = {"head": head, "no-head": None}  # without the head path: native_decode runs
    prompt = np.random.default_rng(0).integers(100, 40000, args.input_len).tolist()
    run_request(engine, prompt, 8, "warmup")
    steps: dict[str, list[dict[str, int]]] = defaultdict(list)
    for r in range(args.rounds):
        for name, path in variants.items():
            paths.native_head = path
            steps[name] += run_request(engine, prompt, args.output_len, f"{name}-{r}")
    paths.native_head = head
    result, fastest = {}, {}
    for name, rows in steps.items():
        keys = ["step", *(p for p in PARTS if any(p in s for s in rows))]
        med = {k: float(np.median([s.get(k, 0) for s in rows])) / 1e3 for k in keys}
        best = {k: float(np.min([s.get(k, 0) for s in rows])) / 1e3 for k in keys}
        fastest[name] = best
        print(f"{name:8s} min " + " ".join(f"{k}={v:.0f}" for k, v in best.items()))
        med["other"] = float(np.median([s["step"] - sum(v for k, v in s.items() if k != "step") for s in rows])) / 1e3
        result[name] = med
        print(f"{name:8s} " + " ".join(f"{k}={v:.0f}" for k, v in med.items()), flush=True)
    print(f"step ratio no-head / head: {result['no-head']['step'] / result['head']['step']:.3f}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"command": command_line(), "us_per_decode_step_median": result,
                       "us_per_decode_step_min": fastest}, f, indent=1)


if __name__ == "__main__":
    raise SystemExit(main())
