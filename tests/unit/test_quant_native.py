"""The native 4/8-bit group-wise kernel (pagedllm/native/csrc/linear_quant.c) against a float
reference on random matrices, on both of its paths (a few rows: one pass over the codes; more:
the weight expanded to bfloat16 for F.linear), with either activation mode of the few-row path
(int8 per block of 32, or bfloat16), with the tolerance bfloat16 activations, scales and zeros and
the int8 rounding of the activations allow."""

from __future__ import annotations

import pytest
import torch

from pagedllm import native as pnative
from pagedllm.native import kernels
from pagedllm.quantization import kernels as K
from pagedllm.quantization import native

from tests.unit.w8a8_reference import edge_rows, w8a8_exact

pytestmark = pytest.mark.skipif(native.load_quant_kernel() is None, reason="no C compiler, or neither AVX-512 BF16 nor AVX2 + FMA")


@pytest.fixture(params=["int8", "bf16"])
def activations(request, monkeypatch):
    """The kernel's activation mode (PAGEDLLM_QUANT_ACTIVATIONS), for this test only."""
    monkeypatch.setenv("PAGEDLLM_QUANT_ACTIVATIONS", request.param)
    native.int8_activations.cache_clear()
    yield request.param
    native.int8_activations.cache_clear()


def _int8_act_bound(x: torch.Tensor, w_mag: torch.Tensor, m: int) -> torch.Tensor:
    """The int8 activations' rounding, where the kernel's path (m <= SMALL_M) uses them: each block
    of 32 inputs of a bf16 row is q = round(x / d), d = max|x| / 127, so |d q - x| <= d / 2 per
    input; it meets the centred weight (code - offset) * scale, bounded by w_mag (the zero term
    takes the exact sums of x), so the output moves by at most sum_k w_mag[n, k] d(k) / 2, plus
    fp32 rounding of the products d q (relative 2^-24, inside the bf16 bound's margin)."""
    if m > native.SMALL_M or not native.int8_activations():
        return torch.zeros(x.shape[0], w_mag.shape[0])
    xb = x.bfloat16().float()
    d = xb.abs().reshape(x.shape[0], -1, 32).amax(-1) / 127
    return (d.repeat_interleave(32, 1) / 2) @ w_mag.T


def _bound(x: torch.Tensor, w_mag: torch.Tensor) -> torch.Tensor:
    """bfloat16 rounding (relative <= 2^-9) of each activation and of each weight's scale and zero
    term (w_mag: a bound of |code| s + |zero| per weight, in the kernel's centring): 2^-9 (|x| @ w_mag^T) for each, doubled for the
    cross terms and the float32 accumulation; the batch path also rounds each weight to bfloat16."""
    return 2.0**-7 * (x.abs() @ w_mag.T) + 1e-4


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("m", [1, 4, 7, 37, native.SMALL_M + 3])
def test_int4_kernel_matches_the_float_reference(group: int, m: int, activations: str) -> None:
    g = torch.Generator().manual_seed(group + m)
    w = torch.randn(70, 512, generator=g) * 0.05  # 70 rows: a partial block of 4 output rows
    x = torch.randn(m, 512, generator=g)
    codes, scales, zeros = K.quantize_groupwise(w, group, 4)
    ref_w = K.dequantize_groupwise(codes, scales, zeros)
    packed, s, z = native.pack_int4_native(codes, scales, zeros)
    assert packed.shape == (80, 256) and packed.dtype == torch.uint8  # 70 rows padded to tiles of 16
    # the kernel reads code - 8 with the zero + 8 scale: bound both parts' rounding
    mag = (((codes.float() - 8).abs() + 8) * scales.repeat_interleave(group, 1)).abs() \
        + zeros.repeat_interleave(group, 1).abs()
    centred = ((codes.float() - 8) * scales.repeat_interleave(group, 1)).abs() * (1 + 2.0**-8)
    for dtype in (torch.float32, torch.bfloat16):
        y = native.group_linear(x.to(dtype), packed, s, z, bits=4, n=70)
        assert y.dtype == dtype and y.shape == (m, 70)
        bound = _bound(x, mag) + _int8_act_bound(x, centred, m) \
            + (2.0**-8 * (x @ ref_w.T).abs() if dtype == torch.bfloat16 else 0)
        assert ((y.float() - x @ ref_w.T).abs() <= bound).all()


