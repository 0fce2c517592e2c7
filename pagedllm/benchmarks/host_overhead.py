"""Per-step host time of decode steps: everything but the model's forward pass (and its attention).

usage: pagedllm bench host-overhead [--batch-sizes 1,16,64,128] [--dtype bfloat16]
                                          [--prompt-len 32] [--decode-steps 24] [--output-json PATH]

For each batch size N it runs LLM.generate on N greedy requests (random prompts of --prompt-len
tokens, ignore_eos) and times, with perf_counter, every engine step in which all N requests
decode one token. The parts are timed by wrapping the functions that do them; a part that does
not exist in the code being measured is left out. `host` is the step's wall time minus the model
forward (the forward paths' `run`, or `_forward` in older trees; attention included; a step the
native decode path runs on through the LM head counts its head there) and the torch LM head
(`compute_logits`).
"""

from __future__ import annotations

import functools
import importlib
import json
import time
from collections import defaultdict
from collections.abc import Callable

import numpy as np

from pagedllm.benchmarks.env import call_times, command_line
from pagedllm.benchmarks.script import parser

# part -> "module:Class.method" candidates (the first that exists is wrapped; "module:A.m,B.m"
# wraps each of them, a call nested in another of the part's calls counting once)
PARTS: dict[str, list[str]] = {
    "step": ["pagedllm.engine.llm_engine:LLMEngine.step"],
    "schedule": ["pagedllm.core.scheduler:Scheduler.schedule"],
    "execute_model": ["pagedllm.worker.model_runner:ModelRunner.execute_model"],
    "update_states": ["pagedllm.worker.model_runner:ModelRunner._update_states"],
    "build_batch": ["pagedllm.worker.model_runner:build_batch",
                    "pagedllm.worker.input_batch:InputBatch.prepare"],
    "forward": ["pagedllm.worker.forward:EagerPath.run,NativeDecodePath.run,NativeHeadPath.run,CudaGraphPath.run,"
                "PipelinePath.run",
                "pagedllm.worker.forward:EagerPath.run,NativeDecodePath.run,CudaGraphPath.run,PipelinePath.run",
                "pagedllm.worker.model_runner:ModelRunner._forward"],
    "compute_logits": ["pagedllm.models.llama:LlamaForCausalLM.compute_logits"],
    "sampling_metadata": ["pagedllm.worker.model_runner:ModelRunner._sampling_metadata",
                          "pagedllm.worker.sample.metadata:SamplingMetadata.from_rows"],
    "sampler": ["pagedllm.worker.sample.sampler:Sampler.forward"],
    "update_from_output": ["pagedllm.core.scheduler:Scheduler.update_from_output"],
    "process_outputs": ["pagedllm.engine.output_processor:OutputProcessor.process_outputs"],
}
DEVICE_PARTS = ("forward", "compute_logits")

current: dict[str, float] = defaultdict(float)
depth: dict[str, int] = defaultdict(int)
state = {"decode_n": -1, "n": 0}
totals: dict[str, list[float]] = defaultdict(list)


def _wrap(part: str, owner: object, attr: str) -> None:
    fn = getattr(owner, attr)

    @functools.wraps(fn)
    def timed(*a: object, **k: object) -> object:
        depth[part] += 1
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            depth[part] -= 1
            if depth[part] == 0:
                current[part] += time.perf_counter() - t0

    setattr(owner, attr, timed)


def install() -> list[str]:
    found = []
    for part, candidates in PARTS.items():
        for cand in candidates:
            mod_name, paths = cand.split(":")
            try:
                module = importlib.import_module(mod_name)
            except ImportError:
                continue
            targets = []
            for path in paths.split(","):
                *outer, attr = path.split(".")
                owner: object = module
                for o in outer:
                    owner = getattr(owner, o, None)
                targets.append((owner, attr))
            if any(owner is None or not hasattr(owner, attr) for owner, attr in targets):
                continue
            for owner, attr in targets:
                _wrap(part, owner, attr)
            found.append(f"{part}={cand}")
            break
    # A step counts when the scheduler hands every one of the N requests exactly one token.
    from pagedllm.core.scheduler import Scheduler
    from pagedllm.engine.llm_engine import LLMEngine

    sched = Scheduler.schedule

    def schedule(self: Scheduler) -> object:
        so = sched(self)
        n = state["n"]
        state["decode_n"] = int(len(so.num_scheduled_tokens) == n and so.total_num_scheduled_tokens == n)
        return so

    Scheduler.schedule = schedule  # type: ignore[method-assign]
    step = LLMEngine.step

    def engine_step(self: LLMEngine) -> object:
        current.clear()
        state["decode_n"] = 0
        out = step(self)
        if state["decode_n"]:
            for part in PARTS:
                if part in current:
                    totals[part].append(current[part])
        return out

    LLMEngine.step = engine_step  # type: ignore[method-assign]
    return found


