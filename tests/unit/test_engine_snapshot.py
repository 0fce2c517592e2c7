"""The engine view's snapshots: the run-length encoding of block states, the wire schema, and a
snapshot of a real scheduler read against the block pool itself, step after step."""

from __future__ import annotations

import random
import time

import msgspec
import pytest

from pagedllm.engine.core_io import Codec, MsgKind
from pagedllm.engine.snapshot import (
    BlockState,
    EngineSnapshot,
    RequestView,
    SnapshotTimer,
    build_snapshot,
    count_states,
    rle_decode,
    rle_encode,
)
from test_scheduler import Driver, make_req, make_sched


def random_cells(rng: random.Random, n: int) -> list[tuple[int, int, int]]:
    cells, i = [], 0
    while i < n:
        state = rng.choice(list(BlockState))
        run = rng.randint(1, 6)
        owner = -1 if state in (BlockState.FREE, BlockState.CACHED) else rng.randint(0, 3)
        first = rng.randint(0, 9)
        for k in range(min(run, n - i)):
            cells.append((state, owner, first + k if owner >= 0 else -1))
        i += run
    return cells


@pytest.mark.parametrize("seed", range(20))
def test_rle_round_trip(seed: int) -> None:
    rng = random.Random(seed)
    cells = random_cells(rng, rng.randint(0, 300))
    runs = rle_encode(cells)
    assert rle_decode(runs) == cells
    assert sum(runs[3::4]) == len(cells)
    counts = count_states(runs)
    for state in BlockState:
        assert counts.get(state, 0) == sum(1 for c in cells if c[0] == state)


def test_rle_is_compact_for_contiguous_tables() -> None:
    # 3 requests holding contiguous block ids, then free blocks: 4 runs whatever the pool's size.
    cells = [(BlockState.USED, r, i) for r in range(3) for i in range(100)]
    cells += [(BlockState.FREE, -1, -1)] * 10_000
    assert rle_encode(cells) == [2, 0, 0, 100, 2, 1, 0, 100, 2, 2, 0, 100, 0, -1, -1, 10_000]
    # A table index that does not follow starts a new run, even for the same owner.
    assert rle_encode([(2, 0, 0), (2, 0, 5)]) == [2, 0, 0, 1, 2, 0, 5, 1]


def test_rle_decode_rejects_bad_runs() -> None:
    with pytest.raises(ValueError, match="fours"):
        rle_decode([0, -1, -1])
    with pytest.raises(ValueError, match="length 0"):
        rle_decode([0, -1, -1, 0])


def snapshot_example() -> EngineSnapshot:
    return EngineSnapshot(
        time=1.5, num_blocks=8, block_size=16, blocks=[2, 0, 0, 3, 3, 1, 0, 1, 0, -1, -1, 4], num_swap_blocks=2,
        swap_blocks=[4, 1, 0, 1, 0, -1, -1, 1], requests=[RequestView("a", 1, 40, 40, 3, 16, 0, 3, 0),
                                                         RequestView("b", 2, 10, 10, 1, 8, -1, 1, 1)],
        budget=2048, max_num_seqs=256, step_prefill_tokens=12, step_decode_tokens=1, step_time=0.01,
        num_steps=7, num_preemptions=1, prefix_cache_queries=100, prefix_cache_hits=32, policy="priority",
    )


def test_snapshot_crosses_the_wire_and_becomes_json() -> None:
    codec = Codec()
    snap = snapshot_example()
    data = codec.encode(MsgKind.SNAPSHOT, snap)
    assert codec.decode(data) == (MsgKind.SNAPSHOT, snap)
    assert codec.decode(codec.encode(MsgKind.WATCH, True)) == (MsgKind.WATCH, True)
    assert len(data) < 400
    # The JSON a viewer gets names every field (the page reads them by name).
    body = msgspec.json.decode(msgspec.json.encode(snap))
    assert body["blocks"] == snap.blocks and body["requests"][0][:2] == ["a", 1]
    assert set(body) == set(EngineSnapshot.__struct_fields__)


