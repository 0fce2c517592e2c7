"""`pagedllm bench memory`: KV cache utilization of paged blocks against contiguous reservation.

Pure Python: the real Scheduler and KVCacheManager run a workload against a fake model (one token
per step per decoding request; prefix caching off, so every request owns its blocks). After each
`schedule()`, for the running requests:

    stored   = tokens whose K/V is in the cache once this step has run (num_computed_tokens)
    paged    = blocks held x block_size
    max_len  = max_model_len per request   (a contiguous cache that reserves the longest sequence)
    oracle   = prompt + max_tokens per request (contiguous, knowing each output length in advance)

Utilization = sum of stored / sum of reserved over all steps; waste = 1 - utilization. The
contiguous figures reserve for the same running set; the contiguous cache could in fact hold only
num_kv_tokens // max_model_len requests at once, reported as its maximum concurrency.
"""

from __future__ import annotations

import random
from typing import Any

from tqdm.auto import tqdm

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import ModelRunnerOutput
from pagedllm.sampling_params import SamplingParams


def make_requests(num: int, input_range: tuple[int, int], output_range: tuple[int, int], seed: int) -> list[Request]:
    rng = random.Random(seed)
    reqs = []
    for i in range(num):
        n_in, n_out = rng.randint(*input_range), rng.randint(*output_range)
        ids = [rng.randrange(10, 32000) for _ in range(n_in)]
        reqs.append(Request(f"m{i}", ids, SamplingParams(max_tokens=n_out, ignore_eos=True), frozenset(),
                            max_tokens=n_out))
    return reqs


def simulate(reqs: list[Request], block_size: int, num_kv_tokens: int, max_model_len: int,
             max_num_seqs: int = 256, max_num_batched_tokens: int = 2048) -> dict[str, Any]:
    """Runs every request to completion; returns token-step sums and per-step utilization."""
    kv = KVCacheManager(num_kv_tokens // block_size, block_size, enable_caching=False)
    config = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                             max_model_len=max_model_len)
    sched = Scheduler(config, kv)
    for r in reqs:
        sched.add_request(r)
    stored = paged = max_len = oracle = 0
    steps = 0
    batch_sizes = []
    while sched.has_unfinished_requests():
        so = sched.schedule()
        step_stored = sum(r.num_computed_tokens for r in sched.running)
        stored += step_stored
        paged += sum(len(kv.req_blocks.get(r.request_id, ())) for r in sched.running) * block_size
        max_len += len(sched.running) * max_model_len
        oracle += sum(r.num_prompt_tokens + r.max_tokens for r in sched.running)
        batch_sizes.append(len(sched.running))
        ids = list(so.num_scheduled_tokens)
        sampled = [[7] if sched.requests[i].num_computed_tokens >= sched.requests[i].num_tokens else [] for i in ids]
        sched.update_from_output(so, ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled))
        if steps % 64 == 0:
            sched.check_integrity()
        steps += 1
    return {
        "block_size": block_size,
        "num_blocks": kv.num_blocks,
        "steps": steps,
        "preemptions": sched.num_preemptions,
        "mean_batch_size": sum(batch_sizes) / max(len(batch_sizes), 1),
        "max_batch_size": max(batch_sizes, default=0),
        "paged_utilization": stored / paged,
        "paged_waste": 1 - stored / paged,
        "contiguous_max_len_utilization": stored / max_len,
        "contiguous_max_len_waste": 1 - stored / max_len,
        "contiguous_oracle_utilization": stored / oracle,
        "contiguous_oracle_waste": 1 - stored / oracle,
    }


def run_memory_bench(block_sizes: list[int], num_prompts: int, input_range: tuple[int, int],
                     output_range: tuple[int, int], num_kv_tokens: int, max_model_len: int, max_num_seqs: int,
                     seed: int = 0, show_progress: bool = True) -> dict[str, Any]:
    if input_range[1] + output_range[1] > max_model_len:
        raise ValueError(f"the longest request ({input_range[1]} + {output_range[1]} tokens) exceeds "
                         f"max_model_len={max_model_len}")
    rows = []
    for bs in tqdm(block_sizes, desc="block sizes", dynamic_ncols=True, disable=not show_progress):
        reqs = make_requests(num_prompts, input_range, output_range, seed)  # fresh: requests carry state
        rows.append(simulate(reqs, bs, num_kv_tokens, max_model_len, max_num_seqs))
    return {
        "benchmark": "memory",
        "workload": {"num_prompts": num_prompts, "input_len_range": list(input_range),
                     "output_len_range": list(output_range), "seed": seed},
        "num_kv_tokens": num_kv_tokens,
        "max_model_len": max_model_len,
        "max_num_seqs": max_num_seqs,
        "contiguous_max_concurrency": num_kv_tokens // max_model_len,
        "results": rows,
    }


def format_memory(report: dict[str, Any]) -> str:
    lines = [f"KV cache of {report['num_kv_tokens']} tokens, max_model_len {report['max_model_len']}, "
             f"{report['workload']['num_prompts']} requests (prompt {report['workload']['input_len_range']}, "
             f"output {report['workload']['output_len_range']})",
             f"{'block':>6} {'paged util':>10} {'paged waste':>11} {'contig max_len waste':>20} "
             f"{'contig oracle waste':>19} {'mean batch':>10} {'preempt':>7}"]
    for r in report["results"]:
        lines.append(f"{r['block_size']:>6} {100 * r['paged_utilization']:>9.1f}% {100 * r['paged_waste']:>10.1f}% "
                     f"{100 * r['contiguous_max_len_waste']:>19.1f}% {100 * r['contiguous_oracle_waste']:>18.1f}% "
                     f"{r['mean_batch_size']:>10.1f} {r['preemptions']:>7}")
    lines.append(f"a contiguous cache of this size holds at most {report['contiguous_max_concurrency']} requests "
                 f"at max_model_len")
    return "\n".join(lines)
