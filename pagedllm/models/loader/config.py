"""The transformers config of a model (from config.json, or built from GGUF metadata) and its EOS ids."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
from typing import TYPE_CHECKING, Any

from pagedllm.models.loader.gemma3 import end_of_turn_ids
from pagedllm.models.loader.gguf_reader import GGUFHeader, read_gguf_header
from pagedllm.models.loader.source import ModelLoadError, ModelSource, read_json

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

_GGUF_ARCHS = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
               "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
               "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
               "phi3": ("Phi3Config", "Phi3ForCausalLM"),
               "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM")}


def load_hf_config(source: ModelSource) -> PretrainedConfig:
    """The transformers config of ``source`` (built from metadata for GGUF)."""
    if source.kind == "gguf":
        return _gguf_config(read_gguf_header(source.path))
    return _hf_config(Path(source.path))


def _hf_config(folder: Path) -> PretrainedConfig:
    """``AutoConfig`` from a local folder, after checking config.json parses."""
    from transformers import AutoConfig

    read_json(folder / "config.json", f"config.json in {folder}")
    try:
        return AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:  # transformers raises OSError/ValueError/KeyError
        raise ModelLoadError(f"cannot load config.json in {folder}: {exc}") from exc


def _gguf_config(header: GGUFHeader) -> PretrainedConfig:
    """A LlamaConfig / Qwen2Config filled from GGUF metadata."""
    import transformers

    arch = header.arch
    if arch not in _GGUF_ARCHS:
        raise ModelLoadError(
            f"GGUF file {header.path} has architecture {arch!r}; supported: "
            + ", ".join(sorted(_GGUF_ARCHS))
        )
    config_name, model_class = _GGUF_ARCHS[arch]
    fields = _gguf_config_fields(header, arch)
    if arch == "gemma3":
        fields = _gemma3_fields(header, fields)
    elif arch == "phi3":
        fields = _phi3_fields(header, fields)
    try:
        config = getattr(transformers, config_name)(architectures=[model_class], **fields)
    except (ValueError, TypeError) as exc:
        raise ModelLoadError(f"GGUF file {header.path} has inconsistent metadata: {exc}") from exc
    return config


def _gguf_config_fields(header: GGUFHeader, arch: str) -> dict[str, Any]:
    """Keyword arguments of the transformers config, from ``{arch}.*`` metadata."""
    meta, req = header.metadata, header.require
    hidden = int(req(f"{arch}.embedding_length"))
    heads = int(req(f"{arch}.attention.head_count"))
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    eos = _meta_int(meta, "tokenizer.ggml.eos_token_id")
    return {
        "hidden_size": hidden,
        "intermediate_size": int(req(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(req(f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": int(meta.get(f"{arch}.attention.key_length",
                                 meta.get(f"{arch}.rope.dimension_count", hidden // heads))),
        "rms_norm_eps": float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 2048)),
        "vocab_size": _gguf_vocab_size(header, arch),
        "rope_parameters": _gguf_rope_parameters(header, arch),
        "bos_token_id": _meta_int(meta, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
        "pad_token_id": _meta_int(meta, "tokenizer.ggml.padding_token_id"),
        "tie_word_embeddings": "output.weight" not in header.tensors,
        "dtype": "float32",
    }


def _gemma3_fields(header: GGUFHeader, fields: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's config from ``gemma3.*`` metadata. llama.cpp's file keeps the global RoPE base,
    the window and the head size; the rest is what llama.cpp's Gemma 3 graph fixes: every 6th
    layer global, a local RoPE base of 10,000 for the sliding layers, the attention scale of the
    head size (query_pre_attn_scalar), GeGLU with gelu's tanh form, no logit softcapping."""
    meta = header.metadata
    fields = dict(fields)
    rope = fields.pop("rope_parameters")
    head_dim = int(meta.get("gemma3.attention.key_length", fields["head_dim"]))
    fields.update(
        head_dim=head_dim,
        query_pre_attn_scalar=head_dim,
        sliding_window=int(meta.get("gemma3.attention.sliding_window", 512)),
        sliding_window_pattern=6,
        rope_theta=rope["rope_theta"],
        rope_local_base_freq=10000.0,
        hidden_activation="gelu_pytorch_tanh",
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
    )
    if rope["rope_type"] == "linear":  # the global layers' scaling (Gemma 3 4B and larger: factor 8)
        fields["rope_scaling"] = {"rope_type": "linear", "factor": rope["factor"]}
    return fields


