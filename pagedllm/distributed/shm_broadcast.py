"""One writer (the engine) to N readers (the workers) through a shared-memory buffer.

The writer puts a message (length + bytes) in the buffer and releases each reader's `ready`
semaphore; each reader copies the message out and releases its `done` semaphore. The writer
waits for every `done` of the previous message before it overwrites the buffer. Blocking
semaphores rather than spinning: on a few shared cores a polling reader would steal the CPU the
ranks compute with. Every wait has a timeout and a liveness check, so a dead peer never hangs it.
"""

from __future__ import annotations

import struct

from collections.abc import Callable
import uuid
from typing import Any

from pagedllm.distributed.shm import SharedBuffer

_HEADER = struct.Struct("<Q")


class MessageTooLarge(ValueError):
    pass


class ShmBroadcastWriter:
    def __init__(self, ctx: Any, num_readers: int, capacity: int = 64 << 20) -> None:
        self.capacity = capacity
        self.shm = SharedBuffer(f"pagedllm_bc_{uuid.uuid4().hex[:16]}", _HEADER.size + capacity, create=True)
        self.ready = [ctx.Semaphore(0) for _ in range(num_readers)]
        self.done = [ctx.Semaphore(0) for _ in range(num_readers)]
        self._pending = False

    def reader_args(self, i: int) -> tuple[str, Any, Any]:
        """What reader i needs (passed to its process at start)."""
        return self.shm.name, self.ready[i], self.done[i]

    def write(self, data: bytes, check_alive: Callable[[], None]) -> None:
        if len(data) > self.capacity:
            raise MessageTooLarge(f"a step message of {len(data)} bytes exceeds the {self.capacity}-byte buffer")
        if self._pending:
            for sem in self.done:
                while not sem.acquire(timeout=0.2):
                    check_alive()
        _HEADER.pack_into(self.shm.buf, 0, len(data))
        self.shm.buf[_HEADER.size : _HEADER.size + len(data)] = data
        for sem in self.ready:
            sem.release()
        self._pending = True

    def unlink(self) -> None:
        """Removes the name once every reader has mapped the buffer."""
        self.shm.unlink()

    def close(self) -> None:
        self.shm.unlink()
        self.shm.close()


class ShmBroadcastReader:
    def __init__(self, name: str, ready: Any, done: Any) -> None:
        self.shm = SharedBuffer(name)
        self.ready, self.done = ready, done

    def read(self, check_alive: Callable[[], None], poll_s: float = 1.0) -> bytes:
        while not self.ready.acquire(timeout=poll_s):
            check_alive()
        (n,) = _HEADER.unpack_from(self.shm.buf, 0)
        data = bytes(self.shm.buf[_HEADER.size : _HEADER.size + n])
        self.done.release()
        return data


