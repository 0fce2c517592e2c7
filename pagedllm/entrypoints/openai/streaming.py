"""Server-sent events whose generator is closed the moment the client goes away."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


def sse(data: str) -> str:
    return f"data: {data}\n\n"


class EngineStreamingResponse(StreamingResponse):
    """A text/event-stream response that always closes its body generator.

    The generator's `finally` aborts the engine requests, so it must run as soon as the stream
    ends for any reason: finished, the client disconnected (noticed by a concurrent receive,
    not only at the next send), a failed send, or server shutdown. Closing it explicitly does
    not wait for garbage collection of an abandoned generator.
    """

    def __init__(self, content: AsyncIterator[str], **kwargs: Any) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **kwargs.pop("headers", {})}
        super().__init__(content, media_type="text/event-stream", headers=headers, **kwargs)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass  # the client went away mid-send
                    tg.cancel_scope.cancel()

                async def watch() -> None:
                    await self.listen_for_disconnect(receive)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                tg.start_soon(watch)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
