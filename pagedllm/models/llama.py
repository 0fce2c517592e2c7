"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) on a flat [num_tokens, hidden] batch.

With tensor parallelism each rank holds its heads and MLP columns (two all-reduces per layer:
after o_proj and after down_proj); with pipeline parallelism each stage holds a range of layers
(the first also the embedding, the last also the final norm and LM head) and hands its hidden
states on.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedllm.config import layer_sliding_windows
from pagedllm.distributed.parallel_state import ParallelContext, TensorParallelGroup
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.attention import Attention
from pagedllm.layers.embedding import LMHead, VocabEmbedding
from pagedllm.layers.linear import MergedLinear, QKVLinear, RowParallelLinear
from pagedllm.layers.rmsnorm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.models.weights import fused_name, load_decoder_weights


def linear_method(quant_config, prefix: str, shards: tuple[str, ...] = ()):
    """The quantization method of the linear layer ``prefix`` (checkpoint modules ``shards`` of
    its parent fused into it), or None for weights in the model dtype."""
    if quant_config is None:
        return None
    parent = prefix.rsplit(".", 1)[0]
    return quant_config.linear_method(prefix, [f"{parent}.{s}" for s in shards] or [prefix])


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx: int, dtype: torch.dtype, qkv_bias: bool, o_bias: bool,
                 rotary_emb: RotaryEmbedding, tp: TensorParallelGroup, quant_config=None, prefix: str = "", *,
                 scale: float | None = None, sliding_window: int | None = None) -> None:
        """`scale`: the attention scale (default head_dim ** -0.5); `sliding_window`: this layer's own
        window (see layers.attention.Attention; default: the config's where the layers' windows differ,
        else the model-wide one)."""
        super().__init__()
        hidden = config.hidden_size
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        self.head_dim = head_dim_of(config)
        self.qkv_proj = QKVLinear(
            hidden, self.head_dim, num_heads, num_kv_heads, qkv_bias, dtype, tp=tp,
            quant_method=linear_method(quant_config, f"{prefix}.qkv_proj", ("q_proj", "k_proj", "v_proj")))
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # this rank's
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, hidden, bias=o_bias, dtype=dtype, tp=tp,
                                        quant_method=linear_method(quant_config, f"{prefix}.o_proj"))
        self.rotary_emb = rotary_emb
        scale = self.head_dim**-0.5 if scale is None else scale
        if sliding_window is None:
            # A window of its own where the layers' windows differ (Qwen2's use_sliding_window: the
            # layers from max_window_layers on, as `layer_types` says); a window every layer shares
            # comes with the step's metadata instead.
            windows = layer_sliding_windows(config)
            sliding_window = windows[layer_idx] if len(set(windows)) > 1 else None
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, scale, layer_idx,
                              sliding_window=sliding_window)
        self.splits = [self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size]

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.splits, dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, config, dtype: torch.dtype, bias: bool, tp: TensorParallelGroup, quant_config=None,
                 prefix: str = "") -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, [inter, inter], bias=bias, dtype=dtype, tp=tp,
                                         quant_method=linear_method(quant_config, f"{prefix}.gate_up_proj",
                                                                    ("gate_proj", "up_proj")))
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=bias, dtype=dtype, tp=tp,
                                           quant_method=linear_method(quant_config, f"{prefix}.down_proj"))
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm decoder layer. Other families reuse it with their own attention class
    (`attention_cls`) or feed-forward block (`make_mlp`)."""

    attention_cls: type[LlamaAttention] = LlamaAttention

    def __init__(self, config, layer_idx: int, dtype: torch.dtype, qkv_bias: bool, o_bias: bool, mlp_bias: bool,
                 rotary_emb: RotaryEmbedding, tp: TensorParallelGroup, quant_config=None):
        super().__init__()
        prefix = f"model.layers.{layer_idx}"
        self.self_attn = self.attention_cls(config, layer_idx, dtype, qkv_bias, o_bias, rotary_emb, tp, quant_config,
                                            f"{prefix}.self_attn")
        self.mlp = self.make_mlp(config, layer_idx, dtype, mlp_bias, tp, quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (residual stream, this layer's MLP output). The stream is `residual + x` (just `x`
        for the first layer): the add runs inside the input norm's pass, as after attention."""
        if residual is None:
            residual, y = x, self.input_layernorm(x)
        else:
            residual, y = self.input_layernorm.add_and_norm(residual, x)
        h, y = self.post_attention_layernorm.add_and_norm(residual, self.self_attn(positions, y))
        return h, self.mlp(y)

    def make_mlp(self, config, layer_idx: int, dtype: torch.dtype, bias: bool, tp: TensorParallelGroup,
                 quant_config, prefix: str) -> nn.Module:
        return LlamaMLP(config, dtype, bias, tp, quant_config, prefix)


