"""Tokenizers: a Hugging Face folder's, or a GGUF's converted once and cached."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedllm.models.loader.gemma3 import GEMMA3_CHAT_TEMPLATE
from pagedllm.models.loader.gguf_reader import read_gguf_header
from pagedllm.models.loader.gguf_tokenizer import TOKENIZER_FORMAT, apply_gguf_pre_tokenizer
from pagedllm.models.loader.resolve import gguf_source
from pagedllm.models.loader.source import ModelLoadError, ModelSource, file_cache_key, publish_dir
from pagedllm.utils import cache_dir

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


def load_tokenizer(source: ModelSource, tokenizer: str | None = None) -> PreTrainedTokenizerBase:
    """A transformers tokenizer for ``source`` (or from the ``tokenizer`` path).

    GGUF tokenizers are converted once and cached under :func:`cache_dir`.
    """
    if tokenizer is not None:
        source = _tokenizer_source(tokenizer)
    if source.kind == "hf":
        return _auto_tokenizer(source.path, {})
    return _auto_tokenizer(str(_cached_gguf_tokenizer(source.path)), {})


def _tokenizer_source(tokenizer: str) -> ModelSource:
    """A tokenizer override: a folder with tokenizer files or a .gguf file."""
    path = Path(tokenizer).expanduser()
    if tokenizer.lower().endswith(".gguf"):
        return gguf_source(path, path.stem)
    if path.is_dir():
        return ModelSource(kind="hf", path=str(path.resolve()), name=path.name)
    raise ModelLoadError(
        f"tokenizer {tokenizer!r} is neither a local folder nor a .gguf file; "
        "hub names are not downloaded"
    )


def _auto_tokenizer(path: str, kwargs: dict[str, Any]) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True, **kwargs)
    except Exception as exc:  # OSError/ValueError/KeyError from transformers
        raise ModelLoadError(f"cannot load a tokenizer from {path}: {exc}") from exc


def _cached_gguf_tokenizer(gguf_path: str) -> Path:
    """Folder with the GGUF's tokenizer saved in Hugging Face format (built once)."""
    key = f"{file_cache_key(gguf_path)}-t{TOKENIZER_FORMAT}"
    final = cache_dir() / "tokenizers" / f"{Path(gguf_path).stem}-{key}"
    if final.is_dir():
        return final
    start = time.perf_counter()
    publish_dir(final, lambda tmp: _convert_gguf_tokenizer(gguf_path, tmp))
    logger.info("converted the tokenizer of %s in %.1f s (cached in %s)",
                gguf_path, time.perf_counter() - start, final)
    return final


def _convert_gguf_tokenizer(gguf_path: str, out_dir: Path) -> None:
    """Build a tokenizer from GGUF metadata via transformers and save it, with the pre-tokenizer
    that ``tokenizer.ggml.pre`` names (see :mod:`pagedllm.models.loader.gguf_tokenizer`)."""
    path = Path(gguf_path)
    tok = _auto_tokenizer(str(path.parent), {"gguf_file": path.name})
    metadata = read_gguf_header(gguf_path).metadata
    pre = metadata.get("tokenizer.ggml.pre")
    if apply_gguf_pre_tokenizer(tok, str(pre) if pre is not None else None):
        logger.info("tokenizer of %s: pre-tokenizer %r (each digit cut out, then GPT-2's regex)", gguf_path, pre)
    template = metadata.get("tokenizer.chat_template")
    if template and not getattr(tok, "chat_template", None):
        tok.chat_template = str(template)
    if not getattr(tok, "chat_template", None) and metadata.get("general.architecture") == "gemma3":
        tok.chat_template = GEMMA3_CHAT_TEMPLATE  # llama.cpp's files of the pretrained models carry none
    tok.save_pretrained(str(out_dir))

