"""`pagedllm simulate --ui`: the engine view's messages recorded from a simulated run.

Every `interval` seconds of simulated time the recorder takes the same snapshot of the scheduler
that the engine core sends a viewer (engine/snapshot.py), stamped with the simulated clock, and
turns it into the feed's JSON message (engine/state_feed.py); `pagedllm simulate --ui` then replays
the messages through the web page's engine view (entrypoints/web/replay.py).
"""

from __future__ import annotations

from typing import Any

from pagedllm.engine.snapshot import SNAPSHOT_INTERVAL_S, build_snapshot, step_split
from pagedllm.engine.state_feed import StateFeed
from pagedllm.engine.stats import IterationStats


class SnapshotRecorder:
    def __init__(self, interval: float = SNAPSHOT_INTERVAL_S, max_messages: int = 20_000) -> None:
        if not interval > 0:
            raise ValueError(f"the recording interval must be positive, got {interval}")
        self.interval = interval
        self.max_messages = max_messages
        self.messages: list[tuple[float, str]] = []  # (simulated seconds, the feed's JSON message)
        self.hello: dict[str, Any] = {}
        self._feed = StateFeed(None)
        self._next = 0.0
        self._steps = 0

    def on_step(self, clock: float, so: Any, scheduler: Any) -> None:
        """Called by Simulation.run after every step."""
        self._steps += 1
        prefill, decode = step_split(so, scheduler.requests)
        self._feed.record(None, IterationStats(num_prompt_tokens=prefill, num_generation_tokens=decode))
        if clock < self._next or len(self.messages) >= self.max_messages:
            return
        self._next = clock + self.interval
        snap = build_snapshot(scheduler, so, self._steps)
        snap.time = clock
        if not self.hello:
            cfg = scheduler.config
            self.hello = {"num_blocks": snap.num_blocks, "block_size": snap.block_size, "budget": snap.budget,
                          "max_num_seqs": snap.max_num_seqs, "policy": snap.policy, "history": [], "viewers": 1,
                          "snapshots": 0, "simulated": True, "max_model_len": cfg.max_model_len}
        point = self._feed.point(snap)
        self.messages.append((clock, self._feed.message(snap, point)))
