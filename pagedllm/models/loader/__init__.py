"""Model files: resolve a model name, load its config, weights and tokenizer.

Two on-disk formats are supported:

* Hugging Face folders: ``config.json`` + ``*.safetensors`` (+ tokenizer files), plain or
  AWQ/GPTQ-quantized (``quantization_config`` in config.json).
* GGUF files (llama.cpp format, e.g. the embedded SmolLM2-135M-Instruct), whose metadata
  carries the architecture, the tokenizer and the chat template.

One concern per module: :mod:`.resolve` (what the user named -> a source), :mod:`.gguf_reader`
(GGUF header, validated), :mod:`.gguf_weights` (GGUF tensors), :mod:`.hf` (safetensors
folders), :mod:`.config` (transformers config, EOS ids), :mod:`.tokenizer`, :mod:`.weights`
(one iterator over any source), :mod:`.convert` (GGUF -> Hugging Face folder).
"""

from __future__ import annotations

import importlib  # noqa: F401  (tests patch importlib.util.find_spec through this module)
import importlib.util  # noqa: F401

from pagedllm.models.loader.config import load_generation_eos_ids, load_hf_config
from pagedllm.models.loader.convert import convert_gguf_to_hf, default_hf_folder
from pagedllm.models.loader.gguf_reader import GGUFHeader, GGUFTensorInfo, read_gguf_header
from pagedllm.models.loader.gguf_weights import (
    _GGUF_GLOBAL_NAMES,
    _GGUF_LAYER_NAMES,
    dequantize_gguf,
    gguf_to_hf_name,
    unpermute_qk,
)
from pagedllm.models.loader.resolve import DEFAULT_GGUF_FILE, DEFAULT_GGUF_PACKAGE, DEFAULT_MODEL, resolve_model
from pagedllm.models.loader.source import ModelLoadError, ModelSource, file_cache_key
from pagedllm.models.loader.tokenizer import load_tokenizer
from pagedllm.models.loader.weights import iterate_weights
from pagedllm.utils import CACHE_ENV

__all__ = [
    "CACHE_ENV", "DEFAULT_GGUF_FILE", "DEFAULT_GGUF_PACKAGE", "DEFAULT_MODEL", "GGUFHeader", "GGUFTensorInfo",
    "ModelLoadError", "ModelSource", "_GGUF_GLOBAL_NAMES", "_GGUF_LAYER_NAMES", "convert_gguf_to_hf",
    "default_hf_folder", "dequantize_gguf", "file_cache_key", "gguf_to_hf_name", "iterate_weights",
    "load_generation_eos_ids", "load_hf_config", "load_tokenizer", "read_gguf_header", "resolve_model",
    "unpermute_qk",
]
