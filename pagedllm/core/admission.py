"""The scheduler's admissions: swapped and waiting requests enter the running set in the policy's
order while the step's budget, the sequence slots and the KV blocks last; and the per-step
counters that aging and the fair policy's time slice read. No torch."""

from __future__ import annotations

import time
from typing import Any

from pagedllm.core.preemption import preempt
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.step import Step


def schedule_admissions(scheduler: Any, step: Step) -> None:
    """Swapped and waiting requests, in the policy's admission order, while budget, sequence
    slots and blocks last; stops at the first that does not fit (see policies: aging)."""
    skip = {r.request_id for r in step.preempted}  # never back in the step that preempted it
    while step.budget > 0:
        candidates = [*scheduler.swapped, *scheduler.waiting] if scheduler.swapped else scheduler.waiting
        if skip:
            candidates = [r for r in candidates if r.request_id not in skip]
        # A request whose grammar is still compiling waits; the others go on.
        candidates = [r for r in candidates if r.structured is None or r.structured.ready]
        if scheduler.max_loras:
            candidates = lora_admissible(candidates, scheduler.running, scheduler.max_loras)
        if not candidates:
            break
        req = scheduler.policy.next_waiting(candidates)
        if not admit(scheduler, req, step):
            break
        skip.update(r.request_id for r in step.preempted)


def lora_admissible(candidates: list[Request], running: list[Request], max_loras: int) -> list[Request]:
    """The candidates whose LoRA adapter can run beside the running requests' (at most
    max_loras distinct adapters run at once); the others wait without blocking these."""
    active = {r.lora_int_id for r in running if r.lora_int_id}
    if len(active) < max_loras:
        return candidates
    return [r for r in candidates if not r.lora_int_id or r.lora_int_id in active]


def admit(scheduler: Any, req: Request, step: Step) -> bool:
    """Admits (or resumes) one request, displacing running ones if its policy allows."""
    kv = scheduler.kv
    swapped = req.status == RequestStatus.SWAPPED
    extra_seqs = 1 + len(scheduler._pending_forks.get(req.request_id, ()))
    while True:
        hits, num_hit = ([], 0) if swapped or not req.uses_prefix_cache else kv.get_computed_blocks(req)
        n = scheduler._num_new_tokens(req, step.budget, step.partial_left, None if swapped else num_hit)
        if n == 0:
            return False
        has_slot = scheduler._num_seqs() + extra_seqs <= scheduler.config.max_num_seqs
        if has_slot and (kv.can_swap_in(req, n) if swapped else kv.can_fit(req, n, hits)):
            break
        # Not a request whose blocks keyed in this step were already hit by an admission.
        victim = scheduler.policy.displace(req, [r for r in scheduler.running if not kv.lends_unwritten_blocks(r)])
        if victim is None:
            return False
        preempt(scheduler, victim, step)  # then look again: the victim may have dropped cached keys
    if swapped:
        blocks = kv.swap_in(req, n)
        assert blocks is not None
        scheduler.swapped.remove(req)
    else:
        blocks = kv.allocate_slots(req, n, hits)
        assert blocks is not None
        req.num_computed_tokens = num_hit
        kv.record_prefix_query(req.num_tokens, num_hit)
        scheduler.waiting.remove(req)
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hit
            req.first_scheduled_time = time.time()
    req.status = RequestStatus.RUNNING
    req.waiting_steps = 0
    req.running_steps = 0
    scheduler.running.append(req)
    step.take(req, n)
    return True


def update_waiting_counters(scheduler: Any, step: Step) -> None:
    """Aging of waiting and swapped requests; time-slice steps of running ones (fair share)."""
    queued = [*scheduler.waiting, *scheduler.swapped]
    for req in queued:
        req.waiting_steps += 1
        if req.waiting_steps >= scheduler.config.max_waiting_steps:
            req.aged = True
    users = {r.user for r in queued}
    for rid in step.scheduled:
        req = scheduler.requests[rid]
        if len(users) > 1 or (users and req.user not in users):
            req.running_steps += 1  # ran while a request of another user waited
