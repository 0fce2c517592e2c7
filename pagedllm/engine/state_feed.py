"""The engine view's feed, on the front end's event loop: snapshots of the engine core's state
(engine/snapshot.py) joined with the front end's own figures (throughput, TTFT, TPOT), handed to
every viewer as JSON text.

The first viewer to subscribe turns the engine core's snapshots on (a WATCH message), the last to
leave turns them off: with nobody watching, the engine core builds nothing and the front end
records nothing. A slow viewer loses its oldest messages, never holds the engine up.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any

import msgspec

from pagedllm.engine.snapshot import BlockState, EngineSnapshot, count_states

# Points of the time series kept for a viewer that arrives later: 5 minutes at 4 a second.
HISTORY_POINTS = 1200
# Messages a viewer may fall behind by before its oldest are dropped.
VIEWER_BACKLOG = 8


class StateFeed:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._viewers: set[asyncio.Queue[str]] = set()
        self.history: collections.deque[dict[str, Any]] = collections.deque(maxlen=HISTORY_POINTS)
        self.latest: EngineSnapshot | None = None
        self.num_snapshots = 0
        self._feed_time = 0.0
        self._encoder = msgspec.json.Encoder()
        self._reset_interval()
        self._prev: EngineSnapshot | None = None

    # ---- viewers --------------------------------------------------------------------------
    @property
    def watched(self) -> bool:
        return bool(self._viewers)

    @property
    def num_viewers(self) -> int:
        return len(self._viewers)

    def subscribe(self) -> asyncio.Queue[str]:
        """A queue of JSON messages, one per snapshot; the caller must unsubscribe it."""
        q: asyncio.Queue[str] = asyncio.Queue(maxsize=VIEWER_BACKLOG)
        first = not self._viewers
        self._viewers.add(q)
        if first:
            self._reset_interval()
            self._prev = None
            self._watch(True)
        return q

    def unsubscribe(self, q: asyncio.Queue[str]) -> None:
        if q not in self._viewers:
            return
        self._viewers.discard(q)
        if not self._viewers:
            self._watch(False)

    def _watch(self, on: bool) -> None:
        if self.engine.errored or getattr(self.engine, "_stopped", False):
            return
        self.engine.start()
        self.engine.client.watch(on)

    def hello(self) -> dict[str, Any]:
        """What a new viewer gets first: the engine's shape and the time series so far."""
        e = self.engine
        sc, cc = e.config.scheduler_config, e.config.cache_config
        return {
            "model": e.model_config.served_model_name,
            "num_blocks": e.num_blocks,
            "block_size": cc.block_size,
            "budget": sc.max_num_batched_tokens,
            "max_num_seqs": sc.max_num_seqs,
            "policy": sc.policy,
            "history": list(self.history),
            "viewers": len(self._viewers),
            "snapshots": self.num_snapshots,
        }

    # ---- figures from the front end (only while watched) -----------------------------------
    def _reset_interval(self) -> None:
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._ttfts: list[float] = []
        self._itls: list[float] = []

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        self._prompt_tokens += iteration_stats.num_prompt_tokens
        self._generation_tokens += iteration_stats.num_generation_tokens
        self._ttfts += iteration_stats.time_to_first_tokens
        self._itls += iteration_stats.inter_token_latencies

    # ---- snapshots from the engine core ------------------------------------------------------
    def point(self, snap: EngineSnapshot) -> dict[str, Any]:
        """One point of the time series: the figures since the previous snapshot."""
        prev = self._prev
        elapsed = snap.time - prev.time if prev is not None else 0.0
        counts = count_states(snap.blocks)
        held = counts.get(BlockState.USED, 0) + counts.get(BlockState.SHARED, 0)
        queries = snap.prefix_cache_queries - (prev.prefix_cache_queries if prev else snap.prefix_cache_queries)
        hits = snap.prefix_cache_hits - (prev.prefix_cache_hits if prev else snap.prefix_cache_hits)
        out = {
            "t": round(snap.time, 3),
            "gen_tps": round(self._generation_tokens / elapsed, 2) if elapsed > 0 else 0.0,
            "prompt_tps": round(self._prompt_tokens / elapsed, 2) if elapsed > 0 else 0.0,
            "ttft": round(sum(self._ttfts) / len(self._ttfts), 4) if self._ttfts else None,
            "tpot": round(sum(self._itls) / len(self._itls), 5) if self._itls else None,
            "kv_usage": round(held / snap.num_blocks, 4) if snap.num_blocks else 0.0,
            "preemptions": snap.num_preemptions - (prev.num_preemptions if prev else snap.num_preemptions),
            "hit_rate": round(hits / queries, 4) if queries > 0 else None,
            "running": sum(1 for r in snap.requests if r.queue == 1),
            "waiting": sum(1 for r in snap.requests if r.queue == 0),
            "swapped": sum(1 for r in snap.requests if r.queue == 2),
            "n": self.num_snapshots,
            # What the feed costs: the engine core's time to build this snapshot, and this
            # process's time to hand the previous one to the viewers.
            "build_ms": round(snap.build_time * 1000, 3),
            "feed_ms": round(self._feed_time * 1000, 3),
        }
        self._reset_interval()
        self._prev = snap
        return out

    def message(self, snap: EngineSnapshot, point: dict[str, Any]) -> str:
        body = msgspec.to_builtins(snap)
        body["requests"] = [msgspec.structs.asdict(r) for r in snap.requests]
        return self._encoder.encode({"snapshot": body, "point": point}).decode()

    def on_snapshot(self, snap: EngineSnapshot) -> None:
        self.latest = snap
        self.num_snapshots += 1
        if not self._viewers:
            return  # a snapshot that crossed the last viewer's leaving
        t0 = time.perf_counter()
        point = self.point(snap)
        self.history.append(point)
        data = self.message(snap, point)
        for q in self._viewers:
            if q.full():
                q.get_nowait()
            q.put_nowait(data)
        self._feed_time = time.perf_counter() - t0
