"""Bad input against a real `pagedllm serve` (tiny random model), tried as a new user would: each
bad request gets the OpenAI error object with the right status, and a good request right after
it still works. Also: bodies over the limit are refused as soon as their headers are in, and the
refusal reaches a client that sends the whole body; slow headers are cut off, and the API docs
follow --api-key."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import socket
import time
from pathlib import Path

import httpx
import pytest

from server_helpers import TINY_API_KEY, Server, assert_error_shape

KEY = TINY_API_KEY
AUTH = {"Authorization": f"Bearer {KEY}"}
COMP, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
JSON = {"Content-Type": "application/json"}

# (name, path, body: dict (sent as JSON) or bytes (sent as is), extra headers, status)
BAD = [
    ("lone-surrogate-prompt", COMP, b'{"prompt": "a\\ud800b", "max_tokens": 2}', JSON, 400),
    ("lone-surrogate-chat", CHAT, b'{"messages": [{"role": "user", "content": "\\udc00"}]}', JSON, 400),
    ("json-as-text-plain", COMP, b'{"prompt": "hi", "max_tokens": 2}', {"Content-Type": "text/plain"}, 415),
    ("json-as-form", COMP, b'{"prompt": "hi"}', {"Content-Type": "application/x-www-form-urlencoded"}, 415),
    ("invalid-utf8", COMP, b'{"prompt": "\xff\xfe", "max_tokens": 2}', JSON, 400),
    ("json-null", COMP, b"null", JSON, 400),
    ("too-many-stop-strings", COMP, {"prompt": "hi", "stop": [f"s{i}" for i in range(65)]}, {}, 400),
    ("stop-string-too-long", COMP, {"prompt": "hi", "stop": ["x" * 1025]}, {}, 400),
    ("logit-bias-value", COMP, {"prompt": "hi", "logit_bias": {"5": 200}}, {}, 400),
    ("logit-bias-oov", COMP, {"prompt": "hi", "logit_bias": {"999999": 1}}, {}, 400),
    ("allowed-token-ids-empty", COMP, {"prompt": "hi", "allowed_token_ids": []}, {}, 400),
    ("allowed-token-ids-oov", COMP, {"prompt": "hi", "allowed_token_ids": [5, 100000]}, {}, 400),
    ("n-over-max-num-seqs", COMP, {"prompt": "hi", "n": 100}, {}, 400),
    ("best-of-not-n", COMP, {"prompt": "hi", "n": 1, "best_of": 3}, {}, 400),
    ("prompt-mixed-types", COMP, {"prompt": [1, "a"]}, {}, 400),
    ("prompt-too-deep", COMP, {"prompt": [[[1]]]}, {}, 400),
    ("messages-not-a-list", CHAT, {"messages": "hi"}, {}, 400),
    ("max-tokens-string", COMP, {"prompt": "hi", "max_tokens": "ten"}, {}, 400),
    ("min-tokens-negative", COMP, {"prompt": "hi", "min_tokens": -1}, {}, 400),
    ("stop-token-negative", COMP, {"prompt": "hi", "stop_token_ids": [-3]}, {}, 400),
    ("seed-below-int64", COMP, {"prompt": "hi", "seed": -(2**64)}, {}, 400),
    ("top-logprobs-negative", CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": -1}, {}, 400),
    ("continue-without-assistant", CHAT, {"messages": MSG, "continue_final_message": True,
                                          "add_generation_prompt": False}, {}, 400),
    ("continue-and-generation-prompt", CHAT, {"messages": MSG + [{"role": "assistant", "content": "x"}],
                                              "continue_final_message": True}, {}, 400),
    ("prompt-over-max-model-len", COMP, {"prompt": [5] * 600, "max_tokens": 1}, {}, 400),
    ("priority-string", COMP, {"prompt": "hi", "priority": "high"}, {}, 400),
    ("get-on-post-route", COMP, None, {}, 405),
]


@pytest.fixture(scope="module")
def server(tiny_server: Server) -> Server:
    """The session's tiny-model server (--num-kv-blocks 128, --max-num-seqs 16, --header-read-timeout
    1, --timeout-keep-alive 3; checked at the session's end for exit 0 and no traceback)."""
    return tiny_server


