"""ModelPool's eviction with real engines (tiny models, the engine core on a thread of this
process): with room for one extra model, a model with a request in flight is never unloaded (the
load of another waits until that request ends), then the least recently used idle one is; each
request's greedy tokens equal pagedllm.LLM's on that model alone."""

from __future__ import annotations

import asyncio
import time

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.entrypoints.openai.model_pool import ModelPool
from pagedllm.models.testing import make_tiny_checkpoint

PROMPT = [5, 17, 42, 99, 7]
PARAMS = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("pool")
    paths = {"a": make_tiny_checkpoint(str(root / "a"), arch="llama", seed=1),
             "b": make_tiny_checkpoint(str(root / "b"), arch="qwen2", seed=2)}
    refs = {}
    for name, path in paths.items():
        llm = LLM(path, dtype="float32", max_model_len=128, kv_cache_memory="8MiB")
        refs[name] = list(llm.generate([{"prompt_token_ids": PROMPT}], PARAMS)[0].outputs[0].token_ids)
        del llm
    return paths, refs


def _in_process(args: EngineArgs, **kwargs):
    return AsyncLLMEngine.from_engine_args(args, multiprocess=False, **kwargs)


def test_a_model_with_a_request_in_flight_is_never_evicted(models) -> None:
    paths, refs = models
    gates: dict[str, asyncio.Event] = {}
    answers: dict[str, list[int]] = {}
    events: list[str] = []

    def make_app(engine, name, stat_logger):
        async def app(scope, receive, send):  # one request: wait for the test's gate, then generate
            events.append(f"start {name}")
            await gates[name].wait()
            async for out in engine.generate({"prompt_token_ids": PROMPT}, PARAMS, f"{name}-{time.monotonic()}"):
                answers[name] = list(out.outputs[0].token_ids)
            events.append(f"end {name}")
        return app

    extras = [(n, EngineArgs(model=p, dtype="float32", max_model_len=128, kv_cache_memory="8MiB",
                             served_model_name=n)) for n, p in paths.items()]

    async def run() -> None:
        pool = ModelPool("main", extras, make_app, max_loaded=2, load_engine=_in_process)
        gates.update(a=asyncio.Event(), b=asyncio.Event())
        first = asyncio.create_task(pool.serve("a", {}, None, None))
        while "start a" not in events:
            await asyncio.sleep(0.01)
        second = asyncio.create_task(pool.serve("b", {}, None, None))
        gates["b"].set()
        await asyncio.sleep(1.0)
        assert pool.loaded_names() == ["a"] and not second.done()  # b waits: a has a request in flight
        gates["a"].set()
        await asyncio.wait_for(asyncio.gather(first, second), 120)
        assert events == ["start a", "end a", "start b", "end b"]
        assert pool.loaded_names() == ["b"]
        assert answers == refs
        # Both idle now: loading a unloads b, the least recently used (and the only other) one.
        await asyncio.wait_for(pool.serve("a", {}, None, None), 120)
        assert pool.loaded_names() == ["a"] and answers["a"] == refs["a"]
        await pool.close()
        assert pool.loaded_names() == []

    asyncio.run(run())
