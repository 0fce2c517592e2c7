"""GGUF files of tiny checkpoints written as llama.cpp's converter writes them (gguf-py's writer)."""

from __future__ import annotations

from pagedllm.benchmarks.gguf_write import decoder_writer, finish

__all__ = ["finish", "llama_cpp_writer", "write_gguf_lora"]


def llama_cpp_writer(path: str, arch: str, config, rope_theta: float):
    """A GGUFWriter holding the metadata the converter writes for every decoder architecture:
    sizes, norm epsilon, RoPE base, vocabulary size and the special token ids (bos 1, eos 2,
    pad 0, as the tiny tokenizer has them); the caller adds its own keys and the tensors."""
    w = decoder_writer(path, arch, config, rope_theta)
    w.add_uint32(f"{arch}.vocab_size", config.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    return w


def write_gguf_lora(peft_folder: str, path: str, arch: str, config, qtype: str = "F32",
                    extra: dict | None = None) -> str:
    """The PEFT adapter in `peft_folder` written as llama.cpp's `convert_lora_to_gguf.py` writes it:
    `general.type` "adapter", `adapter.type` "lora", `adapter.lora.alpha`; for each adapted module
    `<base tensor>.lora_a` (A [rank, in]) and `.lora_b` (B [out, rank]) under gguf-py's name for the
    base tensor; for the llama architecture B of q_proj / k_proj has its rows permuted as the
    converter permutes the base weights' rows (over the query, resp. key-value, heads); tensors in
    `qtype` (F32, F16, BF16 or Q8_0; a row that is not whole Q8_0 blocks falls back to F16, as
    the converter's does). `extra`: more tensors by GGUF name, in F32 (mergekit's norm vectors,
    which the converter keeps)."""
    import json
    from pathlib import Path

    import gguf
    import numpy as np
    from safetensors.torch import load_file

    cfg = json.loads((Path(peft_folder) / "adapter_config.json").read_text())
    tensors = load_file(str(Path(peft_folder) / "adapter_model.safetensors"))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    w = gguf.GGUFWriter(path, arch)
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(cfg["lora_alpha"]))
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    heads = {"q_proj": config.num_attention_heads, "k_proj": kv_heads} if arch == "llama" else {}
    want = getattr(gguf.GGMLQuantizationType, qtype)
    for key in sorted(tensors):
        part = "a" if ".lora_A." in key else "b"
        module = key.removeprefix("base_model.model.").removesuffix(f".lora_{part.upper()}.weight")
        t = tensors[key].float().numpy()
        n_head = heads.get(module.rsplit(".", 1)[1])
        if part == "b" and n_head is not None:  # the converter's rotary permutation of the base rows
            t = t.reshape(n_head, 2, t.shape[0] // n_head // 2, t.shape[1]).swapaxes(1, 2).reshape(t.shape)
        tt = want
        if tt == gguf.GGMLQuantizationType.Q8_0 and t.shape[-1] % 32:
            tt = gguf.GGMLQuantizationType.F16
        data = np.ascontiguousarray(t, dtype=np.float32)
        if tt != gguf.GGMLQuantizationType.F32:
            data = gguf.quants.quantize(data, tt)
        w.add_tensor(names.get_name(module + ".weight", try_suffixes=(".weight",)) + f".lora_{part}", data,
                     raw_dtype=tt)
    for name, t in (extra or {}).items():
        w.add_tensor(name, np.asarray(t, dtype=np.float32))
    finish(w)
    return path