@pytest.fixture(scope="module")
def http(server: Server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        yield c


def good(http: httpx.Client) -> None:
    r = http.post(COMP, json={"prompt": "hello", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text


@pytest.mark.parametrize("name,path,body,headers,status", BAD, ids=[b[0] for b in BAD])
def test_bad_request_then_good(http: httpx.Client, name: str, path: str, body, headers: dict, status: int) -> None:
    if body is None:
        r = http.get(path)
    elif isinstance(body, bytes):
        r = http.post(path, content=body, headers=headers)
    else:
        r = http.post(path, json=body, headers=headers)
    assert r.status_code == status, r.text
    assert_error_shape(r.json())
    good(http)


def test_huge_body_is_refused_unread(server: Server, http: httpx.Client) -> None:
    """A 40 MB body: 413 with the error object as soon as the headers are in, before the body is
    read (here it is never sent)."""
    size = 40 << 20
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(f"POST {COMP} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: "
                  f"application/json\r\nContent-Length: {size}\r\n\r\n".encode() + b'{"prompt": "' + b"x" * 1000)
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), data[:300]
    assert b"request_too_large" in body and b"--max-request-body-size" in body
    good(http)


def assert_too_large(r: httpx.Response) -> None:
    assert r.status_code == 413, r.text
    assert_error_shape(r.json())
    assert r.json()["error"]["code"] == "request_too_large" and "--max-request-body-size" in r.text


def test_huge_body_sent_whole_gets_413(server: Server, http: httpx.Client) -> None:
    """Clients that send all of a 40 MB body before they read the answer get the 413 and its error
    object, not a reset connection or a broken pipe: the server drains the body before it closes.
    The standard library's http.client (which requests and urllib3 use) fails at the first write
    that fails; httpx and the openai client read on after a failed write, which works only while
    the reset has not dropped the answer. Sized (Content-Length) and chunked bodies."""
    from http.client import HTTPConnection

    import openai

    big = b'{"prompt": "' + b"x" * (40 << 20) + b'", "max_tokens": 1}'
    conn = HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request("POST", COMP, body=big, headers={**AUTH, **JSON})
        r = conn.getresponse()
        body = r.read()
    finally:
        conn.close()
    assert r.status == 413 and r.getheader("Connection") == "close", body[:300]
    assert_error_shape(json.loads(body))
    assert_too_large(http.post(COMP, content=big, headers=JSON))

    def chunks():
        for i in range(0, len(big), 1 << 20):
            yield big[i:i + (1 << 20)]

    assert_too_large(http.post(COMP, content=chunks(), headers=JSON))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model=client.models.list().data[0].id, prompt="x" * (40 << 20), max_tokens=1)
    assert e.value.status_code == 413 and e.value.code == "request_too_large"
    good(http)


def test_endless_body_is_cut_off(server: Server, http: httpx.Client) -> None:
    """A client that keeps sending after the 413 has its connection closed once the server has
    drained 64 MiB past the limit (or after 30 s), not held open."""
    from pagedllm.entrypoints.openai.guard import DRAIN_MAX_BYTES

    sent = 0
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(f"POST {COMP} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: "
                  "application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
        chunk = b"%x\r\n%s\r\n" % (1 << 20, b"x" * (1 << 20))
        t0 = time.monotonic()
        with pytest.raises(OSError):  # reset or broken pipe once the server has closed
            while time.monotonic() - t0 < 20:
                s.sendall(chunk)
                sent += 1 << 20
    assert sent < (8 << 20) + DRAIN_MAX_BYTES + (32 << 20)  # the limit, the drain, socket buffers
    good(http)


def test_slow_headers_are_cut_off(server: Server, http: httpx.Client) -> None:
    """200 connections that never finish their headers are closed after --header-read-timeout."""

    async def slow() -> list[bytes]:
        async def one() -> bytes:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
            await writer.drain()
            try:
                return await asyncio.wait_for(reader.read(), timeout=15)  # b"" once the server closes
            finally:
                writer.close()

        return await asyncio.gather(*(one() for _ in range(200)))

    t0 = time.monotonic()
    results = asyncio.run(slow())
    assert results == [b""] * 200
    assert time.monotonic() - t0 < 12
    good(http)


def _health_on(sock: socket.socket) -> bytes:
    """One GET /health on an open keep-alive connection: the response head, or b"" when the server
    has closed the connection."""
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    except (BrokenPipeError, ConnectionResetError):
        return b""
    data = b""
    while b"\r\n\r\n" not in data:
        try:
            chunk = sock.recv(4096)
        except ConnectionResetError:
            return b""
        if not chunk:
            return b""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(4096)
    return head


def test_idle_keep_alive_connection_lives_until_its_timeout(server: Server, http: httpx.Client) -> None:
    """An idle keep-alive connection serves its next request after longer than
    --header-read-timeout (1 s: that bound starts with the next request's first bytes, not at the
    end of the last response) and is closed once idle for --timeout-keep-alive (3 s); a request
    whose headers start but never end is still cut off after --header-read-timeout."""
    def idle_then_closed() -> None:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            assert _health_on(s).startswith(b"HTTP/1.1 200")
            time.sleep(2.0)
            assert _health_on(s).startswith(b"HTTP/1.1 200")
            time.sleep(4.5)
            assert _health_on(s) == b""

    def headers_never_end() -> None:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            assert _health_on(s).startswith(b"HTTP/1.1 200")
            time.sleep(2.0)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
            t0 = time.monotonic()
            assert s.recv(4096) == b""
            assert time.monotonic() - t0 < 2.5

    # The two connections are independent: they wait side by side.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for f in [pool.submit(idle_then_closed), pool.submit(headers_never_end)]:
            f.result()
    good(http)


def test_keep_alive_outlives_client_pools() -> None:
    """The default idle timeout is longer than the official clients keep idle pooled connections
    (httpx's and the openai client's expiry), so they drop a connection before the server does."""
    import openai

    from pagedllm.entrypoints.openai.cli_args import KEEP_ALIVE_S

    assert KEEP_ALIVE_S > httpx.Limits(max_connections=None).keepalive_expiry
    assert KEEP_ALIVE_S > (openai.DEFAULT_CONNECTION_LIMITS.keepalive_expiry or 0)


def test_docs_follow_the_api_key(server: Server) -> None:
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(server.url + path).status_code == 401
        assert httpx.get(server.url + path, headers=AUTH).status_code == 200
