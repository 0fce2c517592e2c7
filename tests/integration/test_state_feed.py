"""The engine view's feed with the engine core on a thread of this process (tiny random model):
snapshots flow only while someone watches, show the request that runs, and agree with the
scheduler's own figures; the last viewer leaving turns them off; --disable-ui removes the page and the feed."""

from __future__ import annotations

import asyncio
import json

import pytest

from pagedllm import SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.snapshot import BlockState, count_states

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_feed_runs_only_while_watched(tiny_model_dir: str) -> None:
    engine = LLMEngine.from_engine_args(EngineArgs(model=tiny_model_dir, num_kv_blocks=64, seed=0))
    ae = AsyncLLMEngine.from_llm_engine(engine)
    feed = ae.state_feed

    async def main() -> None:
        ae.start()
        await asyncio.sleep(0.6)
        assert feed.num_snapshots == 0  # nobody watches: the engine core builds nothing
        q = feed.subscribe()
        hello = feed.hello()
        assert hello["num_blocks"] == 64 and hello["viewers"] == 1
        first = json.loads(await asyncio.wait_for(q.get(), 5))  # at once, even while idle
        assert first["snapshot"]["requests"] == [] and first["snapshot"]["blocks"] == [0, -1, -1, 64]
        params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        seen_running = []

        async def generate() -> None:  # one request after another, until one was seen running
            k = 0
            while not seen_running:
                k += 1
                async for _ in ae.generate("hello " * 20, params, f"req-{k}"):
                    pass

        task = asyncio.create_task(generate())
        while not task.done():
            try:
                msg = json.loads(await asyncio.wait_for(q.get(), 1))
            except asyncio.TimeoutError:
                continue
            snap = msg["snapshot"]
            running = [r for r in snap["requests"] if r["queue"] == 1]
            if running:
                seen_running.append(running[0])
                counts = count_states(snap["blocks"])
                # The request's blocks are in use, and the table's length agrees.
                assert counts.get(BlockState.USED, 0) == running[0]["blocks"] > 0
                assert msg["point"]["running"] == 1
        await task
        assert seen_running and seen_running[0]["id"].startswith("req-")
        r = seen_running[-1]
        assert 0 < r["prompt_done"] <= r["prompt_total"] and 0 <= r["output"] <= r["max_tokens"] == 400
        feed.unsubscribe(q)
        await asyncio.sleep(0.4)  # a snapshot may have been on its way
        n = feed.num_snapshots
        await asyncio.sleep(0.8)
        assert feed.num_snapshots == n  # the last viewer left: no more snapshots

    try:
        asyncio.run(main())
    finally:
        ae.shutdown()


def test_disable_ui_removes_the_page_and_the_feed(tiny_model_dir: str) -> None:
    import httpx

    from pagedllm.entrypoints.openai.api_server import build_app

    engine = LLMEngine.from_engine_args(EngineArgs(model=tiny_model_dir, num_kv_blocks=64, seed=0))
    ae = AsyncLLMEngine.from_llm_engine(engine)

    async def get(app, path: str) -> int:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return (await c.get(path)).status_code

    async def main() -> None:
        on, off = build_app(ae, served_model_names=["tiny"]), build_app(ae, served_model_names=["tiny"], enable_ui=False)
        assert await get(on, "/") == 307 and await get(on, "/ui/") == 200 and await get(on, "/ui/engine.js") == 200
        assert await get(off, "/") == 404 and await get(off, "/ui/") == 404 and await get(off, "/v1/engine/state") == 404
        assert await get(off, "/v1/models") == 200

    try:
        asyncio.run(main())
    finally:
        ae.shutdown()
