"""The engine core: the scheduler, the KV cache and the executor, nothing else.

`step()` is schedule -> execute -> update. It knows token ids only: tokenization, detokenization,
stop strings and request outputs live in the front end (`LLMEngine` offline, `AsyncLLMEngine`
for the server), which may run in another process (see engine/core_proc.py).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass

import psutil

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_groups import describe_capacity, engine_kv_groups
from pagedllm.core.preemption import PreemptionCostModel
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import EngineCoreOutput, SchedulerOutput
from pagedllm.core.spec_decode import spec_control
from pagedllm.core.spec_suffix import make_proposer
from pagedllm.engine.core_io import EngineCoreRequest, StepStats
from pagedllm.executor import create_executor
from pagedllm.pooling_params import attach_pooling
from pagedllm.structured_output import StructuredOutputManager
from pagedllm.utils import HEAP_TOP_PAD

logger = logging.getLogger(__name__)


class KVCacheAllocationError(ValueError):
    """The KV cache asked for does not fit in memory (the message names the size and the flag)."""


@dataclass(frozen=True)
class MemoryBound:
    """What the engine-core process may hold: what it holds once loaded (weights and the runtime),
    plus the KV cache and host swap pools (committed page by page as they fill, up to their
    size), plus one step's working memory."""

    resident: int
    """RSS once the model is loaded and the pools are mapped (weights, runtime, nothing cached yet)."""
    weights: int
    """Bytes of model weights in this process (part of `resident`)."""
    kv_cache: int
    swap: int
    workspace: int
    """Estimate of one step's activations and sampling buffers at the token and sequence budgets."""

    @property
    def total(self) -> int:
        return self.resident + self.kv_cache + self.swap + self.workspace

    def describe(self) -> str:
        g = 1 << 30
        return (
            f"Memory bound of the engine core: {self.total / g:.2f} GiB RSS at most = {self.resident / g:.2f} GiB "
            f"now (weights {self.weights / g:.2f} GiB + runtime) + {self.kv_cache / g:.2f} GiB KV cache + "
            f"{self.swap / g:.2f} GiB host swap space (both committed as they fill) + {self.workspace / g:.2f} GiB "
            "step workspace"
        )


