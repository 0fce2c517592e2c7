"""The serving front end: tokenization, validation, detokenization and per-request streams,
on the server's event loop; the engine core runs in its own process (or, for tests and simple
use, on a thread of this one) and answers every step with outputs and scheduler statistics.

Everything that touches request state here runs on the event loop, so a client that leaves at
any moment (before admission, mid-prefill, mid-stream, at its last token) only ever removes its
own request and sends one abort. A failure while processing one request's output fails that
request alone; an engine-core fault fails every request in flight with EngineDeadError.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler import SchedulerStats
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.core_io import EngineCoreOutputs, MsgKind, StepStats
from pagedllm.engine.llm_engine import LLMEngine, PromptType, load_frontend_tokenizer
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.processor import Processor
from pagedllm.engine.state_feed import StateFeed
from pagedllm.engine.stats import IterationStats
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizer import TokenizerWrapper

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop failed; every request in flight fails with this."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full; the client should retry later."""


class RequestFailedError(RuntimeError):
    """One request failed inside the engine (its outputs could not be processed); others go on."""


class StatLogger(Protocol):
    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None: ...

    def log(self) -> None: ...


class LoggingStatLogger:
    """Logs running/waiting counts, KV usage and throughput every `interval` seconds while busy."""

    def __init__(self, interval: float = 10.0) -> None:
        self.interval = interval
        self.last_log = time.monotonic()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.last: SchedulerStats | None = None
        self.last_hits = (0, 0)
        self.last_spec = (0, 0, 0)  # speculative decoding: drafts, draft tokens, accepted tokens

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        self.prompt_tokens += iteration_stats.num_prompt_tokens
        self.generation_tokens += iteration_stats.num_generation_tokens
        self.last = scheduler_stats

    def log(self) -> None:
        now = time.monotonic()
        elapsed = now - self.last_log
        if elapsed < self.interval or self.last is None:
            return
        s = self.last
        busy = self.prompt_tokens or self.generation_tokens or s.num_running or s.num_waiting or s.num_swapped
        if busy:
            q = s.prefix_cache_queries - self.last_hits[0]
            h = s.prefix_cache_hits - self.last_hits[1]
            logger.info(
                "Running: %d reqs, Swapped: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prompt throughput: "
                "%.1f tokens/s, Generation throughput: %.1f tokens/s, Prefix cache hit rate: %.1f%%, Preemptions: %d",
                s.num_running,
                s.num_swapped,
                s.num_waiting,
                100 * s.kv_cache_usage,
                self.prompt_tokens / elapsed,
                self.generation_tokens / elapsed,
                100 * h / q if q else 0.0,
                s.num_preemptions,
            )
            sd = s.spec_decode
            if sd is not None and sd.num_drafts > self.last_spec[0]:
                drafts, proposed, accepted = (sd.num_drafts - self.last_spec[0],
                                              sd.num_draft_tokens - self.last_spec[1],
                                              sd.num_accepted_tokens - self.last_spec[2])
                logger.info("Speculative decoding: acceptance rate %.1f%%, mean acceptance length %.2f, "
                            "%d drafts, %d proposed tokens, %d accepted", 100 * accepted / max(proposed, 1),
                            1 + accepted / drafts, drafts, proposed, accepted)
        if s.spec_decode is not None:
            sd = s.spec_decode
            self.last_spec = (sd.num_drafts, sd.num_draft_tokens, sd.num_accepted_tokens)
        self.last_hits = (s.prefix_cache_queries, s.prefix_cache_hits)
        self.prompt_tokens = self.generation_tokens = 0
        self.last_log = now


class AsyncLLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        tokenizer: TokenizerWrapper,
        client: Any,
        max_queued_requests: int | None = None,
        stat_loggers: list[StatLogger] | None = None,
    ) -> None:
        self.config = config
        self.model_config = config.model_config
        self.tokenizer = tokenizer
        self.client = client
        self.num_blocks: int = client.num_blocks
        self.processor = Processor(config, tokenizer, self.num_blocks)
        self.output_processor = OutputProcessor(tokenizer.rust)
        self.max_queued_requests = max_queued_requests
        self.stat_loggers: list[StatLogger] = list(stat_loggers or [])
        self._streams: dict[str, asyncio.Queue] = {}
        self.dead_error: str | None = None
        # Called once (on the event loop) when the engine core dies, e.g. to stop the server.
        self.on_dead: list[Callable[[], None]] = []
        self.last_stats = StepStats.idle()
        # The engine view's feed: snapshots from the engine core while a viewer watches.
        self.state_feed = StateFeed(self)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped = False

    @classmethod
    def from_engine_args(cls, args: EngineArgs, multiprocess: bool = True, log_level: str = "INFO",
                         **kwargs: Any) -> AsyncLLMEngine:
        """Starts the engine core (loading the model there) and the front end here."""
        from pagedllm.engine.core_client import MultiProcessClient

        config = args.create_engine_config()
        if not multiprocess:
            return cls.from_llm_engine(LLMEngine(config), **kwargs)
        client = MultiProcessClient(config, log_level)
        try:
            tokenizer = load_frontend_tokenizer(config)  # while the engine core loads the model
            client.wait_ready()
        except BaseException:
            client.shutdown()
            raise
        return cls(config, tokenizer, client, **kwargs)

    @classmethod
    def from_llm_engine(cls, engine: LLMEngine, **kwargs: Any) -> AsyncLLMEngine:
        """Serves an in-process engine's core from a thread of this process."""
        from pagedllm.engine.core_client import InProcessClient

        return cls(engine.config, engine.tokenizer, InProcessClient(engine.core), **kwargs)

    # ---- lifecycle ------------------------------------------------------------------------
    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    def start(self) -> None:
        """Starts delivering engine-core messages to the running event loop (idempotent)."""
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self.client.start(self._loop, self._on_message)

    def shutdown(self) -> None:
        self._stopped = True
        self.client.shutdown()

    async def aclose(self) -> None:
        """shutdown() from the event loop without blocking it: the engine core's messages stop
        reaching the loop here, and the process is stopped and reaped on a worker thread."""
        self._stopped = True
        detach = getattr(self.client, "detach", None)
        if detach is not None:
            detach()
        await asyncio.to_thread(self.client.shutdown)

    # ---- requests -------------------------------------------------------------------------
    def num_waiting(self) -> int:
        """Requests held by the front end that the engine does not report as running."""
        return max(len(self.output_processor.requests) - self.last_stats.scheduler.num_running, 0)

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine has failed: {self.dead_error}")

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = 0,
        user: str | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs; raises ValueError (bad input), EngineOverloadedError or
        EngineDeadError. Leaving the iteration early aborts the request."""
        self._check_alive()
        if self.max_queued_requests is not None and self.num_waiting() >= self.max_queued_requests:
            raise EngineOverloadedError(
                f"the waiting queue is full ({self.max_queued_requests} requests); retry later"
            )
        text, req = self.processor.make_request(
            request_id, prompt, sampling_params, self.output_processor, None, priority, user, cache_salt, lora_request
        )
        self.start()
        stream: asyncio.Queue = asyncio.Queue()
        self.output_processor.add_request(
            request_id, text, req.prompt_token_ids, sampling_params, req.arrival_time, priority
        )
        self._streams[request_id] = stream
        finished = False
        try:
            self.client.add_request(req)
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._abort(request_id)

    def _abort(self, request_id: str) -> None:
        seq_ids = self.output_processor.remove_request(request_id)
        if seq_ids and self.dead_error is None and not self._stopped:
            self.client.abort(seq_ids)

    async def abort(self, request_id: str) -> None:
        self._abort(request_id)

    # ---- messages from the engine core (on the event loop) --------------------------------
    def _on_message(self, kind: MsgKind, payload: Any) -> None:
        if self.dead_error is not None:
            return
        if kind == MsgKind.OUTPUTS:
            try:
                self._on_outputs(payload)
            except Exception as e:
                logger.exception("processing engine outputs failed")
                self._die(f"{type(e).__name__}: {e}")
        elif kind == MsgKind.SNAPSHOT:
            self.state_feed.on_snapshot(payload)
        elif kind == MsgKind.DEAD:
            if not self._stopped:
                self._die(payload)

    def _on_outputs(self, msg: EngineCoreOutputs) -> None:
        step = msg.stats
        self.last_stats = step
        stats = IterationStats(num_scheduled_tokens=step.num_scheduled_tokens, num_preempted=step.num_preempted,
                               step_time=step.step_time)
        result = self.output_processor.process_outputs(msg.outputs, stats)
        for out in result.outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)
        for rid, err in result.failed.items():
            logger.error("request %s failed: %r", rid, err)
            stream = self._streams.get(rid)
            if stream is not None:
                stream.put_nowait(RequestFailedError(f"request {rid} failed: {type(err).__name__}: {err}"))
        if result.stopped:
            self.client.abort(result.stopped, stopped=True)
        if result.failed_seq_ids:
            self.client.abort(result.failed_seq_ids)
        scheduler_stats = step.scheduler
        if self.state_feed.watched:
            self.state_feed.record(scheduler_stats, stats)
        for sl in self.stat_loggers:
            try:
                sl.record(scheduler_stats, stats)
                sl.log()
            except Exception:  # a stats sink's fault costs its own figures, never the serving
                logger.exception("stat logger %s failed; it is turned off", type(sl).__name__)
                self.stat_loggers = [x for x in self.stat_loggers if x is not sl]  # this loop goes on over the old list

    def _die(self, reason: str) -> None:
        logger.error("the engine has failed: %s", reason)
        self.dead_error = reason
        err = EngineDeadError(f"the engine has failed: {reason}")
        for stream in list(self._streams.values()):
            stream.put_nowait(err)
        for callback in self.on_dead:
            callback()
