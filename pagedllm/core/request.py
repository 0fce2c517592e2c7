"""A request as the scheduler sees it: token ids, progress counters and status. No torch here."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Ordered: every finished status compares greater than PREEMPTED.

    WAITING: queued, never admitted or waiting to be forked off its parent (n > 1); RUNNING: holds
    KV blocks; SWAPPED: preempted with its blocks moved to the host swap pool (keeps its computed
    tokens); PREEMPTED: preempted by recompute (back in the waiting queue with nothing computed).
    """

    WAITING = enum.auto()
    RUNNING = enum.auto()
    SWAPPED = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # the engine could not continue this request (its sampling raised)

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One sequence to generate. `num_computed_tokens` catches up with `num_tokens` step by step.

    Tokens `all_token_ids[:num_computed_tokens]` have their K/V in the cache; the scheduler hands
    out the rest (a prompt chunk, or the one newly sampled token) under the step's token budget.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: set[int] | frozenset[int] = frozenset(),
        arrival_time: float | None = None,
        priority: int = 0,
        user: str | None = None,
        cache_salt: str | None = None,
        max_tokens: int | None = None,
        lora_request: tuple[str, int, str] | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.user = user
        self.cache_salt = cache_salt
        # The LoRA adapter (name, id, folder) it runs with; None: the base model.
        self.lora_request = tuple(lora_request) if lora_request else None
        self.lora_int_id = int(lora_request[1]) if lora_request else 0
        # Resolved limit on generated tokens (the engine fills in max_model_len - prompt when unset).
        self.max_tokens = max_tokens if max_tokens is not None else (sampling_params.max_tokens or 1)

        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        # Prompt tokens served from the prefix cache at first admission (for usage reporting).
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        # sha256 keys of this request's full blocks, extended as tokens arrive (prefix caching).
        self.block_hashes: list[bytes] = []
        # Scheduler bookkeeping: its step count when the request last entered the swapped queue
        # (the waiting queue stamps its own entries); steps run since admission while a request of
        # another user waited (fair share's time slice); `aged` is set once it has waited (or been
        # swapped) max_waiting_steps steps in a row, and stays set.
        self.first_scheduled_time: float | None = None
        # Structured output (grammar, matcher, thinking state): set by the engine core for requests
        # that ask for a structure or a thinking budget (pagedllm/structured_output); the scheduler
        # only asks it `ready` and feeds it the sampled tokens.
        self.structured: Any = None
        # Pooling (pagedllm/pooling_params.PoolingParams, set by the engine core): the prompt's
        # hidden states are pooled and the request ends with its last prompt chunk, sampling nothing.
        self.pooling: Any = None
        # False for an encoder's prompt: attention spans the whole prompt, so it runs in one step.
        self.chunkable = True
        self.queued_step = 0
        self.running_steps = 0
        self.aged = False

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    @property
    def is_prefill_done(self) -> bool:
        return self.num_computed_tokens >= self.num_tokens

    @property
    def remaining_work(self) -> int:
        """Tokens still to compute plus tokens still to generate (the srtf key)."""
        return (self.num_tokens - self.num_computed_tokens) + (self.max_tokens - self.num_output_tokens)

    @property
    def uses_prefix_cache(self) -> bool:
        """Whether admission may take cached prefix blocks (a pooling request: only where its
        pooling needs no hidden state of the positions a hit skips)."""
        return self.pooling is None or self.pooling.uses_prefix_cache

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def get_finished_reason(self) -> str | None:
        return _FINISH_REASONS.get(self.status)

    def check_stop(self, max_model_len: int) -> bool:
        """Sets a finished status when the last generated token ends the request."""
        params = self.sampling_params
        if self.num_output_tokens >= params.min_tokens and self.output_token_ids:
            last = self.output_token_ids[-1]
            if not params.ignore_eos and last in self.eos_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in params.all_stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
                return True
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, computed={self.num_computed_tokens}, "
            f"tokens={self.num_tokens}, prompt={self.num_prompt_tokens})"
        )
