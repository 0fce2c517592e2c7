"""The server's HTTP protocols (uvicorn's h11 and httptools, each with the header-read bound) on
both event loops, in a real uvicorn over a loopback socket: a streamed response arrives whole, an
idle keep-alive connection outlives the header bound, and headers that never end are cut off."""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import uvicorn

from pagedllm.entrypoints.openai.http_server import http_protocol, resolve_http_impl, resolve_loop

HEADER_TIMEOUT_S = 0.5


async def app(scope, receive, send) -> None:  # a tiny ASGI app: GET / streams 50 SSE events
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    for i in range(50):
        await send({"type": "http.response.body", "body": f"data: {i}\n\n".encode(), "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def _read_response(sock: socket.socket) -> bytes:
    """One chunked response, whole (up to its terminating zero-length chunk), or b"" if closed."""
    data = b""
    while not data.endswith(b"0\r\n\r\n"):
        chunk = sock.recv(65536)
        if not chunk:
            return b""
        data += chunk
    return data


COMBOS = [(h, lp) for h in ("h11", "httptools") for lp in ("asyncio", "uvloop")
          if not (lp == "uvloop" and sys.platform == "win32")]  # uvloop is not a dependency on Windows


@contextlib.contextmanager
def serving(impl: str, loop: str) -> Iterator[int]:
    """A uvicorn of `app` with protocol `impl` on event loop `loop`, in a thread; yields its port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_config=None, loop=loop, timeout_keep_alive=5,
                            http=http_protocol(impl, HEADER_TIMEOUT_S))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.01)
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def check_stream_keep_alive_and_header_bound(impl: str, loop: str) -> None:
    with serving(impl, loop) as port:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            body = _read_response(s)
            assert body.startswith(b"HTTP/1.1 200") and all(f"data: {i}\n\n".encode() in body for i in range(50))
            time.sleep(HEADER_TIMEOUT_S * 2)  # idle between requests: the header bound is not running
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert _read_response(s).startswith(b"HTTP/1.1 200")
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
            t0 = time.monotonic()
            assert s.recv(4096) == b""
            assert time.monotonic() - t0 < HEADER_TIMEOUT_S + 2
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:  # a new connection that sends nothing
            t0 = time.monotonic()
            assert s.recv(4096) == b""
            assert time.monotonic() - t0 < HEADER_TIMEOUT_S + 2


def test_stream_keep_alive_and_header_bound() -> None:
    """Each protocol on each loop, a server of its own; the four at once, as the test waits
    (idle and header timeouts) more than it computes."""
    with ThreadPoolExecutor(len(COMBOS)) as pool:
        futures = {combo: pool.submit(check_stream_keep_alive_and_header_bound, *combo) for combo in COMBOS}
    for combo, future in futures.items():
        try:
            future.result()
        except AssertionError as exc:
            raise AssertionError(f"{combo[0]} on {combo[1]}: {exc}") from exc


def test_resolve_names() -> None:
    assert resolve_http_impl("h11") == "h11" and resolve_loop("asyncio") == "asyncio"
    assert resolve_http_impl("auto") in ("h11", "httptools") and resolve_loop("auto") in ("asyncio", "uvloop")
    with pytest.raises(ValueError, match="'h2'"):
        resolve_http_impl("h2")
    with pytest.raises(ValueError, match="'trio'"):
        resolve_loop("trio")
