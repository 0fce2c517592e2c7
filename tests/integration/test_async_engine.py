"""The serving front end with the engine core on a thread of this process (tiny random model):
clients that leave at any moment, /metrics while the engine is busy, one request's failure,
colliding ids. Each of these once took the whole engine down."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import httpx
import pytest

from pagedllm import SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.async_engine import AsyncLLMEngine, RequestFailedError
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.openai.api_server import build_app

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture()
def engine(tiny_model_dir: str) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(model=tiny_model_dir, num_kv_blocks=64, seed=0))


@pytest.fixture()
def ae(engine: LLMEngine):
    """The serving front end over `engine`'s core, on a thread of this process."""
    front = AsyncLLMEngine.from_llm_engine(engine)
    yield front
    front.shutdown()
    idle_and_clean(engine)


def idle_and_clean(e: LLMEngine) -> None:
    s = e.scheduler.get_stats()
    assert (s.num_running, s.num_waiting, s.num_swapped) == (0, 0, 0), s
    e.scheduler.check_integrity()
    assert e.scheduler.kv.usage == 0


async def wait_until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def collect(ae: AsyncLLMEngine, rid: str, prompt: str = "hello", **kw) -> str:
    params = SamplingParams(temperature=0, max_tokens=kw.pop("max_tokens", 8), ignore_eos=True, **kw)
    text = ""
    async for out in ae.generate(prompt, params, rid):
        text = out.outputs[0].text
    return text


def test_clients_leaving_at_random_moments_never_kill_the_engine(engine: LLMEngine, ae: AsyncLLMEngine) -> None:
    """A request cancelled while the engine is still busy with the previous step (its add not yet
    handled), mid-prefill or mid-decode only aborts itself."""
    rng = random.Random(1234)

    async def run() -> None:
        before = await collect(ae, "ref")
        tasks = []
        for i in range(120):
            task = asyncio.ensure_future(collect(ae, f"r{i}", f"story {i}", max_tokens=rng.randint(1, 24)))
            tasks.append(task)
            if rng.random() < 0.7:
                await asyncio.sleep(rng.choice([0, 0, 0.0005, 0.002, 0.01]))
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await wait_until(lambda: not ae.output_processor.requests and ae.last_stats.scheduler.num_running == 0)
        await wait_until(lambda: not engine.scheduler.has_unfinished_requests())
        assert not ae.errored
        assert await collect(ae, "ref2") == before

    asyncio.run(run())


def test_metrics_and_health_never_wait_on_the_engine(engine: LLMEngine, ae: AsyncLLMEngine) -> None:
    """A step that takes long (here: held on purpose) delays no scrape and cancels nothing."""
    app = build_app(ae, served_model_names=["tiny"])
    release = threading.Event()
    real_step = engine.core.step

    def slow_step():
        release.wait(timeout=20)
        return real_step()

    async def run() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as c:
            engine.core.step = slow_step  # type: ignore[method-assign]
            req = asyncio.ensure_future(c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4}))
            await wait_until(lambda: bool(ae.output_processor.requests))
            for _ in range(5):
                t0 = time.monotonic()
                assert (await c.get("/metrics")).status_code == 200
                assert (await c.get("/health")).status_code == 200
                assert time.monotonic() - t0 < 1.0
            release.set()
            r = await req
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
            assert not ae.errored

    try:
        asyncio.run(run())
    finally:
        release.set()


def test_a_failing_request_fails_alone(engine: LLMEngine, ae: AsyncLLMEngine) -> None:
    """A detokenizer error in one request ends that request with an error; the others finish."""

    def broken(*args, **kwargs):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")

    register = ae.output_processor.add_request

    def add_request(request_id: str, *args, **kwargs):  # "bad" gets a detokenizer that fails
        seq_ids = register(request_id, *args, **kwargs)
        if request_id == "bad":
            ae.output_processor.requests[request_id].seqs[0].detok.update = broken  # type: ignore[method-assign]
        return seq_ids

    ae.output_processor.add_request = add_request  # type: ignore[method-assign]

    async def run() -> None:
        good = [asyncio.ensure_future(collect(ae, f"good{i}", f"fine {i}", max_tokens=12)) for i in range(3)]
        bad = asyncio.ensure_future(collect(ae, "bad", "broken", max_tokens=12))
        with pytest.raises(RequestFailedError, match="bad"):
            await bad
        assert all(len(t) > 0 for t in await asyncio.gather(*good))
        assert not ae.errored
        await wait_until(lambda: not engine.scheduler.has_unfinished_requests())

    asyncio.run(run())


