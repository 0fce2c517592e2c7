"""Per-step statistics handed to stat loggers (Prometheus, the periodic log line)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class FinishedRequestStats:
    finish_reason: str
    e2e_latency: float
    queue_time: float
    prefill_time: float
    decode_time: float
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclass
class IterationStats:
    """What happened in one engine step."""

    num_prompt_tokens: int = 0
    """Prompt tokens of requests that produced their first token this step."""
    num_generation_tokens: int = 0
    num_scheduled_tokens: int = 0
    num_preempted: int = 0
    step_time: float = 0.0
    """Seconds the engine core spent in this step (schedule, execute, update)."""
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
