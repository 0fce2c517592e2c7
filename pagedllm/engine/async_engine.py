"""An engine for servers: one background thread steps the LLMEngine; each request has its own
async stream of RequestOutputs; a cancelled stream aborts its request and frees its blocks."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from pagedllm.core.scheduler import SchedulerStats
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine, PromptType
from pagedllm.engine.stats import IterationStats
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop failed; every request in flight fails with this."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full; the client should retry later."""


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
        self.last_hits = (s.prefix_cache_queries, s.prefix_cache_hits)
        self.prompt_tokens = self.generation_tokens = 0
        self.last_log = now


class AsyncLLMEngine:
    def __init__(
        self,
        engine: LLMEngine,
        max_queued_requests: int | None = None,
        stat_loggers: list[StatLogger] | None = None,
    ) -> None:
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self.stat_loggers: list[StatLogger] = list(stat_loggers or [])
        self._commands: queue.Queue[tuple[str, Any, concurrent.futures.Future | None]] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        # Adds submitted by clients and adds handled by the engine thread (each written by one thread).
        self._adds_submitted = 0
        self._adds_handled = 0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.dead_error: BaseException | None = None
        # Held while enqueuing a command and while the dying loop fails the queue, so that no
        # command can slip in after the loop has drained it for the last time.
        self._submit_lock = threading.Lock()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, **kwargs: Any) -> AsyncLLMEngine:
        return cls(LLMEngine.from_engine_args(args), **kwargs)

    # ---- lifecycle ------------------------------------------------------------------------
    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="pagedllm-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._commands.put(("wake", None, None))
        if self._thread is not None:
            self._thread.join(timeout=10)

    # ---- requests -------------------------------------------------------------------------
    def num_waiting(self) -> int:
        sched = self.engine.scheduler
        return len(sched.waiting) + len(sched.swapped) + self._adds_submitted - self._adds_handled

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = 0,
        user: str | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs; raises ValueError (bad input), EngineOverloadedError or
        EngineDeadError. Leaving the iteration early aborts the request."""
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine has failed: {self.dead_error}")
        if self.max_queued_requests is not None and self.num_waiting() >= self.max_queued_requests:
            raise EngineOverloadedError(
                f"the waiting queue is full ({self.max_queued_requests} requests); retry later"
            )
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.start()
        loop = asyncio.get_running_loop()
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, stream)
        finished = False
        try:
            fut: concurrent.futures.Future = concurrent.futures.Future()
            self._submit(("add", (request_id, prompt, sampling_params, priority, user, cache_salt), fut))
            await asyncio.wrap_future(fut)
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
                self._commands.put(("abort", request_id, None))

    def _submit(self, command: tuple[str, Any, concurrent.futures.Future | None]) -> None:
        with self._submit_lock:
            if self.dead_error is not None:
                raise EngineDeadError(f"the engine has failed: {self.dead_error!r}")
            if command[0] == "add":
                self._adds_submitted += 1
            self._commands.put(command)

    async def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id, None))

    def call_in_engine(self, fn: Callable[[LLMEngine], Any]) -> concurrent.futures.Future:
        """Runs `fn(engine)` on the engine thread between steps (e.g. reset_prefix_cache)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self.start()
        self._submit(("call", fn, fut))
        return fut

    # ---- the engine thread ----------------------------------------------------------------
    def _handle(self, kind: str, payload: Any, fut: concurrent.futures.Future | None) -> None:
        if kind == "add":
            self._adds_handled += 1
            rid, prompt, params, priority, user, salt = payload
            try:
                self.engine.add_request(rid, prompt, params, priority=priority, user=user, cache_salt=salt)
            except Exception as e:  # ValueError for bad input; the loop goes on
                assert fut is not None
                fut.set_exception(e)
                return
            if rid not in self._streams:  # the client left before the request was queued
                self.engine.abort_request(rid)
            assert fut is not None
            fut.set_result(None)
        elif kind == "abort":
            self.engine.abort_request(payload)
        elif kind == "call":
            assert fut is not None
            try:
                fut.set_result(payload(self.engine))
            except Exception as e:
                fut.set_exception(e)

    def _drain_commands(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=1.0) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*item)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            entry = self._streams.get(out.request_id)
            if entry is not None:
                loop, stream = entry
                loop.call_soon_threadsafe(stream.put_nowait, out)

    def _loop(self) -> None:
        engine = self.engine
        try:
            while not self._stop.is_set():
                self._drain_commands(block=not engine.has_unfinished_requests())
                if engine.has_unfinished_requests():
                    outputs = engine.step()
                    self._dispatch(outputs)
                    stats = engine.scheduler.get_stats()
                    for sl in self.stat_loggers:
                        sl.record(stats, engine.last_iteration_stats)
                for sl in self.stat_loggers:
                    sl.log()
        except BaseException as e:  # a real fault: fail everyone in flight, report unhealthy
            logger.exception("engine loop failed")
            err = EngineDeadError(f"the engine has failed: {e!r}")
            with self._submit_lock:
                self.dead_error = e
                while True:
                    try:
                        _, _, fut = self._commands.get_nowait()
                    except queue.Empty:
                        break
                    if fut is not None and not fut.done():
                        fut.set_exception(err)
            for loop, stream in list(self._streams.values()):
                loop.call_soon_threadsafe(stream.put_nowait, err)