def test_colliding_ids_are_rejected_before_anything_changes(engine: LLMEngine, ae: AsyncLLMEngine) -> None:
    """`0_a` is the id of sample 0 of request `a` (n=2): a new request may not take it, nor may a
    request whose samples would take ids in flight. Nothing of the running request changes."""

    async def run() -> None:
        params = SamplingParams(n=2, max_tokens=30, ignore_eos=True, temperature=0)
        gen = ae.generate("hello", params, "a")
        first = await gen.__anext__()
        for rid, n in (("0_a", 1), ("a", 1), ("a", 3)):
            with pytest.raises(ValueError, match="in use"):
                await ae.generate("x", SamplingParams(n=n, max_tokens=2), rid).__anext__()
        assert ae.output_processor.seq_owner["0_a"][0].request_id == "a"
        outs = [first] + [o async for o in gen]
        assert outs[-1].finished and [len(c.token_ids) for c in outs[-1].outputs] == [30, 30]

    asyncio.run(run())


def test_metrics_count_requests_and_step_histograms(engine: LLMEngine, ae: AsyncLLMEngine) -> None:
    """An n=3 request is one success; per-request and per-step histograms are filled from what
    the engine core pushed (no scrape asks the engine anything)."""
    import re

    app = build_app(ae, served_model_names=["tiny"])

    async def run() -> str:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as c:
            r = await c.post("/v1/completions", json={"prompt": "hi", "n": 3, "max_tokens": 5, "ignore_eos": True})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 15
            return (await c.get("/metrics")).text

    text = asyncio.run(run())

    def value(name: str) -> float:
        found = re.findall(rf"^pagedllm:{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
        assert found, name
        return sum(float(v) for v in found)

    assert value("request_success_total") == 1
    for name in ("request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                 "e2e_request_latency_seconds"):
        assert value(f"{name}_count") == 1, name
    assert value("request_generation_tokens_sum") == 15
    assert value("iteration_tokens_total_count") >= 5  # at least one step per generated position
    assert value("iteration_tokens_total_sum") >= 2 + 15 - 3  # the prompt once, then every sample's tokens
    assert value("engine_step_time_seconds_count") == value("iteration_tokens_total_count")
    assert value("num_requests_running") == 0 and value("kv_cache_usage_perc") == 0


def test_tokens_after_a_stop_string_are_dropped(engine: LLMEngine, ae: AsyncLLMEngine) -> None:
    """With the engine core in another process, a step may run before it hears that the front end
    stopped a sample on a stop string: that step's token is not part of the sample."""
    from pagedllm.core.scheduler_output import EngineCoreOutput
    from pagedllm.sampling_params import RequestOutputKind

    op = ae.output_processor
    tok = engine.tokenizer
    ids = tok.encode("fox dog", add_special_tokens=False)
    params = SamplingParams(n=2, stop=["dog"], max_tokens=10, output_kind=RequestOutputKind.CUMULATIVE)
    op.add_request("r", "p", [1, 2], params, time.time())
    res = op.process_outputs([EngineCoreOutput("0_r", ids), EngineCoreOutput("1_r", ids[:1])])
    assert res.stopped == ["0_r"]
    text = res.outputs[0].outputs[0].text
    late = op.process_outputs([EngineCoreOutput("0_r", ids[:1]), EngineCoreOutput("1_r", ids[:1])])
    assert late.outputs[0].outputs[0].text == text and late.outputs[0].outputs[0].finish_reason == "stop"
    assert late.stopped == []


def test_offline_generate_fails_for_a_request_whose_sampling_raises(tiny_model_dir: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline, a request whose sampling raises (the sampler's fault hook, set here in-process)
    makes generate() raise naming it; the other requests of the call are ended, the engine is left
    empty and the next call gives the same tokens as an engine that never failed."""
    from fault_hooks import sampler_fault
    from pagedllm import LLM
    from pagedllm.worker.sample import metadata

    llm = LLM(model=tiny_model_dir, num_kv_blocks=64, seed=0, dtype="float32")
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(["a fox", "a dog"], greedy, use_tqdm=False)]
    monkeypatch.setattr(metadata, "fault_hook", sampler_fault(77, 2))
    faulty = SamplingParams(temperature=0.5, seed=77, max_tokens=8, ignore_eos=True)
    with pytest.raises(RuntimeError, match="injected sampler fault"):
        llm.generate(["a fox", "a cat", "a dog"], [greedy, faulty, greedy], use_tqdm=False)
    idle_and_clean(llm.llm_engine)
    assert not llm.llm_engine.output_processor.requests
    assert [o.outputs[0].token_ids for o in llm.generate(["a fox", "a dog"], greedy, use_tqdm=False)] == want


def test_finished_requests_leave_nothing_behind(engine: LLMEngine, ae: AsyncLLMEngine) -> None:
    """After bursts of requests that finish, get aborted mid-stream or end on a stop string (n = 1
    and n = 2), every per-request table of the front end and the engine is empty, and the live
    request objects do not grow from one burst to the next."""
    import gc

    from pagedllm.core.request import Request
    from pagedllm.engine.output_processor import RequestState, SequenceState

    def live() -> int:
        gc.collect()
        kinds = {Request, RequestState, SequenceState}
        # type(), not isinstance(): isinstance also reads each object's __class__, and some of
        # torch's module-level objects warn when it is read
        return sum(type(o) in kinds for o in gc.get_objects())

    async def burst(tag: str) -> None:
        rng = random.Random(7)
        tasks = []
        for i in range(40):
            kw = {"n": 2, "seed": i} if i % 5 == 0 else {"stop": ["e"]} if i % 5 == 1 else {}
            task = asyncio.ensure_future(collect(ae, f"{tag}{i}", f"tale {i}", max_tokens=rng.randint(1, 12), **kw))
            tasks.append(task)
            if i % 3 == 0:
                await asyncio.sleep(rng.choice([0, 0.002, 0.01]))
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await wait_until(lambda: not engine.scheduler.has_unfinished_requests() and not ae.output_processor.requests)

    def assert_empty() -> None:
        s = engine.scheduler
        assert not ae._streams and not ae.output_processor.requests and not ae.output_processor.seq_owner
        assert not s.requests and not s._worker and not s._pending_forks and not s.kv.req_blocks
        assert not s.kv._num_cached and not s.kv._cow and not s.kv.swapped_blocks
        # The worker drops the rows of the last step's finished requests at its next step.
        assert set(engine.executor.runner.requests) <= set(s._forget)

    async def run() -> None:
        await burst("a")
        assert_empty()
        after_one = live()
        await burst("b")
        await burst("c")
        assert_empty()
        assert live() <= after_one
        assert not ae.errored

    asyncio.run(run())


def test_a_failing_stat_logger_is_turned_off_and_serving_goes_on(engine: LLMEngine) -> None:
    """A stat logger that raises loses its own figures; requests, and the other loggers, go on."""

    class Broken:
        def record(self, scheduler_stats, iteration_stats) -> None:
            raise KeyError("injected")

        def log(self) -> None: ...

    class Counting:
        steps = 0

        def record(self, scheduler_stats, iteration_stats) -> None:
            self.steps += 1

        def log(self) -> None: ...

    broken, counting = Broken(), Counting()
    front = AsyncLLMEngine.from_llm_engine(engine, stat_loggers=[broken, counting])
    try:
        async def run() -> list[str]:
            return await asyncio.gather(*(collect(front, f"r{i}", f"text {i}", max_tokens=6) for i in range(3)))

        assert all(len(t) > 0 for t in asyncio.run(run()))
        assert not front.errored and front.stat_loggers == [counting] and counting.steps >= 6
    finally:
        front.shutdown()
    idle_and_clean(engine)


EXITS_WITHOUT_SHUTDOWN = """
import asyncio, sys
from pagedllm import SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.async_engine import AsyncLLMEngine

async def main():
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=sys.argv[1], num_kv_blocks=64))
    print(engine.client.pid, flush=True)
    async for _ in engine.generate("hello", SamplingParams(max_tokens=2), "r"):
        pass
    raise RuntimeError("the program ends without shutdown()")

if __name__ == "__main__":
    asyncio.run(main())
"""


def test_a_program_that_never_calls_shutdown_still_exits(tiny_model_dir: str, tmp_path) -> None:
    """The engine-core process is not daemonic and multiprocessing joins such children at exit:
    without a stop of its own at exit, a program that ends on an exception would hang there."""
    import os
    import subprocess
    import sys

    script = tmp_path / "no_shutdown.py"
    script.write_text(EXITS_WITHOUT_SHUTDOWN)
    proc = subprocess.run([sys.executable, str(script), tiny_model_dir], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "the program ends without shutdown()" in proc.stderr, proc.stderr[-2000:]
    pid = int(proc.stdout.split()[0])
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
