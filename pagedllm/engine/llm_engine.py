"""The engine: add and abort requests; `step()` = schedule, execute, update."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, Union

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.preemption import PreemptionCostModel
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.output_processor import OutputProcessor, child_id
from pagedllm.engine.stats import IterationStats
from pagedllm.executor import create_executor
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizer import TokenizerWrapper

logger = logging.getLogger(__name__)

# A prompt: text, token ids, or vLLM's dict forms {"prompt": ...} / {"prompt_token_ids": [...]}.
PromptType = Union[str, list[int], dict[str, Any]]


class LLMEngine:
    def __init__(self, config: EngineConfig, log_stats: bool = True) -> None:
        from pagedllm.models.loader import load_tokenizer, resolve_model

        t0 = time.perf_counter()
        self.config = config
        mc, cc, sc = config.model_config, config.cache_config, config.scheduler_config
        self.model_config = mc
        source = resolve_model(mc.tokenizer or mc.path)
        self.tokenizer = TokenizerWrapper(load_tokenizer(source))
        self.executor = create_executor(config)
        num_blocks = self.executor.determine_num_blocks()
        self.executor.initialize_kv_cache(num_blocks)
        # The host swap pool exists only for preemption modes that can swap.
        num_swap_blocks = self.executor.determine_num_swap_blocks() if sc.preemption_mode != "recompute" else 0
        self.executor.initialize_swap_space(num_swap_blocks)
        self.preemption_costs = self._measure_preemption_costs() if sc.preemption_mode == "auto" else None
        kv = KVCacheManager(num_blocks, cc.block_size, cc.enable_prefix_caching, num_swap_blocks)
        self.scheduler = Scheduler(sc, kv, self.preemption_costs)
        self.output_processor = OutputProcessor(self.tokenizer.rust)
        self.log_stats = log_stats
        self.num_blocks = num_blocks
        self.last_iteration_stats = IterationStats()
        capacity = num_blocks * cc.block_size
        logger.info(
            "KV cache: %d blocks of %d tokens = %d tokens (%.2f GiB, %s); maximum concurrency at "
            "max_model_len=%d: %.2fx; token budget %d per step, at most %d sequences; %s policy, %s "
            "preemption (%d host swap blocks); ready in %.1f s",
            num_blocks,
            cc.block_size,
            capacity,
            num_blocks * cc.block_size * mc.kv_bytes_per_token() / (1 << 30),
            mc.kv_cache_dtype,
            mc.max_model_len,
            capacity / mc.max_model_len,
            sc.max_num_batched_tokens,
            sc.max_num_seqs,
            sc.policy,
            sc.preemption_mode,
            num_swap_blocks,
            time.perf_counter() - t0,
        )

    def _measure_preemption_costs(self) -> PreemptionCostModel:
        """Measures FLOP/s and block-copy bytes/s once, for preemption mode auto."""
        mc, bs = self.model_config, self.config.cache_config.block_size
        flops, copy = self.executor.measure_preemption_rates()
        costs = PreemptionCostModel(
            flops_per_second=flops,
            copy_bytes_per_second=copy,
            flops_per_token=self.executor.flops_per_token(),
            attention_flops_per_pair=4.0 * mc.num_layers * mc.num_heads * mc.head_dim,
            kv_bytes_per_block=mc.kv_bytes_per_token() * bs,
        )
        logger.info(
            "Preemption costs: %.1f GFLOP/s, %.2f GB/s block copies; swapping beats recompute from %.0f tokens",
            flops / 1e9, copy / 1e9, costs.break_even_tokens(bs),
        )
        return costs

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args.create_engine_config())

    # ---- requests -------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType, add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt, validated against the vocabulary."""
        text: str | None
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                text, ids = prompt["prompt"], None
            else:
                raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        elif isinstance(prompt, str):
            text, ids = prompt, None
        elif isinstance(prompt, (list, tuple)):
            text, ids = None, list(prompt)
        else:
            raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")
        if ids is None:
            if not isinstance(text, str):
                raise ValueError(f"prompt text must be a string, got {type(text).__name__}")
            ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        if not ids:
            raise ValueError("The decoder prompt cannot be empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:8]} are out of vocabulary (vocab size {vocab})")
        return text, ids

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        user: str | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """Validates and queues a request; raises ValueError (queuing nothing) on bad input."""
        params = params or SamplingParams()
        if request_id in self.output_processor.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self.tokenize_prompt(prompt)
        params.verify_vocab(self.model_config.vocab_size)
        arrival = time.time() if arrival_time is None else arrival_time
        max_len = self.model_config.max_model_len
        max_tokens = params.max_tokens if params.max_tokens is not None else max(max_len - len(ids), 1)
        if params.seed is not None and params.n > 1:
            child_params = [params.clone() for _ in range(params.n)]
            for i, p in enumerate(child_params):
                p.seed = params.seed + i  # the n samples of a seeded request differ from each other
        else:
            child_params = [params] * params.n
        requests = [
            Request(
                seq_id, ids, child_params[i], self.model_config.eos_token_ids, arrival, priority, user, cache_salt,
                max_tokens,
            )
            for i, seq_id in enumerate(child_id(request_id, i, params.n) for i in range(params.n))
        ]
        for req in requests:
            self.scheduler.check_request(req)
        self.output_processor.add_request(request_id, text, ids, params, arrival, priority)
        # Sample 0 computes the prompt; the others are forked off it, sharing its blocks.
        self.scheduler.add_request(requests[0], forks=requests[1:])

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        """Ends requests now and frees their KV blocks."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            seq_ids = self.output_processor.remove_request(rid)
            self.scheduler.finish_requests(seq_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.requests)

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule tokens, run the model on them, turn the results into RequestOutputs."""
        so = self.scheduler.schedule()
        out = self.executor.execute_model(so)
        core_outputs = self.scheduler.update_from_output(so, out)
        stats = IterationStats(num_scheduled_tokens=so.total_num_scheduled_tokens, num_preempted=so.num_preempted)
        outputs, stopped = self.output_processor.process_outputs(core_outputs, stats)
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        self.last_iteration_stats = stats
        return outputs

    def reset_prefix_cache(self) -> None:
        self.scheduler.kv.reset_prefix_cache()

    def get_tokenizer(self) -> TokenizerWrapper:
        return self.tokenizer

    def shutdown(self) -> None:
        """Stops the executor's worker processes, if it has any."""
        stop = getattr(self.executor, "shutdown", None)
        if stop is not None:
            stop()
