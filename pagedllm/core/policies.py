"""Who is served first: the order of admission from the waiting queue and the choice of victim.

Every policy shares one aging rule: a request that has waited `max_waiting_steps` steps is
admitted before any other waiting request (oldest first) and is never chosen as a victim by a
request that has waited less, so no request waits forever.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedllm.config import SchedulerConfig
from pagedllm.core.request import Request


class Policy:
    """FCFS: arrival order. Subclasses change `key`; lower keys are served first."""

    name = "fcfs"
    # True when a waiting request may preempt a running one that ranks below it.
    preempts_for_waiting = False

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config

    def key(self, request: Request) -> tuple:
        return (request.arrival_time,)

    def _aged(self, request: Request) -> bool:
        return request.waiting_steps >= self.config.max_waiting_steps

    def admission_key(self, request: Request) -> tuple:
        # Aged requests first (oldest arrival first), then the policy's own order.
        if self._aged(request):
            return (0, request.arrival_time)
        return (1, *self.key(request))

    def next_waiting(self, waiting: Sequence[Request]) -> Request:
        return min(waiting, key=self.admission_key)

    def pick_victim(self, running: Sequence[Request]) -> Request:
        """The running request to preempt when blocks run out: the one ranked last."""
        return max(running, key=self.admission_key)

    def on_step(self, scheduled: Sequence[Request], num_tokens: dict[str, int]) -> None:
        """Accounting hook called once per step with the requests that ran."""


class PriorityPolicy(Policy):
    """Lower `priority` first, ties by arrival; a waiting request may preempt a lower one."""

    name = "priority"
    preempts_for_waiting = True

    def key(self, request: Request) -> tuple:
        return (request.priority, request.arrival_time)


class SRTFPolicy(Policy):
    """Shortest remaining work first: prompt tokens to compute plus tokens to generate."""

    name = "srtf"

    def key(self, request: Request) -> tuple:
        return (request.remaining_work, request.arrival_time)


class FairPolicy(Policy):
    """Weighted fair share of tokens per user: the user with the least weighted service goes first."""

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
