"""GGUF files of tiny checkpoints written as llama.cpp's converter writes them (gguf-py's writer)."""

from __future__ import annotations


def llama_cpp_writer(path: str, arch: str, config, rope_theta: float):
    """A GGUFWriter holding the metadata the converter writes for every decoder architecture:
    sizes, norm epsilon, RoPE base, vocabulary size and the special token ids (bos 1, eos 2,
    pad 0, as the tiny tokenizer has them); the caller adds its own keys and the tensors."""
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
    w.add_uint32(f"{arch}.vocab_size", config.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    return w


def finish(w) -> None:
    """Writes the header, the metadata and the tensors, and closes the file."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