def _phi3_fields(header: GGUFHeader, fields: dict[str, Any]) -> dict[str, Any]:
    """Phi-3 / Phi-4-mini from ``phi3.*`` metadata: llama.cpp writes the rotary dimensions (a part
    of the head size: partial rotary), the original context length, the window, and LongRoPE's
    factors as the tensors ``rope_factors_long`` / ``rope_factors_short``."""
    meta = header.metadata
    fields = dict(fields)
    head_dim = fields["hidden_size"] // fields["num_attention_heads"]
    rotary = int(meta.get("phi3.rope.dimension_count", head_dim))
    theta = fields["rope_parameters"]["rope_theta"]
    original = meta.get("phi3.rope.scaling.original_context_length")
    fields.update(head_dim=head_dim, partial_rotary_factor=rotary / head_dim,
                  sliding_window=int(meta.get("phi3.attention.sliding_window", 0)) or None)
    if original is not None:
        fields["original_max_position_embeddings"] = int(original)
    if "rope_factors_long.weight" in header.tensors:
        if original is None:
            raise ModelLoadError(f"GGUF file {header.path}: LongRoPE factors without "
                                 "phi3.rope.scaling.original_context_length")
        fields["rope_parameters"] = {
            "rope_type": "longrope", "rope_theta": theta, "partial_rotary_factor": rotary / head_dim,
            "original_max_position_embeddings": int(original),
            "long_factor": _f32_tensor(header, "rope_factors_long.weight"),
            "short_factor": _f32_tensor(header, "rope_factors_short.weight"),
        }
    return fields


def _f32_tensor(header: GGUFHeader, name: str) -> list[float]:
    """A small float32 tensor's values (LongRoPE factors)."""
    info = header.tensors.get(name)
    if info is None or info.qtype != 0:  # GGML_TYPE_F32
        raise ModelLoadError(f"GGUF file {header.path}: {name} must be a float32 tensor")
    data = np.fromfile(header.path, dtype=np.float32, count=info.n_bytes // 4, offset=info.offset)
    return [float(x) for x in data]


def _meta_int(meta: dict[str, Any], key: str) -> int | None:
    value = meta.get(key)
    return None if value is None else int(value)


def _gguf_vocab_size(header: GGUFHeader, arch: str) -> int:
    """``{arch}.vocab_size``, else the token list length, else the embedding rows."""
    if f"{arch}.vocab_size" in header.metadata:
        return int(header.metadata[f"{arch}.vocab_size"])
    tokens = header.metadata.get("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens)
    embed = header.tensors.get("token_embd.weight")
    if embed is None:
        return int(header.require(f"{arch}.vocab_size"))
    return int(embed.shape[-1])


def _gguf_rope_parameters(header: GGUFHeader, arch: str) -> dict[str, Any]:
    """transformers-5 ``rope_parameters`` (theta + optional scaling) from metadata."""
    meta = header.metadata
    params: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
    }
    kind = str(meta.get(f"{arch}.rope.scaling.type", "none"))
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind in ("linear", "yarn") and factor is not None and float(factor) != 1.0:
        params["rope_type"] = kind
        params["factor"] = float(factor)
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            params["original_max_position_embeddings"] = int(original)
    elif kind not in ("none", "linear", "yarn"):
        logger.warning("GGUF file %s: rope scaling type %r is not supported; ignoring it",
                       header.path, kind)
    if "rope_freqs.weight" in header.tensors:
        logger.warning("GGUF file %s: per-dimension rope frequency factors are ignored",
                       header.path)
    return params


def load_generation_eos_ids(source: ModelSource) -> list[int]:
    """End-of-sequence ids: generation_config.json (else config.json) or the GGUF eos."""
    if source.kind == "gguf":
        header = read_gguf_header(source.path)
        eos = _meta_int(header.metadata, "tokenizer.ggml.eos_token_id")
        ids = [] if eos is None else [eos]
        if header.arch == "gemma3":  # Gemma's turns end with <end_of_turn>, as its generation config says
            ids += [i for i in end_of_turn_ids(header.metadata) if i not in ids]
        return ids
    folder = Path(source.path)
    for name in ("generation_config.json", "config.json"):
        path = folder / name
        if path.is_file():
            ids = _eos_list(read_json(path, f"{name} in {folder}"))
            if ids:
                return ids
    return []


def _eos_list(data: Any) -> list[int]:
    """``eos_token_id`` of a JSON object as a list (int, list or absent)."""
    value = data.get("eos_token_id") if isinstance(data, dict) else None
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [int(v) for v in value if isinstance(v, int)]
    return []

