"""Linear layers whose parameters know how to load their share of a checkpoint tensor.

`QKVLinear` and `MergedLinear` fuse several checkpoint matrices into one GEMM; each parameter's
`weight_loader(param, loaded, shard_id)` copies one checkpoint tensor into its rows. The math of
the layer is delegated to a quantization method (`create_weights / process_weights_after_loading
/ apply`), unquantized by default.

Tensor parallelism: a column-parallel layer holds 1/tp of the output rows (no communication), a
row-parallel layer 1/tp of the input columns (partial sums, then one all-reduce). The quantization
method sees only the rank's local sizes; `shard_checkpoint` narrows each checkpoint tensor to the
rank's part before `weight_loader` copies it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.hardware import BF16_FLAGS, FP16_FLAGS, cpu_flags
from pagedllm.layers.native_linear import small_m_linear

_SINGLE = TensorParallelGroup()
# float32 on the CPU: from this many rows up, oneDNN's GEMM runs about 2x faster than MKL's sgemm
# behind F.linear on this model's shapes (16 rows: 1.3-2.0x, 64-1024 rows: 1.6-2.2x; 1 row:
# 0.6-1.2x; AVX2 host: 1.77x at 16 rows, 1.2x at 128, 1.09x at 2,048). Rows up to
# native_linear.SMALL_M (15 with AVX-512, 128 with AVX2) take the small-M kernel before this.
MKLDNN_MIN_ROWS = 16
# bfloat16 on CPUs without bf16 dot products (AVX-512 BF16 or AMX), and float16 on CPUs without
# float16 ones (AVX-512 FP16 or AMX-FP16): torch's GEMM in that dtype is emulated there, 4-100x
# slower than float32 (AVX2 host: 0.7 GFLOP/s against 70 on a 1,024-cube product), so past the
# small-M kernel's rows the operands are widened to float32 (exact), multiplied by oneDNN's float32
# GEMM and the result rounded once, as a 16-bit GEMM with float32 accumulation does. The widening
# costs about a tenth of the GEMM at 128 rows and less beyond (pagedllm bench kernels small-m-gemm).
WIDENED_DTYPES = frozenset(d for d, flags in ((torch.bfloat16, BF16_FLAGS), (torch.float16, FP16_FLAGS))
                           if not set(flags) & cpu_flags())


def _onednn_linear():
    """oneDNN's linear on a plain (row-major) weight, or None where torch lacks it. On a plain
    weight it is as fast as on one reordered ahead into oneDNN's layout (same results, bit for bit;
    measured at 16-2048 rows of this model's shapes), so the weight is held once."""
    try:
        op = torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return None
    return op if torch.backends.mkldnn.is_available() else None


_ONEDNN_LINEAR = _onednn_linear()


def takes_onednn(weight: torch.Tensor, rows: int) -> bool:
    """Whether x W^T with `rows` rows of x runs through oneDNN: float32 on the CPU, MKLDNN_MIN_ROWS+ rows."""
    return (_ONEDNN_LINEAR is not None and weight.dtype == torch.float32 and weight.device.type == "cpu"
            and rows >= MKLDNN_MIN_ROWS)


