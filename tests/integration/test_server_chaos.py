"""Chaos against a real `pagedllm serve` (tiny random model, engine core in its own process):
hundreds of clients leaving at random moments mixed with normal traffic and /metrics polls; the
engine-core process killed mid-stream; the server killed under the engine core. Seeded, bounded."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from pathlib import Path

import httpx
import psutil
import pytest

from server_helpers import Server, gone, wait_idle

COMP = "/v1/completions"
SEED = int(os.environ.get("PAGEDLLM_CHAOS_SEED", "20261201"))
# PAGEDLLM_CHAOS_SEED and PAGEDLLM_CHAOS_REQUESTS choose the storm (pagedllm bench chaos runs
# it with many seeds, and with 1,000 requests).
NUM_REQUESTS = int(os.environ.get("PAGEDLLM_CHAOS_REQUESTS", "300"))
MOMENTS = ("before_admission", "prefill", "mid_stream", "last_token", "normal")


def start(tmp_path: Path, model: str, name: str, *args: str) -> Server:
    server = Server(tmp_path / f"{name}.log", model, "--num-kv-blocks", "256", "--max-num-seqs", "64", *args,
                    env={"PAGEDLLM_CHECK_INTEGRITY": "1"})
    server.wait_ready()
    return server


def greedy(http: httpx.Client) -> str:
    r = http.post(COMP, json={"prompt": "The quick brown fox", "max_tokens": 24, "temperature": 0,
                              "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


async def one_client(c: httpx.AsyncClient, rng: random.Random, i: int) -> str:
    """One request that leaves at a moment drawn from MOMENTS; returns what happened."""
    moment = rng.choice(MOMENTS)
    max_tokens = rng.randint(2 if moment == "mid_stream" else 1, 40)
    prompt = " ".join(rng.choice(["fox", "dog", "blocks", "cache", "Paris", "1", "2"]) for _ in range(rng.randint(1, 60)))
    body = {"prompt": f"{i} {prompt}", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.8,
            "seed": i, "stream": moment in ("mid_stream", "last_token", "normal") and rng.random() < 0.8}
    if moment in ("before_admission", "prefill"):
        delay = rng.uniform(0, 0.003) if moment == "before_admission" else rng.uniform(0.003, 0.05)
        task = asyncio.ensure_future(c.post(COMP, json=body))
        await asyncio.sleep(delay)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return moment
    if not body["stream"]:
        r = await c.post(COMP, json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == max_tokens
        return "normal"
    # Leaves once it has this many tokens, in the first half of its stream: a chunk may carry
    # several tokens (a busy server sends what piled up since the last one), so the moment is
    # counted by tokens (continuous usage stats), not chunks, and it is what happened.
    stop_after = rng.randint(1, max(1, (max_tokens - 1) // 2)) if moment == "mid_stream" else None
    body["stream_options"] = {"continuous_usage_stats": True}
    async with c.stream("POST", COMP, json=body) as r:
        assert r.status_code == 200
        events = []
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line)
            if line == "data: [DONE]":
                break
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            last = any(ch["finish_reason"] is not None for ch in chunk["choices"])
            if stop_after is not None and chunk["usage"]["completion_tokens"] >= stop_after:
                return "last_token" if last else "mid_stream"  # leaves
            if moment == "last_token" and last:
                return moment  # leaves with the last token, before [DONE]
    assert events[-1] == "data: [DONE]"
    return "normal"


async def storm(url: str, seed: int, n: int) -> dict[str, int]:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as c:
        sem = asyncio.Semaphore(48)
        done = asyncio.Event()

        async def guarded(i: int) -> str:
            async with sem:
                return await one_client(c, random.Random(rng.random()), i)

        async def poll() -> int:
            # Its own client: the storm's pool (64 connections for 48 clients and their
            # cancelled posts) must not queue the polls, which are counted below.
            polls = 0
            async with httpx.AsyncClient(base_url=url, timeout=60) as own:
                while not done.is_set():
                    assert (await own.get("/metrics")).status_code == 200
                    assert (await own.get("/health")).status_code == 200
                    polls += 1
                    await asyncio.sleep(0.01)
            return polls

        poller = asyncio.ensure_future(poll())
        results = await asyncio.gather(*(guarded(i) for i in range(n)))
        done.set()
        polls = await poller
    counts = {m: results.count(m) for m in MOMENTS}
    counts["metrics_polls"] = polls
    return counts


@pytest.mark.slow
def test_disconnect_storm_leaves_the_engine_clean(tmp_path: Path, tiny_model_dir: str) -> None:
    server = start(tmp_path, tiny_model_dir, "storm")
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            before = greedy(http)
            counts = asyncio.run(storm(server.url, SEED, NUM_REQUESTS))
            assert all(counts[m] > 20 for m in MOMENTS), counts
            # Polls interleave with the storm; each takes a few hundred ms while the API server
            # carries 48 streams, so their count follows the host's speed (9-17 seen).
            assert counts["metrics_polls"] >= 3, counts
            wait_idle(http)
            assert http.get("/health").status_code == 200
            assert greedy(http) == before  # and the engine ran its integrity check on every step
            wait_idle(http)
        engine = server.engine_pid()
    finally:
        code = server.stop()
    assert code == 0, server.output()[-3000:]
    assert gone(engine, 5), "the engine-core process outlived the server"
    assert "Traceback" not in server.output()


def test_engine_killed_mid_stream_fails_requests_and_exits(tmp_path: Path, tiny_model_dir: str) -> None:
    server = start(tmp_path, tiny_model_dir, "kill")
    try:
        engine = server.engine_pid()
        helpers = [p.pid for p in psutil.Process(server.proc.pid).children(recursive=True)]

        async def run() -> tuple[list[list[str]], list[int]]:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
                started = asyncio.Semaphore(0)

                async def stream(i: int) -> list[str]:
                    body = {"prompt": f"count {i}", "max_tokens": 480, "ignore_eos": True, "stream": True}
                    events: list[str] = []
                    async with c.stream("POST", COMP, json=body) as r:
                        assert r.status_code == 200
                        async for line in r.aiter_lines():
                            if line.startswith("data: "):
                                events.append(line)
                                if len(events) == 1:
                                    started.release()
                    return events

                tasks = [asyncio.ensure_future(stream(i)) for i in range(6)]
                for _ in tasks:
                    await started.acquire()
                os.kill(engine, signal.SIGKILL)
                statuses = []
                t0 = time.monotonic()
                while time.monotonic() - t0 < 3:
                    try:
                        statuses.append((await c.get("/health")).status_code)
                    except httpx.HTTPError:
                        break
                    await asyncio.sleep(0.05)
                return await asyncio.gather(*tasks), statuses

        t0 = time.monotonic()
        streams, statuses = asyncio.run(run())
        for events in streams:
            assert events[-1] == "data: [DONE]"
            err = json.loads(events[-2][6:])
            assert err["error"]["code"] == "engine_dead", err
        assert 503 in statuses, statuses
        code = server.proc.wait(timeout=10)
        assert code != 0
        assert time.monotonic() - t0 < 10
        assert all(gone(pid, 5) for pid in helpers), "a child of the server outlived it"
    finally:
        server.stop()


def test_engine_core_ends_when_the_server_is_killed(tmp_path: Path, tiny_model_dir: str) -> None:
    server = start(tmp_path, tiny_model_dir, "orphan")
    try:
        engine = server.engine_pid()
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(timeout=10)
        assert gone(engine, 5), "the engine-core process outlived its server"
    finally:
        server.stop()
