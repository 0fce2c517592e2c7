"""Phi-3 and Phi-4-mini: the Llama layout with fused checkpoint tensors (`qkv_proj` rows
[q | k | v], `gate_up_proj` rows [gate | up]), RoPE on the first `partial_rotary_factor` of each
head (Phi-4-mini: 0.75) and LongRoPE scaling (short / long factors around
`original_max_position_embeddings`, layers/partial_rotary.py)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pagedllm.layers.partial_rotary import PartialRotaryEmbedding
from pagedllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM, head_dim_of


class Phi3DecoderLayer(LlamaDecoderLayer):
    """The Llama layer; its own type so that Llama-only fast paths decline it (partial rotary)."""


class Phi3ForCausalLM(LlamaForCausalLM):
    layer_cls = Phi3DecoderLayer

    def make_rotary(self, config, dtype: torch.dtype) -> PartialRotaryEmbedding:
        return PartialRotaryEmbedding(config, head_dim_of(config), config.max_position_embeddings, dtype)

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """Splits the fused checkpoint tensors into q/k/v and gate/up ones (which the tensor-parallel
        layers then shard like any Llama checkpoint's)."""
        c = self.config
        d = head_dim_of(c)
        q = c.num_attention_heads * d
        kv = (getattr(c, "num_key_value_heads", None) or c.num_attention_heads) * d
        for name, t in weights:
            if ".qkv_proj." in name:
                if t.shape[0] != q + 2 * kv:
                    raise ValueError(f"checkpoint tensor {name!r} has {t.shape[0]} rows, expected {q + 2 * kv}")
                for part, rows in zip(("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv])):
                    yield name.replace(".qkv_proj.", f".{part}."), rows
            elif ".gate_up_proj." in name:
                if t.shape[0] % 2:
                    raise ValueError(f"checkpoint tensor {name!r} has an odd number of rows ({t.shape[0]})")
                gate, up = t.chunk(2)
                yield name.replace(".gate_up_proj.", ".gate_proj."), gate
                yield name.replace(".gate_up_proj.", ".up_proj."), up
            else:
                yield name, t