def torch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b through torch's GEMMs: oneDNN where takes_onednn says so, else F.linear; bf16 and
    float16 on CPUs without dot products in them in float32 (WIDENED_DTYPES)."""
    if weight.dtype in WIDENED_DTYPES and x.dtype == weight.dtype and weight.device.type == "cpu":
        y = torch_linear(x.float(), weight.float(), None if bias is None else bias.float())
        return y.to(weight.dtype)
    if x.dim() == 2 and takes_onednn(weight, x.shape[0]):
        y = _ONEDNN_LINEAR(x.contiguous(), weight, None, "none", [], "")
        return y if bias is None else y.add_(bias)
    return F.linear(x, weight, bias)


# The elementwise op fused_linear applies to x W^T + b inside oneDNN's GEMM (its post-op), by name.
_POST_OPS = {"gelu": ("gelu", "none"), "gelu_tanh": ("gelu", "tanh"), "relu": ("relu", "")}
_POST_TORCH = {"gelu": F.gelu, "gelu_tanh": lambda y: F.gelu(y, approximate="tanh"), "relu": F.relu}


def fused_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, post: str | None = None,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
    """post(x W^T + b) (`post`: "gelu", "gelu_tanh", "relu" or None), or x W^T + b + residual, as one
    oneDNN call (the bias, the activation or the sum in the GEMM's epilogue, no pass over the output
    after it) for rows of float32, or of bf16 where the CPU multiplies bf16 (not WIDENED_DTYPES),
    from MKLDNN_MIN_ROWS rows; elsewhere dense_linear and torch's op. On all-MiniLM-L6-v2's
    1,900-row steps (2-core Xeon): the MLP's up projection and GELU 8.8 against 16.8 ms in float32,
    1.7 against 2.3 ms in bf16; the down projection and the residual 8.3 against 10.0 ms, 1.4
    against 1.6 ms."""
    if post is not None and residual is not None:
        raise ValueError(f"fused_linear takes a post-op ({post!r}) or a residual, not both")
    if (_ONEDNN_LINEAR is not None and x.dim() == 2 and x.shape[0] >= MKLDNN_MIN_ROWS and weight.device.type == "cpu"
            and x.dtype == weight.dtype and (weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16
                                                                            and weight.dtype not in WIDENED_DTYPES))):
        x = x.contiguous()
        if residual is not None:
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual.contiguous(), weight, bias, "add")
        attr, algorithm = _POST_OPS[post] if post is not None else ("none", "")
        return _ONEDNN_LINEAR(x, weight, bias, attr, [], algorithm)
    y = dense_linear(x, weight, bias)
    if residual is not None:
        return y + residual
    return _POST_TORCH[post](y) if post is not None else y


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b for a dense weight (linear layers and the LM head): decode rows and short prompt
    chunks (up to small_m_rows) through the small-M kernel, everything else torch_linear."""
    y = small_m_linear(x, weight, bias)  # decode rows: one pass over the weights
    return y if y is not None else torch_linear(x, weight, bias)


class UnquantizedLinearMethod:
    """Plain dense weights in the model dtype."""

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return dense_linear(x, layer.weight, bias)


class Linear(nn.Module):
    """y = x W^T + b with a pluggable quantization method."""

    input_parallel = False
    """Whether the input columns are split over tensor-parallel ranks (RowParallelLinear)."""

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

    def shard_checkpoint(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object) -> torch.Tensor:
        """This rank's part of a checkpoint tensor (the whole of it for a replicated layer)."""
        return loaded

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        loaded = self.shard_checkpoint(param, loaded, shard_id)
        start, size = self.shard_offsets(shard_id)
        if loaded.shape[0] != size or (param.dim() == 2 and loaded.shape[1:] != param.shape[1:]):
            raise ValueError(
                f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit rows {start}:{start + size} "
                f"of a parameter of shape {tuple(param.shape)} (shard {shard_id!r})"
            )
        param.data[start : start + size].copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class ColumnParallelLinear(Linear):
    """Output rows split over the tensor-parallel ranks: rank r holds rows [r * n, (r + 1) * n),
    n = out_features / tp. The output stays split (the next layer is row-parallel)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype = torch.float32,
                 tp: TensorParallelGroup | None = None, quant_method: UnquantizedLinearMethod | None = None) -> None:
        self.tp = tp or _SINGLE
        super().__init__(in_features, out_features // self.tp.size, bias=bias, dtype=dtype, quant_method=quant_method)

    def shard_checkpoint(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object) -> torch.Tensor:
        if self.tp.size == 1:
            return loaded
        _, size = self.shard_offsets(shard_id)
        return loaded.narrow(0, self.checkpoint_row(shard_id), size)

    def checkpoint_row(self, shard_id: object) -> int:
        """First row of this rank's part inside the checkpoint tensor of `shard_id`."""
        return self.tp.rank * self.out_features