class PPMissingLayer(nn.Module):
    """Stands in for a layer another pipeline stage holds (keeps `layers[i]` indexing)."""


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (fused parameter name fragment, shard id)
    stacked_params = {
        ".q_proj.": (".qkv_proj.", "q"),
        ".k_proj.": (".qkv_proj.", "k"),
        ".v_proj.": (".qkv_proj.", "v"),
        ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }
    qkv_bias_default = False
    layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer

    def __init__(self, config, dtype: torch.dtype = torch.float32, parallel: ParallelContext | None = None,
                 quant_config=None) -> None:
        super().__init__()
        self.config = config
        self.parallel = parallel = parallel or ParallelContext()
        tp = parallel.tp
        attn_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = attn_bias or self.qkv_bias_default
        mlp_bias = bool(getattr(config, "mlp_bias", False))
        self.start_layer, self.end_layer = parallel.layers(config.num_hidden_layers)
        if parallel.is_first_stage:
            self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype, tp)
        # One RoPE table for the whole model, shared by its layers.
        rotary = self.make_rotary(config, dtype)
        self.layers = nn.ModuleList(
            self.layer_cls(config, i, dtype, qkv_bias, attn_bias, mlp_bias, rotary, tp, quant_config)
            if self.start_layer <= i < self.end_layer else PPMissingLayer()
            for i in range(config.num_hidden_layers)
        )
        if parallel.is_last_stage:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
            self.lm_head = LMHead(config.vocab_size, config.hidden_size, dtype, tp)
            if getattr(config, "tie_word_embeddings", False) and parallel.is_first_stage:
                self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        """Flat batch: input_ids, positions [T] -> [T, hidden]: the final (normed) hidden states on
        the last pipeline stage, otherwise the residual stream handed to the next stage (which
        passes it back in as `hidden_states`)."""
        x = self.embed_tokens(input_ids) if hidden_states is None else hidden_states
        residual = None
        for i in range(self.start_layer, self.end_layer):
            residual, x = self.layers[i](positions, x, residual)
        if residual is None:  # a stage without layers
            return self.norm(x) if self.parallel.is_last_stage else x
        if self.parallel.is_last_stage:
            return self.norm.add_and_norm(residual, x)[1]
        return residual + x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def make_rotary(self, config, dtype: torch.dtype) -> RotaryEmbedding:
        return RotaryEmbedding(config, head_dim_of(config), config.max_position_embeddings, dtype)

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors as load_weights maps them (a family with fused checkpoint
        tensors splits them here into the per-projection names)."""
        return weights

    def map_param(self, name: str) -> tuple[str, object]:
        """(parameter name, shard id) of checkpoint tensor `name` (without `model.`)."""
        return fused_name(name, self.stacked_params)

    def _param_name(self, name: str) -> str:
        name = name.removeprefix("model.")
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies checkpoint tensors (Hugging Face names) into parameters; returns the names loaded."""
        tensors = ((n, t) for n, t in self.checkpoint_tensors(weights) if "rotary_emb.inv_freq" not in n)
        return load_decoder_weights(self, tensors, self._param_name, self.map_param)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: the Llama layout with biases on q/k/v (not on o_proj)."""

    qkv_bias_default = True


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: the Llama layout (sliding window, if any, is applied through attention metadata)."""
