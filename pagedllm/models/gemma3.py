"""Gemma 3 (text): interleaved sliding-window and global attention on a flat [num_tokens, hidden] batch.

What differs from the Llama family (pagedllm/models/llama.py), as transformers' Gemma3ForCausalLM
computes it:

* layers are `sliding_attention` (each query sees the last `sliding_window` keys, itself included)
  or `full_attention` (`layer_types`; by default every 6th layer is global): each Attention layer
  carries its own window, and the paged cache keeps every block for both kinds;
* each kind has its own RoPE table: `rope_parameters["sliding_attention"]` (the local base,
  10,000) and `rope_parameters["full_attention"]` (`rope_theta`, with any `rope_scaling`);
* per-head RMSNorm of q and k (q_norm, k_norm) before RoPE; the attention scale is
  `query_pre_attn_scalar ** -0.5`;
* four norms a layer (input, post-attention, pre-feedforward, post-feedforward), all Gemma's
  `x * (1 + w)` in float32 (pagedllm/layers/gemma_norm.py): the sublayers' outputs are normed
  before they join the residual stream;
* embeddings scaled by sqrt(hidden) in the model dtype; a GeGLU MLP (gelu, tanh approximation);
  a tied LM head, and a final logit softcap where the config sets one.

Decode steps on the CPU run the fused native decode step (worker/native_decode.py, its Gemma form:
these norms, GELU-tanh, the embedding scale, each layer's window, RoPE table and KV group); the
other steps run this module's forward, attention through the native CPU kernels with a per-layer
window.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable

import torch
from torch import nn

from pagedllm.config import FULL_ATTENTION, SLIDING_ATTENTION, attention_layer_types
from pagedllm.distributed.parallel_state import ParallelContext, TensorParallelGroup
from pagedllm.layers.activation import GeluTanhAndMul
from pagedllm.layers.embedding import LMHead, VocabEmbedding
from pagedllm.layers.gemma_norm import GemmaRMSNorm
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, PPMissingLayer, head_dim_of
from pagedllm.models.weights import fused_name, load_decoder_weights

SLIDING, FULL = SLIDING_ATTENTION, FULL_ATTENTION


def _rope_config(config, kind: str):
    """A copy of the config whose `rope_parameters` are those of one layer kind (what
    RotaryEmbedding reads)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    own = params.get(kind)
    if own is None:  # a flat dict (older configs): theta for global layers, the local base for sliding
        theta = float(params.get("rope_theta", getattr(config, "rope_theta", 1e6)))
        local = float(getattr(config, "rope_local_base_freq", 10000.0))
        own = {**params, "rope_theta": local} if kind == SLIDING else {**params, "rope_theta": theta}
        if kind == SLIDING:
            own["rope_type"] = "default"
    shim = copy.copy(config)
    shim.rope_parameters = dict(own)
    return shim


