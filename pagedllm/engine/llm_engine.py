"""The offline engine: add and abort requests; `step()` = schedule, execute, update.

The front end (tokenizer, validation, output processing) and the engine core run in this one
process; the server runs the same pieces split over two processes (see async_engine.py)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.core.request import RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.core import EngineCore
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.processor import Processor, PromptType
from pagedllm.engine.stats import IterationStats
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizer import TokenizerWrapper

logger = logging.getLogger(__name__)

__all__ = ["LLMEngine", "PromptType", "load_frontend_tokenizer"]


def load_frontend_tokenizer(config: EngineConfig) -> TokenizerWrapper:
    from pagedllm.models.loader import load_tokenizer, resolve_model

    mc = config.model_config
    return TokenizerWrapper(load_tokenizer(resolve_model(mc.tokenizer or mc.path)))


class LLMEngine:
    def __init__(self, config: EngineConfig, log_stats: bool = True) -> None:
        self.config = config
        self.model_config = config.model_config
        self.tokenizer = load_frontend_tokenizer(config)
        self.core = EngineCore(config)
        self.num_blocks = self.core.num_blocks
        self.processor = Processor(config, self.tokenizer, self.num_blocks)
        self.output_processor = OutputProcessor(self.tokenizer.rust)
        self.log_stats = log_stats
        self.last_iteration_stats = IterationStats()

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def executor(self) -> Any:
        return self.core.executor

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args.create_engine_config())

    # ---- requests -------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType, add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt, validated against the vocabulary."""
        return self.processor.tokenize_prompt(prompt, add_special_tokens)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        user: str | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Validates and queues a request; raises ValueError (queuing nothing) on bad input."""
        params = params or SamplingParams()
        text, req = self.processor.make_request(
            request_id, prompt, params, self.output_processor, arrival_time, priority, user, cache_salt, lora_request
        )
        self.output_processor.add_request(request_id, text, req.prompt_token_ids, params, req.arrival_time, priority)
        self.core.add_request(req)

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        """Ends requests now and frees their KV blocks."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            self.core.abort_requests(self.output_processor.remove_request(rid))

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.requests)

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule tokens, run the model on them, turn the results into RequestOutputs."""
        core_outputs, step = self.core.step()
        stats = IterationStats(num_scheduled_tokens=step.num_scheduled_tokens, num_preempted=step.num_preempted,
                               step_time=step.step_time)
        result = self.output_processor.process_outputs(core_outputs, stats)
        if result.stopped:
            self.core.abort_requests(result.stopped, RequestStatus.FINISHED_STOPPED)
        if result.failed_seq_ids:
            self.core.abort_requests(result.failed_seq_ids)
        for rid, err in result.failed.items():
            logger.error("request %s failed: %r", rid, err)
        if result.failed:
            first = next(iter(result.failed.values()))
            raise RuntimeError(f"requests {sorted(result.failed)} failed: {first!r}") from first
        self.last_iteration_stats = stats
        return result.outputs

    def reset_prefix_cache(self) -> None:
        self.core.reset_prefix_cache()

    def get_tokenizer(self) -> TokenizerWrapper:
        return self.tokenizer

    def shutdown(self) -> None:
        """Stops the executor's worker processes, if it has any."""
        self.core.shutdown()
