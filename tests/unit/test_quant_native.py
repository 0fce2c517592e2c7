"""The native 4/8-bit group-wise kernel (pagedllm/quantization/csrc/linear_quant.c) against a float
reference on random matrices, on both of its paths (a few rows: one pass over the codes; more:
the weight expanded to bfloat16 for F.linear), with the tolerance bfloat16 activations, scales and
zeros allow."""

from __future__ import annotations

import pytest
import torch

from pagedllm.quantization import kernels as K
from pagedllm.quantization import native

pytestmark = pytest.mark.skipif(native.load_quant_kernel() is None, reason="no AVX-512 BF16 here")


def _bound(x: torch.Tensor, w_mag: torch.Tensor) -> torch.Tensor:
    """bfloat16 rounding (relative <= 2^-9) of each activation and of each weight's scale and zero
    term (w_mag: a bound of |code| s + |zero| per weight, in the kernel's centring): 2^-9 (|x| @ w_mag^T) for each, doubled for the
    cross terms and the float32 accumulation; the batch path also rounds each weight to bfloat16."""
    return 2.0**-7 * (x.abs() @ w_mag.T) + 1e-4


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("m", [1, 4, 7, native.SMALL_M + 3])
def test_int4_kernel_matches_the_float_reference(group: int, m: int) -> None:
    g = torch.Generator().manual_seed(group + m)
    w = torch.randn(70, 512, generator=g) * 0.05  # 70 rows: a partial block of 4 output rows
    x = torch.randn(m, 512, generator=g)
    codes, scales, zeros = K.quantize_groupwise(w, group, 4)
    ref_w = K.dequantize_groupwise(codes, scales, zeros)
    packed, s, z = native.pack_int4_native(codes, scales, zeros)
    assert packed.shape == (70, 256) and packed.dtype == torch.uint8
    # the kernel reads code - 8 with the zero + 8 scale: bound both parts' rounding
    mag = (((codes.float() - 8).abs() + 8) * scales.repeat_interleave(group, 1)).abs() \
        + zeros.repeat_interleave(group, 1).abs()
    for dtype in (torch.float32, torch.bfloat16):
        y = native.group_linear(x.to(dtype), packed, s, z, bits=4)
        assert y.dtype == dtype and y.shape == (m, 70)
        bound = _bound(x, mag) + (2.0**-8 * (x @ ref_w.T).abs() if dtype == torch.bfloat16 else 0)
        assert ((y.float() - x @ ref_w.T).abs() <= bound).all()


@pytest.mark.parametrize("m", [1, 5, native.SMALL_M + 1])
def test_int8_kernel_matches_the_float_reference(m: int) -> None:
    g = torch.Generator().manual_seed(m)
    w = torch.randn(33, 1536, generator=g) * 0.05
    x = torch.randn(3, m, 1536, generator=g)  # leading dimensions are kept
    codes, scales = K.quantize_int8_per_channel(w)
    ref_w = codes.float() * scales[:, None]
    zeros = torch.zeros(33, 1, dtype=torch.bfloat16)
    y = native.group_linear(x, codes, scales.bfloat16()[:, None], zeros, bits=8)
    assert y.shape == (3, m, 33) and y.dtype == torch.float32
    assert ((y - x @ ref_w.T).abs() <= _bound(x.reshape(-1, 1536), ref_w.abs()).reshape(3, m, 33)).all()


def test_kernel_refuses_a_group_that_does_not_divide_the_inputs() -> None:
    assert not native.fits(576, 128) and native.fits(576, 64) and not native.fits(512, 16)


def test_e4m3_codes_widen_exactly() -> None:
    """Every e4m3 code (normals, subnormals, both signs; not NaN) is read as its exact value."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes[codes & 0x7F == 0x7F] = 0
    values = codes.view(torch.float8_e4m3fn).float()
    one = torch.ones(1, 1, dtype=torch.bfloat16)
    zero = torch.zeros(1, 1, dtype=torch.bfloat16)
    for rows in torch.eye(256).split(native.SMALL_M):  # one-hot x rows read the codes one by one
        y = native.group_linear(rows, codes[None], one, zero, bits=3)
        assert torch.equal(y[:, 0], rows @ values)
    y = native.group_linear(torch.eye(256), codes[None], one, zero, bits=3)  # the batch path
    assert torch.equal(y[:, 0], values)


@pytest.mark.parametrize("m", [1, native.SMALL_M + 1])
def test_fp8_kernel_matches_the_float_reference(m: int) -> None:
    g = torch.Generator().manual_seed(m)
    w = torch.randn(40, 576, generator=g) * 0.05
    x = torch.randn(m, 576, generator=g)
    w8, scales = K.quantize_fp8_per_channel(w)
    ref_w = w8.float() * scales[:, None]
    y = native.group_linear(x, w8.view(torch.uint8), scales.bfloat16()[:, None],
                            torch.zeros(40, 1, dtype=torch.bfloat16), bits=3)
    assert ((y - x @ ref_w.T).abs() <= _bound(x, ref_w.abs())).all()
