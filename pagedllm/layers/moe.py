"""Mixture-of-experts feed-forward block: a router picks each token's top-k experts, and each
active expert runs one gated MLP (two GEMMs) on the contiguous rows of the tokens routed to it.

Routing follows the reference implementation: softmax over the router logits in float32, then
`torch.topk` (its order, ties included), optionally renormalised over the k chosen. Each expert's
output is scaled by its routing weight and added into the token's row in ascending expert order,
as the reference does, so the float32 sums are taken in the same order.

Tensor parallelism: every rank holds all experts with 1/tp of their intermediate dimension (the
gate/up rows column-parallel, the down projection's columns row-parallel, as the dense MLP); the
partial sums of all experts are added up by one all-reduce per layer.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.linear import Linear, dense_linear

_SINGLE = TensorParallelGroup()


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
          weights_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] router logits -> (weights [T, k], expert ids [T, k]): float32 softmax, top-k in
    torch.topk's order, renormalised over the k when `renormalize`; the weights in
    `weights_dtype` (the logits' dtype when None)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(weights_dtype or router_logits.dtype), ids


class FusedMoE(nn.Module):
    """All experts of one layer: `w13` [E, 2 * I/tp, hidden] ([gate | up] of this rank) and
    `w2` [E, hidden, I/tp], loaded expert by expert from the checkpoint's per-expert matrices
    (shard id (expert, 0 gate | 1 up | 2 down))."""

    def __init__(self, num_experts: int, top_k: int, hidden: int, intermediate: int, renormalize: bool,
                 dtype: torch.dtype, tp: TensorParallelGroup | None = None, float32_weights: bool = False) -> None:
        super().__init__()
        self.tp = tp = tp or _SINGLE
        if intermediate % tp.size:
            raise ValueError(f"expert intermediate size {intermediate} is not divisible by "
                             f"tensor_parallel_size={tp.size}")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and num_experts={num_experts}")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        # Mixtral keeps the routing weights in float32 when it scales the experts' outputs.
        self.float32_weights = float32_weights
        self.inter = intermediate // tp.size
        self.gate = Linear(hidden, num_experts, bias=False, dtype=dtype)  # the router, on every rank
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.inter, hidden, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, self.inter, dtype=dtype), requires_grad=False)
        self.w13.weight_loader = self.w2.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.act = SiluAndMul()

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object) -> None:
        expert, part = shard_id  # type: ignore[misc]
        n, r = self.inter, self.tp.rank
        if part == 2:  # down: [hidden, I], this rank's columns
            want = (param.shape[1], n * self.tp.size)
            dst = param.data[expert]
            src = loaded.narrow(1, r * n, n) if loaded.shape == want else None
        else:  # gate or up: [I, hidden], this rank's rows
            want = (n * self.tp.size, param.shape[2])
            dst = param.data[expert, part * n:(part + 1) * n]
            src = loaded.narrow(0, r * n, n) if loaded.shape == want else None
        if src is None:
            raise ValueError(f"expert {expert} tensor of shape {tuple(loaded.shape)}, expected {want}")
        dst.copy_(src)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]."""
        weights, ids = route(self.gate(x), self.top_k, self.renormalize,
                             torch.float32 if self.float32_weights else x.dtype)
        return self.experts(x, weights, ids)

    def experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Sum over each token's k experts of weight * expert(x), tokens grouped by expert."""
        out = torch.zeros_like(x)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // self.top_k
        w = weights.reshape(-1).index_select(0, order).unsqueeze(1)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = tokens[start:start + n]
            h = self.act(dense_linear(x.index_select(0, rows), self.w13[e]))
            y = dense_linear(h, self.w2[e]) * w[start:start + n]
            out.index_add_(0, rows, y.to(x.dtype))
            start += n
        return self.tp.all_reduce(out)
