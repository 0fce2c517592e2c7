"""float32 linear layers on the CPU run batches of MKLDNN_MIN_ROWS+ rows through oneDNN on a weight
kept in its layout; the result matches the float64 reference within float32 rounding."""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers.linear import MKLDNN_MIN_ROWS, Linear


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("rows", [1, MKLDNN_MIN_ROWS - 1, MKLDNN_MIN_ROWS, 300])
def test_packed_float32_linear_matches_reference(rows: int) -> None:
    torch.manual_seed(rows)
    layer = Linear(576, 960, bias=True)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    layer.quant_method.process_weights_after_loading(layer)
    assert getattr(layer, "weight_mkldnn", None) is not None
    x = torch.randn(rows, 576)
    with torch.inference_mode():
        y = layer(x)
    ref = x.double() @ layer.weight.double().T + layer.bias.double()
    assert y.dtype == torch.float32 and y.shape == (rows, 960)
    # 576 products of N(0,1) values (sums of about 24 in size): float32 accumulation error is ~1e-5
    # relative; 1e-3 absolute leaves room for any summation order and still catches a wrong result.
    assert (y.double() - ref).abs().max().item() < 1e-3


def test_bfloat16_layers_keep_no_packed_copy() -> None:
    layer = Linear(64, 32, dtype=torch.bfloat16)
    layer.quant_method.process_weights_after_loading(layer)
    assert getattr(layer, "weight_mkldnn", None) is None
