"""What every loader module shares: the error type, the model source, JSON and cache helpers."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal


class ModelLoadError(ValueError):
    """A model file is missing, truncated or malformed (message names the path)."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model lives on disk."""

    kind: Literal["gguf", "hf"]
    """``"gguf"`` for a llama.cpp GGUF file, ``"hf"`` for a Hugging Face folder."""
    path: str
    """Absolute path of the ``.gguf`` file or of the Hugging Face folder."""
    name: str
    """Display name (the default model's name, the file stem or the folder name)."""


def read_json(path: Path, label: str) -> Any:
    """Parse a JSON file; ModelLoadError naming ``label`` on failure."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{label} does not exist ({path})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{label} cannot be read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{label} is not valid JSON: {exc}") from None


def file_cache_key(path: str) -> str:
    """Short hash of a file's absolute path, size and modification time."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ModelLoadError(f"cannot read model file {path}: {exc.strerror}") from None
    ident = f"{os.path.abspath(path)}\0{st.st_size}\0{st.st_mtime_ns}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def publish_dir(final: Path, build: Callable[[Path], None]) -> Path:
    """Create ``final`` atomically: build into a temp sibling, then rename it."""
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        build(tmp)
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():  # not a lost race with another process: a real error
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final

