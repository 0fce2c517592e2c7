"""Iteration-level scheduler: one token budget per step, shared by decodes and prompt chunks.

There is no prefill phase and no decode phase. Every request has `num_computed_tokens` and
`num_tokens`; each step hands out tokens so that the first catches up with the second: running
requests first (one decode token, or the next chunk of an unfinished prompt), then waiting
requests, whose prompts are chunked to fit what is left of `max_num_batched_tokens`.
Admissions live in `admission.py`, preemption in `preemption.py`, the limits a request must
meet in `request_limits.py`, one step's hand-out in `step.py`.
Plain Python: tests drive `schedule()` / `update_from_output()` with fake model outputs.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedllm.config import SchedulerConfig
from pagedllm.core.admission import schedule_admissions, update_waiting_counters
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.policies import make_policy
from pagedllm.core.pooling import check_whole_prompt, finish_pooled
from pagedllm.core.preemption import PreemptionCostModel, preempt
from pagedllm.core.request_limits import check_request_limits
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.spec_decode import Proposer, SpecDecodeStats, proposals_for, roll_back
from pagedllm.core.waiting_queue import WaitingQueue
from pagedllm.core.step import Step, WorkerView
from pagedllm.core.scheduler_output import (
    CachedRequestData,
    EngineCoreOutput,
    ForkedRequestData,
    Logprobs,
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
    num_preemptions_by_mode: dict[str, int] = field(default_factory=dict)
    """Preemptions so far by how they were done: {"recompute": ..., "swap": ...}."""
    swap_usage: float = 0.0
    """Fraction of the host swap pool held by swapped requests."""
    num_cow_copies: int = 0
    """Shared blocks copied before a write (copy-on-write) so far."""
    spec_decode: SpecDecodeStats | None = None
    """Speculative decoding's counts so far (None: off)."""


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv_cache_manager: KVCacheManager, costs: PreemptionCostModel | None = None,
        proposer: Proposer | None = None,
    ) -> None:
        self.config = config
        # Speculative decoding: proposes tokens for decoding requests (None: off, no work per step).
        self.proposer = proposer
        self.spec_stats = SpecDecodeStats() if proposer is not None else None
        self.kv = kv_cache_manager
        self.policy = make_policy(config)
        # Measured costs for preemption mode auto; without them auto swaps whenever the pool has room.
        self.costs = costs
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue(self.policy)  # in queue order; admission order from heaps
        self.running: list[Request] = []  # in admission order
        self.swapped: list[Request] = []  # in swap-out order
        # n > 1: samples waiting to be forked off their parent (sample 0) once its prompt is computed.
        self._pending_forks: dict[str, list[Request]] = {}
        # What the worker knows of each request it has seen (absent: never sent).
        self._worker: dict[str, WorkerView] = {}
        # What the worker must forget before the next step: request id -> preempted (True) or ended.
        self._forget: dict[str, bool] = {}
        self.num_preemptions = 0
        self.num_preemptions_by_mode = {"recompute": 0, "swap": 0}
        # Distinct LoRA adapters the running requests may use at once (--max-loras; 0: no LoRA).
        self.max_loras = 0
        self.num_steps = 0  # schedule() calls so far (aging counts in these)

    # ---- admission ------------------------------------------------------------------------
    def check_request(self, request: Request) -> None:
        """Rejects a request that could never complete, naming the numbers."""
        check_request_limits(
            request.num_prompt_tokens, request.max_tokens, request.sampling_params.n, self.config,
            self.kv.num_blocks, self.kv.block_size, self.kv.groups,
        )
        if not request.chunkable:
            check_whole_prompt(request.num_prompt_tokens, self.config)

    def add_request(self, request: Request, forks: Sequence[Request] = ()) -> None:
        """Queues a request. `forks` are the other samples of an n > 1 request: they share its
        prompt and are forked off it (sharing its blocks) once its prompt is computed."""
        group = [request, *forks]
        for req in group:
            self.check_request(req)
            if req.request_id in self.requests:
                raise ValueError(f"request id {req.request_id!r} is already in use")
            assert req.prompt_token_ids == request.prompt_token_ids, "forked samples share the prompt"
        if len({r.request_id for r in group}) != len(group):
            raise ValueError(f"request ids {[r.request_id for r in group]} are not distinct")
        for req in group:
            self.requests[req.request_id] = req
            req.status = RequestStatus.WAITING
        self.waiting.append(request, self.num_steps)
        if forks:
            self._pending_forks[request.request_id] = list(forks)

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
            elif req.status == RequestStatus.SWAPPED:
                self.swapped.remove(req)
            elif req in self.waiting:
                self.waiting.remove(req)
            else:
                self._drop_pending_fork(req)
            req.status = status
            self._release(req)
            done.append(req)
        return done

    def _drop_pending_fork(self, req: Request) -> None:
        for parent_id, forks in self._pending_forks.items():
            if req in forks:
                forks.remove(req)
                if not forks:
                    del self._pending_forks[parent_id]
                return
        raise AssertionError(f"{req} is in no queue")

    def _release(self, req: Request) -> None:
        self.kv.free(req)
        self.kv.free_swapped(req)
        self.requests.pop(req.request_id, None)
        if self.proposer is not None:
            self.proposer.release(req)
        # Samples still waiting for this parent's fork go on alone, computing the prompt themselves.
        for fork in self._pending_forks.pop(req.request_id, ()):
            self.waiting.append(fork, self.num_steps)
        if self._worker.pop(req.request_id, None) is not None:
            self._forget[req.request_id] = False  # it ended: the worker drops its random generator too

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self._pending_forks)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped) + self._num_pending_forks()

    def _num_pending_forks(self) -> int:
        # Every unfinished request is in exactly one queue or pending fork (check_integrity).
        return len(self.requests) - len(self.waiting) - len(self.running) - len(self.swapped)

    def _num_seqs(self) -> int:
        """Sequence slots taken: running requests and the samples they will fork."""
        if not self._pending_forks:
            return len(self.running)
        return len(self.running) + sum(len(self._pending_forks.get(r.request_id, ())) for r in self.running)

    # ---- one step -------------------------------------------------------------------------
    def _num_new_tokens(self, req: Request, step: Step, computed: int | None = None) -> int:
        """Tokens to schedule for `req` this step, counting from `computed` (default: its
        num_computed_tokens; an admission passes its prefix-cache hit)."""
        computed = req.num_computed_tokens if computed is None else computed
        n = req.num_tokens - computed
        if not req.chunkable:  # an encoder's prompt runs whole or waits (admission rejects one over the budget)
            return n if n <= step.budget else 0
        if self.config.long_prefill_token_threshold and n > 1:
            n = min(n, self.config.long_prefill_token_threshold)
        n = min(n, step.budget)
        # A prompt chunk (more than the one decode token) counts against the partial-prefill limit
        # and the prompt-token cap of a shared step (core/step.py).
        if n > 1 or computed + n < req.num_tokens:
            if step.partial_left == 0:
                return 0
            n = step.prompt_tokens(req, n)
        return n

    def schedule(self) -> SchedulerOutput:
        step = Step.open(self.config, self.running, len(self.waiting) + len(self.swapped))
        self._schedule_running(step)
        # Admit or resume only when no running request had to be preempted for blocks.
        if not step.preempted:
            schedule_admissions(self, step)
        update_waiting_counters(self, step)
        return self._build_output(step)

    def _schedule_running(self, step: Step) -> None:
        """Running requests, in admission order: a decode token or their next prompt chunk."""
        idx = 0
        if self.proposer is not None:
            self.proposer.begin_step(len(self.running))
        while idx < len(self.running) and step.budget > 0:
            req = self.running[idx]
            n = self._num_new_tokens(req, step)
            if n == 0:
                idx += 1
                continue
            proposals = proposals_for(self.proposer, req, step.budget, self.config.max_model_len) if self.proposer is not None and n == 1 else None
            if proposals:
                blocks = self.kv.allocate_slots(req, 1 + len(proposals))
                if blocks is None:
                    proposals = None  # no room to verify them: an ordinary decode
                else:
                    n = 1 + len(proposals)
            if not proposals:
                blocks = self.kv.allocate_slots(req, n)
            while blocks is None:
                victim = self.policy.pick_victim(self.running)
                pos = self.running.index(victim)
                preempt(self, victim, step)
                if victim is req:
                    break
                if pos < idx:
                    idx -= 1
                blocks = self.kv.allocate_slots(req, n)
            if blocks is None:
                continue  # req itself was preempted; running[idx] is now the next one
            step.take(req, n, proposals)
            step.new_block_ids[req.request_id] = [b.block_id for b in blocks]
            idx += 1

    def _build_output(self, step: Step) -> SchedulerOutput:
        scheduled = step.scheduled
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        ordered: dict[str, int] = {}
        # Batch order: requests the worker knows first, then new ones (worker relies on this).
        for rid, n in scheduled.items():
            req = self.requests[rid]
            if self._worker.get(rid) == WorkerView.HELD:
                cached_reqs.append(
                    CachedRequestData(
                        rid, step.new_block_ids[rid], req.num_computed_tokens, self.kv.replaced_blocks(rid),
                        self.kv.take_trimmed(rid),
                    )
                )
                ordered[rid] = n
        for rid, n in scheduled.items():
            req = self.requests[rid]
            if self._worker.get(rid) != WorkerView.HELD:
                new_reqs.append(
                    NewRequestData(
                        req_id=rid,
                        prompt_token_ids=req.prompt_token_ids,
                        output_token_ids=list(req.output_token_ids),
                        sampling_params=req.sampling_params,
                        eos_token_ids=req.eos_token_ids,
                        block_ids=self.kv.get_block_ids(rid),
                        num_computed_tokens=req.num_computed_tokens,
                        lora_request=req.lora_request,
                        pooling=req.pooling,
                    )
                )
                ordered[rid] = n
        for rid, n in scheduled.items():
            self._worker[rid] = WorkerView.HELD
            self.requests[rid].num_computed_tokens += n  # the one place progress advances
        forked = self._fork_samples(scheduled)
        self.policy.on_step([self.requests[r] for r in scheduled], scheduled)
        swap_out, swap_in, copies = self.kv.take_block_moves()
        out = SchedulerOutput(
            new_reqs=new_reqs,
            cached_reqs=cached_reqs,
            num_scheduled_tokens=ordered,
            total_num_scheduled_tokens=sum(scheduled.values()),
            finished_req_ids=set(self._forget),
            preempted_req_ids={rid for rid, preempted in self._forget.items() if preempted},
            blocks_to_swap_out=swap_out,
            blocks_to_swap_in=swap_in,
            blocks_to_copy=copies,
            forked_reqs=forked,
            num_preempted=len(step.preempted),
            spec_token_ids=step.spec,
        )
        self._forget = {}
        return out

    def _fork_samples(self, scheduled: dict[str, int]) -> list[ForkedRequestData]:
        """Splits the other samples off each parent whose prompt this step completes.

        Each gets the parent's whole block table (ref counts go up, the partly filled last block
        included) and the parent's progress; the worker samples its first token from the parent's
        last logits. Whoever later writes into a still-shared block copies it first.
        """
        forked = []
        for rid in scheduled:
            parent = self.requests[rid]
            if rid not in self._pending_forks or parent.num_computed_tokens < parent.num_tokens:
                continue
            for child in self._pending_forks.pop(rid):
                cid = child.request_id
                self.kv.fork(parent, child)
                child.num_computed_tokens = parent.num_computed_tokens
                child.status = RequestStatus.RUNNING
                child.num_cached_tokens = parent.num_cached_tokens
                child.first_scheduled_time = parent.first_scheduled_time
                self.running.append(child)
                self._worker[cid] = WorkerView.HELD
                forked.append(ForkedRequestData(cid, rid, child.sampling_params, self.kv.get_block_ids(cid)))
        return forked

    def update_from_output(self, so: SchedulerOutput, out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Appends sampled tokens, applies stop rules, frees finished requests; ends the requests
        whose sampling failed with finish_reason "error"."""
        results: list[EngineCoreOutput] = []
        any_finished = False
        for rid, error in out.failed.items():
            req = self.requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING:
                continue
            req.status = RequestStatus.FINISHED_ERROR
            self._release(req)
            any_finished = True
            results.append(EngineCoreOutput(rid, [], finish_reason=req.get_finished_reason(), error=error,
                                            first_scheduled_time=req.first_scheduled_time))
        if out.pooled:
            any_finished |= finish_pooled(self, out, results)  # core/pooling.py
        max_len = self.config.max_model_len
        for i, rid in enumerate(out.req_ids):
            req = self.requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted or preempted since it was scheduled
            new_tokens = out.sampled_token_ids[i]
            prompt_lp = out.prompt_logprobs.get(rid)
            if so.spec_token_ids and rid in so.spec_token_ids and new_tokens:
                roll_back(self.kv, req, len(so.spec_token_ids[rid]), len(new_tokens) - 1)
                self.spec_stats.record(len(so.spec_token_ids[rid]), len(new_tokens) - 1)  # type: ignore[union-attr]
                self.proposer.record(rid, len(so.spec_token_ids[rid]), len(new_tokens) - 1)  # type: ignore[union-attr]
            if not new_tokens and prompt_lp is None:
                continue  # an unfinished prompt chunk
            appended: list[int] = []
            for t in new_tokens:
                req.append_output_token(t)
                appended.append(t)
                if req.check_stop(max_len):
                    break
                if req.structured is not None and req.structured.accept(t, req.all_token_ids):
                    # The structure is complete (or the token broke it, a fault of the mask).
                    req.status = RequestStatus.FINISHED_STOPPED
                    break
            logprobs = out.logprobs.get(rid)
            if logprobs is not None and len(appended) < len(new_tokens):  # tokens past a stop are dropped
                logprobs = Logprobs(logprobs.token_ids[: len(appended)], logprobs.logprobs[: len(appended)],
                                    logprobs.ranks[: len(appended)])
            result = EngineCoreOutput(
                req_id=rid,
                new_token_ids=appended,
                logprobs=logprobs,
                prompt_logprobs=prompt_lp,
                num_cached_tokens=max(req.num_cached_tokens, 0),
                first_scheduled_time=req.first_scheduled_time,
            )
            if req.is_finished:
                if req.structured is not None and req.structured.error is not None:
                    req.status = RequestStatus.FINISHED_ERROR
                    result.error = req.structured.error
                result.finish_reason = req.get_finished_reason()
                result.stop_reason = req.stop_reason
                self._release(req)
                any_finished = True
            results.append(result)
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
        if self.kv.groups.hybrid:  # window groups give back the blocks their next queries skip
            for rid in so.num_scheduled_tokens:
                req = self.requests.get(rid)
                if req is not None and req.status == RequestStatus.RUNNING:
                    self.kv.free_outside_windows(req)
        return results

    # ---- introspection --------------------------------------------------------------------
    def get_stats(self) -> SchedulerStats:
        kv = self.kv.stats()
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting) + self._num_pending_forks(),
            num_swapped=len(self.swapped),
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_queries,
            prefix_cache_hits=kv.prefix_hits,
            num_preemptions=self.num_preemptions,
            num_preemptions_by_mode=dict(self.num_preemptions_by_mode),
            swap_usage=kv.swap_usage,
            num_cow_copies=kv.num_cow_copies,
            spec_decode=None if self.spec_stats is None else self.spec_stats.copy(),
        )

    def check_integrity(self) -> None:
        """Invariants of queues and blocks, device and host (run by tests after every step)."""
        self.kv.check_integrity()
        self.waiting.check_integrity()
        pending = [r for forks in self._pending_forks.values() for r in forks]
        queues = (self.running, self.waiting, self.swapped, pending)
        ids = [r.request_id for q in queues for r in q]
        assert len(ids) == len(set(ids)), "a request is queued twice"
        assert set(ids) == set(self.requests), "queues and the request table disagree"
        assert set(self.kv.req_blocks) <= {r.request_id for r in self.running}, "a non-running request holds blocks"
        assert set(self.kv.swapped_blocks) == {r.request_id for r in self.swapped}, "swapped requests and host blocks"
        assert self._num_seqs() <= self.config.max_num_seqs
        for r in self.running:
            assert r.status == RequestStatus.RUNNING
            nblocks = len(self.kv.req_blocks.get(r.request_id, ())) // self.kv.num_groups
            assert nblocks >= self.kv.blocks_needed(r.num_computed_tokens), f"{r} has too few blocks"
            self.kv.check_windows(r)
        for r in self.swapped:
            assert r.status == RequestStatus.SWAPPED
            assert len(self.kv.swapped_blocks[r.request_id]) == self.kv.held_entries(r.num_computed_tokens)
        for r in self.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert r.num_computed_tokens == 0
        for parent_id, forks in self._pending_forks.items():
            assert parent_id in self.requests and forks
            assert all(r.status == RequestStatus.WAITING and r.num_computed_tokens == 0 for r in forks)
