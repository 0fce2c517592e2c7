"""`pagedllm simulate --ui`: a simulated run's engine view, replayed through the web page.

A small server on 127.0.0.1 serves the same page as `pagedllm serve` (opened on its engine view)
and, at `GET /v1/engine/state`, the messages the simulator recorded (simulator/recording.py),
paced by their simulated times at `--ui-speed` simulated seconds per second; at the end the last
state stays on screen. There is no model: the chat tab has nothing to talk to.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, RedirectResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles

from pagedllm.entrypoints.web.routes import KEEP_ALIVE_S, STATIC_DIR

logger = logging.getLogger(__name__)


async def replay_events(hello: dict[str, Any], messages: list[tuple[float, str]], speed: float) -> AsyncIterator[str]:
    yield f"event: hello\ndata: {json.dumps(hello)}\n\n"
    loop = asyncio.get_running_loop()
    start = loop.time()
    t0 = messages[0][0] if messages else 0.0
    for t, data in messages:
        delay = start + (t - t0) / speed - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        yield f"data: {data}\n\n"
    while True:
        await asyncio.sleep(KEEP_ALIVE_S)
        yield ": keep-alive\n\n"


def build_replay_app(hello: dict[str, Any], messages: list[tuple[float, str]], speed: float = 1.0) -> FastAPI:
    if not speed > 0:
        raise ValueError(f"the replay speed must be positive, got {speed}")
    app = FastAPI(title="pagedllm simulate --ui")

    @app.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse("/ui/#engine")

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": hello.get("model", "simulated"), "object": "model"}]})

    @app.get("/v1/engine/state")
    async def state() -> StreamingResponse:
        return StreamingResponse(replay_events(hello, messages, speed), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    app.mount("/ui", StaticFiles(directory=STATIC_DIR, html=True), name="ui")
    return app


def serve_replay(recorder: Any, args: argparse.Namespace) -> int:
    """Serves the recorded run until interrupted (Ctrl-C)."""
    if not recorder.messages:
        raise ValueError("the simulation recorded no engine state to replay (no step ran)")
    app = build_replay_app(recorder.hello, recorder.messages, args.ui_speed)
    span = recorder.messages[-1][0] - recorder.messages[0][0]
    print(f"Replaying {len(recorder.messages)} engine snapshots ({span:.1f} simulated s at {args.ui_speed:g}x) at "
          f"http://127.0.0.1:{args.ui_port}/ (Ctrl-C ends)", flush=True)
    uvicorn.run(app, host="127.0.0.1", port=args.ui_port, log_level="warning")
    return 0