def _micro(sizes: list[int], context: int = 512, block_size: int = 16, reps: int = 50) -> dict[str, dict[str, float]]:
    """Best-of-`reps` microseconds of one decode step's batch layout and sampling metadata for N
    greedy requests of `context` tokens, built the old way and from the persistent batch."""
    import torch

    from pagedllm.sampling_params import SamplingParams
    from pagedllm.worker.input_batch import RequestState, build_batch
    from pagedllm.worker.sample import SamplingMetadata, SamplingRow

    try:
        from pagedllm.worker.input_batch import InputBatch
    except ImportError:
        InputBatch = None  # noqa: N806  (a tree without the persistent batch)

    def best(fn: Callable[[], object]) -> float:
        return min(call_times(fn, reps)) * 1e6

    out: dict[str, dict[str, float]] = {}
    cpu = torch.device("cpu")
    for n in sizes:
        p = SamplingParams(temperature=0)
        nb = -(-(context + 1) // block_size)
        states = [RequestState(f"r{i}", list(range(context + 1)), 32, list(range(i * nb, (i + 1) * nb)), context, p)
                  for i in range(n)]
        res = {"build_batch": best(lambda: build_batch(states, [1] * n, block_size, build_groups=False)),
               "from_rows": best(lambda: SamplingMetadata.from_rows(
                   [SamplingRow(s.sampling_params, None, s.prompt_token_ids, s.output_token_ids, s.eos_token_ids)
                    for s in states], 49152, cpu))}
        if InputBatch is not None:
            ib = InputBatch(8192, block_size)
            for s in states:
                ib.add(s.req_id, s.token_ids, s.num_prompt_tokens, s.block_ids, s.num_computed_tokens, p)
            ids = [s.req_id for s in states]
            counts = np.ones(n, dtype=np.int64)
            res["prepare"] = best(lambda: ib.prepare(ib.rows_of(ids), counts, build_groups=False))
            rows = ib.rows_of(ids)
            static = SamplingMetadata.static_from_batch(ib, rows, 49152, cpu)
            res["from_batch"] = best(lambda: SamplingMetadata.from_batch(ib, rows, 49152, cpu))
            res["cached_metadata"] = best(lambda: static.with_token_state(ib, rows, cpu))
        out[str(n)] = res
        print(f"micro N={n:4d} " + " ".join(f"{k}={v:.0f}" for k, v in res.items()), flush=True)
    return out


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = parser(__doc__, prog)
    ap.add_argument("--batch-sizes", default="1,16,64,128", help="requests decoding together, comma-separated")
    ap.add_argument("--dtype", default="bfloat16", help="model dtype")
    ap.add_argument("--prompt-len", type=int, default=32, help="tokens of each random prompt")
    ap.add_argument("--decode-steps", type=int, default=24, help="decode steps timed per batch size")
    ap.add_argument("--micro", action="store_true",
                    help="also time the batch layout and sampling metadata alone: per-request objects "
                         "(build_batch, SamplingMetadata.from_rows) against the persistent batch")
    ap.add_argument("--output-json")
    args = ap.parse_args(argv)
    micro = _micro([int(x) for x in args.batch_sizes.split(",")]) if args.micro else None
    found = install()
    from pagedllm import LLM, SamplingParams

    llm = LLM(dtype=args.dtype, kv_cache_memory="1GiB", max_num_seqs=256, enable_prefix_caching=False)
    rng = np.random.default_rng(0)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    results = {}
    for n in [int(x) for x in args.batch_sizes.split(",")]:
        totals.clear()
        state["n"] = n
        prompts = [{"prompt_token_ids": rng.integers(100, 40000, args.prompt_len).tolist()} for _ in range(n)]
        params = SamplingParams(max_tokens=args.decode_steps + 1, temperature=0, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)
        steps = len(totals["step"])
        # the median step of each part, in microseconds
        med = {p: float(np.median(v)) * 1e6 for p, v in totals.items()}
        host = [s - sum(totals[d][i] for d in DEVICE_PARTS if d in totals) for i, s in enumerate(totals["step"])]
        med["host"] = float(np.median(host)) * 1e6
        results[n] = {"decode_steps": steps, **med}
        print(f"N={n:4d} steps={steps:3d} " + " ".join(f"{p}={v:.0f}" for p, v in med.items()), flush=True)
    out = {"command": command_line(), "dtype": args.dtype, "parts": found, "us_per_step_median": results}
    if micro is not None:
        out["micro_us"] = micro
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    raise SystemExit(main())
