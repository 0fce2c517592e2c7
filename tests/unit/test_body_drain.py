"""The 413 for a body over the limit (GuardMiddleware.reject, at the ASGI level): the answer goes
out at once, the rest of the body is read and dropped, and the response ends (so that uvicorn
closes the connection) when the client has sent it all, has gone, or has sent too much or for
too long. The same against a real server and clients: tests/integration/test_server_bad_input.py."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from pagedllm.entrypoints.openai.guard import GuardMiddleware


async def never_called(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError("the app ran for a body over the limit")


def run(receive_body: list[bytes] | None, headers: list[tuple[bytes, bytes]], **bounds: Any) -> tuple[list, int, float]:
    """Sends a POST through the middleware (limit 100 bytes): the body's chunks, or endless
    1 KiB chunks for None. Returns (the messages sent, the chunks received, seconds taken)."""
    sent: list[dict] = []
    received = 0

    async def receive() -> dict:
        nonlocal received
        received += 1
        await asyncio.sleep(0.001)
        if receive_body is None:
            return {"type": "http.request", "body": b"x" * 1024, "more_body": True}
        if received > len(receive_body):
            return {"type": "http.disconnect"}
        return {"type": "http.request", "body": receive_body[received - 1], "more_body": received < len(receive_body)}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}
    t0 = time.monotonic()
    asyncio.run(GuardMiddleware(never_called, [], 100, **bounds)(scope, receive, send))
    return sent, received, time.monotonic() - t0


def assert_413_then_end(sent: list[dict]) -> None:
    start, body, end = sent
    assert start["type"] == "http.response.start" and start["status"] == 413
    assert (b"connection", b"close") in start["headers"]
    assert body["more_body"] is True and json.loads(body["body"])["error"]["code"] == "request_too_large"
    assert end == {"type": "http.response.body", "body": b"", "more_body": False}


@pytest.mark.parametrize("sized", [True, False], ids=["content-length", "chunked"])
def test_the_rest_of_the_body_is_drained(sized: bool) -> None:
    chunks = [b"x" * 64] * 50
    headers = [(b"content-length", b"3200")] if sized else []
    sent, received, _ = run(chunks, headers)
    assert_413_then_end(sent)
    assert received == len(chunks)  # every chunk read, none after the last


def test_drain_stops_when_the_client_goes() -> None:
    sent, received, _ = run([], [(b"content-length", b"1000")])
    assert_413_then_end(sent)
    assert received == 1


def test_endless_body_is_bounded_in_bytes_and_time() -> None:
    sent, received, _ = run(None, [(b"content-length", b"99999999")], drain_max_bytes=50 << 10)
    assert_413_then_end(sent)
    assert received == 51  # past 50 KiB
    sent, _, took = run(None, [], drain_max_bytes=1 << 40, drain_max_s=0.3)
    assert_413_then_end(sent)
    assert 0.3 <= took < 2
