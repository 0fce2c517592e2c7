"""The engine-core process's warm-up: the model's step paths run once on dummy data before the
server reports ready, so that the first request does not pay their first calls.

A first step pays once what later steps do not: the native kernels' first calls, torch's and
oneDNN's primitive set-up, the allocators' first growth, the first writes into the lazily
committed KV cache. A server's first chat request of the default model took 2.1 s against 0.06 s
for the next ones (docs/benchmarks.md). The warm-up drives the executor with hand-made SchedulerOutputs, as the
scheduler's steps would: a prompt of a few hundred tokens in two chunks (the chunked-prefill
path), a second prompt beside the first one's decode (a mixed step), greedy decode steps of two
rows and then of one (the fused native decode step where it is used), then a seeded random
request alone (the random sampler). Through the executor every rank of a parallel executor runs
them.

It leaves no trace: the scheduler, its KV cache manager and the metrics never see it (no request
ids, no counters, no prefix-cache keys); its requests end with the last of its steps, so the
runner forgets them (their rows, generators and LoRA slots). Its K/V goes into the first blocks of
the pool's free queue, read but not taken (`BlockPool.next_free_ids`): free blocks without a key,
whose content is never read before a request writes it, and the ones the first requests will be
given, their pages now committed. Greedy steps draw no random numbers and the seeded request,
sampled alone, draws from its own generator only, so the default generator (unseeded requests)
is where it was.

Only the server's engine-core process warms up (engine/core_proc.py); an in-process `LLM` does not.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from pagedllm.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PROMPT_TOKENS = 256
"""The first request's prompt, run in two chunks."""
SECOND_PROMPT_TOKENS = 32
"""The other requests' prompts (the second one's run beside the first one's first decode step)."""
DECODE_STEPS = 4
"""Decode steps of each phase: both greedy requests, the first alone, the seeded one alone."""


def skip_reason(core: Any) -> str | None:
    """Why this engine has nothing to warm up, or None."""
    mc = core.model_config
    if mc.runner != "generate" or mc.is_encoder:
        return "a pooling model"
    if core.config.cache_config.calculate_kv_scales and mc.kv_cache_dtype.startswith("fp8"):
        # The fp8 cache's scales come from the first batch that runs: it must be a real request's.
        return "--calculate-kv-scales takes the fp8 KV cache's scales from the first batch"
    return None


def warm_up(core: Any) -> float | None:
    """Runs the warm-up steps through the engine core's executor; their time in seconds (None: skipped,
    with the reason logged)."""
    reason = skip_reason(core)
    steps = None if reason else plan_steps(core)
    if steps is None:
        logger.info("warm-up: skipped (%s)", reason or "the KV cache or token budget is too small for it")
        return None
    t0 = time.perf_counter()
    for so in steps:
        core.executor.execute_model(so)
    seconds = time.perf_counter() - t0
    logger.info("warm-up: %d ms", round(seconds * 1000))
    return seconds


class _Steps:
    """SchedulerOutputs as the scheduler lays them out: the held requests first, then the new ones;
    a finished request is named in the next step's finished_req_ids."""

    def __init__(self, eos: Any) -> None:
        self.eos = eos
        self.steps: list[SchedulerOutput] = []
        self.new: dict[str, NewRequestData] = {}
        self.computed: dict[str, int] = {}
        self.finished: set[str] = set()

    def add(self, req_id: str, prompt: list[int], params: SamplingParams, block_ids: list[int]) -> None:
        self.new[req_id] = NewRequestData(req_id, prompt, [], params, self.eos, block_ids, 0)

    def step(self, scheduled: dict[str, int]) -> None:
        cached = [CachedRequestData(r, [], self.computed[r]) for r in scheduled if r in self.computed]
        new = [self.new.pop(r) for r in scheduled if r in self.new]
        order = [c.req_id for c in cached] + [n.req_id for n in new]
        self.steps.append(SchedulerOutput(new_reqs=new, cached_reqs=cached,
                                          num_scheduled_tokens={r: scheduled[r] for r in order},
                                          total_num_scheduled_tokens=sum(scheduled.values()),
                                          finished_req_ids=self.finished))
        self.finished = set()
        for r, n in scheduled.items():
            self.computed[r] = self.computed.get(r, 0) + n

    def finish(self, req_id: str) -> None:
        del self.computed[req_id]
        self.finished.add(req_id)


def plan_steps(core: Any) -> list[SchedulerOutput] | None:
    """The warm-up's steps for this engine's budgets (None: they do not fit).

    A greedy and a random row never sample in one step: such a step draws the greedy row's unused
    random number from the default generator (worker/sample/sampler.py), which unseeded requests
    draw from. So the two requests that run together are greedy, and the seeded one runs alone.
    """
    mc, sc, cc = core.model_config, core.config.scheduler_config, core.config.cache_config
    kv = core.scheduler.kv
    budget, d = sc.max_num_batched_tokens, DECODE_STEPS
    # Each request's most tokens: its prompt, a token from its last chunk, one per decode step.
    prompt = min(PROMPT_TOKENS, 2 * budget, mc.max_model_len - 2 * d - 2)
    other = min(SECOND_PROMPT_TOKENS, budget - 1, mc.max_model_len - d - 1)
    if prompt < 2:
        return None
    lengths = [prompt + 2 * d + 2] + ([other + d + 1] * 2 if other > 0 else [])
    need = [-(-n // cc.block_size) * kv.num_groups for n in lengths]
    if sum(need) > kv.pool.num_free_blocks:
        lengths, need = lengths[:1], need[:1]
        if need[0] > kv.pool.num_free_blocks:
            return None
    free = kv.pool.next_free_ids(sum(need))
    tables = [free[sum(need[:i]):sum(need[:i + 1])] for i in range(len(need))]
    vocab = mc.vocab_size
    # Token ids spread over the vocabulary, away from the lowest (special) ones.
    tokens = [int(t) for t in np.arange(prompt + 2 * other) * 7919 % max(vocab - 256, 1) + min(256, vocab - 1)]
    greedy = SamplingParams(temperature=0.0, max_tokens=None)
    plan = _Steps(mc.eos_token_ids)
    plan.add("warmup-0", tokens[:prompt], greedy, tables[0])
    first = -(-prompt // 2)
    plan.step({"warmup-0": first})  # a prompt chunk, then the chunk after it
    plan.step({"warmup-0": prompt - first})
    if len(tables) > 1 and sc.max_num_seqs >= 2:
        plan.add("warmup-1", tokens[prompt:prompt + other], greedy, tables[1])
        plan.step({"warmup-0": 1, "warmup-1": other})  # a decode beside a prompt
        for _ in range(d):
            plan.step({"warmup-0": 1, "warmup-1": 1})
        plan.finish("warmup-1")
    for _ in range(d):
        plan.step({"warmup-0": 1})
    plan.finish("warmup-0")
    if len(tables) > 2:  # the random sampler, on its own generator
        seeded = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=0, max_tokens=None)
        plan.add("warmup-2", tokens[prompt + other:], seeded, tables[2])
        plan.step({"warmup-2": other})
        for _ in range(d):
            plan.step({"warmup-2": 1})
        plan.finish("warmup-2")
    plan.step({})
    return plan.steps
