"""GGUF files of tiny checkpoints written as llama.cpp's converter writes them (gguf-py's writer)."""

from __future__ import annotations

from pagedllm.benchmarks.gguf_write import decoder_writer, finish

__all__ = ["finish", "llama_cpp_writer"]


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
