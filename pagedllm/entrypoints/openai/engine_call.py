"""The engine requests behind one API call, and awaiting them with disconnect handling: a
client that leaves, a dead engine or a server shutdown ends the wait and aborts the requests."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request

from pagedllm.engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineOverloadedError
from pagedllm.entrypoints.openai.errors import ServerState, shutting_down_error
from pagedllm.outputs import PoolingRequestOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")

# How often a waiting request checks that the engine is still alive.
_POLL_S = 1.0


class ClientDisconnected(Exception):
    """The client went away; whatever it asked for has been aborted."""


@dataclass
class EnginePrompt:
    """One prompt ready for the engine: its token ids and text (for echo)."""

    token_ids: list[int]
    text: str | None

    def as_engine_input(self) -> dict[str, Any]:
        return {"prompt": self.text, "prompt_token_ids": self.token_ids}


class EngineCall:
    """The engine requests behind one API call (one per prompt), merged into one stream.

    `start()` submits every prompt and waits for each one's first output, so that bad input,
    a full queue or a dead engine is known before any response header is sent. `next()` then
    yields (prompt index, output) pairs; `close()` aborts whatever has not finished and must
    run on every path (it is safe to call twice).
    """

    def __init__(self, engine: AsyncLLMEngine, base_id: str, state: ServerState | None = None) -> None:
        self.engine = engine
        self.base_id = base_id
        self.state = state or ServerState()
        self.request_ids: list[str] = []
        self._gens: list[Any] = []
        self._finished: set[int] = set()
        self._tasks: list[asyncio.Task] = []
        self._queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()
        self._live = 0
        self._closed = False

    async def start(
        self,
        prompts: list[EnginePrompt],
        params: SamplingParams,
        priority: int = 0,
        user: str | None = None,
        cache_salt: str | None = None,
        lora_request: Any = None,
    ) -> list[RequestOutput]:
        for i, p in enumerate(prompts):
            rid = f"{self.base_id}-{i}"
            self.request_ids.append(rid)
            self._gens.append(
                self.engine.generate(p.as_engine_input(), params.clone(), rid, priority, user, cache_salt,
                                     lora_request)
            )
        results = await asyncio.gather(*(g.__anext__() for g in self._gens), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.close()
            # Report the most telling error: a dead engine, then bad input, then a full queue.
            for kind in (EngineDeadError, ValueError, EngineOverloadedError):
                for e in errors:
                    if isinstance(e, kind):
                        raise e
            raise errors[0]
        for i, out in enumerate(results):
            assert isinstance(out, (RequestOutput, PoolingRequestOutput))
            if out.finished:
                self._finished.add(i)
        return results  # type: ignore[return-value]

    def _start_pumps(self) -> None:
        async def pump(i: int, gen: Any) -> None:
            try:
                async for out in gen:
                    self._queue.put_nowait((i, out))
                self._queue.put_nowait((i, None))
            except Exception as e:
                self._queue.put_nowait((i, e))

        self._live = len(self._gens)
        self._tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(self._gens)]

    async def next(self) -> tuple[int, RequestOutput] | None:
        """The next output of any prompt, or None when all have finished."""
        if not self._tasks:
            self._start_pumps()
        while self._live:
            if self.state.shutting_down:
                raise shutting_down_error()
            try:
                if self._queue.empty():
                    i, item = await asyncio.wait_for(self._queue.get(), timeout=_POLL_S)
                else:
                    i, item = self._queue.get_nowait()
            except asyncio.TimeoutError:
                if self.engine.errored:
                    raise EngineDeadError(f"the engine has failed: {self.engine.dead_error!r}") from None
                continue
            if item is None:
                self._live -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                self._finished.add(i)
            return i, item
        return None

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Synchronous part first: even under cancellation the aborts reach the engine.
        for t in self._tasks:
            t.cancel()
        for i, rid in enumerate(self.request_ids):
            if i not in self._finished:
                await self.engine.abort(rid)
        for g in self._gens:
            try:
                await g.aclose()
            except RuntimeError:
                pass  # still running in a cancelled pump task; its own finally aborts it


async def await_unless_disconnected(
    raw_request: Request | None, engine: AsyncLLMEngine, aw: Awaitable[T], state: ServerState | None = None
) -> T:
    """Awaits `aw`, cancelling it (which aborts its engine requests) when the client disconnects,
    the engine dies or the server shuts down."""
    task = asyncio.ensure_future(aw)
    watcher: asyncio.Task | None = None
    if raw_request is not None:

        async def wait_disconnect() -> None:
            while True:
                message = await raw_request.receive()
                if message["type"] == "http.disconnect":
                    return

        watcher = asyncio.ensure_future(wait_disconnect())
    try:
        while True:
            waiting = {task} if watcher is None else {task, watcher}
            done, _ = await asyncio.wait(waiting, timeout=_POLL_S, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                return task.result()
            if watcher is not None and watcher in done:
                raise ClientDisconnected()
            if engine.errored:
                raise EngineDeadError(f"the engine has failed: {engine.dead_error!r}")
            if state is not None and state.shutting_down:
                raise shutting_down_error()
    finally:
        for t in (task, watcher):
            if t is not None and not t.done():
                t.cancel()
        if not task.done():
            # Let the cancellation reach the engine streams' `finally` (which aborts them).
            await asyncio.gather(task, return_exceptions=True)
