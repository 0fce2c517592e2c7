"""Mixture-of-experts decoders: Qwen3-MoE, Mixtral and OLMoE. Each is the Llama layer with a
sparse block (layers/moe.py) in place of the MLP on its sparse layers; they differ in the
attention's q/k norms and in routing:

- Qwen3-MoE: Qwen3's per-head q/k norms; `num_experts`, `num_experts_per_tok`, renormalised when
  `norm_topk_prob`; a layer is sparse unless it is in `mlp_only_layers` or
  (index + 1) % `decoder_sparse_step` != 0 (those run a dense MLP of `intermediate_size`).
- Mixtral: `num_local_experts`, top-k always renormalised, routing weights kept in float32.
- OLMoE: RMSNorm over the whole q and k projections (not per head), optional `clip_qkv`,
  renormalised only when `norm_topk_prob`.

Checkpoints hold one matrix per expert (`mlp.experts.<e>.gate_proj/up_proj/down_proj`, Mixtral's
`block_sparse_moe.experts.<e>.w1/w3/w2`) and the router as `mlp.gate`. Under `-q int8 | w8a8 |
int4 | fp8` each expert loads into its own pair of quantized linear layers (`mlp.experts.<e>.w13`,
`.w2`) instead of the stacked weights.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from pagedllm.distributed.parallel_state import ParallelContext, TensorParallelGroup
from pagedllm.layers.moe import FusedMoE
from pagedllm.layers.rmsnorm import RMSNorm
from pagedllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from pagedllm.models.qwen3 import QKNormAttention

_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_PART = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": 2, "w2": 2}


class MoEForCausalLM(LlamaForCausalLM):
    """Loads per-expert checkpoint matrices into the layers' stacked expert weights."""

    def __init__(self, config, dtype: torch.dtype = torch.float32, parallel: ParallelContext | None = None,
                 quant_config=None) -> None:
        self.per_expert = quant_config is not None  # quantized experts: one layer pair each
        super().__init__(config, dtype, parallel, quant_config)

    def _param_name(self, name: str) -> str:
        return super()._param_name(name).replace(".block_sparse_moe.", ".mlp.")

    def map_param(self, name: str) -> tuple[str, object]:
        m = _EXPERT.match(name)
        if m is None:
            return super().map_param(name)
        part, expert = _PART[m.group(3)], int(m.group(2))
        w = "w2" if part == 2 else "w13"
        if self.per_expert:
            return f"{m.group(1)}.{expert}.{w}.weight", (expert, part)
        return f"{m.group(1).removesuffix('.experts')}.{w}", (expert, part)


# -- Qwen3-MoE ---------------------------------------------------------------------------------

def _qwen3_moe_sparse(config, layer_idx: int) -> bool:
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0 and (layer_idx + 1) % config.decoder_sparse_step == 0)


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    attention_cls = QKNormAttention

    def make_mlp(self, config, layer_idx: int, dtype: torch.dtype, bias: bool, tp: TensorParallelGroup,
                 quant_config, prefix: str) -> nn.Module:
        if not _qwen3_moe_sparse(config, layer_idx):
            return LlamaMLP(config, dtype, bias, tp, quant_config, prefix)
        return FusedMoE(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                        config.moe_intermediate_size, bool(config.norm_topk_prob), dtype, tp,
                        quant_config=quant_config, prefix=prefix)


class Qwen3MoeForCausalLM(MoEForCausalLM):
    layer_cls = Qwen3MoeDecoderLayer


# -- Mixtral -----------------------------------------------------------------------------------

class MixtralDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config, layer_idx: int, dtype: torch.dtype, bias: bool, tp: TensorParallelGroup,
                 quant_config, prefix: str) -> nn.Module:
        return FusedMoE(config.num_local_experts, config.num_experts_per_tok, config.hidden_size,
                        config.intermediate_size, True, dtype, tp, float32_weights=True, quant_config=quant_config,
                        prefix=prefix.replace(".mlp", ".block_sparse_moe"), names=("w1", "w3", "w2"))


class MixtralForCausalLM(MoEForCausalLM):
    layer_cls = MixtralDecoderLayer


# -- OLMoE -------------------------------------------------------------------------------------

class OlmoeAttention(LlamaAttention):
    """q and k each through one RMSNorm over the whole projection, then clipped (`clip_qkv`)."""

    def __init__(self, config, layer_idx: int, dtype: torch.dtype, qkv_bias: bool, o_bias: bool, rotary_emb,
                 tp: TensorParallelGroup, quant_config=None, prefix: str = "") -> None:
        if tp.size > 1:
            raise ValueError(f"OLMoE's q/k norms span all heads; tensor_parallel_size={tp.size} is not supported")
        super().__init__(config, layer_idx, dtype, qkv_bias, o_bias, rotary_emb, tp, quant_config, prefix)
        self.q_norm = RMSNorm(self.qkv_proj.q_size, config.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(self.qkv_proj.kv_size, config.rms_norm_eps, dtype)
        self.clip = getattr(config, "clip_qkv", None)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.splits, dim=-1)
        q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        if self.clip is not None:
            c = float(self.clip)
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class OlmoeDecoderLayer(LlamaDecoderLayer):
    attention_cls = OlmoeAttention

    def make_mlp(self, config, layer_idx: int, dtype: torch.dtype, bias: bool, tp: TensorParallelGroup,
                 quant_config, prefix: str) -> nn.Module:
        return FusedMoE(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                        config.intermediate_size, bool(config.norm_topk_prob), dtype, tp,
                        quant_config=quant_config, prefix=prefix)


class OlmoeForCausalLM(MoEForCausalLM):
    layer_cls = OlmoeDecoderLayer
