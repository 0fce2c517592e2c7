"""One request's failure fails that request alone, against a real `pagedllm serve` (tiny random
model, engine core in its own process): a request whose sampling raises in the engine core and
one whose detokenization raises in the API server end with an OpenAI error (an error event
mid-stream, HTTP 500 otherwise), while the requests running beside them finish with exactly the
tokens they get without the faults, every KV block is freed, /health stays 200 and the engine core
lives on.

The faults come from two narrow hook points, None in production, that the server's launcher
tests/fault_serve.py sets in each of its processes (tests/fault_hooks.py): the sampler's
(pagedllm/worker/sample/metadata.py: building the sampling metadata raises for a row with a given
seed once it has some tokens) and the detokenizer's (pagedllm/engine/detokenizer.py: decoding a
given token id raises), asked for with a logit_bias.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from server_helpers import Server, assert_error_shape, serve, wait_idle

COMP = "/v1/completions"
FAULT_SERVE = str(Path(__file__).parent.parent / "fault_serve.py")
FAULT_SEED, FAULT_AFTER = 4242, 3
FAULT_TOKEN = 300

# Requests that must not fail: they never sample the token whose decoding fails.
BAN = {"logit_bias": {str(FAULT_TOKEN): -100}}
NORMAL = [
    {"prompt": "The quick brown fox", "temperature": 0, **BAN},
    {"prompt": "Paris is the capital of", "temperature": 0, **BAN},
    {"prompt": "Once upon a time", "temperature": 0.9, "seed": 11, **BAN},
    {"prompt": "1 2 3 4", "temperature": 0.9, "seed": 12, "top_k": 20, **BAN},
]
FAULTY = {
    "sampler_stream": {"prompt": "count with me", "temperature": 0.9, "seed": FAULT_SEED, **BAN},
    "sampler_plain": {"prompt": "count with me", "temperature": 0.9, "seed": FAULT_SEED, **BAN},
    # n=2 with seed 4241: the second sample gets seed 4242 and fails; the request fails whole.
    "sampler_n2": {"prompt": "two of them", "temperature": 0.9, "seed": FAULT_SEED - 1, "n": 2, **BAN},
    "detokenizer": {"prompt": "say the word", "temperature": 0, "logit_bias": {str(FAULT_TOKEN): 100}},
}


async def stream(c: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    """Streams one completion: its tokens, text, finish reasons and any error event."""
    body = {"max_tokens": 24, "ignore_eos": True, "logprobs": 0, **body, "stream": True}
    out: dict[str, Any] = {"tokens": [], "text": "", "finish": [], "error": None, "chunks": 0}
    async with c.stream("POST", COMP, json=body) as r:
        if r.status_code != 200:
            out["status"], out["error"] = r.status_code, json.loads(await r.aread())
            return out
        out["status"] = 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                out["error"] = chunk
                continue
            out["chunks"] += 1
            for ch in chunk["choices"]:
                out["text"] += ch["text"]
                out["tokens"] += (ch.get("logprobs") or {}).get("tokens") or []
                if ch["finish_reason"] is not None:
                    out["finish"].append(ch["finish_reason"])
    return out


async def plain(c: httpx.AsyncClient, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    r = await c.post(COMP, json={"max_tokens": 24, "ignore_eos": True, **body})
    return r.status_code, r.json()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str):
    """The tiny model behind the fault launcher, checking every step's integrity; it must exit 0
    without a traceback in its log."""
    launcher = [FAULT_SERVE, "--sampler-fault", f"{FAULT_SEED}:{FAULT_AFTER}", "--detokenizer-fault", str(FAULT_TOKEN)]
    with serve(tmp_path_factory.mktemp("faults"), tiny_model_dir, "--num-kv-blocks", "128",
               env={"PAGEDLLM_CHECK_INTEGRITY": "1"}, entry=launcher) as s:
        yield s
    log = s.output()
    assert s.proc.returncode == 0 and "Traceback" not in log, log[-3000:]


def test_stream_events_survive_clients_that_split_lines_like_splitlines(server: Server) -> None:
    """Text holding U+2028, U+2029 or U+0085 (a random model emits such tokens) goes out escaped:
    httpx's aiter_lines, which splits where str.splitlines does, once cut such events in two."""
    prompt = "a\u2028b\u2029c\x85d"
    body = {"prompt": prompt, "max_tokens": 2, "echo": True, "stream": True, "temperature": 0, **BAN}
    texts = []
    with httpx.Client(base_url=server.url, timeout=60) as http:
        with http.stream("POST", COMP, json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    texts += [ch["text"] for ch in json.loads(line[6:])["choices"]]
    assert "".join(texts).startswith(prompt)


def test_faulty_requests_fail_alone(server: Server) -> None:
    engine = server.engine_pid()

    async def run() -> tuple[list[dict], list[dict], dict[str, Any], list[int]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            baseline = await asyncio.gather(*(stream(c, b) for b in NORMAL))
            health: list[int] = []
            done = asyncio.Event()

            async def poll() -> None:
                while not done.is_set():
                    health.append((await c.get("/health")).status_code)
                    await asyncio.sleep(0.02)

            poller = asyncio.ensure_future(poll())
            normal = asyncio.gather(*(stream(c, b) for b in NORMAL))
            faulty = asyncio.gather(
                stream(c, FAULTY["sampler_stream"]), plain(c, FAULTY["sampler_plain"]),
                stream(c, FAULTY["sampler_n2"]), plain(c, FAULTY["detokenizer"]),
            )
            with_faults, faults = await asyncio.gather(normal, faulty)
            done.set()
            await poller
            return baseline, with_faults, dict(zip(FAULTY, faults)), health

    baseline, with_faults, faults, health = asyncio.run(run())
    for b in baseline:
        assert b["status"] == 200 and b["error"] is None and len(b["tokens"]) == 24 and b["finish"] == ["length"], b
    # The requests beside the faulty ones: exactly the same tokens and text as without them.
    assert [(w["tokens"], w["text"], w["finish"], w["error"]) for w in with_faults] == [
        (b["tokens"], b["text"], b["finish"], None) for b in baseline]

    s = faults["sampler_stream"]  # FAULT_AFTER tokens, then the error event
    assert s["status"] == 200 and s["chunks"] == FAULT_AFTER and len(s["tokens"]) == FAULT_AFTER, s
    assert_error_shape(s["error"])
    assert s["error"]["error"]["code"] == "request_failed", s
    assert "injected sampler fault" in s["error"]["error"]["message"], s
    n2 = faults["sampler_n2"]
    assert n2["status"] == 200 and n2["error"]["error"]["code"] == "request_failed" and not n2["finish"], n2
    for name in ("sampler_plain", "detokenizer"):
        status, body = faults[name]
        assert status == 500, (name, body)
        assert_error_shape(body)
        assert body["error"]["code"] == "request_failed", body
    assert "injected detokenizer fault" in faults["detokenizer"][1]["error"]["message"]
    assert health and set(health) == {200}, health

    with httpx.Client(base_url=server.url, timeout=60) as http:
        wait_idle(http)  # every KV block free, nothing running or waiting
        again = asyncio.run(_one(server.url, NORMAL[0]))
        assert (again["tokens"], again["text"]) == (baseline[0]["tokens"], baseline[0]["text"])
        wait_idle(http)
        assert http.get("/health").status_code == 200
    assert server.engine_pid() == engine and server.proc.poll() is None
    assert re.search(r"sampling failed for \d+ of \d+ rows", server.output())


async def _one(url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        return await stream(c, body)
