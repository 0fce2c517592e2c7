"""Small helpers shared across layers (no torch here)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "PAGEDLLM_CACHE_DIR"


def cache_dir() -> Path:
    """``$PAGEDLLM_CACHE_DIR`` or ``~/.cache/pagedllm``: converted tokenizers, model folders, kernels."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "pagedllm").expanduser()
