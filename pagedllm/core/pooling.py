"""The scheduler's part of pooling requests: an encoder's prompt runs whole, and a pooling request
ends with its last prompt chunk, carrying its pooled output instead of a sampled token. No torch."""

from __future__ import annotations

from typing import Any

from pagedllm.config import SchedulerConfig
from pagedllm.core.request import RequestStatus
from pagedllm.core.scheduler_output import EngineCoreOutput, ModelRunnerOutput


def check_whole_prompt(num_prompt_tokens: int, config: SchedulerConfig) -> None:
    """An encoder's prompt is never chunked: it must fit one step's token budget."""
    if num_prompt_tokens > config.max_num_batched_tokens:
        raise ValueError(
            f"the prompt has {num_prompt_tokens} tokens, more than max_num_batched_tokens="
            f"{config.max_num_batched_tokens}: an encoder attends over the whole prompt at once, so its prompt "
            "runs in one step; shorten it or raise --max-num-batched-tokens"
        )


def finish_pooled(scheduler: Any, out: ModelRunnerOutput, results: list[EngineCoreOutput]) -> bool:
    """Ends the pooling requests whose last prompt chunk ran this step, with their pooled output
    (appended to `results`); whether any ended."""
    done = False
    for rid, pooled in out.pooled.items():
        req = scheduler.requests.get(rid)
        if req is None or req.status != RequestStatus.RUNNING:
            continue  # aborted or preempted since it was scheduled
        req.status = RequestStatus.FINISHED_STOPPED
        scheduler._release(req)
        done = True
        results.append(EngineCoreOutput(rid, [], finish_reason=req.get_finished_reason(), pooled=pooled,
                                        num_cached_tokens=max(req.num_cached_tokens, 0),
                                        first_scheduled_time=req.first_scheduled_time))
    return done
