"""The simulation loop: arrivals, then schedule -> simulated execute -> update, on a simulated clock."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.preemption import PreemptionCostModel
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams
from pagedllm.simulator.cost_model import CostModel
from pagedllm.simulator.trace import TraceRequest, prompt_token_ids
from pagedllm.simulator.worker import SimWorker

logger = logging.getLogger(__name__)


@dataclass
class RequestTimes:
    arrival_s: float
    prompt_len: int
    output_len: int
    first_token_s: float = -1.0
    finish_s: float = -1.0
    num_preemptions: int = 0
    priority: int = 0
    user: str | None = None


@dataclass
class SimResult:
    requests: list[RequestTimes]
    num_steps: int
    sim_elapsed_s: float
    wall_s: float
    num_kv_blocks: int
    num_swap_blocks: int
    preemptions_by_mode: dict[str, int]
    prefix_hit_rate: float
    # Per step (decimated for long runs): time, KV usage, running / waiting / swapped queue lengths.
    timeline: dict[str, list[float]] = field(default_factory=dict)
    # Simulated seconds per cost term, summed over steps.
    time_by_term: dict[str, float] = field(default_factory=dict)


def kv_blocks_for(cost: CostModel, cache: CacheConfig, tp: int, pp: int, max_activation_tokens: int) -> int:
    """The KV cache size: --num-kv-blocks, else --kv-cache-memory (per device), else the profile's
    device memory x utilization minus this device's weights and activations."""
    if cache.num_kv_blocks:
        return cache.num_kv_blocks
    devices = tp * pp
    per_dev_block = cost.block_bytes / devices
    if cache.kv_cache_memory:
        return max(1, int(cache.kv_cache_memory // per_dev_block))
    hw, model = cost.hw, cost.model
    if not hw.memory_bytes:
        raise ValueError(f"profile {hw.name!r} states no memory_bytes: pass --num-kv-blocks or --kv-cache-memory")
    act = max_activation_tokens * model.shape.intermediate * 4 * model.dtype_bytes / tp
    free = hw.memory_bytes * hw.memory_utilization - model.weight_bytes / devices - act
    if free < per_dev_block:
        raise ValueError(f"{model.name} ({model.weight_bytes / 1e9:.1f} GB of weights) leaves no KV cache room on "
                         f"{devices} x {hw.name} ({hw.memory_bytes / 1e9:.0f} GB each)")
    return int(free // per_dev_block)


class Simulation:
    def __init__(
        self,
        sched_config: SchedulerConfig,
        cache_config: CacheConfig,
        cost: CostModel,
        num_kv_blocks: int,
        num_swap_blocks: int = 0,
        check_integrity: bool = False,
    ) -> None:
        self.sc, self.cc, self.cost = sched_config, cache_config, cost
        kv = KVCacheManager(num_kv_blocks, cache_config.block_size, cache_config.enable_prefix_caching,
                            num_swap_blocks)
        costs = None
        if sched_config.preemption_mode == "auto":
            hw, m = cost.hw, cost.model
            costs = PreemptionCostModel(
                flops_per_second=hw.gemm_flops * cost.tp, copy_bytes_per_second=hw.swap_bw * cost.tp,
                flops_per_token=m.flops_per_token,
                attention_flops_per_pair=m.attention_flops_per_pair if hw.attn_flops else 0.0,
                kv_bytes_per_block=cost.block_bytes)
        self.scheduler = Scheduler(sched_config, kv, costs)
        self.worker = SimWorker(cache_config.block_size, check=check_integrity)
        self.check = check_integrity
        self.num_kv_blocks, self.num_swap_blocks = num_kv_blocks, num_swap_blocks

    def run(self, trace: list[TraceRequest], max_timeline_points: int = 2000, track_tokens: bool = False,
            on_step: Any = None) -> SimResult:
        """Replays `trace`. With `track_tokens` the timeline also holds the tokens whose K/V the
        running requests hold (for memory utilization: live tokens / allocated block slots).
        `on_step(clock, scheduler_output, scheduler)` is called after every step (simulate --ui)."""
        sched, worker, cost = self.scheduler, self.worker, self.cost
        times = [RequestTimes(r.arrival_s, r.prompt_len, r.output_len, priority=r.priority, user=r.user)
                 for r in trace]
        live: dict[str, tuple[int, Request]] = {}
        terms = {"overhead": 0.0, "gemm": 0.0, "prefill_attention": 0.0, "decode_attention": 0.0, "moves": 0.0,
                 "comm": 0.0}
        tl: dict[str, list[float]] = {k: [] for k in ("t", "kv_usage", "running", "waiting", "swapped")}
        if track_tokens:
            tl["kv_tokens"] = []
        clock, i, n, steps = 0.0, 0, len(trace), 0
        max_len = self.sc.max_model_len
        t_wall = time.perf_counter()
        while i < n or sched.has_unfinished_requests():
            while i < n and trace[i].arrival_s <= clock:
                r = trace[i]
                params = SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0)
                if r.prompt_len + r.output_len > max_len:
                    raise ValueError(f"trace request {i} needs {r.prompt_len + r.output_len} tokens, more than "
                                     f"max_model_len={max_len}")
                req = Request(str(i), prompt_token_ids(r, i), params, arrival_time=r.arrival_s,
                              priority=r.priority, user=r.user, max_tokens=r.output_len)
                sched.add_request(req)
                live[req.request_id] = (i, req)
                i += 1
            if not sched.has_unfinished_requests():
                clock = trace[i].arrival_s
                continue
            so = sched.schedule()
            out, feats = worker.execute_model(so)
            if so.is_empty and not (so.blocks_to_swap_out or so.blocks_to_swap_in):
                if i >= n:
                    raise RuntimeError(f"the scheduler scheduled nothing with {sched.num_unfinished} requests "
                                       "left and no arrivals to come")
                clock = max(clock, trace[i].arrival_s)
                continue
            c = cost.step_time(feats)
            clock += c.total
            terms["overhead"] += c.overhead
            terms["gemm"] += c.gemm
            terms["prefill_attention"] += c.prefill_attention
            terms["decode_attention"] += c.decode_attention
            terms["moves"] += c.moves
            terms["comm"] += c.comm
            for res in sched.update_from_output(so, out):
                idx, req = live[res.req_id]
                rt = times[idx]
                if rt.first_token_s < 0 and res.new_token_ids:
                    rt.first_token_s = clock
                if res.finished:
                    rt.finish_s = clock
                    rt.num_preemptions = req.num_preemptions
                    del live[res.req_id]
            if self.check:
                sched.check_integrity()
            tl["t"].append(clock)
            tl["kv_usage"].append(sched.kv.usage)
            tl["running"].append(len(sched.running))
            tl["waiting"].append(len(sched.waiting))
            tl["swapped"].append(len(sched.swapped))
            if track_tokens:
                tl["kv_tokens"].append(sum(r.num_computed_tokens for r in sched.running))
            steps += 1
            if on_step is not None:
                on_step(clock, so, sched)
        if len(tl["t"]) > max_timeline_points:
            stride = -(-len(tl["t"]) // max_timeline_points)
            tl = {k: v[::stride] for k, v in tl.items()}
        kv = sched.kv
        return SimResult(
            requests=times, num_steps=steps, sim_elapsed_s=clock, wall_s=time.perf_counter() - t_wall,
            num_kv_blocks=self.num_kv_blocks, num_swap_blocks=self.num_swap_blocks,
            preemptions_by_mode=dict(sched.num_preemptions_by_mode),
            prefix_hit_rate=kv.prefix_hits / kv.prefix_queries if kv.prefix_queries else 0.0,
            timeline=tl, time_by_term=terms,
        )


def run_one(ea: Any, model: Any, profile: Any, trace: list, tp: int, pp: int, check: bool,
            slo_ttft: float, slo_tpot: float, on_step: Any = None) -> dict[str, Any]:
    """One simulation: the report dict (summary at the top level, then details)."""
    from pagedllm.simulator.report import summarize

    need = max(r.prompt_len + r.output_len for r in trace)
    sc, cc = ea.create_scheduler_config(ea.max_model_len or need), ea.create_cache_config()
    cost = CostModel(model, profile, cc.block_size, tp, pp)
    num_blocks = kv_blocks_for(cost, cc, tp, pp, sc.max_num_batched_tokens)
    num_swap = 0
    if sc.preemption_mode != "recompute":
        # As the engine sizes it: swap_space GiB of host memory per device.
        num_swap = int(cc.swap_space * (1 << 30) // (cost.block_bytes / (tp * pp)))
    sim = Simulation(sc, cc, cost, num_blocks, num_swap, check_integrity=check)
    res = sim.run(trace, on_step=on_step)
    summary = summarize(res.requests, res.sim_elapsed_s, slo_ttft, slo_tpot)
    done = [r for r in res.requests if r.finish_s >= 0]
    return {
        **summary,
        "num_steps": res.num_steps,
        "wall_s": res.wall_s,
        "sim_requests_per_wall_s": len(trace) / max(res.wall_s, 1e-9),
        "num_kv_blocks": res.num_kv_blocks,
        "num_swap_blocks": res.num_swap_blocks,
        "kv_capacity_tokens": res.num_kv_blocks * cc.block_size,
        "preemptions_by_mode": res.preemptions_by_mode,
        "prefix_hit_rate": res.prefix_hit_rate,
        "mean_kv_usage": sum(res.timeline["kv_usage"]) / max(len(res.timeline["kv_usage"]), 1),
        "max_waiting": max(res.timeline["waiting"], default=0),
        "time_by_term_s": res.time_by_term,
        "timeline": res.timeline,
        "per_request": {
            "ttft": [r.first_token_s - r.arrival_s for r in done],
            "e2e": [r.finish_s - r.arrival_s for r in done],
        },
    }
