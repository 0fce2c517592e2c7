"""`pagedllm bench scheduler`: CPU time of `schedule()` + `update_from_output()` per step, with a
fake model, at a steady number of running requests and of waiting ones.

Pure Python: requests with random prompt and output lengths; a finished request is replaced by a
new one at once, so the running set stays at N, W more requests wait (`--num-waiting`: the queue
`LLM.generate` builds from a long prompt list, or a server's backlog), and every step mixes N-ish
decodes with the admission (and prompt chunk) of the replacements, as a busy server does. The fake model returns one
token for every request whose prompt is complete. Timings are compared with one model step at the
same batch size: `--model-step-ms`, or measured with the real model (prompts of one token, so the
prefill is cheap; the decode step then attends to at most 3 tokens, which makes it a lower bound
on a model step and the scheduler's share an upper bound).
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from tqdm.auto import tqdm

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.sampling_params import SamplingParams


class _FakeWorkload:
    def __init__(self, input_range: tuple[int, int], output_range: tuple[int, int], seed: int) -> None:
        self.rng = random.Random(seed)
        self.input_range = input_range
        self.output_range = output_range
        self.count = 0

    def new_request(self) -> Request:
        n_in = self.rng.randint(*self.input_range)
        n_out = self.rng.randint(*self.output_range)
        ids = [self.rng.randrange(10, 32000) for _ in range(n_in)]
        self.count += 1
        params = SamplingParams(max_tokens=n_out, ignore_eos=True)
        return Request(f"r{self.count}", ids, params, frozenset({2}), max_tokens=n_out)


def fake_model_output(sched: Scheduler, so: SchedulerOutput, token: int = 7) -> ModelRunnerOutput:
    """One sampled token for each scheduled request whose prompt is now fully computed."""
    ids = list(so.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        req = sched.requests[rid]
        sampled.append([token] if req.num_computed_tokens >= req.num_tokens else [])
    return ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled)


def time_scheduler(num_running: int, num_steps: int, block_size: int = 16,
                   input_range: tuple[int, int] = (32, 512), output_range: tuple[int, int] = (16, 256),
                   max_num_batched_tokens: int | None = None, enable_prefix_caching: bool = True,
                   seed: int = 0, show_progress: bool = True, num_waiting: int = 1) -> dict[str, Any]:
    """µs per step of schedule() + update_from_output() with `num_running` requests running and
    `num_waiting` more queued."""
    # Enough budget that admissions keep up with completions at N running: N decode tokens plus
    # the prompts of the ~N / mean_output requests that finish per step, with 50% slack.
    mean_in, mean_out = sum(input_range) / 2, sum(output_range) / 2
    budget = max_num_batched_tokens or max(2048, int(num_running * (1 + 1.5 * mean_in / mean_out)) + input_range[1])
    max_len = input_range[1] + output_range[1]
    num_blocks = num_running * -(-max_len // block_size) + 1  # room for all: no preemption
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=num_running, max_model_len=max_len)
    sched = Scheduler(config, KVCacheManager(num_blocks, block_size, enable_prefix_caching))
    wl = _FakeWorkload(input_range, output_range, seed)

    def top_up() -> None:
        while sched.num_unfinished < num_running + num_waiting:
            sched.add_request(wl.new_request())

    # Warm up: until N requests run, then as many steps again as the longest output, so that the
    # running set mixes old and new requests as in a steady state.
    top_up()
    steps = 0
    while steps < 10_000:
        so = sched.schedule()
        full = len(sched.running) >= num_running
        sched.update_from_output(so, fake_model_output(sched, so))
        top_up()
        steps += 1
        if full:
            break
    for _ in range(min(output_range[1], 64)):
        so = sched.schedule()
        sched.update_from_output(so, fake_model_output(sched, so))
        top_up()
    completed_before = wl.count - sched.num_unfinished
    sched_s, update_s, running, tokens = [], [], [], []
    for _ in tqdm(range(num_steps), desc=f"scheduler steps at {num_running} running, {num_waiting} waiting",
                  dynamic_ncols=True,
                  disable=not show_progress):
        t0 = time.perf_counter()
        so = sched.schedule()
        t1 = time.perf_counter()
        out = fake_model_output(sched, so)
        t2 = time.perf_counter()
        sched.update_from_output(so, out)
        t3 = time.perf_counter()
        sched_s.append(t1 - t0)
        update_s.append(t3 - t2)
        running.append(len(so.num_scheduled_tokens))
        tokens.append(so.total_num_scheduled_tokens)
        top_up()
    step = [a + b for a, b in zip(sched_s, update_s)]
    return {
        "num_running": num_running,
        "num_waiting": num_waiting,
        "num_steps": num_steps,
        "block_size": block_size,
        "max_num_batched_tokens": budget,
        "mean_scheduled_requests": statistics.fmean(running),
        "mean_scheduled_tokens": statistics.fmean(tokens),
        "requests_completed": wl.count - sched.num_unfinished - completed_before,
        "schedule_us": 1e6 * statistics.fmean(sched_s),
        "update_us": 1e6 * statistics.fmean(update_s),
        "step_us_mean": 1e6 * statistics.fmean(step),
        "step_us_median": 1e6 * statistics.median(step),
        "step_us_p99": 1e6 * sorted(step)[min(len(step) - 1, int(0.99 * len(step)))],
        "us_per_request": 1e6 * statistics.fmean(step) / max(statistics.fmean(running), 1),
    }


def measure_model_step_ms(model: str | None, batch_sizes: list[int], engine_kwargs: dict[str, Any]) -> dict[int, float]:
    """ms of one decode `execute_model` of the real model at each batch size (1-token prompts)."""
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.sampling_params import SamplingParams

    top = max(batch_sizes)
    kwargs = dict(engine_kwargs) | {"max_num_seqs": top, "max_num_batched_tokens": max(2048, top),
                                    "enable_prefix_caching": False}
    engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))
    timings: list[float] = []
    execute = engine.executor.execute_model

    def timed(so):
        t0 = time.perf_counter()
        out = execute(so)
        timings.append(time.perf_counter() - t0)
        return out

    engine.executor.execute_model = timed  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    result = {}
    for n in tqdm(batch_sizes, desc="model decode step", dynamic_ncols=True):
        for i in range(n):
            engine.add_request(f"m{n}-{i}", {"prompt_token_ids": [100 + i % 1000]}, params)
        timings.clear()
        while engine.has_unfinished_requests():
            engine.step()
        result[n] = 1000 * min(timings[1:])  # step 0 is the prefill; later steps decode n tokens
    return result


def run_scheduler_bench(sizes: list[int], num_steps: int, block_size: int, model_step_ms: float | None,
                        measure_model: bool, model: str | None, engine_kwargs: dict[str, Any],
                        seed: int = 0, waiting: tuple[int, ...] = (1,)) -> dict[str, Any]:
    from pagedllm.benchmarks.env import run_metadata

    meta = run_metadata()
    rows = [time_scheduler(n, num_steps, block_size, seed=seed, num_waiting=w) for n in sizes for w in waiting]
    if model_step_ms is not None:
        steps = {n: model_step_ms for n in sizes}
        source = "--model-step-ms"
    elif measure_model:
        steps = measure_model_step_ms(model, sizes, engine_kwargs)
        source = "measured: one decode step of the real model at this batch size (1-token prompts)"
    else:
        steps, source = {}, None
    for r in rows:
        ms = steps.get(r["num_running"])
        if ms:
            r["model_step_ms"] = ms
            r["fraction_of_model_step"] = r["step_us_mean"] / 1000 / ms
    return {"benchmark": "scheduler", "meta": meta, "model_step_source": source, "results": rows}


def format_scheduler(report: dict[str, Any]) -> str:
    lines = [f"{'running':>8} {'waiting':>8} {'sched µs':>9} {'update µs':>9} {'step µs':>9} {'p99 µs':>9} {'µs/req':>7} "
             f"{'model step ms':>13} {'share':>7}"]
    for r in report["results"]:
        ms = r.get("model_step_ms")
        share = f"{100 * r['fraction_of_model_step']:.2f}%" if ms else "-"
        step_ms = f"{ms:.1f}" if ms else "-"
        lines.append(
            f"{r['num_running']:>8} {r.get('num_waiting', 1):>8} {r['schedule_us']:>9.0f} {r['update_us']:>9.0f} {r['step_us_mean']:>9.0f} "
            f"{r['step_us_p99']:>9.0f} {r['us_per_request']:>7.2f} {step_ms:>13} {share:>7}"
        )
    if report.get("model_step_source"):
        lines.append(f"model step: {report['model_step_source']}")
    return "\n".join(lines)
