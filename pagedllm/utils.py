"""Small helpers shared across layers (no torch here)."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any

CACHE_ENV = "PAGEDLLM_CACHE_DIR"


def cache_dir() -> Path:
    """``$PAGEDLLM_CACHE_DIR`` or ``~/.cache/pagedllm``: converted tokenizers, model folders, kernels."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "pagedllm").expanduser()


_libc: Any = None


def trim_heap() -> bool:
    """Hands the C heap's free pages back to the system (glibc's malloc_trim); False where there is
    no glibc. After a burst of steps of many different shapes, the arenas of torch's, oneDNN's and
    ZeroMQ's threads keep tens of MB of freed memory that RSS still counts; an idle process has no
    use for it."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL("libc.so.6")
            _libc.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _libc = False
    if not _libc:
        return False
    _libc.malloc_trim(0)
    return True
