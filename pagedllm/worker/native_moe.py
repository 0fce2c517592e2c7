"""The fused decode step's mixture-of-experts layers (Qwen3-MoE, Mixtral): which FusedMoE blocks
the C step computes (dense experts in the model dtype, one rank) and their binding into its model
struct (llama_decode.c's router_w, experts_w13, experts_w2). The step routes each row as
layers/moe.py's route() does (float32 softmax of the router logits, top-k, renormalised) and runs
each active expert's two GEMMs on the rows routed to it, summing in ascending expert order."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch
from torch import nn

from pagedllm.layers.linear import UnquantizedLinearMethod
from pagedllm.layers.moe import FusedMoE


def is_moe(mlp: nn.Module) -> bool:
    return type(mlp) is FusedMoE


def moe_reason(mlps: list[nn.Module], dtype: torch.dtype) -> str | None:
    """Why the step cannot run these layers' FusedMoE blocks (all alike: experts, top-k, width,
    routing; dense experts and router in the dtype, contiguous), or None."""
    blocks = [m for m in mlps if is_moe(m)]
    if not blocks:
        return None
    first = blocks[0]
    for m in blocks:
        if m.quantized:
            return "quantized experts"
        if (m.num_experts, m.top_k, m.inter, m.renormalize, m.float32_weights) != (
                first.num_experts, first.top_k, first.inter, first.renormalize, first.float32_weights):
            return "mixture-of-experts layers of different shapes or routing"
        for w in (m.gate.weight, m.w13, m.w2):
            if w.dtype != dtype or not w.is_contiguous():
                return f"expert or router weights in {w.dtype} or not contiguous"
        if m.gate.bias is not None or type(m.gate.quant_method) is not UnquantizedLinearMethod:
            return "a router with a bias or quantized"
    if first.num_experts > 512:
        return f"{first.num_experts} experts (the step takes up to 512)"
    return None


def bind_moe(md: ctypes.Structure, mlps: list[nn.Module], ptrs: Callable[[list], object]) -> bool:
    """Points the step's struct at the layers' routers and stacked experts (None for dense
    layers); False where no layer is a mixture of experts."""
    blocks = [m for m in mlps if is_moe(m)]
    if not blocks:
        return False
    first = blocks[0]
    md.num_experts, md.top_k, md.expert_inter = first.num_experts, first.top_k, first.inter
    md.moe_renorm, md.moe_f32_weights = int(first.renormalize), int(first.float32_weights)
    md.router_w = ptrs([m.gate.weight if is_moe(m) else None for m in mlps])
    md.experts_w13 = ptrs([m.w13 if is_moe(m) else None for m in mlps])
    md.experts_w2 = ptrs([m.w2 if is_moe(m) else None for m in mlps])
    return True
