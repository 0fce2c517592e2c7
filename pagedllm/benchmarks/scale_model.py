"""The models of `pagedllm bench scale`: a Llama-3.2-1B-shaped and a Qwen3-0.6B-shaped decoder with
random weights, as a Hugging Face folder (bf16 safetensors) and as llama.cpp GGUFs.

transformers builds each model from its config (`AutoModelForCausalLM.from_config` under
`torch.manual_seed(0)`: its own initialisation) and saves it in bfloat16 with the default model's
tokenizer files (vocabulary 49152); the embedding and the tied LM head keep the real model's
vocabulary size (128256 / 151936), so their cost is the real one. The BF16 GGUF is written with
gguf-py under llama.cpp's `llama` / `qwen3` names and keys, as llama.cpp's converter writes them:
Llama's Q/K rows permuted for llama.cpp's rotary layout and its llama3 frequency factors stored
as `rope_freqs.weight`; the tokenizer copied from the default model's GGUF and padded to the
vocabulary size with unused `[PAD<i>]` entries. Q8_0 / Q4_0 come from llama.cpp's own quantizer
(`gguf_export.llamacpp_quantized_gguf`). Everything is cached under the pagedllm cache directory,
keyed by a hash of the config.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path
from typing import Any

from pagedllm.benchmarks.gguf_write import decoder_writer, finish
from pagedllm.utils import cache_dir

SHAPES = ("llama-3.2-1b", "qwen3-0.6b")
TOKENIZER_VOCAB = 49152  # the default model's tokenizer: prompts are random ids below this

_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_BASE: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, intermediate_size=8192,
                         max_position_embeddings=131072, rms_norm_eps=1e-5, rope_parameters=_LLAMA3_ROPE,
                         tie_word_embeddings=True),
    "qwen3-0.6b": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                       max_position_embeddings=40960, rms_norm_eps=1e-6,
                       rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
                       tie_word_embeddings=True),
}


def shape_config(shape: str, layers: int | None = None, hidden: int | None = None,
                 vocab: int | None = None) -> dict[str, Any]:
    """The transformers config (as a dict with `model_type`) of `shape`; `layers`, `hidden` and
    `vocab` shrink it (tests): the head counts and the MLP width scale with the hidden size, the
    head width stays."""
    if shape not in _BASE:
        raise ValueError(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
    cfg = dict(_BASE[shape], bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    if hidden is not None:
        scale = hidden / cfg["hidden_size"]
        cfg.update(hidden_size=hidden, num_attention_heads=max(1, round(cfg["num_attention_heads"] * scale)),
                   num_key_value_heads=max(1, round(cfg["num_key_value_heads"] * scale)),
                   intermediate_size=max(16, round(cfg["intermediate_size"] * scale)))
    if vocab is not None:
        if vocab < TOKENIZER_VOCAB:
            raise ValueError(f"vocab must be at least the tokenizer's {TOKENIZER_VOCAB}, got {vocab}")
        cfg["vocab_size"] = vocab
    return cfg


def model_dir(cfg: dict[str, Any], root: Path | None = None) -> Path:
    """The model's folder: under `root`, else the cache's `bench-scale`, named by a hash of `cfg`."""
    key = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:12]
    return (root or cache_dir() / "bench-scale") / f"{cfg['model_type']}-{key}"


def build_model(cfg: dict[str, Any], root: Path | None = None) -> tuple[str, str]:
    """(HF folder, BF16 GGUF path) of the model of `cfg`, built once and cached (under `root` if given)."""
    folder = model_dir(cfg, root)
    gguf_path = folder / "model.BF16.gguf"
    if (folder / "model.safetensors").exists() and gguf_path.exists():
        return str(folder), str(gguf_path)
    import torch
    import transformers as t

    from pagedllm.models.loader import default_hf_folder

    folder.mkdir(parents=True, exist_ok=True)
    kwargs = {k: v for k, v in cfg.items() if k != "model_type"}
    config = t.AutoConfig.for_model(cfg["model_type"], **kwargs)
    torch.manual_seed(0)
    hf = t.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    hf.save_pretrained(str(folder))
    tok = Path(default_hf_folder())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok / name, folder / name)
    write_gguf(hf, str(gguf_path))
    return str(folder), str(gguf_path)


def llama_permute(w: Any, n_head: int) -> Any:
    """llama.cpp's converter's Q/K row order for its rotary layout (pagedllm's loader undoes it)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(rope: dict[str, Any], head_dim: int) -> list[float]:
    """The per-frequency divisors llama.cpp's converter stores as `rope_freqs.weight` for llama3 RoPE."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * rope["rope_theta"] ** (i / head_dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(float(factor))
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def write_gguf(hf: Any, path: str) -> None:
    """`hf` (a LlamaForCausalLM or Qwen3ForCausalLM) as llama.cpp's BF16 GGUF: matrices BF16, 1-D
    tensors F32, the default model's GGUF tokenizer padded to the vocabulary size."""
    import gguf
    import numpy as np

    c = hf.config
    arch = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen3": gguf.MODEL_ARCH.QWEN3}[c.model_type]
    rope = c.rope_parameters
    tmp = Path(path).with_suffix(".tmp")
    w = decoder_writer(str(tmp), gguf.MODEL_ARCH_NAMES[arch], c, rope["rope_theta"])
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_dimension_count(c.head_dim)
    w.add_vocab_size(c.vocab_size)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    add_padded_tokenizer(w, c.vocab_size)

    def add(tensor: Any, name: str, bid: int | None = None, suffix: str = ".weight") -> None:
        data = tensor.detach().float().numpy() if hasattr(tensor, "detach") else np.asarray(tensor, np.float32)
        full = gguf.TENSOR_NAMES[name].format(bid=bid) + suffix
        if data.ndim > 1:
            w.add_tensor(full, gguf.quants.quantize(data, gguf.GGMLQuantizationType.BF16),
                         raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            w.add_tensor(full, data, raw_dtype=gguf.GGMLQuantizationType.F32)

    T = gguf.MODEL_TENSOR
    m = hf.model
    if rope.get("rope_type") == "llama3":
        add(llama3_rope_factors(rope, c.head_dim), T.ROPE_FREQS, suffix=".weight")
    add(m.embed_tokens.weight, T.TOKEN_EMBD)
    is_llama = c.model_type == "llama"
    for i, layer in enumerate(m.layers):
        a, mlp = layer.self_attn, layer.mlp
        q, k = a.q_proj.weight, a.k_proj.weight
        if is_llama:
            q, k = llama_permute(q, c.num_attention_heads), llama_permute(k, c.num_key_value_heads)
        parts = [(layer.input_layernorm.weight, T.ATTN_NORM), (q, T.ATTN_Q), (k, T.ATTN_K),
                 (a.v_proj.weight, T.ATTN_V), (a.o_proj.weight, T.ATTN_OUT)]
        if not is_llama:
            parts += [(a.q_norm.weight, T.ATTN_Q_NORM), (a.k_norm.weight, T.ATTN_K_NORM)]
        parts += [(layer.post_attention_layernorm.weight, T.FFN_NORM), (mlp.gate_proj.weight, T.FFN_GATE),
                  (mlp.up_proj.weight, T.FFN_UP), (mlp.down_proj.weight, T.FFN_DOWN)]
        for tensor, name in parts:
            add(tensor, name, i)
    add(m.norm.weight, T.OUTPUT_NORM)
    if not c.tie_word_embeddings:
        add(hf.lm_head.weight, T.OUTPUT)
    finish(w)
    tmp.replace(path)


def add_padded_tokenizer(w: Any, vocab_size: int) -> None:
    """The default model's GGUF tokenizer keys, its token list (and types, scores) padded to
    `vocab_size` with unused `[PAD<i>]` entries, as llama.cpp's converter pads a larger vocabulary."""
    import gguf

    from pagedllm.models.loader import resolve_model

    reader = gguf.GGUFReader(resolve_model(None).path)
    fields = {n: f for n, f in reader.fields.items() if n.startswith("tokenizer.")}
    n_tokens = len(fields["tokenizer.ggml.tokens"].contents())
    if vocab_size < n_tokens:
        raise ValueError(f"vocab_size {vocab_size} is below the tokenizer's {n_tokens} tokens")
    extra = range(n_tokens, vocab_size)
    pads = {"tokenizer.ggml.tokens": [f"[PAD{i}]" for i in extra],
            "tokenizer.ggml.token_type": [int(gguf.TokenType.UNUSED)] * len(extra),
            "tokenizer.ggml.scores": [-1000.0] * len(extra)}
    for name, field in fields.items():
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if name in pads:
            value = [*value, *pads[name]]
        w.add_key_value(name, value, vtype, sub_type=sub)
