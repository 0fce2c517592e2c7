"""float32 linear layers and the LM head on the CPU run batches of MKLDNN_MIN_ROWS+ rows through
oneDNN on the plain weight (held once); the result matches the float64 reference within float32
rounding."""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers.embedding import LMHead
from pagedllm.layers.linear import MKLDNN_MIN_ROWS, Linear, takes_onednn


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("rows", [1, MKLDNN_MIN_ROWS - 1, MKLDNN_MIN_ROWS, 300])
def test_packed_float32_linear_matches_reference(rows: int) -> None:
    torch.manual_seed(rows)
    layer = Linear(576, 960, bias=True)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    layer.quant_method.process_weights_after_loading(layer)
    assert takes_onednn(layer.weight, rows) == (rows >= MKLDNN_MIN_ROWS)
    x = torch.randn(rows, 576)
    with torch.inference_mode():
        y = layer(x)
    ref = x.double() @ layer.weight.double().T + layer.bias.double()
    assert y.dtype == torch.float32 and y.shape == (rows, 960)
    # 576 products of N(0,1) values (sums of about 24 in size): float32 accumulation error is ~1e-5
    # relative; 1e-3 absolute leaves room for any summation order and still catches a wrong result.
    assert (y.double() - ref).abs().max().item() < 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_hold_their_weight_once(dtype: torch.dtype) -> None:
    layer = Linear(64, 32, dtype=dtype)
    layer.quant_method.process_weights_after_loading(layer)
    tensors = [v for v in vars(layer).values() if isinstance(v, torch.Tensor)]
    assert tensors == [] and [n for n, _ in layer.named_parameters()] == ["weight"]
    assert takes_onednn(layer.weight, MKLDNN_MIN_ROWS) == (dtype == torch.float32)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("rows", [1, MKLDNN_MIN_ROWS, 200])
def test_lm_head_logits_match_reference(rows: int) -> None:
    """The LM head takes the same dense path as the linear layers (oneDNN for float32 batches)."""
    torch.manual_seed(rows)
    head = LMHead(1000, 576, torch.float32, None)
    head.weight.data.normal_()
    x = torch.randn(rows, 576)
    with torch.inference_mode():
        logits = head(x)
    ref = x.double() @ head.weight.double().T
    assert logits.dtype == torch.float32 and logits.shape == (rows, 1000)
    assert (logits.double() - ref).abs().max().item() < 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("widened", [False, True])
def test_16bit_batches_past_the_kernel_widen_where_the_cpu_lacks_their_dot_products(dtype, widened,
                                                                                   monkeypatch) -> None:
    """Without dot products in the dtype (WIDENED_DTYPES: no AVX-512 BF16 / AMX for bf16, no
    AVX-512 FP16 / AMX-FP16 for float16), a GEMM past the small-M kernel's rows runs as the float32
    GEMM of the widened operands plus the bias, rounded once; with them, torch's GEMM in the dtype.
    Either way the result is the exact product within the dtype's rounding."""
    from pagedllm.layers import linear
    from pagedllm.layers.native_linear import small_m_rows

    monkeypatch.setattr(linear, "WIDENED_DTYPES", frozenset({dtype} if widened else ()))
    g = torch.Generator().manual_seed(5)
    rows = small_m_rows(dtype) + 3
    layer = Linear(576, 200, bias=True, dtype=dtype)
    layer.weight.data.copy_(torch.randn(200, 576, generator=g) / 24)
    layer.bias.data.copy_(torch.randn(200, generator=g))
    x = torch.randn(rows, 576, generator=g).to(dtype)
    with torch.inference_mode():
        y = layer(x)
    assert y.dtype == dtype and y.shape == (rows, 200)
    if widened:
        fp32 = linear.torch_linear(x.float(), layer.weight.float(), layer.bias.float())
        assert torch.equal(y, fp32.to(dtype))
    ref = x.double() @ layer.weight.double().T + layer.bias.double()
    # float32 sums of exact products (~K * 2^-24 relative), then one rounding to the dtype (2^-9 for
    # bf16, 2^-12 for float16).
    torch.testing.assert_close(y.double(), ref, rtol=2**-8, atol=1e-3)
