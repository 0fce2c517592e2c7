"""Server-sent events whose generator is closed the moment the client goes away."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


# JSON may hold these raw inside strings, and SSE allows them, but clients that split lines the way
# str.splitlines does (httpx's aiter_lines, say) would cut the event in two: they go out escaped,
# which is the same JSON. (JSON already escapes every other character splitlines breaks on.)
_SPLITLINES_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(data: str) -> str:
    """One server-sent event holding `data` (JSON, or [DONE]) on a single line for every client."""
    return f"data: {data.translate(_SPLITLINES_BREAKS)}\n\n"


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
