"""The listening socket and uvicorn's HTTP/1.1 protocol with a bound on reading a request's headers;
`--uvicorn-http` and `--uvicorn-loop` resolved."""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import socket
from typing import Any

def bind_socket(host: str, port: int) -> socket.socket:
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"cannot resolve --host {host!r}: {e}") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


class HeaderTimeoutMixin:
    """A bound on reading a request's headers, for uvicorn's HTTP/1.1 protocols (h11 and httptools):
    a connection that has not sent complete headers `header_read_timeout` seconds after it opened,
    or after the first bytes of its next request, is closed, so that slow-header clients cannot
    hold connections open forever. Between a response and the next request's first bytes the
    connection is idle, and uvicorn's keep-alive timeout (--timeout-keep-alive) bounds it instead."""

    header_read_timeout = 10.0
    cycle: Any
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._idle = False
        self._arm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        self._idle = True

    def data_received(self, data: bytes) -> None:
        # The next request begins (not bytes of a request already in progress, as a pipelined
        # one would be): its headers get the same bound as the first request's.
        if self._idle and (self.cycle is None or self.cycle.response_complete):
            self._arm_header_timer()
        self._idle = False
        super().data_received(data)  # type: ignore[misc]

    def _arm_header_timer(self) -> None:
        cycle = self.cycle  # a new request replaces it as soon as its headers are in

        def expire() -> None:
            if self.cycle is cycle and not self.transport.is_closing():
                self.transport.close()

        self.loop.call_later(self.header_read_timeout, expire)


def _resolve(flag: str, value: str, fast: str, fallback: str) -> str:
    """`auto` is `fast` (a C implementation) when it is installed, else `fallback` (as uvicorn decides)."""
    if value == "auto":
        return fast if importlib.util.find_spec(fast) is not None else fallback
    if value not in (fallback, fast):
        raise ValueError(f"{flag} must be auto, {fallback} or {fast}, got {value!r}")
    return value


resolve_http_impl = functools.partial(_resolve, "--uvicorn-http", fast="httptools", fallback="h11")
resolve_loop = functools.partial(_resolve, "--uvicorn-loop", fast="uvloop", fallback="asyncio")


def http_protocol(impl: str, header_read_timeout: float) -> type:
    """uvicorn's HTTP/1.1 protocol class for `impl` (h11 or httptools) with the header-read bound."""
    if impl == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    else:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base  # type: ignore[assignment]
    return type(f"HeaderTimeout{base.__name__}", (HeaderTimeoutMixin, base), {"header_read_timeout": header_read_timeout})
