"""A named shared-memory buffer (a file in /dev/shm, mapped), without multiprocessing's
resource tracker: the creator unlinks the name as soon as every process has mapped it, so
nothing is left behind even when a process is killed."""

from __future__ import annotations

import mmap
import os
import tempfile

_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class SharedBuffer:
    def __init__(self, name: str, size: int | None = None, create: bool = False) -> None:
        """Creates `size` bytes under `name`, or maps an existing buffer whole (size None)."""
        self.name = name
        self.path = os.path.join(_DIR, name)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            elif size is None:
                size = os.fstat(fd).st_size
            self._mmap = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.buf = memoryview(self._mmap)

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        try:
            self.buf.release()
            self._mmap.close()
        except BufferError:  # a tensor still views it; the mapping goes with the process
            pass
