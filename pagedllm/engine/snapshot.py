"""The engine core's state, as a viewer sees it: the KV block pool, the queues and the last step.

The engine core builds an `EngineSnapshot` at most every `SNAPSHOT_INTERVAL_S` and only while a
viewer watches (`SnapshotTimer`; the front end turns it on with a WATCH message, see core_io.py).
A snapshot is a few KB: the block states are run-length encoded, so a pool of thousands of blocks
costs a handful of runs when requests hold contiguous block ids, as they mostly do.

Block runs: `[state, owner, first, length]` quadruples, flattened into one list of ints. `state`
is a `BlockState`, `owner` the index of the request in `EngineSnapshot.requests` that holds it
(-1: none; for a shared block, the first table that names it), `first` the block's index in that
request's block table (its tokens are `[first * block_size, (first + 1) * block_size)`), and a
run covers consecutive block ids whose state and owner agree and whose table index goes up by one.
"""

from __future__ import annotations

import enum
import re
import time
from collections.abc import Sequence
from typing import Any

import msgspec

# The fastest a viewer is sent snapshots: 4 a second.
SNAPSHOT_INTERVAL_S = 0.25
# The most of the engine core's time snapshots may take: a pool whose snapshot takes longer to
# build than this share of the interval is sent snapshots less often.
MAX_TIME_SHARE = 0.01


class BlockState(enum.IntEnum):
    FREE = 0
    """Ref count 0, holding no cached prefix."""
    CACHED = 1
    """Ref count 0, still holding a cached prefix a later request can take back."""
    USED = 2
    """Held by one request."""
    SHARED = 3
    """Held by several requests (a prefix-cache hit or the samples of an n > 1 request)."""
    SWAPPED = 4
    """A host (swap pool) block holding a swapped-out request's KV."""


class RequestView(msgspec.Struct, array_like=True):
    """One request in a queue: `[id, queue, prompt_done, prompt_total, output, max_tokens, priority,
    blocks, preemptions]`; `queue` is 0 waiting, 1 running, 2 swapped."""

    id: str
    queue: int
    prompt_done: int
    prompt_total: int
    output: int
    max_tokens: int
    priority: int
    blocks: int
    preemptions: int


class EngineSnapshot(msgspec.Struct):
    """What a viewer sees of the engine core at one moment."""

    time: float
    """Wall-clock seconds (time.time()) when it was taken."""
    num_blocks: int
    block_size: int
    blocks: list[int]
    """The device pool's runs, see the module's docstring."""
    num_swap_blocks: int
    swap_blocks: list[int]
    """The host swap pool's runs (states FREE and SWAPPED)."""
    requests: list[RequestView]
    """Running first (in admission order), then swapped, then waiting (in queue order)."""
    budget: int
    """Tokens one step may compute (--max-num-batched-tokens)."""
    max_num_seqs: int
    step_prefill_tokens: int
    """Prompt tokens the last step computed (prompt chunks, and recomputation after preemption)."""
    step_decode_tokens: int
    """Tokens the last step decoded (one per generating sequence)."""
    step_time: float
    num_steps: int
    """Steps since the engine core started."""
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    policy: str = "fcfs"
    build_time: float = 0.0
    """Seconds the engine core took to build this snapshot."""


def rle_encode(cells: Sequence[tuple[int, int, int]]) -> list[int]:
    """(state, owner, table index) per block, in block-id order -> flattened runs."""
    runs: list[int] = []
    prev_state = prev_owner = prev_index = -2
    for state, owner, index in cells:
        if state == prev_state and owner == prev_owner and (owner < 0 or index == prev_index + 1):
            runs[-1] += 1
        else:
            runs += (state, owner, index, 1)
        prev_state, prev_owner, prev_index = state, owner, index
    return runs


def rle_decode(runs: Sequence[int]) -> list[tuple[int, int, int]]:
    """The inverse of rle_encode: (state, owner, table index) per block."""
    if len(runs) % 4:
        raise ValueError(f"block runs come in fours, got {len(runs)} numbers")
    cells: list[tuple[int, int, int]] = []
    for i in range(0, len(runs), 4):
        state, owner, first, length = runs[i : i + 4]
        if length < 1:
            raise ValueError(f"a block run has length {length} at position {i}")
        cells += [(state, owner, first + k if owner >= 0 else first) for k in range(length)]
    return cells


def count_states(runs: Sequence[int]) -> dict[int, int]:
    """Blocks per state in a run-length encoded pool."""
    counts: dict[int, int] = {}
    for i in range(0, len(runs), 4):
        counts[runs[i]] = counts.get(runs[i], 0) + runs[i + 3]
    return counts


_RUNS = re.compile(rb"(.)\1*", re.S)


