"""A LoRA adapter in GGUF, as llama.cpp's `convert_lora_to_gguf.py` writes it, read into the same
modules as a PEFT folder (`pagedllm.lora.peft`), and `read_adapter`, which takes either.

The file's metadata: `general.type` = "adapter", `adapter.type` = "lora", `general.architecture`
(the base model's llama.cpp architecture) and `adapter.lora.alpha`. Its tensors are named after
the base model's llama.cpp tensors, `<base tensor>.lora_a` and `<base tensor>.lora_b` (e.g.
`blk.3.attn_q.weight.lora_a`): A [rank, in] and B [out, rank] in row-major terms (GGUF dimensions
[in, rank] and [rank, out]), in F32, F16, BF16 or Q8_0. llama.cpp scales each pair by
alpha / rank (by 1 where alpha is 0), rank being B's column count. For the llama architecture its
converter permutes the rows of q and k projections for its rotary layout, and the rows of their B
with them; they are permuted back here as the base model's weights are (`unpermute_qk`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagedllm.lora.peft import ModuleLoRA, PeftAdapter, both_halves, read_peft_adapter

# The llama.cpp architecture of each Hugging Face model_type whose GGUF tensor names pagedllm reads
# (`gguf_to_hf_name`); llama.cpp's converter writes Mistral checkpoints as "llama".
_LLAMA_CPP_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
                   "gemma3_text": "gemma3", "gemma3": "gemma3"}
_SUFFIXES = (".lora_a", ".lora_b")


def is_gguf_file(path: str) -> bool:
    """True for a file that starts with GGUF's magic."""
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == b"GGUF"


def read_adapter(path: str, max_rank: int, hf_config: Any) -> PeftAdapter:
    """The adapter at `path`: a GGUF LoRA file or a PEFT folder, its B pre-scaled."""
    if is_gguf_file(path):
        return read_gguf_adapter(path, max_rank, hf_config)
    if not Path(path).exists():
        raise ValueError(f"LoRA adapter path {path!r} does not exist")
    if Path(path).is_file():
        raise ValueError(f"LoRA adapter path {path!r} is a file but not a GGUF file (a PEFT adapter is a folder)")
    return read_peft_adapter(path, max_rank)


def model_arch(hf_config: Any) -> str:
    """The llama.cpp architecture name of a model's config; a ValueError for one without GGUF names."""
    model_type = str(getattr(hf_config, "model_type", ""))
    arch = _LLAMA_CPP_ARCH.get(model_type)
    if arch is None:
        raise ValueError(f"GGUF LoRA adapters are served for models of type {sorted(_LLAMA_CPP_ARCH)}, "
                         f"not {model_type!r}")
    return arch


def _metadata(header: Any, path: str, arch: str) -> float:
    """Checks the adapter's metadata against the model; returns adapter.lora.alpha."""
    meta = header.metadata
    kind = meta.get("general.type")
    if kind != "adapter":
        raise ValueError(f"LoRA adapter {path!r}: general.type is {kind!r}, not 'adapter' (a model file, not a "
                         "LoRA adapter?)")
    if meta.get("adapter.type") != "lora":
        raise ValueError(f"LoRA adapter {path!r}: adapter.type is {meta.get('adapter.type')!r}, not 'lora'")
    if header.arch != arch:
        raise ValueError(f"LoRA adapter {path!r}: general.architecture is {header.arch!r}, the model's is {arch!r} "
                         "(an adapter of another base model)")
    if "adapter.alora_invocation_tokens" in meta:
        raise ValueError(f"LoRA adapter {path!r}: adapter.alora_invocation_tokens (activated LoRA) is not supported")
    return float(meta.get("adapter.lora.alpha", 0.0))


def read_gguf_adapter(path: str, max_rank: int, hf_config: Any) -> PeftAdapter:
    """The GGUF adapter's modules under the model's Hugging Face names, B scaled as llama.cpp
    scales it; a ValueError naming the field or tensor for anything not served exactly."""
    import numpy as np

    from pagedllm.models.loader.gguf_reader import read_gguf_header
    from pagedllm.models.loader.gguf_weights import dequantize_gguf, gguf_to_hf_name, unpermute_qk

    arch = model_arch(hf_config)
    header = read_gguf_header(path)  # a ModelLoadError (a ValueError) names a corrupt file
    alpha = _metadata(header, path, arch)
    pairs: dict[str, dict[str, Any]] = {}
    for name, info in header.tensors.items():
        suffix = next((s for s in _SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            raise ValueError(f"LoRA adapter {path!r}: tensor {name!r} is neither a .lora_a nor a .lora_b tensor "
                             "(norm vectors and other trained tensors are not supported)")
        pairs.setdefault(name[: -len(suffix)], {})[suffix] = info
    if not pairs:
        raise ValueError(f"LoRA adapter {path!r}: the file holds no LoRA tensors")
    heads = {}
    if arch == "llama":  # the rows llama.cpp's converter permuted, and over how many heads
        n_head = int(hf_config.num_attention_heads)
        heads = {"attn_q": n_head, "attn_k": int(getattr(hf_config, "num_key_value_heads", None) or n_head)}
    data = np.memmap(path, dtype=np.uint8, mode="r")
    modules = []
    for base, ab in sorted(pairs.items()):
        a_info, b_info = both_halves(path, f"tensor {base!r}", ab, (".lora_a", ".lora_b"))
        hf_name = gguf_to_hf_name(base, arch)
        if hf_name is None or not hf_name.endswith(".weight"):
            raise ValueError(f"LoRA adapter {path!r}: tensor {a_info.name!r} adapts {base!r}, which is no tensor "
                             f"of a {arch} model that pagedllm knows")
        a_shape, b_shape = a_info.torch_shape, b_info.torch_shape
        if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[0] != b_shape[1]:
            raise ValueError(f"LoRA adapter {path!r}: tensors {a_info.name!r} {a_shape} and {b_info.name!r} "
                             f"{b_shape} do not share a rank")
        r = b_shape[1]
        if r > max_rank:
            raise ValueError(f"LoRA adapter {path!r}: tensor {b_info.name!r} has rank {r}, over --max-lora-rank "
                             f"{max_rank}")
        a, b = (dequantize_gguf(data[i.offset: i.offset + i.n_bytes], i.qtype, i.torch_shape) for i in (a_info, b_info))
        n_head = heads.get(base.split(".")[2]) if base.startswith("blk.") and base.count(".") == 3 else None
        if n_head is not None:
            if b.shape[0] % (2 * n_head):
                raise ValueError(f"LoRA adapter {path!r}: tensor {b_info.name!r} has {b.shape[0]} rows, not a "
                                 f"whole number of {n_head} rotary heads (an adapter of another base model?)")
            b = unpermute_qk(b, n_head)
        scale = alpha / r if alpha else 1.0
        modules.append(ModuleLoRA(hf_name.removesuffix(".weight"), a, b * scale, a_info.name, b_info.name))
    return PeftAdapter(path, max(m.rank for m in modules), None, modules)
