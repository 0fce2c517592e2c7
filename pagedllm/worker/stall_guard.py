"""How many threads the fused native decode step (worker/native_decode.py) runs on while other
processes share the cores."""

from __future__ import annotations

import logging
import time
from collections import deque

logger = logging.getLogger(__name__)


class StallGuard:
    """How many threads the fused step runs on: torch's threads while their steps keep their usual
    pace, one thread for a while once they stall.

    A team waits at every barrier for its slowest thread (five barriers per layer). When another
    process holds a core, nearly every barrier waits for a descheduled thread's next time slice:
    measured with one busy process beside a bfloat16 single-request step on this 2-core machine, the
    two-thread step's median went from 11.4 to 23.6 ms and its 90th percentile to 132 ms, while one
    thread ran at 20.1 / 21.5 ms (`pagedllm bench cpu-contention` measures the engine). So: when the last WINDOW team steps took on average more than
    SLOW times the fastest team step of their size (stalls come in bursts: one slow step, a GC
    pause or a page fault, does not do it), the step runs on one thread for SOLO steps; then one
    team step is tried; if it takes over SLOW times too, the next one-thread stretch is twice as
    long (up to MAX_SOLO), else the team is back. Results are the same bits either way (a team
    computes every element as one thread does)."""

    SLOW = 2.0
    WINDOW = 8
    SOLO = 64
    MAX_SOLO = 4096
    RELAX = 1.002  # the fastest time creeps up per team step, as contexts (and steps) grow

    def __init__(self, threads: int) -> None:
        self.team = threads
        self.best: dict[int, float] = {}
        self.recent: deque[float] = deque(maxlen=self.WINDOW)  # team steps' time / their size's fastest
        self.solo_left = 0
        self.solo_len = self.SOLO
        self.probing = False
        self.switches = 0  # team -> one thread, for logs and tests
        self._logged = -float("inf")

    def stalled(self) -> bool:
        """Whether steps run on one thread now (a stretch after stalls), without taking a step of it."""
        return self.team > 1 and self.solo_left > 0

    def threads(self) -> int:
        """Threads for the next step: 0 (torch's) or 1."""
        if self.stalled():
            self.solo_left -= 1
            self.probing = self.solo_left == 0
            return 1
        return 0

    def record(self, key: int, threads: int, seconds: float) -> None:
        """The time of a step that ran on `threads` (as threads() said); `key` tells steps of
        different sizes apart (the fused step: rows, and whether it ran the LM head)."""
        if self.team <= 1 or threads == 1:
            return
        prev = self.best.get(key)
        self.best[key] = seconds if prev is None else min(prev * self.RELAX, seconds)
        ratio = 1.0 if prev is None else seconds / prev
        stalled = ratio > self.SLOW
        if self.probing:
            self.probing = False
            if stalled:
                self.solo_len = min(2 * self.solo_len, self.MAX_SOLO)
                self.solo_left = self.solo_len
            else:
                self.solo_len = self.SOLO
                self.recent.clear()
                self._log("decode steps back on %d threads", self.team)
            return
        self.recent.append(ratio)
        if len(self.recent) == self.WINDOW and sum(self.recent) > self.SLOW * self.WINDOW:
            mean = sum(self.recent) / self.WINDOW
            self.recent.clear()
            self.solo_left = self.solo_len
            self.switches += 1
            self._log("decode steps on one thread for a while: the last %d %d-thread steps took %.1fx their usual "
                      "time on average (another process is using a core)", self.WINDOW, self.team, mean)

    def _log(self, msg: str, *args: object) -> None:
        """At most one INFO line a minute (a busy neighbour can flip the choice every second)."""
        now = time.monotonic()
        level = logging.INFO if now - self._logged >= 60.0 else logging.DEBUG
        if level == logging.INFO:
            self._logged = now
        logger.log(level, msg, *args)
