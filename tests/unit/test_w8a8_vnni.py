"""w8a8_linear's batch form in vpdpbusd (16 x 16 blocks over packed x rows,
pagedllm/native/csrc/linear_quant_vnni.h) against its row form, the torch path
(kernels.int8_dynamic_linear) and the definition, to the bit (tolerance zero: both forms quantize the
rows with the same function and take exact int32 sums, wrapping alike, then the same two fp32
products). Runs wherever the kernel's AVX-512 form builds; where the CPU also has AMX-INT8 the tiles
are set aside for these tests."""

from __future__ import annotations

import pytest
import torch

from pagedllm.quantization import kernels as K
from pagedllm.quantization import native

_LIB = native.load_quant_kernel()
pytestmark = pytest.mark.skipif(_LIB is None or _LIB.w8a8_vnni_rows() == 0,
                                reason="the kernel's AVX-512 form (with the vpdpbusd batch form) does not build here")


@pytest.fixture(autouse=True)
def _no_amx_tiles():
    """Every w8a8_linear call of these tests in the vpdpbusd forms, on AMX hosts too."""
    _LIB.w8a8_amx_from(1 << 62)
    yield
    _LIB.w8a8_amx_from(0)
    _LIB.w8a8_vnni_from(0)


def _exact(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """w8a8 by its definition, the int32 sums in float64 (exact)."""
    xf = x.float()
    d = (xf.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-12)
    q = torch.round(xf / d).clamp(-127, 127)
    return ((q.double() @ codes.double().T).float() * d * scales).to(x.dtype)


def _row_form(fn):
    """fn() with every w8a8_linear call in the row form (w8a8_tile: 4 x rows x 4 code rows)."""
    _LIB.w8a8_vnni_from(1 << 62)
    try:
        return fn()
    finally:
        _LIB.w8a8_vnni_from(0)


# Odd sizes: output rows past a panel of 16 (the last panel from a zero-padded copy), inputs past a
# whole dword (the last 1-3 inputs from a padded one) and past a packed block of 64, K below 4 and
# below 64; x rows past a block of 16 and past a chunk of 256.
@pytest.mark.parametrize("n,k", [(960, 576), (48, 1536), (37, 100), (17, 64), (5, 3), (33, 130), (16, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_w8a8_vnni_batches_equal_row_form_torch_and_definition(n: int, k: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(n * k + 1)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)
    codes, scales = K.quantize_int8_per_channel(w)
    wsum = codes.sum(dim=1, dtype=torch.int32)
    x = torch.randn(530, k, generator=g) * 4
    x[1] = 0
    x[2] = torch.randn(k, generator=g) * 1e-14  # max|x| / 127 below the 1e-12 floor
    x[3] = 0.5 * torch.arange(k) % 5 - 2.0  # x / d = x: ties at ±0.5, ±1.5
    x[3, 0] = 127.0
    x = x.to(dtype)
    assert _LIB.w8a8_vnni_rows() == 5 and native.w8a8_rows() > 530
    for m in (5, 6, 16, 17, 33, 256, 257, 530):
        y = native.w8a8_small_m_linear(x[:m], codes, scales, wsum)
        assert y.dtype == dtype
        assert torch.equal(y, _row_form(lambda: native.w8a8_small_m_linear(x[:m], codes, scales, wsum)))
        assert torch.equal(y, K.int8_dynamic_linear(x[:m], codes.t(), scales))
        assert torch.equal(y, _exact(x[:m], codes, scales))


def test_w8a8_vnni_int32_sums_wrap_as_the_row_form() -> None:
    """Codes and activations at ±127 over K = 140,002 inputs: sums past 2^31, which both forms wrap
    the same way (the bits, not the value, are the contract here)."""
    k, n = 140_002, 20
    codes = torch.full((n, k), 127, dtype=torch.int8)
    codes[1::2] = -127
    scales = torch.ones(n)
    wsum = codes.sum(dim=1, dtype=torch.int32)
    x = torch.ones(8, k)
    y = native.w8a8_small_m_linear(x, codes, scales, wsum)
    assert torch.equal(y, _row_form(lambda: native.w8a8_small_m_linear(x, codes, scales, wsum)))


def test_w8a8_vnni_threshold_is_this_librarys_setting() -> None:
    """w8a8_vnni_from sets the rows from which the batch form runs and returns them; 0 restores the
    default."""
    assert _LIB.w8a8_vnni_from(9) == 9 and _LIB.w8a8_vnni_rows() == 9
    assert _LIB.w8a8_vnni_from(0) == 5 and _LIB.w8a8_vnni_rows() == 5
