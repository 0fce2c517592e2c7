"""Who is served first: the order of admission, the choice of victim, and who may displace whom.

Policies: fcfs (arrival order), priority (lower `priority` first, ties by arrival; a waiting
request may preempt a running one of strictly lower priority), srtf (shortest remaining work:
prompt tokens still to compute plus tokens still to generate) and fair (weighted fair share of
tokens per user; a running request that has held its place for `time_slice` steps yields it to a
waiting request of a less-served user).

Swapped requests resume before new admissions (under priority: before new admissions of the same
priority, so that a swapped low-priority request never blocks a high-priority arrival).

Aging, shared by every policy. A request that has spent `max_waiting_steps` = W steps in the
waiting or swapped queue becomes *aged* for the rest of its life. Then:
  1. aged requests are admitted (or resumed) before every other one, oldest arrival first, and
     the admission loop stops at the first request that does not fit, so while an aged request
     waits nobody else is admitted and the running set only shrinks;
  2. an aged request is never displaced by a waiting one (priority, time slice), and a victim for
     lack of blocks is a non-aged request whenever one runs, otherwise the aged one that arrived
     last: the oldest aged request, once admitted, runs to completion.
Bound: let D be the steps the running set needs to finish with nobody admitted (at most the sum
of its requests' remaining tokens plus one step per request, since every step computes a token or
preempts a request; ceil(max_model_len / chunk) + max_tokens when the token budget covers every
running request's chunk, chunk = long_prefill_token_threshold). A request that arrives at step a
is admitted at the latest at step a + W + (k + 1) * (D + 1), where k is the number of aged
requests that arrived before it. tests/unit/test_scheduler_sim.py asserts this bound per request.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedllm.config import SchedulerConfig
from pagedllm.core.request import Request, RequestStatus


class Policy:
    """FCFS: arrival order. Subclasses change `key`; lower keys are served first."""

    name = "fcfs"

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config

    def key(self, request: Request) -> tuple:
        return (request.arrival_time,)

    def rank(self, request: Request) -> tuple:
        """The policy's order with aging on top: aged requests first, oldest arrival first."""
        if request.aged:
            return (0, request.arrival_time)
        return (1, *self.key(request))

    def admission_key(self, request: Request) -> tuple:
        if request.aged:
            return (0, request.arrival_time)
        return (1, request.status != RequestStatus.SWAPPED, *self.key(request))

    def bucket(self, request: Request) -> object:
        """What a non-aged waiting request's order depends on beyond `queue_key` (the waiting
        queue keeps one heap per value; see core/waiting_queue.py)."""
        return None

    def queue_key(self, request: Request) -> tuple:
        """Orders the waiting requests of one bucket as `admission_key` does, and does not change
        while they wait (the waiting queue's heap key)."""
        return self.admission_key(request)

    def next_waiting(self, candidates: Sequence[Request]) -> Request:
        """The next request to admit or resume, among waiting and swapped ones."""
        return min(candidates, key=self.admission_key)

    def pick_victim(self, running: Sequence[Request]) -> Request:
        """The running request to preempt when blocks run out: the one ranked last."""
        return max(running, key=self.rank)

    def displace(self, candidate: Request, running: Sequence[Request]) -> Request | None:
        """A running request that the waiting `candidate` may preempt to take its place, if any."""
        return None

    def on_step(self, scheduled: Sequence[Request], num_tokens: dict[str, int]) -> None:
        """Accounting hook called once per step with the requests that ran."""


class PriorityPolicy(Policy):
    """Lower `priority` first, ties by arrival; a waiting request may preempt a lower one."""

    name = "priority"

    def key(self, request: Request) -> tuple:
        return (request.priority, request.arrival_time)

    def admission_key(self, request: Request) -> tuple:
        if request.aged:
            return (0, request.arrival_time)
        return (1, request.priority, request.status != RequestStatus.SWAPPED, request.arrival_time)

    def displace(self, candidate: Request, running: Sequence[Request]) -> Request | None:
        victims = [r for r in running if not r.aged and r.priority > candidate.priority]
        return max(victims, key=self.rank) if victims else None


class SRTFPolicy(Policy):
    """Shortest remaining work first: prompt tokens to compute plus tokens to generate."""

    name = "srtf"

    def key(self, request: Request) -> tuple:
        return (request.remaining_work, request.arrival_time)


class FairPolicy(Policy):
    """Weighted fair share of tokens per user: the user with the least weighted service goes first.

    Service is counted in scheduled tokens (prompt and generated) divided by the user's weight.
    A running request of another user that has run `time_slice` steps since its admission yields
    its place to a waiting request whose user has less weighted service than its own.
    """

    name = "fair"

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.served: dict[str | None, float] = {}

    def weight(self, user: str | None) -> float:
        return self.config.user_weights.get(user or "", 1.0)

    def virtual_time(self, user: str | None) -> float:
        return self.served.get(user, 0.0) / self.weight(user)

    def key(self, request: Request) -> tuple:
        return (self.virtual_time(request.user), request.arrival_time)

    def bucket(self, request: Request) -> object:
        return request.user  # a user's virtual time changes every step: one heap per user

    def queue_key(self, request: Request) -> tuple:
        if request.aged:
            return (0, request.arrival_time)
        return (1, request.status != RequestStatus.SWAPPED, request.arrival_time)

    def displace(self, candidate: Request, running: Sequence[Request]) -> Request | None:
        mine = self.virtual_time(candidate.user)
        victims = [
            r
            for r in running
            if not r.aged
            and r.user != candidate.user
            and r.running_steps >= self.config.time_slice
            and self.virtual_time(r.user) > mine
        ]
        return max(victims, key=self.rank) if victims else None

    def on_step(self, scheduled: Sequence[Request], num_tokens: dict[str, int]) -> None:
        for req in scheduled:
            self.served[req.user] = self.served.get(req.user, 0.0) + num_tokens[req.request_id]


def make_policy(config: SchedulerConfig) -> Policy:
    policies: dict[str, type[Policy]] = {
        "fcfs": Policy,
        "priority": PriorityPolicy,
        "srtf": SRTFPolicy,
        "fair": FairPolicy,
    }
    return policies[config.policy](config)
