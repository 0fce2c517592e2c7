"""`pagedllm simulate --ui`: the engine view's messages recorded from a simulated run, and their
replay, paced by simulated time, in the feed's format."""

from __future__ import annotations

import asyncio
import json

import pytest

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.engine.snapshot import BlockState, count_states
from pagedllm.entrypoints.web.replay import build_replay_app, replay_events
from pagedllm.simulator.cost_model import CostModel
from pagedllm.simulator.recording import SnapshotRecorder
from pagedllm.simulator.runner import Simulation
from test_simulator import TOY, UNIT_HW, _trace


def record(interval: float) -> tuple[SnapshotRecorder, object]:
    sc = SchedulerConfig(max_num_batched_tokens=48, max_num_seqs=8, max_model_len=128, preemption_mode="swap")
    cc = CacheConfig(block_size=4, num_kv_blocks=40)
    rec = SnapshotRecorder(interval=interval)
    res = Simulation(sc, cc, CostModel(TOY, UNIT_HW, 4), 40, 20, check_integrity=True).run(_trace(),
                                                                                          on_step=rec.on_step)
    return rec, res


def test_recorder_takes_snapshots_on_the_simulated_clock() -> None:
    rec, res = record(0.05)
    times = [t for t, _ in rec.messages]
    assert times == sorted(times) and len(times) >= 3
    assert all(b - a >= 0.05 for a, b in zip(times, times[1:]))  # at most one per interval
    assert times[-1] <= res.sim_elapsed_s
    assert rec.hello["num_blocks"] == 40 and rec.hello["budget"] == 48
    seen = set()
    for t, data in rec.messages:
        msg = json.loads(data)
        snap = msg["snapshot"]
        assert snap["time"] == t and sum(snap["blocks"][3::4]) == 40
        assert msg["point"]["running"] == sum(1 for r in snap["requests"] if r["queue"] == 1)
        assert 0 <= msg["point"]["kv_usage"] <= 1
        seen |= {s for s, n in count_states(snap["blocks"]).items() if n}
    assert BlockState.USED in seen
    with pytest.raises(ValueError, match="positive"):
        SnapshotRecorder(interval=0)


def test_replay_paces_the_messages_by_simulated_time() -> None:
    rec, _ = record(0.05)
    msgs = rec.messages[:4]
    span = msgs[-1][0] - msgs[0][0]

    async def take() -> tuple[list[str], float]:
        gen = replay_events(rec.hello, msgs, speed=10.0)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        out = [await gen.__anext__() for _ in range(1 + len(msgs))]
        elapsed = loop.time() - t0
        await gen.aclose()
        return out, elapsed

    out, elapsed = asyncio.run(take())
    assert out[0].startswith("event: hello\n") and json.loads(out[0].split("data: ", 1)[1])["num_blocks"] == 40
    assert [e[len("data: "):-2] for e in out[1:]] == [d for _, d in msgs]
    assert elapsed >= span / 10.0 * 0.9
    with pytest.raises(ValueError, match="speed"):
        build_replay_app(rec.hello, msgs, speed=0)
