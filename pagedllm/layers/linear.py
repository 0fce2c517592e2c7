"""Linear layers whose parameters know how to load their share of a checkpoint tensor.

`QKVLinear` and `MergedLinear` fuse several checkpoint matrices into one GEMM; each parameter's
`weight_loader(param, loaded, shard_id)` copies one checkpoint tensor into its rows. The math of
the layer is delegated to a quantization method (`create_weights / process_weights_after_loading
/ apply`), unquantized by default.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class UnquantizedLinearMethod:
    """Plain dense weights in the model dtype."""

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


class Linear(nn.Module):
    """y = x W^T + b with a pluggable quantization method."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        quant_method: UnquantizedLinearMethod | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.quant_method = quant_method or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, in_features, out_features, dtype)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        for p in self.parameters(recurse=False):
            if not hasattr(p, "weight_loader"):
                p.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def shard_offsets(self, shard_id: object) -> tuple[int, int]:
        """(first output row, number of rows) of a checkpoint shard inside the fused weight."""
        return 0, self.out_features

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        start, size = self.shard_offsets(shard_id)
        if loaded.shape[0] != size or (param.dim() == 2 and loaded.shape[1:] != param.shape[1:]):
            raise ValueError(
                f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit rows {start}:{start + size} "
                f"of a parameter of shape {tuple(param.shape)} (shard {shard_id!r})"
            )
        param.data[start : start + size].copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class QKVLinear(Linear):
    """Fused q/k/v projection: rows [q | k | v]."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool, dtype: torch.dtype,
                 quant_method: UnquantizedLinearMethod | None = None):
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        super().__init__(hidden, self.q_size + 2 * self.kv_size, bias=bias, dtype=dtype, quant_method=quant_method)

    def shard_offsets(self, shard_id: object) -> tuple[int, int]:
        return {
            "q": (0, self.q_size),
            "k": (self.q_size, self.kv_size),
            "v": (self.q_size + self.kv_size, self.kv_size),
        }[shard_id]  # type: ignore[index]


class MergedLinear(Linear):
    """Several projections of the same input stacked by rows (e.g. [gate | up])."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, dtype: torch.dtype,
                 quant_method: UnquantizedLinearMethod | None = None):
        self.out_sizes = out_sizes
        super().__init__(in_features, sum(out_sizes), bias=bias, dtype=dtype, quant_method=quant_method)

    def shard_offsets(self, shard_id: object) -> tuple[int, int]:
        i = int(shard_id)  # type: ignore[call-overload]
        return sum(self.out_sizes[:i]), self.out_sizes[i]