class RowParallelLinear(Linear):
    """Input columns split over the tensor-parallel ranks; each rank's partial product is summed
    by one all-reduce. The bias is added by rank 0 only, before the sum, so it counts once."""

    input_parallel = True

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype = torch.float32,
                 tp: TensorParallelGroup | None = None, quant_method: UnquantizedLinearMethod | None = None) -> None:
        self.tp = tp or _SINGLE
        super().__init__(in_features // self.tp.size, out_features, bias=bias, dtype=dtype, quant_method=quant_method)

    def shard_checkpoint(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object) -> torch.Tensor:
        if self.tp.size == 1 or param is self.bias or loaded.dim() < 2:
            return loaded
        # This rank's share of the columns: of the inputs for a weight or codes, of the groups for
        # per-group scales and zeros. A group wider than a rank's share (one scale per row) is
        # repeated over the ranks' groups first.
        width, total = param.shape[1], param.shape[1] * self.tp.size
        if loaded.shape[1] != total:
            if loaded.shape[1] == 0 or total % loaded.shape[1]:
                raise ValueError(f"{loaded.shape[1]} columns do not split into {self.tp.size} tensor-parallel "
                                 f"shares of {width}")
            loaded = loaded.repeat_interleave(total // loaded.shape[1], dim=1)
        return loaded.narrow(1, self.tp.rank * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp.rank == 0 else None
        return self.tp.all_reduce(self.quant_method.apply(self, x, bias))


class QKVLinear(ColumnParallelLinear):
    """Fused q/k/v projection: rows [q | k | v] of this rank's heads.

    Query heads split evenly; KV heads split too while tp <= num_kv_heads, and beyond that each
    KV head is replicated on tp / num_kv_heads consecutive ranks (8 heads, 2 KV heads, tp 4:
    ranks 0,1 hold KV head 0, ranks 2,3 KV head 1).
    """

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool, dtype: torch.dtype,
                 tp: TensorParallelGroup | None = None, quant_method: UnquantizedLinearMethod | None = None):
        tp = tp or _SINGLE
        self.head_dim = head_dim
        self.num_heads = num_heads // tp.size
        self.num_kv_heads = max(1, num_kv_heads // tp.size)
        self.kv_replicas = max(1, tp.size // num_kv_heads)
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        super().__init__(hidden, (self.q_size + 2 * self.kv_size) * tp.size, bias=bias, dtype=dtype, tp=tp,
                         quant_method=quant_method)

    def shard_offsets(self, shard_id: object) -> tuple[int, int]:
        return {
            "q": (0, self.q_size),
            "k": (self.q_size, self.kv_size),
            "v": (self.q_size + self.kv_size, self.kv_size),
        }[shard_id]  # type: ignore[index]

    def checkpoint_row(self, shard_id: object) -> int:
        if shard_id == "q":
            return self.tp.rank * self.q_size
        return (self.tp.rank // self.kv_replicas) * self.kv_size


class MergedLinear(ColumnParallelLinear):
    """Several projections of the same input stacked by rows (e.g. [gate | up]), each split over
    the tensor-parallel ranks: rank r holds [gate_r | up_r]."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, dtype: torch.dtype,
                 tp: TensorParallelGroup | None = None, quant_method: UnquantizedLinearMethod | None = None):
        tp = tp or _SINGLE
        self.out_sizes = [s // tp.size for s in out_sizes]
        super().__init__(in_features, sum(out_sizes), bias=bias, dtype=dtype, tp=tp, quant_method=quant_method)

    def shard_offsets(self, shard_id: object) -> tuple[int, int]:
        i = int(shard_id)  # type: ignore[call-overload]
        return sum(self.out_sizes[:i]), self.out_sizes[i]

    def checkpoint_row(self, shard_id: object) -> int:
        return self.tp.rank * self.out_sizes[int(shard_id)]  # type: ignore[call-overload]
