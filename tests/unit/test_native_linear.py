"""The bf16 small-M GEMM kernel equals a float32 GEMM on the same bf16 values, up to bf16 output
rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.layers.native_linear import load_linear_kernel, small_m_linear

pytestmark = pytest.mark.skipif(load_linear_kernel() is None, reason="CPU without AVX-512 BF16 or no compiler")


@pytest.mark.parametrize("M", [1, 2, 3, 4])
@pytest.mark.parametrize("N,K,with_bias", [(960, 576, False), (7, 64, True), (130, 1536, True)])
def test_small_m_bf16_linear_matches_fp32(M, N, K, with_bias):
    g = torch.Generator().manual_seed(M * N)
    x = torch.randn(M, K, generator=g).bfloat16()
    w = (torch.randn(N, K, generator=g) / K**0.5).bfloat16()
    b = torch.randn(N, generator=g).bfloat16() if with_bias else None
    y = small_m_linear(x, w, b)
    assert y is not None and y.dtype == torch.bfloat16 and y.shape == (M, N)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    # fp32 accumulation of exact bf16 products (order differs: ~K * 2^-24 relative), then one
    # rounding to bf16: half an ulp, 2^-9 relative.
    torch.testing.assert_close(y.float(), ref, rtol=2**-8, atol=1e-3)


def test_kernel_declines_what_it_does_not_cover():
    x = torch.randn(5, 64).bfloat16()
    w = torch.randn(8, 64).bfloat16()
    assert small_m_linear(x, w, None) is None  # more rows than its blocking: torch's GEMM
    assert small_m_linear(x[:1].float(), w.float(), None) is None  # float32
    assert small_m_linear(torch.randn(1, 48).bfloat16(), torch.randn(8, 48).bfloat16(), None) is None  # K % 32
