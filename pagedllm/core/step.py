"""What one `Scheduler.schedule()` call hands out (`Step`), and what the worker holds of each
request it has been sent (`WorkerView`). No torch."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pagedllm.core.request import Request


class WorkerView(enum.Enum):
    """What the worker holds of a request it has been sent."""

    HELD = 1
    """Its state (tokens, block table, random generator): send only what changed."""
    DROPPED = 2
    """Preempted: the worker dropped it but keeps its random generator; send it in full again."""


@dataclass
class Step:
    """What one schedule() call has handed out so far."""

    budget: int
    partial_left: int  # prompt chunks still allowed this step; -1: no limit
    scheduled: dict[str, int] = field(default_factory=dict)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)
    # Speculating requests: their proposals, verified after their last token (n = 1 + proposals).
    spec: dict[str, list[int]] = field(default_factory=dict)

    def take(self, req: Request, n: int, proposals: list[int] | None = None) -> None:
        self.scheduled[req.request_id] = n
        self.budget -= n
        if proposals:
            self.spec[req.request_id] = proposals
        elif req.num_computed_tokens + n < req.num_tokens or n > 1:
            self.partial_left -= 1
