"""Iteration-level scheduler: one token budget per step, shared by decodes and prompt chunks.

There is no prefill phase and no decode phase. Every request has `num_computed_tokens` and
`num_tokens`; each step hands out tokens so that the first catches up with the second: running
requests first (one decode token, or the next chunk of an unfinished prompt), then waiting
requests, whose prompts are chunked to fit what is left of `max_num_batched_tokens`.
Plain Python: tests drive `schedule()` / `update_from_output()` with fake model outputs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.policies import make_policy
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler_output import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)

logger = logging.getLogger(__name__)


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.policy = make_policy(config)
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # in admission order
        # Requests whose state the worker holds; the rest are sent in full when scheduled.
        self._known_to_worker: set[str] = set()
        # Requests the worker has ever seen (it keeps per-request random generators until they end).
        self._sent: set[str] = set()
        self._forget: set[str] = set()
        self._preempted_ids: set[str] = set()
        self.num_preemptions = 0

    # ---- admission ------------------------------------------------------------------------
    def check_request(self, request: Request) -> None:
        """Rejects a request that could never complete, naming the numbers."""
        max_len = self.config.max_model_len
        total = request.num_prompt_tokens + request.max_tokens
        if total > max_len:
            raise ValueError(
                f"This model's maximum context length is {max_len} tokens, but the request asks for "
                f"{total} tokens ({request.num_prompt_tokens} in the prompt and {request.max_tokens} "
                f"to generate). Please reduce the length of the prompt or of max_tokens."
            )
        need = self.kv.blocks_needed(total)
        if need > self.kv.num_blocks:
            raise ValueError(
                f"the request needs {total} tokens of KV cache ({need} blocks of {self.kv.block_size}) but the "
                f"whole KV cache holds {self.kv.num_blocks * self.kv.block_size} tokens ({self.kv.num_blocks} blocks)"
            )

    def add_request(self, request: Request) -> None:
        self.check_request(request)
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def finish_requests(self, request_ids: str | list[str], status: RequestStatus) -> list[Request]:
        """Ends requests from outside the step (abort, stop string): frees their blocks at once."""
        assert RequestStatus.is_finished(status)
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        done = []
        for rid in ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            req.status = status
            self._release(req)
            done.append(req)
        return done

    def _release(self, req: Request) -> None:
        self.kv.free(req)
        self.requests.pop(req.request_id, None)
        self._known_to_worker.discard(req.request_id)
        if req.request_id in self._sent:
            self._sent.discard(req.request_id)
            self._forget.add(req.request_id)
            self._preempted_ids.discard(req.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- one step -------------------------------------------------------------------------
    def _num_new_tokens(self, req: Request, budget: int, partial_left: int) -> int:
        n = req.num_tokens - req.num_computed_tokens
        if self.config.long_prefill_token_threshold and n > 1:
            n = min(n, self.config.long_prefill_token_threshold)
        n = min(n, budget)
        # A prompt chunk (more than the one decode token) counts against the partial-prefill limit.
        if n > 1 or req.num_computed_tokens + n < req.num_tokens:
            if partial_left == 0:
                return 0
        return n

    def _preempt(self, req: Request) -> None:
        """Recompute preemption: drop the request's blocks; it keeps its generated tokens."""
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.waiting_steps = 0
        self.num_preemptions += 1
        if req.request_id in self._known_to_worker:
            self._known_to_worker.discard(req.request_id)
            self._forget.add(req.request_id)
            self._preempted_ids.add(req.request_id)
        self.waiting.append(req)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        partial_left = self.config.max_num_partial_prefills or -1  # -1: unlimited
        scheduled: dict[str, int] = {}
        new_block_ids: dict[str, list[int]] = {}
        preempted: list[Request] = []

        # 1. Running requests, in admission order.
        idx = 0
        while idx < len(self.running) and budget > 0:
            req = self.running[idx]
            n = self._num_new_tokens(req, budget, partial_left)
            if n == 0:
                idx += 1
                continue
            blocks = self.kv.allocate_slots(req, n)
            while blocks is None:
                victim = self.policy.pick_victim(self.running)
                pos = self.running.index(victim)
                self._preempt(victim)
                preempted.append(victim)
                if victim.request_id in scheduled:
                    budget += scheduled.pop(victim.request_id)
                    new_block_ids.pop(victim.request_id, None)
                if victim is req:
                    break
                if pos < idx:
                    idx -= 1
                blocks = self.kv.allocate_slots(req, n)
            if blocks is None:
                continue  # req itself was preempted; running[idx] is now the next one
            scheduled[req.request_id] = n
            new_block_ids[req.request_id] = [b.block_id for b in blocks]
            budget -= n
            if req.num_computed_tokens + n < req.num_tokens or n > 1:
                partial_left -= 1
            idx += 1

        # 2. Waiting requests, while budget, sequence slots and blocks last (not after a preemption).
        admitted: list[Request] = []
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.policy.next_waiting(self.waiting)
            hits, num_hit = self.kv.get_computed_blocks(req)
            req.num_computed_tokens = num_hit
            n = self._num_new_tokens(req, budget, partial_left)
            # allocate_slots counts the hits itself: they precede the request's computed tokens.
            req.num_computed_tokens = 0
            blocks = self.kv.allocate_slots(req, n, hits) if n > 0 else None
            if blocks is None:
                break
            req.num_computed_tokens = num_hit
            self.kv.record_prefix_query(req.num_tokens, num_hit)
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            req.waiting_steps = 0
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
                req.first_scheduled_time = time.time()
            self.running.append(req)
            admitted.append(req)
            scheduled[req.request_id] = n
            budget -= n
            if req.num_computed_tokens + n < req.num_tokens or n > 1:
                partial_left -= 1

        for req in self.waiting:
            req.waiting_steps += 1
        return self._build_output(scheduled, new_block_ids, preempted)

    def _build_output(
        self, scheduled: dict[str, int], new_block_ids: dict[str, list[int]], preempted: list[Request]
    ) -> SchedulerOutput:
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        ordered: dict[str, int] = {}
        # Batch order: requests the worker knows first, then new ones (worker relies on this).
        for rid, n in scheduled.items():
            req = self.requests[rid]
            if rid in self._known_to_worker:
                cached_reqs.append(CachedRequestData(rid, new_block_ids[rid], req.num_computed_tokens))
                ordered[rid] = n
        for rid, n in scheduled.items():
            req = self.requests[rid]
            if rid not in self._known_to_worker:
                new_reqs.append(
                    NewRequestData(
                        req_id=rid,
                        prompt_token_ids=req.prompt_token_ids,
                        output_token_ids=list(req.output_token_ids),
                        sampling_params=req.sampling_params,
                        eos_token_ids=req.eos_token_ids,
                        block_ids=self.kv.get_block_ids(rid),
                        num_computed_tokens=req.num_computed_tokens,
                    )
                )
                ordered[rid] = n
        for rid, n in scheduled.items():
            self._known_to_worker.add(rid)
            self._sent.add(rid)
            self.requests[rid].num_computed_tokens += n
        self.policy.on_step([self.requests[r] for r in scheduled], scheduled)
        out = SchedulerOutput(
            new_reqs=new_reqs,
            cached_reqs=cached_reqs,
            num_scheduled_tokens=ordered,
            total_num_scheduled_tokens=sum(scheduled.values()),
            finished_req_ids=self._forget,
            preempted_req_ids=self._preempted_ids,
            num_preempted=len(preempted),
        )
        self._forget = set()
        self._preempted_ids = set()
        return out

    def update_from_output(self, so: SchedulerOutput, out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Appends sampled tokens, applies stop rules, frees finished requests."""
        results: list[EngineCoreOutput] = []
        any_finished = False
        max_len = self.config.max_model_len
        for i, rid in enumerate(out.req_ids):
            req = self.requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted or preempted since it was scheduled
            new_tokens = out.sampled_token_ids[i]
            prompt_lp = out.prompt_logprobs.get(rid)
            if not new_tokens and prompt_lp is None:
                continue  # an unfinished prompt chunk
            appended: list[int] = []
            for t in new_tokens:
                req.append_output_token(t)
                appended.append(t)
                if req.check_stop(max_len):
                    break
            result = EngineCoreOutput(
                req_id=rid,
                new_token_ids=appended,
                logprobs=out.logprobs.get(rid),
                prompt_logprobs=prompt_lp,
                num_cached_tokens=max(req.num_cached_tokens, 0),
                first_scheduled_time=req.first_scheduled_time,
            )
            if req.is_finished:
                result.finish_reason = req.get_finished_reason()
                result.stop_reason = req.stop_reason
                self._release(req)
                any_finished = True
            results.append(result)
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
        return results

    # ---- introspection --------------------------------------------------------------------
    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_swapped=0,
            kv_cache_usage=self.kv.usage,
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            num_preemptions=self.num_preemptions,
        )

    def check_integrity(self) -> None:
        """Invariants of queues and blocks (run by tests after every step)."""
        self.kv.check_integrity()
        ids = [r.request_id for r in self.running] + [r.request_id for r in self.waiting]
        assert len(ids) == len(set(ids)), "a request is queued twice"
        assert set(ids) == set(self.requests), "queues and the request table disagree"
        assert set(self.kv.req_blocks) <= {r.request_id for r in self.running}, "a non-running request holds blocks"
        for r in self.running:
            assert r.status == RequestStatus.RUNNING
            nblocks = len(self.kv.req_blocks.get(r.request_id, ()))
            assert nblocks >= self.kv.blocks_needed(r.num_computed_tokens), f"{r} has too few blocks"
        for r in self.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert r.num_computed_tokens == 0
