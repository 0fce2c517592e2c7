"""The fused bf16 RMSNorm (+ residual add) and SiLU·mul kernels round where the reference formulas
round: their outputs equal the torch formulas' except at rare rounding ties (the kernels sum the
squares and evaluate exp in a different order, so an intermediate sitting on a bf16 rounding
boundary may land one ulp away, which the product with the weight can stretch to two; about 1 in
30,000 values here). The float32 kernels round each product and sum as the torch formulas do:
RoPE and the residual add equal them to the bit; RMSNorm (another order of the sum of squares)
and SiLU (another exp) within a few float32 ulps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.native_elementwise import load_elementwise_kernel, rms_norm_bf16, silu_mul_bf16
from pagedllm.layers.rmsnorm import RMSNorm

pytestmark = pytest.mark.skipif(load_elementwise_kernel() is None, reason="neither AVX-512 nor AVX2 + FMA, or no C compiler")
needs_bf16 = pytest.mark.skipif(not hasattr(load_elementwise_kernel(), "rms_norm_bf16"),
                                reason="the bf16 kernels need AVX-512")


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 steps (same-sign values)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


def assert_close_ulp(out: torch.Tensor, ref: torch.Tensor) -> None:
    d = ulps(out, ref)
    assert int(d.max()) <= 2
    assert float((d == 0).float().mean()) > 0.999


def reference_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(torch.bfloat16)


@needs_bf16
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_and_residual_add_match_reference_rounding(rows):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=g) * 3).bfloat16()
    a = torch.randn(rows, 576, generator=g).bfloat16()
    norm = RMSNorm(576, 1e-5, torch.bfloat16)
    norm.weight.data.copy_(torch.rand(576, generator=g) + 0.5)
    h, y = norm.add_and_norm(x, a)
    assert torch.equal(h, x + a)  # the residual add is exact bf16 addition
    assert_close_ulp(y, reference_norm(x + a, norm.weight, 1e-5))
    assert_close_ulp(norm(x), reference_norm(x, norm.weight, 1e-5))
    # A strided view (rows of a wider tensor) is read in place.
    wide = torch.randn(rows, 2 * 576, generator=g).bfloat16()
    _, y2 = rms_norm_bf16(wide[:, :576], norm.weight, 1e-5)
    assert_close_ulp(y2, reference_norm(wide[:, :576], norm.weight, 1e-5))


@needs_bf16
def test_silu_mul_matches_reference_rounding():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(33, 2 * 1536, generator=g) * 4).bfloat16()
    gate, up = x.chunk(2, dim=-1)
    assert_close_ulp(SiluAndMul()(x), F.silu(gate) * up)


def test_fallbacks_when_the_kernel_does_not_apply():
    x = torch.randn(4, 40).bfloat16()  # 40 is not a multiple of 16
    w = torch.ones(40, dtype=torch.bfloat16)
    assert rms_norm_bf16(x, w, 1e-6) is None
    assert silu_mul_bf16(torch.randn(4, 64, dtype=torch.float64)) is None  # neither bf16 nor float32
    assert rms_norm_bf16(torch.randn(4, 32), torch.ones(32, dtype=torch.bfloat16), 1e-6) is None  # mixed dtypes
    norm = RMSNorm(40, 1e-6, torch.bfloat16)
    torch.testing.assert_close(norm(x), reference_norm(x, norm.weight, 1e-6), atol=0, rtol=0)


@needs_bf16
def test_rope_matches_reference_rounding_on_fused_and_separate_qk():
    from types import SimpleNamespace

    from pagedllm.layers.native_elementwise import rope_bf16
    from pagedllm.layers.rotary import RotaryEmbedding

    cfg = SimpleNamespace(rope_theta=10000.0)
    rope = RotaryEmbedding(cfg, 64, 512, torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(37, 9 * 64 + 2 * 3 * 64, generator=g).bfloat16()
    q, k, _ = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)
    pos = torch.randint(0, 512, (37,), generator=g)
    cos, sin = rope.cos[pos].unsqueeze(1), rope.sin[pos].unsqueeze(1)
    ref_q, ref_k = (rope._rotate(t.contiguous(), cos, sin) for t in (q, k))  # the torch formula
    fq, fk = rope(pos, q, k)  # fused q|k rows
    sq, sk = rope(pos, q.contiguous(), k.contiguous())  # separate tensors
    for out, ref in ((fq, ref_q), (fk, ref_k), (sq, ref_q), (sk, ref_k)):
        assert_close_ulp(out, ref)
    # A position beyond the table is left to the torch path, which rejects it.
    assert rope_bf16(q, torch.tensor([600] * 37), rope.cos, rope.sin, 64) is None


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_float32_kernels_against_the_torch_formulas(rows):
    """Tolerances: RMSNorm's statistic sums 576 squares in another order and SiLU evaluates exp with
    another polynomial, each a few float32 ulps (relative 2^-21 allowed); the add and RoPE are
    exact products and sums, rounded as torch rounds them: zero."""
    from types import SimpleNamespace

    from pagedllm.layers.rotary import RotaryEmbedding

    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=g) * 3
    a = torch.randn(rows, 576, generator=g)
    norm = RMSNorm(576, 1e-5, torch.float32)
    norm.weight.data.copy_(torch.rand(576, generator=g) + 0.5)
    h, y = norm.add_and_norm(x, a)
    assert torch.equal(h, x + a)
    torch.testing.assert_close(y, F.rms_norm(x + a, (576,), norm.weight, 1e-5), rtol=2.0**-21, atol=1e-30)
    gu = torch.randn(rows, 2 * 1536, generator=g) * 4
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(SiluAndMul()(gu), F.silu(gate) * up, rtol=2.0**-21, atol=1e-30)
    assert silu_mul_bf16(gu) is not None and rms_norm_bf16(x, norm.weight, 1e-5, a) is not None  # native
    rope = RotaryEmbedding(SimpleNamespace(rope_theta=10000.0), 64, 512, torch.float32)
    qkv = torch.randn(rows, 9 * 64 + 2 * 3 * 64, generator=g)
    q, k, _ = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)
    pos = torch.randint(0, 512, (rows,), generator=g)
    cos, sin = rope.cos[pos].unsqueeze(1), rope.sin[pos].unsqueeze(1)
    from pagedllm.layers.native_elementwise import rope_bf16

    assert rope_bf16(q, pos, rope.cos, rope.sin, 64) is not None  # the native pass runs in float32
    for out, ref in zip((*rope(pos, q, k), *rope(pos, q.contiguous(), k.contiguous())),
                        [rope._rotate(t.contiguous(), cos, sin) for t in (q, k)] * 2):
        assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_split_over_the_team_equal_one_thread(dtype):
    """A prompt step's rows (256 x 576 here, above the kernels' split bound of 2^14 elements) go
    to the team's threads; every row is computed as on one thread, so the results are the same
    to the bit at any thread count."""
    if dtype == torch.bfloat16 and not hasattr(load_elementwise_kernel(), "rms_norm_bf16"):
        pytest.skip("the bf16 kernels need AVX-512")
    from pagedllm.layers.native_elementwise import rope_bf16
    from pagedllm.layers.rotary import RotaryEmbedding
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(5)
    x = (torch.randn(256, 576, generator=g) * 3).to(dtype)
    a = torch.randn(256, 576, generator=g).to(dtype)
    w = (torch.rand(576, generator=g) + 0.5).to(dtype)
    gu = (torch.randn(256, 2 * 1536, generator=g) * 4).to(dtype)
    rope = RotaryEmbedding(SimpleNamespace(rope_theta=10000.0), 64, 512, dtype)
    qk = torch.randn(256, 9 * 64 + 2 * 3 * 64, generator=g).to(dtype)[:, : 12 * 64]  # strided q|k rows
    pos = torch.randint(0, 512, (256,), generator=g)

    def run():
        return (*rms_norm_bf16(x, w, 1e-5, a), rms_norm_bf16(x, w, 1e-5)[1], silu_mul_bf16(gu),
                rope_bf16(qk, pos, rope.cos, rope.sin, 64))

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(2)
        team = run()
    finally:
        torch.set_num_threads(threads)
    for o, t in zip(one, team):
        assert torch.equal(o, t)
