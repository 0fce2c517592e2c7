"""The page's routes: `/` redirects to `/ui/` (the static page, shipped in `static/`: plain HTML,
JavaScript and CSS, nothing fetched from elsewhere), and `GET /v1/engine/state` streams the engine
view's feed (engine/state_feed.py) as server-sent events, behind --api-key like every /v1 route.

Events: one `hello` (the engine's shape and the time series so far), then one message per engine
snapshot (at most 4 a second), and a comment line every `KEEP_ALIVE_S` while nothing changes.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import RedirectResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).parent / "static"
KEEP_ALIVE_S = 10.0


async def state_events(feed: Any, request: Request | None = None) -> AsyncIterator[str]:
    """The feed as SSE text; leaving the iteration (the client went away) unsubscribes."""
    q = feed.subscribe()
    try:
        yield f"event: hello\ndata: {json.dumps(feed.hello())}\n\n"
        while True:
            try:
                data = await asyncio.wait_for(q.get(), KEEP_ALIVE_S)
            except asyncio.TimeoutError:
                if request is not None and await request.is_disconnected():
                    return
                yield ": keep-alive\n\n"
                continue
            yield f"data: {data}\n\n"
    finally:
        feed.unsubscribe(q)


def add_ui_routes(app: FastAPI, async_engine: Any) -> None:
    feed = async_engine.state_feed

    @app.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse("/ui/")

    @app.get("/v1/engine/state")
    async def engine_state(request: Request) -> StreamingResponse:
        return StreamingResponse(state_events(feed, request), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    app.mount("/ui", StaticFiles(directory=STATIC_DIR, html=True), name="ui")
