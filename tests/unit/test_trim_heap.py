"""The engine core hands freed C heap back when it goes idle (utils.trim_heap)."""

from __future__ import annotations

import platform

import psutil
import pytest

from pagedllm.utils import trim_heap


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc_trim")
def test_trim_heap_returns_freed_fragments_to_the_system() -> None:
    proc = psutil.Process()
    # 160 MB of 100 KB heap chunks (below malloc's mmap threshold), every 16th kept: freeing the
    # rest leaves holes that free() itself never returns, as a burst of odd-sized steps does.
    chunks = [bytearray(b"x" * 100_000) for _ in range(1600)]
    kept = chunks[::16]
    del chunks
    before = proc.memory_info().rss
    assert trim_heap()
    after = proc.memory_info().rss
    assert before - after > 80 << 20, (before >> 20, after >> 20)
    assert len(kept) == 100 and all(c[0] == ord("x") for c in kept)