def step_workspace_bytes(config: EngineConfig) -> int:
    """A generous estimate of one step's float32 working memory: per scheduled token the hidden
    states, attention and MLP activations (and their temporaries); per sampled row a few copies
    of the logits (processed logits, probabilities, noise); plus the pad the tuned C heap maps
    beyond what it needs (utils.tune_heap)."""
    hf = config.model_config.hf_config
    hidden = int(getattr(hf, "hidden_size", 0) or 0)
    inter = int(getattr(hf, "intermediate_size", 0) or 4 * hidden)
    sc = config.scheduler_config
    per_token = 2 * (8 * hidden + 3 * inter) * 4
    per_row = 4 * config.model_config.vocab_size * 4
    return sc.max_num_batched_tokens * per_token + sc.max_num_seqs * per_row + HEAP_TOP_PAD


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        t0 = time.perf_counter()
        self.config = config
        mc, cc, sc = config.model_config, config.cache_config, config.scheduler_config
        self.model_config = mc
        self.executor = create_executor(config)
        num_blocks = self.executor.determine_num_blocks()
        groups = engine_kv_groups(mc, cc)
        # A block holds the K/V of one group's layers (all layers without window groups).
        block_bytes = cc.block_size * mc.kv_bytes_per_token() * groups.layers_per_block // mc.num_layers
        if config.draft_model_config is not None:  # a speculative draft's KV shares the block ids
            block_bytes += cc.block_size * config.draft_model_config.kv_bytes_per_token()
        kv_bytes = num_blocks * block_bytes
        try:
            self.executor.initialize_kv_cache(num_blocks)
        except (OSError, MemoryError, RuntimeError) as e:
            raise KVCacheAllocationError(
                f"cannot allocate the KV cache: {num_blocks} blocks of {cc.block_size} tokens = "
                f"{kv_bytes / (1 << 30):.2f} GiB ({type(e).__name__}: {e}); lower --kv-cache-memory "
                "(or --num-kv-blocks)"
            ) from None
        # The host swap pool exists only for preemption modes that can swap.
        num_swap_blocks = self.executor.determine_num_swap_blocks() if sc.preemption_mode != "recompute" else 0
        self.executor.initialize_swap_space(num_swap_blocks)
        self.preemption_costs = (self._measure_preemption_costs(block_bytes, groups.num_groups)
                                 if sc.preemption_mode == "auto" else None)
        kv = KVCacheManager(num_blocks, cc.block_size, cc.enable_prefix_caching, num_swap_blocks, groups)
        spec = config.speculative_config
        self.scheduler = Scheduler(sc, kv, self.preemption_costs, make_proposer(spec) if spec is not None else None)
        self.scheduler.max_loras = config.lora_config.max_loras if config.lora_config is not None else 0
        if spec is not None:
            self.scheduler.proposer.control = spec_control(spec, config.device_config.device)  # type: ignore[union-attr]
        self.structured = StructuredOutputManager(config)
        # Requests whose grammar is compiling (waiting in the scheduler until it is ready), and every
        # unfinished request with structured-output state (the step's bitmask looks at these only).
        self._compiling: list[Request] = []
        self._structured: dict[str, Request] = {}
        self.num_blocks = num_blocks
        self.memory_bound = MemoryBound(
            resident=psutil.Process().memory_info().rss,
            weights=self._weight_bytes(),
            kv_cache=kv_bytes,
            swap=num_swap_blocks * block_bytes,
            workspace=step_workspace_bytes(config),
        )
        logger.info("%s", self.memory_bound.describe())
        logger.info(
            "Model %s loaded (%s). KV cache (%.2f GiB, %s): %s; token budget %d per step%s, at most %d "
            "sequences; %s policy, %s preemption (%d host swap blocks); ready in %.1f s",
            mc.model,
            mc.kind,
            kv_bytes / (1 << 30),
            mc.kv_cache_dtype,
            describe_capacity(groups, num_blocks, cc.block_size, mc.max_model_len, sc.max_num_batched_tokens),
            sc.max_num_batched_tokens,
            (f" ({sc.max_num_shared_prefill_tokens} prompt tokens when shared)"
             if 0 < sc.max_num_shared_prefill_tokens < sc.max_num_batched_tokens else ""),
            sc.max_num_seqs,
            sc.policy,
            sc.preemption_mode,
            num_swap_blocks,
            time.perf_counter() - t0,
        )

    def _weight_bytes(self) -> int:
        """This process's model weights (0 when they live in worker processes)."""
        runner = getattr(self.executor, "runner", None)
        if runner is None:
            return 0
        model = runner.model
        tensors = [*model.parameters(), *model.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def _measure_preemption_costs(self, block_bytes: int, num_groups: int) -> PreemptionCostModel:
        """Measures FLOP/s and block-copy bytes/s once, for preemption mode auto (`block_bytes`:
        one block of the pool, the layers of one KV group; `num_groups`: the KV layer groups)."""
        mc, bs = self.model_config, self.config.cache_config.block_size
        flops, copy = self.executor.measure_preemption_rates()
        costs = PreemptionCostModel(
            flops_per_second=flops,
            copy_bytes_per_second=copy,
            flops_per_token=self.executor.flops_per_token(),
            attention_flops_per_pair=4.0 * mc.num_layers * mc.num_heads * mc.head_dim,
            kv_bytes_per_block=block_bytes,
            kv_groups=num_groups,
        )
        logger.info(
            "Preemption costs: %.1f GFLOP/s, %.2f GB/s block copies; swapping beats recompute from %.0f tokens",
            flops / 1e9, copy / 1e9, costs.break_even_tokens(bs),
        )
        return costs

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, req: EngineCoreRequest) -> None:
        """Queues a request validated by the front end (sample 0 computes the prompt; the other
        samples of an n > 1 request are forked off it, sharing its blocks)."""
        params = req.params()
        n = len(req.seq_ids)
        if params.seed is not None and n > 1:
            child_params = [params.clone() for _ in range(n)]
            for i, p in enumerate(child_params):
                p.seed = params.seed + i  # the n samples of a seeded request differ from each other
        else:
            child_params = [params] * n
        eos = self.model_config.eos_token_ids
        requests = [
            Request(sid, req.prompt_token_ids, child_params[i], eos, req.arrival_time, req.priority, req.user,
                    req.cache_salt, req.max_tokens, req.lora_request)
            for i, sid in enumerate(req.seq_ids)
        ]
        if req.pooling is not None:
            attach_pooling(requests[0], req.pooling, self.model_config)
        if params.structured_outputs is not None or params.thinking_token_budget is not None:
            for r in requests:
                self.structured.init_request(r)
                if r.structured is not None:
                    self._structured[r.request_id] = r
            self._compiling.extend(r for r in requests if r.structured is not None and r.structured.future is not None)
        self.scheduler.add_request(requests[0], forks=requests[1:])

    def abort_requests(self, seq_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Ends sequences now (abort, or a stop string found by the front end) and frees their blocks."""
        for req in self.scheduler.finish_requests(list(seq_ids), status):
            self._structured.pop(req.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> tuple[list[EngineCoreOutput], StepStats]:
        """Schedule tokens, run the model on them, append the sampled tokens."""
        t0 = time.perf_counter()
        failed = self._grammars_failed() if self._compiling else []
        so = self.scheduler.schedule()
        if so.is_empty and self._compiling:
            wait([r.structured.future for r in self._compiling], timeout=0.05, return_when=FIRST_COMPLETED)
        if self._structured:
            self._grammar_bitmask(so)
        out = self.executor.execute_model(so)
        core_outputs = failed + self.scheduler.update_from_output(so, out)
        if self._structured:  # finished requests leave the structured-output table
            for o in core_outputs:
                if o.finished:
                    self._structured.pop(o.req_id, None)
        self.last_output = so  # read by the engine view's snapshots (engine/snapshot.py)
        stats = StepStats(self.scheduler.get_stats(), so.total_num_scheduled_tokens, so.num_preempted,
                          time.perf_counter() - t0)
        return core_outputs, stats

    def _grammars_failed(self) -> list[EngineCoreOutput]:
        """Ends the requests whose grammar failed to compile (finish_reason "error", naming why)."""
        failed, still = [], []
        for r in self._compiling:
            if r.structured.compiling:
                still.append(r)
                continue
            error = r.structured.compile_error()
            if error is not None and not r.is_finished:
                self.scheduler.finish_requests(r.request_id, RequestStatus.FINISHED_ERROR)
                self._structured.pop(r.request_id, None)
                failed.append(EngineCoreOutput(r.request_id, [], finish_reason="error", error=error))
        self._compiling = still
        return failed

    def _grammar_bitmask(self, so: SchedulerOutput) -> None:
        """Fills the step's bitmask rows of the constrained sequences that sample this step: the
        step's scheduled and forked requests are looked up, the waiting ones never looked at."""
        forked = {f.req_id for f in so.forked_reqs}
        sampling = []
        for rid in [*so.num_scheduled_tokens, *forked]:
            r = self._structured.get(rid)
            if r is not None and (rid in forked or r.num_computed_tokens >= r.num_tokens):
                sampling.append(r)
        if sampling:
            mask = self.structured.grammar_bitmask(sampling)
            if mask is not None:
                so.grammar_bitmask, so.structured_rows = mask

    def stats(self) -> StepStats:
        return StepStats(self.scheduler.get_stats())

    def shutdown(self) -> None:
        """Stops the executor's worker processes, if it has any."""
        self.structured.shutdown()
        stop = getattr(self.executor, "shutdown", None)
        if stop is not None:
            stop()

    def reset_prefix_cache(self) -> None:
        self.scheduler.kv.reset_prefix_cache()
