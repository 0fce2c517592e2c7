"""Small helpers shared across layers (no torch here)."""

from __future__ import annotations

import ctypes
import json
from pathlib import Path
from typing import Any

from pagedllm import envs

CACHE_ENV = "PAGEDLLM_CACHE_DIR"


def cache_dir() -> Path:
    """``$PAGEDLLM_CACHE_DIR`` or ``~/.cache/pagedllm``: converted tokenizers, model folders, kernels."""
    return Path(envs.PAGEDLLM_CACHE_DIR or Path.home() / ".cache" / "pagedllm").expanduser()


def json_or_pair(text: str) -> dict[str, Any] | tuple[str, str] | None:
    """A flag value in either of vLLM's forms for a named entry (`--lora-modules`,
    `--extra-models`): a JSON object ('{...}', returned as the dict) or 'NAME=VALUE' (the two sides,
    stripped; None without '='). ValueError naming the value where its JSON does not parse."""
    text = text.strip()
    if text.startswith("{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"cannot read {text!r} as JSON ({e})") from None
    name, sep, value = text.partition("=")
    return (name.strip(), value.strip()) if sep else None


_libc: Any = None

# glibc mallopt parameters
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
# The largest mmap threshold glibc accepts on 64-bit (HEAP_MAX_SIZE / 2).
_MMAP_THRESHOLD_MAX = 32 << 20
HEAP_TOP_PAD = 64 << 20
"""Extra bytes the tuned heap maps each time it grows (so that growing is rare)."""
HEAP_KEEP = 1 << 30
"""Free bytes at the tuned heap's top that stay mapped for the next step."""


def _load_libc() -> Any:
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL("libc.so.6")
            _libc.malloc_trim.argtypes = [ctypes.c_size_t]
            _libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        except (OSError, AttributeError):
            _libc = False
    return _libc


def tune_heap() -> bool:
    """Keeps a step's temporaries in the C heap between steps instead of mapping and unmapping them
    each time; False where there is no glibc. By default glibc serves blocks of a few MB and more with
    a fresh mmap and unmaps them on free, and trims the heap's top as soon as it is free, so every
    step faults in (and zeroes) its activations' pages again: about 1.5 us a 4 KiB page here, some
    hundreds of thousands of faults on the 128-request workload. Blocks up to 32 MiB (glibc's
    largest threshold) now come from the heap, and up to HEAP_KEEP of free heap top stays
    mapped; an idle engine core still hands it all back with trim_heap."""
    libc = _load_libc()
    if not libc:
        return False
    libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
    libc.mallopt(_M_TRIM_THRESHOLD, HEAP_KEEP)
    libc.mallopt(_M_TOP_PAD, HEAP_TOP_PAD)
    return True


def trim_heap() -> bool:
    """Hands the C heap's free pages back to the system (glibc's malloc_trim); False where there is
    no glibc. After a burst of steps of many different shapes, the arenas of torch's, oneDNN's and
    ZeroMQ's threads keep tens of MB of freed memory that RSS still counts; an idle process has no
    use for it."""
    libc = _load_libc()
    if not libc:
        return False
    libc.malloc_trim(0)
    return True
