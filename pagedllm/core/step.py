"""What one `Scheduler.schedule()` call hands out (`Step`), and what the worker holds of each
request it has been sent (`WorkerView`). No torch.

The prompt-token cap of a shared step (`max_num_shared_prefill_tokens` = P). A step that more
than one request could use (running and waiting requests together) carries at most P prompt
tokens; decode tokens come on top, all within `max_num_batched_tokens`. A lone request keeps the
whole budget, so one long prompt is prefilled at full speed. Why: a step's duration grows with its
prompt tokens, and a request's first token comes at the end of the step that computes its last
prompt chunk. Under a closed loop of chat streams with similar lengths, requests admitted
together finish together and come back together: with the whole budget open to prompts, a wave
of k prompts of p tokens shares about k p / budget long steps, every one of them gets its first
token at the end of those steps, and the decodes beside them wait as long for their next token.
With P about one or two prompts, a wave's prompts finish one or two per step in arrival order
(shortest wait first, as in shortest-job-first), so its mean time to first token falls towards
half of its prefill time; the staggered finishes break the waves up, and later requests arrive
one at a time and wait one short step each. The total work is the same. Encoder prompts (not
chunkable) are not capped: they run whole.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedllm.config import SchedulerConfig
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
    prefill_left: int = -1  # prompt tokens still allowed this step; -1: only the budget limits them

    @classmethod
    def open(cls, config: SchedulerConfig, running: Sequence[Request], num_waiting: int = 0) -> Step:
        """A step's allowances: the token budget, the prompt-chunk count, and the prompt-token
        cap when more than one request (running, or waiting and swapped: `num_waiting`) shares the
        step (see the module's docstring)."""
        step = cls(config.max_num_batched_tokens, config.max_num_partial_prefills or -1)
        cap = config.max_num_shared_prefill_tokens
        if cap and len(running) + num_waiting > 1:
            step.prefill_left = cap
        return step

    def prompt_tokens(self, req: Request, n: int) -> int:
        """How many of `n` prompt tokens `req` may take under the cap."""
        return n if self.prefill_left < 0 or not req.chunkable else min(n, self.prefill_left)

    def take(self, req: Request, n: int, proposals: list[int] | None = None) -> None:
        self.scheduled[req.request_id] = n
        self.budget -= n
        if proposals:
            self.spec[req.request_id] = proposals
        elif req.num_computed_tokens + n < req.num_tokens or n > 1:
            self.partial_left -= 1
            if self.prefill_left >= 0:
                self.prefill_left = max(0, self.prefill_left - n)
