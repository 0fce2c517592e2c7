"""GGUF files written with gguf-py under llama.cpp's names, for the peers' side of a benchmark (and
for the tests' tiny checkpoints): the metadata every decoder architecture carries."""

from __future__ import annotations

from typing import Any


def decoder_writer(path: str, arch: str, config: Any, rope_theta: float) -> Any:
    """A `gguf.GGUFWriter` for `arch` at `path` holding the sizes, head counts, RMSNorm epsilon and
    RoPE base of a transformers decoder `config`; the caller adds its own keys and the tensors."""
    import gguf

    w = gguf.GGUFWriter(path, arch)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(rope_theta)
    return w


def finish(w: Any) -> None:
    """Writes the header, the metadata and the tensors, and closes the file."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