class Gemma3Attention(LlamaAttention):
    """Llama's attention with per-head q/k norms, its own scale and this layer kind's window."""

    def __init__(self, config, layer_idx: int, kind: str, dtype: torch.dtype, rotary_emb: RotaryEmbedding,
                 tp: TensorParallelGroup, quant_config=None, prefix: str = "") -> None:
        if getattr(config, "attn_logit_softcapping", None) is not None:
            raise ValueError(f"attn_logit_softcapping={config.attn_logit_softcapping}: attention logit softcapping "
                             "is not supported by pagedllm's attention kernels")
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention=True (Gemma 3 embedding models) is not supported")
        bias = bool(getattr(config, "attention_bias", False))
        window = int(config.sliding_window) if kind == SLIDING else 0
        scale = float(getattr(config, "query_pre_attn_scalar", None) or head_dim_of(config)) ** -0.5
        super().__init__(config, layer_idx, dtype, bias, bias, rotary_emb, tp, quant_config, prefix,
                         scale=scale, sliding_window=window)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.splits, dim=-1)
        T = x.shape[0]
        q = self.q_norm(q.reshape(T, self.num_heads, self.head_dim)).view(T, -1)
        k = self.k_norm(k.reshape(T, self.num_kv_heads, self.head_dim)).view(T, -1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class Gemma3MLP(LlamaMLP):
    """Llama's gated MLP with GeGLU (gelu, tanh approximation) and no bias."""

    def __init__(self, config, dtype: torch.dtype, tp: TensorParallelGroup, quant_config=None, prefix: str = "") -> None:
        act = getattr(config, "hidden_activation", None) or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"hidden_activation={act!r} is not supported for Gemma 3 (gelu_pytorch_tanh only)")
        super().__init__(config, dtype, False, tp, quant_config, prefix)
        self.act = GeluTanhAndMul()


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, kind: str, dtype: torch.dtype, rotary_emb: RotaryEmbedding,
                 tp: TensorParallelGroup, quant_config=None) -> None:
        super().__init__()
        prefix = f"model.layers.{layer_idx}"
        self.kind = kind
        self.self_attn = Gemma3Attention(config, layer_idx, kind, dtype, rotary_emb, tp, quant_config,
                                         f"{prefix}.self_attn")
        self.mlp = Gemma3MLP(config, dtype, tp, quant_config, f"{prefix}.mlp")
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The residual stream in, the residual stream out."""
        x = x + self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(x)))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3ForCausalLM(nn.Module):
    """Gemma 3's text decoder (`Gemma3ForCausalLM`, model_type `gemma3_text`)."""

    # checkpoint name fragment -> (fused parameter name fragment, shard id): the Llama family's
    stacked_params = LlamaForCausalLM.stacked_params

    def __init__(self, config, dtype: torch.dtype = torch.float32, parallel: ParallelContext | None = None,
                 quant_config=None) -> None:
        super().__init__()
        self.config = config
        self.parallel = parallel = parallel or ParallelContext()
        tp = parallel.tp
        self.start_layer, self.end_layer = parallel.layers(config.num_hidden_layers)
        self.layer_types = attention_layer_types(config)
        hidden = config.hidden_size
        if parallel.is_first_stage:
            self.embed_tokens = VocabEmbedding(config.vocab_size, hidden, dtype, tp)
        # sqrt(hidden) rounded to the model dtype, as transformers scales the embeddings.
        self.embed_scale = float(torch.tensor(math.sqrt(hidden), dtype=dtype))
        head_dim, max_pos = head_dim_of(config), config.max_position_embeddings
        # One RoPE table per layer kind, shared by the layers of that kind.
        rotary = {kind: RotaryEmbedding(_rope_config(config, kind), head_dim, max_pos, dtype)
                  for kind in sorted(set(self.layer_types))}
        self.rotary = nn.ModuleDict(rotary)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, i, kind, dtype, rotary[kind], tp, quant_config)
            if self.start_layer <= i < self.end_layer else PPMissingLayer()
            for i, kind in enumerate(self.layer_types)
        )
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)
        if parallel.is_last_stage:
            self.norm = GemmaRMSNorm(hidden, config.rms_norm_eps, dtype)
            self.lm_head = LMHead(config.vocab_size, hidden, dtype, tp)
            if getattr(config, "tie_word_embeddings", False) and parallel.is_first_stage:
                self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        """Flat batch: input_ids, positions [T] -> [T, hidden]: the final (normed) hidden states on
        the last pipeline stage, otherwise the residual stream handed to the next stage."""
        if hidden_states is None:
            x = self.embed_tokens(input_ids)
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        else:
            x = hidden_states
        for i in range(self.start_layer, self.end_layer):
            x = self.layers[i](positions, x)
        return self.norm(x) if self.parallel.is_last_stage else x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies checkpoint tensors (Hugging Face names, q/k/v and gate/up fused as in the Llama
        family) into parameters; returns the names loaded."""
        return load_decoder_weights(self, weights, lambda name: name.removeprefix("model."),
                                    lambda name: fused_name(name, self.stacked_params))