@pytest.mark.parametrize("m", [1, 5, native.SMALL_M + 1])
def test_int8_kernel_matches_the_float_reference(m: int, activations: str) -> None:
    g = torch.Generator().manual_seed(m)
    w = torch.randn(33, 1536, generator=g) * 0.05
    x = torch.randn(3, m, 1536, generator=g)  # leading dimensions are kept
    codes, scales = K.quantize_int8_per_channel(w)
    ref_w = codes.float() * scales[:, None]
    packed, s, z = native.pack_int8_native(codes, scales[:, None], torch.zeros(33, 1))
    assert packed.shape == (48, 1536) and s.shape == (48, 1)
    y = native.group_linear(x, packed, s, z, bits=8, n=33)
    assert y.shape == (3, m, 33) and y.dtype == torch.float32
    x2 = x.reshape(-1, 1536)
    bound = _bound(x2, ref_w.abs()) + _int8_act_bound(x2, ref_w.abs() * (1 + 2.0**-8), 3 * m)
    assert ((y - x @ ref_w.T).abs() <= bound.reshape(3, m, 33)).all()


@pytest.mark.parametrize("bits", [4, 8])
def test_tiled_layouts_expand_to_the_weight(bits: int) -> None:
    """The batch path's expansion reads every code, scale and zero of the tiled layouts back in
    place (rows past a tile, groups, both nibbles): exact in float32."""
    g = torch.Generator().manual_seed(bits)
    n, k, group = 37, 256, 64
    codes = torch.randint(0, 16 if bits == 4 else 256, (n, k), generator=g)
    scales = torch.rand(n, k // group, generator=g).bfloat16().float()
    zeros = torch.randn(n, k // group, generator=g).bfloat16().float()
    if bits == 4:
        packed, s, z = native.pack_int4_native(codes, scales, zeros)
        kernel_zeros = (zeros + 8 * scales).bfloat16().float()  # the zeros of code - 8, as kept
        ref = ((codes.float() - 8).reshape(n, -1, group) * scales[..., None] + kernel_zeros[..., None]).reshape(n, k)
    else:
        centred = (codes - 128).to(torch.int8)
        packed, s, z = native.pack_int8_native(centred, scales, zeros)
        ref = (centred.float().reshape(n, -1, group) * scales[..., None] + zeros[..., None]).reshape(n, k)
    w = native.dequantize(packed, s, z, bits, n, torch.float32)
    torch.testing.assert_close(w, ref, rtol=2**-20, atol=0)


def test_kernel_refuses_a_group_that_does_not_divide_the_inputs() -> None:
    assert not native.fits(576, 128) and native.fits(576, 64) and not native.fits(512, 16)


def test_e4m3_codes_widen_exactly() -> None:
    """Every e4m3 code (normals, subnormals, both signs; not NaN) is read as its exact value."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes[codes & 0x7F == 0x7F] = 0
    values = codes.view(torch.float8_e4m3fn).float()
    one = torch.ones(1, 1, dtype=torch.bfloat16)
    zero = torch.zeros(1, 1, dtype=torch.bfloat16)
    for rows in torch.eye(256).split(native.kernel_rows(3)):  # one-hot x rows read the codes one by one
        y = native.group_linear(rows, codes[None], one, zero, bits=3, n=1)
        assert torch.equal(y[:, 0], rows @ values)
    y = native.group_linear(torch.eye(256), codes[None], one, zero, bits=3, n=1)  # the batch path
    assert torch.equal(y[:, 0], values)


@pytest.mark.parametrize("m", [1, native.SMALL_M + 1])
def test_fp8_kernel_matches_the_float_reference(m: int) -> None:
    g = torch.Generator().manual_seed(m)
    w = torch.randn(40, 576, generator=g) * 0.05
    x = torch.randn(m, 576, generator=g)
    w8, scales = K.quantize_fp8_per_channel(w)
    ref_w = w8.float() * scales[:, None]
    y = native.group_linear(x, w8.view(torch.uint8), scales.bfloat16()[:, None],
                            torch.zeros(40, 1, dtype=torch.bfloat16), bits=3, n=40)
    assert ((y - x @ ref_w.T).abs() <= _bound(x, ref_w.abs())).all()


@pytest.mark.parametrize("n,k", [(70, 576), (33, 1536), (5, 100), (9, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_w8a8_kernel_equals_the_torch_path_to_the_bit(n: int, k: int, dtype: torch.dtype) -> None:
    """The native w8a8 kernel (decode rows; batches: its passes around torch._int_mm) against torch's path (kernels.int8_dynamic_linear) and the
    definition. Tolerance: zero. Both quantize each row with the same formula (IEEE fp32 division,
    round half to even, the same clamp), both sums are exact int32 (the kernel's +128 offset of the
    activations comes off as 128 x the codes' row sum, exactly), and both take the two fp32 products
    in the same order, (float(acc) * d) * s; a different order would differ by two fp32 roundings
    (relative 2^-23) at most, this one by nothing. Odd sizes: output rows past a block of 4, inputs
    past a block of 64; rows of zeros, of values below the 1e-12 scale floor, and of exact ties."""
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)
    codes, scales = K.quantize_int8_per_channel(w)
    wsum = codes.sum(dim=1, dtype=torch.int32)
    x = edge_rows(torch.randn(native.SMALL_M, k, generator=g) * 4, g)
    for m in (1, 5, native.SMALL_M):
        xm = x[:m].to(dtype)
        y = native.w8a8_small_m_linear(xm, codes, scales, wsum)
        assert y.dtype == dtype and torch.equal(y, w8a8_exact(xm, codes, scales))
        assert torch.equal(y, K.int8_dynamic_linear(xm, codes.t(), scales))
    assert native.w8a8_small_m_linear(x.to(dtype), codes, scales, wsum) is not None
    # more rows than SMALL_M: the batch path's, unless the kernel runs on AMX tiles (then it takes them all)
    beyond = native.w8a8_small_m_linear(torch.zeros(native.SMALL_M + 1, k), codes, scales, wsum)
    assert (beyond is None) == (native.w8a8_rows() == native.SMALL_M)
    # Batches: the kernel's row quantization and scaling around torch._int_mm, as many rows as a
    # prefill chunk (the quantization then splits its rows over the threads).
    xb = torch.cat([x, torch.randn(300 - native.SMALL_M, k, generator=g) * 3]).to(dtype)
    for m in (native.SMALL_M + 1, 300):
        y = native.w8a8_batch_linear(xb[:m], codes, scales)
        assert y.dtype == dtype and torch.equal(y, K.int8_dynamic_linear(xb[:m], codes.t(), scales))
        assert torch.equal(y, w8a8_exact(xb[:m], codes, scales))
    y3 = native.w8a8_batch_linear(xb[:300].reshape(3, 100, k), codes, scales)  # leading dims kept
    assert y3.shape == (3, 100, n) and torch.equal(y3.reshape(300, n), y)
    assert native.w8a8_batch_linear(xb[:0], codes, scales).shape == (0, n)


def test_int8_dot_peak_counts_its_products() -> None:
    """int8_dot_peak (the int8 rate `bench kernels quant --int8-peak` divides by) returns the
    multiplies its threads made: 16 chains of 64 bytes (AVX-512 VNNI) or 12 of 32 (AVX2) per round
    and thread; built here as the AVX2 form too where this CPU runs the AVX-512 one, with as many
    threads."""
    lib = native.load_quant_kernel()
    assert lib.int8_dot_peak(0) == 0
    made = lib.int8_dot_peak(1000)
    per_round = 16 * 64 if lib.w8a8_vnni_rows() else 12 * 32  # the AVX-512 form, or the AVX2 one
    assert made > 0 and made % (1000 * per_round) == 0
    if per_round == 16 * 64:
        cdll = pnative.compile_native(pnative.CSRC / kernels.QUANT.source, pnative.AVX2_FORM_FLAGS)
        if cdll is None:
            pytest.skip("no C compiler")
        avx2 = pnative.bind(cdll, kernels.QUANT)
        assert avx2.int8_dot_peak(1000) == made // (16 * 64) * (12 * 32)