def encode_pool(pool: Any, tables: dict[int, tuple[int, int]], held: int) -> list[int]:
    """The pool's runs. Held blocks come from the block tables (`tables`: block id -> (owner, table
    index), the first table naming it), cached-free ones from the prefix-cache table; the runs of
    equal states are found in C (a regular expression over one byte per block), so a pool of
    100k blocks costs what its held blocks cost, not a Python loop over every block."""
    states = bytearray(pool.num_blocks)  # FREE
    blocks = pool.blocks
    for b in pool._cached.values():  # noqa: SLF001 (read only)
        if b.ref_cnt == 0:
            states[b.block_id] = BlockState.CACHED
    for block_id in tables:
        states[block_id] = held if blocks[block_id].ref_cnt == 1 else BlockState.SHARED
    runs: list[int] = []
    for m in _RUNS.finditer(states):
        state, start, end = states[m.start()], m.start(), m.end()
        if state in (BlockState.FREE, BlockState.CACHED):
            runs += (state, -1, -1, end - start)
            continue
        prev_owner = prev_index = -2
        for block_id in range(start, end):
            owner, index = tables[block_id]
            if owner == prev_owner and index == prev_index + 1:
                runs[-1] += 1
            else:
                runs += (state, owner, index, 1)
            prev_owner, prev_index = owner, index
    return runs


def _view(req: Any, queue: int, num_blocks: int) -> RequestView:
    prompt = req.num_prompt_tokens
    return RequestView(req.request_id, queue, min(req.num_computed_tokens, prompt), prompt, req.num_output_tokens,
                       req.max_tokens, req.priority, num_blocks, req.num_preemptions)


def step_split(so: Any, requests: dict[str, Any]) -> tuple[int, int]:
    """(prefill, decode) tokens of a scheduler output: a request's tokens are decode tokens when
    it had computed its whole prompt before the step."""
    if so is None:
        return 0, 0
    before = {r.req_id: r.num_computed_tokens for r in so.new_reqs}
    before.update((r.req_id, r.num_computed_tokens) for r in so.cached_reqs)
    prefill = decode = 0
    for rid, n in so.num_scheduled_tokens.items():
        req = requests.get(rid)
        if req is not None and before.get(rid, 0) >= req.num_prompt_tokens:
            decode += n
        else:
            prefill += n
    return prefill, decode


def build_snapshot(scheduler: Any, last_output: Any = None, num_steps: int = 0, step_time: float = 0.0) -> EngineSnapshot:
    """Reads the scheduler and its KV cache manager (changing nothing) into a snapshot."""
    kv = scheduler.kv
    queues = [(scheduler.running, 1), (scheduler.swapped, 2), (scheduler.waiting, 0)]
    views: list[RequestView] = []
    device: dict[int, tuple[int, int]] = {}
    host: dict[int, tuple[int, int]] = {}
    for reqs, queue in queues:
        for req in reqs:
            rid = req.request_id
            owner = len(views)
            table = kv.req_blocks.get(rid) or kv.swapped_blocks.get(rid) or []
            target = host if queue == 2 and rid in kv.swapped_blocks else device
            for i, b in enumerate(table):
                if b is not kv.null_block:  # entries of window blocks freed (KV layer groups)
                    target.setdefault(b.block_id, (owner, i))
            views.append(_view(req, queue, len(table)))
    blocks = encode_pool(kv.pool, device, BlockState.USED)
    swap = encode_pool(kv.swap_pool, host, BlockState.SWAPPED) if kv.swap_pool else []
    prefill, decode = step_split(last_output, scheduler.requests)
    kvs = kv.stats()
    cfg = scheduler.config
    return EngineSnapshot(
        time=time.time(), num_blocks=kv.num_blocks, block_size=kv.block_size, blocks=blocks,
        num_swap_blocks=kv.num_swap_blocks, swap_blocks=swap, requests=views,
        budget=cfg.max_num_batched_tokens, max_num_seqs=cfg.max_num_seqs,
        step_prefill_tokens=prefill, step_decode_tokens=decode, step_time=step_time, num_steps=num_steps,
        num_preemptions=scheduler.num_preemptions, prefix_cache_queries=kvs.prefix_queries,
        prefix_cache_hits=kvs.prefix_hits, policy=str(getattr(cfg, "policy", "fcfs")),
    )


class SnapshotTimer:
    """Whether a snapshot is due: only while watched, at most every `interval` seconds (longer
    where building one would take more than MAX_TIME_SHARE of the engine core's time)."""

    def __init__(self, interval: float = SNAPSHOT_INTERVAL_S) -> None:
        self.min_interval = self.interval = interval
        self.watching = False
        self._last = 0.0
        self.num_steps = 0
        self.step_time = 0.0

    def watch(self, on: bool) -> None:
        self.watching = bool(on)
        self._last = 0.0  # a new viewer gets a snapshot at once

    def poll_ms(self, idle_ms: int) -> int:
        """How long an idle loop may wait for a command before the next snapshot is due."""
        if not self.watching:
            return idle_ms
        left = self._last + self.interval - time.monotonic()
        return max(1, min(idle_ms, int(left * 1000) + 1))

    def due(self) -> bool:
        if not self.watching:
            return False
        now = time.monotonic()
        if now - self._last < self.interval:
            return False
        self._last = now
        return True

    def stepped(self, step_time: float) -> None:
        """Counts a step (called only while watched)."""
        self.num_steps += 1
        self.step_time = step_time

    def take(self, core: Any) -> EngineSnapshot:
        t0 = time.perf_counter()
        snap = build_snapshot(core.scheduler, getattr(core, "last_output", None), self.num_steps, self.step_time)
        snap.build_time = time.perf_counter() - t0
        self.interval = max(self.min_interval, snap.build_time / MAX_TIME_SHARE)
        return snap
