"""The scheduler's admissions: swapped and waiting requests enter the running set in the policy's
order while the step's budget, the sequence slots and the KV blocks last; and the per-step
counters that aging and the fair policy's time slice read. No torch."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pagedllm.core.preemption import preempt
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.step import Step


def schedule_admissions(scheduler: Any, step: Step) -> None:
    """Swapped and waiting requests, in the policy's admission order, while budget, sequence
    slots and blocks last; stops at the first that does not fit (see policies: aging). Each pick
    costs O(swapped + buckets + log waiting) (core/waiting_queue.py), never a scan of the waiting."""
    skip = {r.request_id for r in step.preempted}  # never back in the step that preempted it
    policy = scheduler.policy

    def eligible(r: Request) -> bool:
        # A request whose grammar is still compiling waits; the others go on.
        return r.request_id not in skip and (r.structured is None or r.structured.ready)

    while step.budget > 0:
        lora_ok = lora_admissible(scheduler.running, scheduler.max_loras) if scheduler.max_loras else None
        req = scheduler.waiting.next_eligible(eligible, lora_ok)
        resumable = [r for r in scheduler.swapped if eligible(r) and (lora_ok is None or lora_ok(r.lora_int_id))]
        if resumable:
            resume = policy.next_waiting(resumable)
            if req is None or policy.admission_key(resume) <= policy.admission_key(req):
                req = resume  # swapped requests go first among equals
        if req is None:
            break
        if not admit(scheduler, req, step):
            break
        skip.update(r.request_id for r in step.preempted)


def lora_admissible(running: list[Request], max_loras: int) -> Callable[[int], bool]:
    """Whether a request of a LoRA adapter (by id; 0: none) can run beside the running requests'
    (at most max_loras distinct adapters run at once); the others wait without blocking these."""
    active = {r.lora_int_id for r in running if r.lora_int_id}
    if len(active) < max_loras:
        return lambda lora_id: True
    return lambda lora_id: not lora_id or lora_id in active


def admit(scheduler: Any, req: Request, step: Step) -> bool:
    """Admits (or resumes) one request, displacing running ones if its policy allows."""
    kv = scheduler.kv
    swapped = req.status == RequestStatus.SWAPPED
    extra_seqs = 1 + len(scheduler._pending_forks.get(req.request_id, ()))
    while True:
        hits, num_hit = ([], 0) if swapped or not req.uses_prefix_cache else kv.get_computed_blocks(req)
        n = scheduler._num_new_tokens(req, step, None if swapped else num_hit)
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
    req.running_steps = 0
    scheduler.running.append(req)
    step.take(req, n)
    return True


def update_waiting_counters(scheduler: Any, step: Step) -> None:
    """Aging of waiting and swapped requests (by the step count at which each entered its queue);
    time-slice steps of running ones (fair share). O(swapped + newly aged + scheduled)."""
    scheduler.num_steps += 1
    now, limit = scheduler.num_steps, scheduler.config.max_waiting_steps
    scheduler.waiting.end_step(now, limit)
    for req in scheduler.swapped:
        if now - req.queued_step >= limit:
            req.aged = True
    users = scheduler.waiting.users
    if len(users) < 2:
        users = {*users, *(r.user for r in scheduler.swapped)}
    for rid in step.scheduled:
        req = scheduler.requests[rid]
        if len(users) > 1 or (users and req.user not in users):
            req.running_steps += 1  # ran while a request of another user waited