def pool_truth(sched) -> dict[int, int]:
    counts: dict[int, int] = {}
    for b in sched.kv.pool.blocks:
        if b.ref_cnt == 0:
            s = BlockState.CACHED if b.block_hash is not None else BlockState.FREE
        else:
            s = BlockState.USED if b.ref_cnt == 1 else BlockState.SHARED
        counts[s] = counts.get(s, 0) + 1
    return counts


def check_snapshot(sched, snap: EngineSnapshot) -> None:
    assert count_states(snap.blocks) == pool_truth(sched)
    cells = rle_decode(snap.blocks)
    assert len(cells) == sched.kv.num_blocks
    # Every held block names a request that holds it, at the table index where it sits.
    for block_id, (state, owner, index) in enumerate(cells):
        if state in (BlockState.USED, BlockState.SHARED):
            rid = snap.requests[owner].id
            assert sched.kv.req_blocks[rid][index].block_id == block_id
    ids = {q: [r.id for r in snap.requests if r.queue == q] for q in (0, 1, 2)}
    assert ids == {0: [r.request_id for r in sched.waiting], 1: [r.request_id for r in sched.running],
                   2: [r.request_id for r in sched.swapped]}
    for r in snap.requests:
        req = sched.requests[r.id]
        assert (r.prompt_total, r.output, r.max_tokens) == (req.num_prompt_tokens, req.num_output_tokens, req.max_tokens)
        assert 0 <= r.prompt_done <= r.prompt_total
    swapped = count_states(snap.swap_blocks).get(BlockState.SWAPPED, 0)
    assert swapped == sum(len(v) for v in sched.kv.swapped_blocks.values())


def test_snapshot_of_a_running_scheduler_agrees_with_the_pool() -> None:
    # Shared prefixes (caching on), chunked prompts and swap preemptions, checked after every step.
    sched = make_sched(num_blocks=24, block_size=4, caching=True, num_swap_blocks=16, preemption_mode="swap",
                       max_num_batched_tokens=16)
    for i in range(8):
        sched.add_request(make_req(f"r{i}", 9 + 3 * i, max_tokens=12, arrival=i, base=500))  # one shared prefix
    d = Driver(sched)
    seen = set()
    prefill = decode = 0
    while sched.has_unfinished_requests():
        so, _ = d.step()
        snap = build_snapshot(sched, so)
        check_snapshot(sched, snap)
        seen |= {s for s, n in count_states(snap.blocks).items() if n}
        assert snap.step_prefill_tokens + snap.step_decode_tokens == so.total_num_scheduled_tokens
        assert snap.step_prefill_tokens + snap.step_decode_tokens <= snap.budget == 16
        prefill += snap.step_prefill_tokens
        decode += snap.step_decode_tokens
        if sched.swapped:
            seen.add(BlockState.SWAPPED)
    assert {BlockState.USED, BlockState.SHARED, BlockState.CACHED, BlockState.SWAPPED} <= seen
    assert decode > 0 and prefill > 0
    final = build_snapshot(sched)
    assert final.requests == [] and count_states(final.blocks).get(BlockState.USED, 0) == 0


def test_timer_sends_only_while_watched_and_at_most_every_interval() -> None:
    timer = SnapshotTimer(interval=0.05)
    assert not timer.due() and timer.poll_ms(500) == 500  # nobody watches: nothing, ever
    timer.watch(True)
    assert timer.due()  # a new viewer gets one at once
    assert not timer.due()
    assert 1 <= timer.poll_ms(500) <= 51
    time.sleep(0.06)
    assert timer.due()
    timer.watch(False)
    assert not timer.due()


def test_timer_backs_off_where_snapshots_are_costly() -> None:
    class Core:  # what SnapshotTimer.take reads of the engine core
        scheduler = make_sched(num_blocks=4096, block_size=4, caching=True)

    timer = SnapshotTimer(interval=0.25)
    timer.watch(True)
    snap = timer.take(Core())
    assert snap.num_blocks == 4096 and count_states(snap.blocks) == {BlockState.FREE: 4096}
    assert timer.interval >= 0.25
    timer.min_interval = 0.0
    timer.take(Core())
    assert 0 < timer.interval < 0.25  # the interval follows the measured cost (100x the build time)
