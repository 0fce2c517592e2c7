"""Mixture-of-experts feed-forward block: a router picks each token's top-k experts, and each
active expert runs one gated MLP (two GEMMs) on the contiguous rows of the tokens routed to it.

Routing follows the reference implementation: softmax over the router logits in float32, the k
largest (the larger first; among equal probabilities the lower expert first, where `torch.topk`
leaves ties to its selection algorithm: a stable sort instead, so that the fused native decode
step, which routes the same way, picks the same experts), optionally renormalised over the k chosen. Each expert's
output is scaled by its routing weight and added into the token's row in ascending expert order,
as the reference does, so the float32 sums are taken in the same order.

Tensor parallelism: every rank holds all experts with 1/tp of their intermediate dimension (the
gate/up rows column-parallel, the down projection's columns row-parallel, as the dense MLP); the
partial sums of all experts are added up by one all-reduce per layer.

Quantized experts (`-q int8`, `w8a8`, `int4`, `fp8`): each expert is a pair of `Linear` layers
(`experts.<e>.w13`, `experts.<e>.w2`) whose quantization method the model's quantization setup
picks per expert (so `--quantization-skip` globs such as `*.experts.*` apply), loaded in the
model dtype and quantized after loading like any linear layer; the grouping and the order of the
sums are the dense path's, each expert's two GEMMs through its method's kernel. The router stays
in the model dtype.
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
    """[T, E] router logits -> (weights [T, k], expert ids [T, k]): float32 softmax, the top k
    (descending, the lower expert first on ties), renormalised over the k when `renormalize`; the
    weights in `weights_dtype` (the logits' dtype when None)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :top_k], ids[:, :top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(weights_dtype or router_logits.dtype), ids


class ExpertLinears(nn.Module):
    """One quantized expert: `w13` [gate | up] (2 * I/tp outputs) and `w2` (I/tp inputs), each with
    its quantization method (None: the model dtype)."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, w13_method, w2_method) -> None:
        super().__init__()
        self.w13 = Linear(hidden, 2 * inter, dtype=dtype, quant_method=w13_method)
        self.w2 = Linear(inter, hidden, dtype=dtype, quant_method=w2_method)


class FusedMoE(nn.Module):
    """All experts of one layer: `w13` [E, 2 * I/tp, hidden] ([gate | up] of this rank) and
    `w2` [E, hidden, I/tp], loaded expert by expert from the checkpoint's per-expert matrices
    (shard id (expert, 0 gate | 1 up | 2 down)). With a quantization setup (`quant_config`), one
    `ExpertLinears` per expert in `experts` instead, its methods asked for under the checkpoint's
    names: `<prefix>.experts.<e>.<name>` for each of `names` (gate, up, down)."""

    def __init__(self, num_experts: int, top_k: int, hidden: int, intermediate: int, renormalize: bool,
                 dtype: torch.dtype, tp: TensorParallelGroup | None = None, float32_weights: bool = False,
                 quant_config=None, prefix: str = "",
                 names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> None:
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
        self.act = SiluAndMul()
        self.quantized = quant_config is not None
        if self.quantized:
            gate, up, down = (f"{prefix}.experts.{{}}.{n}" for n in names)
            self.experts = nn.ModuleList(
                ExpertLinears(hidden, self.inter, dtype,
                              quant_config.expert_method(f"{prefix}.experts.{e}.w13", [gate.format(e), up.format(e)]),
                              quant_config.expert_method(f"{prefix}.experts.{e}.w2", [down.format(e)]))
                for e in range(num_experts))
            loaded = [p for ex in self.experts for p in (ex.w13.weight, ex.w2.weight)]
        else:
            self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.inter, hidden, dtype=dtype), requires_grad=False)
            self.w2 = nn.Parameter(torch.empty(num_experts, hidden, self.inter, dtype=dtype), requires_grad=False)
            loaded = [self.w13, self.w2]
        for p in loaded:
            p.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object) -> None:
        """Copies one expert's checkpoint matrix into this rank's part of the stacked weight
        (`param` [E, ...]) or of the expert's own layer (`param` 2-D)."""
        expert, part = shard_id  # type: ignore[misc]
        n, r = self.inter, self.tp.rank
        dst = param.data[expert] if param.dim() == 3 else param.data
        if part == 2:  # down: [hidden, I], this rank's columns
            want = (dst.shape[0], n * self.tp.size)
            src = loaded.narrow(1, r * n, n) if loaded.shape == want else None
        else:  # gate or up: [I, hidden], this rank's rows
            want = (n * self.tp.size, dst.shape[1])
            dst = dst[part * n:(part + 1) * n]
            src = loaded.narrow(0, r * n, n) if loaded.shape == want else None
        if src is None:
            raise ValueError(f"expert {expert} tensor of shape {tuple(loaded.shape)}, expected {want}")
        dst.copy_(src)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]."""
        weights, ids = route(self.gate(x), self.top_k, self.renormalize,
                             torch.float32 if self.float32_weights else x.dtype)
        return self.run_experts(x, weights, ids)

    def run_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
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
            xe = x.index_select(0, rows)
            if self.quantized:
                ex = self.experts[e]
                y = ex.w2(self.act(ex.w13(xe)))
            else:
                y = dense_linear(self.act(dense_linear(xe, self.w13[e])), self.w2[e])
            y = y * w[start:start + n]
            # A token appears once per expert: gather, add, scatter back (index_add_ runs torch's
            # scalar scatter_add_ in bfloat16, about 1.3 ms a call for one row of 1,024 on this CPU).
            out.index_copy_(0, rows, out.index_select(0, rows) + y.to(x.dtype))
            start += n
        return self.tp.all_reduce(out)
