"""The waiting queue: requests not yet admitted (or preempted by recompute), kept so that one
step's work grows with what the step admits, not with how many requests wait.

It reads as the list it replaces (iteration, `len`, `in`, indexing: queue order, which is the
order requests entered it), and it answers the admission loop's question, "which eligible request
does the policy admit next?", from heaps instead of a scan:

- Requests are grouped in buckets by (aged, LoRA adapter, the policy's `bucket`: the user under
  fair share, else nothing). Within a bucket the policy's `queue_key` orders requests as its
  `admission_key` does, and it does not change while they wait, so each bucket is a heap.
- The next request is the bucket head with the least `admission_key` (ties: queue order), so a
  pick costs O(buckets + log n); heads that may not run this step (preempted in it, grammar still
  compiling) are set aside until the step ends.
- Aging: entries are stamped with the scheduler's step count when they enter; since they enter in
  order, those that reach `max_waiting_steps` are at the front of a FIFO, and each step looks at
  those only.

No torch.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from pagedllm.core.request import Request


class _Item:
    """One request in the queue: its bucket, its place in queue order, when it entered."""

    __slots__ = ("req", "seq", "since", "bucket", "live")

    def __init__(self, req: Request, seq: int, since: int) -> None:
        self.req = req
        self.seq = seq
        self.since = since
        self.bucket: tuple = ()
        self.live = True


class _Bucket:
    __slots__ = ("heap", "live")

    def __init__(self) -> None:
        self.heap: list[tuple[tuple, int, _Item]] = []
        self.live = 0


class WaitingQueue:
    """Waiting requests in queue order, with the policy's next admission in O(buckets + log n)."""

    def __init__(self, policy: Any) -> None:
        self._policy = policy
        self._items: dict[str, _Item] = {}  # queue order
        self._buckets: dict[tuple, _Bucket] = {}
        self._fifo: deque[_Item] = deque()  # entry order, for aging
        self._set_aside: list[_Item] = []
        self._seq = itertools.count()
        self.users: dict[str | None, int] = {}
        """Waiting requests per user (the fair policy's time slice asks whether others wait)."""

    # ---- the list it replaces ------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __iter__(self) -> Iterator[Request]:
        return (item.req for item in list(self._items.values()))

    def __contains__(self, req: object) -> bool:
        item = self._items.get(getattr(req, "request_id", None))  # type: ignore[arg-type]
        return item is not None and item.req is req

    def __getitem__(self, index: int) -> Request:
        return list(self)[index]

    def __add__(self, other: list[Request]) -> list[Request]:
        return [*self, *other]

    def __radd__(self, other: list[Request]) -> list[Request]:
        return [*other, *self]

    def __repr__(self) -> str:
        return f"WaitingQueue({list(self)!r})"

    def append(self, req: Request, step: int) -> None:
        """Queues `req` at the end; `step` is the scheduler's step count (for aging)."""
        item = _Item(req, next(self._seq), step)
        self._items[req.request_id] = item
        self._fifo.append(item)
        self.users[req.user] = self.users.get(req.user, 0) + 1
        self._push(item)

    def remove(self, req: Request) -> None:
        item = self._items.pop(req.request_id)
        item.live = False
        self._buckets[item.bucket].live -= 1
        if not self._buckets[item.bucket].live:
            del self._buckets[item.bucket]
        left = self.users[req.user] - 1
        if left:
            self.users[req.user] = left
        else:
            del self.users[req.user]

    # ---- admission order -----------------------------------------------------------------
    def _push(self, item: _Item) -> None:
        req = item.req
        item.bucket = (req.aged, req.lora_int_id, None if req.aged else self._policy.bucket(req))
        bucket = self._buckets.get(item.bucket)
        if bucket is None:
            bucket = self._buckets[item.bucket] = _Bucket()
        bucket.live += 1
        heapq.heappush(bucket.heap, (self._policy.queue_key(req), item.seq, item))

    def _head(self, key: tuple, bucket: _Bucket, eligible: Callable[[Request], bool]) -> _Item | None:
        """The bucket's first live entry that may run now (the others are set aside)."""
        heap = bucket.heap
        while heap:
            item = heap[0][2]
            if not item.live or item.bucket != key:
                heapq.heappop(heap)  # removed, or moved to the aged bucket
            elif not eligible(item.req):
                heapq.heappop(heap)
                self._set_aside.append(item)
            else:
                return item
        return None

    def next_eligible(
        self, eligible: Callable[[Request], bool], lora_ok: Callable[[int], bool] | None = None
    ) -> Request | None:
        """The request the policy admits next among those `eligible` (and, by adapter, `lora_ok`):
        the least `admission_key`, first in queue order among equals; None if none may run."""
        best: tuple | None = None
        best_item = None
        for key, bucket in self._buckets.items():
            if lora_ok is not None and not lora_ok(key[1]):
                continue
            item = self._head(key, bucket, eligible)
            if item is not None:
                rank = (self._policy.admission_key(item.req), item.seq)
                if best is None or rank < best:
                    best, best_item = rank, item
        return None if best_item is None else best_item.req

    def end_step(self, step: int, max_waiting_steps: int) -> None:
        """Puts back what this step set aside, then ages the requests that have waited
        `max_waiting_steps` steps by the scheduler's step count `step`."""
        for item in self._set_aside:
            if item.live:
                heapq.heappush(self._buckets[item.bucket].heap, (self._policy.queue_key(item.req), item.seq, item))
        self._set_aside = []
        fifo = self._fifo
        while fifo and (not fifo[0].live or step - fifo[0].since >= max_waiting_steps):
            item = fifo.popleft()
            if item.live and not item.req.aged:
                item.req.aged = True
                old = self._buckets[item.bucket]
                old.live -= 1
                if not old.live:
                    del self._buckets[item.bucket]
                self._push(item)  # into its aged bucket; the old heap entry is skipped as stale

    def check_integrity(self) -> None:
        """The buckets' counts and the user counts agree with the queue (run by tests)."""
        live: dict[tuple, int] = {}
        users: dict[str | None, int] = {}
        for item in self._items.values():
            assert item.live and item.bucket[0] == item.req.aged, f"{item.req} is misfiled"
            live[item.bucket] = live.get(item.bucket, 0) + 1
            users[item.req.user] = users.get(item.req.user, 0) + 1
        assert live == {k: b.live for k, b in self._buckets.items()}, "bucket counts"
        assert users == self.users, "user counts"
