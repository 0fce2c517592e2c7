"""The small-M GEMM kernel equals a float32 GEMM on the same values, up to the output rounding
(bf16) or the order of sums (float32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm import native
from pagedllm.hardware import cpu_flags
from pagedllm.layers.native_linear import (_DTYPE_CODES, AVX512_FORM, F16_ROWS_AVX2, amx_rows, amx_rows_from,
                                          kernel_dtypes, load_linear_kernel, row1_reads, small_m_linear,
                                          small_m_rows)
from pagedllm.native import kernels

pytestmark = pytest.mark.skipif(load_linear_kernel() is None, reason="no C compiler, or neither AVX-512 nor AVX2 + FMA")
F16_NOTE = " (a CPU without F16C)"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 9, 15, 32, 47, 64, 200])
@pytest.mark.parametrize("N,K,with_bias", [(960, 576, False), (7, 64, True), (130, 1536, True)])
def test_small_m_linear_matches_fp32(dtype, M, N, K, with_bias):
    """Row counts past one tile of x (4 rows: later tiles reread the W block the first one
    prefetched), N with a short last block, up to the dtype's row limit."""
    if dtype not in kernel_dtypes():
        pytest.skip(f"no {dtype} kernel in this build{F16_NOTE if dtype == torch.float16 else ''}")
    if M > small_m_rows(dtype):
        pytest.skip(f"{dtype} takes at most {small_m_rows(dtype)} rows")
    g = torch.Generator().manual_seed(M * N)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if with_bias else None
    y = small_m_linear(x, w, b)
    assert y is not None and y.dtype == dtype and y.shape == (M, N)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    if dtype == torch.bfloat16:
        # fp32 accumulation of exact bf16 products (order differs: ~K * 2^-24 relative), then one
        # rounding to bf16: half an ulp, 2^-9 relative.
        torch.testing.assert_close(y.double(), ref, rtol=2**-8, atol=1e-3)
    elif dtype == torch.float16:
        # The same with float16's rounding: half an ulp, 2^-11 relative.
        torch.testing.assert_close(y.double(), ref, rtol=2**-10, atol=1e-3)
    else:
        # K float32 products summed in another order: a few ulps of the sum's magnitude (|y| ~ 1).
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)


def test_kernel_declines_what_it_does_not_cover():
    w = torch.randn(8, 64).bfloat16()
    for dtype in (torch.bfloat16, torch.float32, torch.float16):  # more rows than it beats torch's GEMM at
        x = torch.randn(small_m_rows(dtype) + 1, 64).to(dtype)
        assert small_m_linear(x, w.to(dtype), None) is None
    x = torch.randn(1, 64).bfloat16()
    if torch.float16 not in kernel_dtypes():
        assert small_m_linear(x[:1].half(), w.half(), None) is None  # float16 (builds with F16C only)
    assert small_m_linear(x[:1].float(), w, None) is None  # mixed dtypes
    assert small_m_linear(torch.randn(1, 48).bfloat16(), torch.randn(8, 48).bfloat16(), None) is None  # K % 32
    assert small_m_linear(torch.randn(1, 40), torch.randn(8, 40), None) is None  # K % 16


@pytest.fixture
def one_row_form(request):
    """The one-row path the test runs in (row after row, or the tiles' 4-row blocks), put back after."""
    if request.param and not AVX512_FORM:
        pytest.skip("the row-after-row form is the AVX-512 build's")
    default = row1_reads()
    row1_reads(request.param)
    yield request.param
    row1_reads(default)


def test_the_one_row_form_follows_the_cpu_vendor():
    assert row1_reads() == (AVX512_FORM and "AuthenticAMD" in open("/proc/cpuinfo").read())


@pytest.mark.parametrize("one_row_form", [False, True], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("N,K", [(37, 576), (150, 1536), (20, 2048), (17, 4096)])
def test_one_row_gives_the_same_bits_in_both_forms(one_row_form, dtype, N, K):
    """A single row read row after row and in the tiles' blocks sums in the same order (K up to
    ROW1_MAX_K = 2048 takes the row form where it is on; 4096 the tiles in both)."""
    if dtype not in kernel_dtypes():
        pytest.skip(f"no {dtype} kernel in this build{F16_NOTE if dtype == torch.float16 else ''}")
    g = torch.Generator().manual_seed(N)
    x = torch.randn(1, K, generator=g).to(dtype)
    w = torch.randn(N, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g).to(dtype)
    y = small_m_linear(x, w, b)
    row1_reads(not one_row_form)
    assert torch.equal(y, small_m_linear(x, w, b))


@pytest.mark.parametrize("one_row_form", [False, True], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("N", [13, 37, 150])
def test_a_rows_result_does_not_depend_on_its_place_in_the_batch(one_row_form, dtype, with_bias, N):
    """Whole 4 x 4 tiles sum their 16 accumulators in one shuffle tree, partial tiles each alone,
    and a single row of x reads W row after row where that form is on (16-row blocks summed in one
    tree, then single rows; run with it on and off): all pair the lanes alike, so a row gives the same bits as the only row, as a row of a
    whole tile and as the odd row of a partial one, in every column (N = 13: whole and short W
    blocks; 37: two 16-row blocks of the one-row path and a tail; 150: split over the threads)."""
    if dtype not in kernel_dtypes():
        pytest.skip(f"no {dtype} kernel in this build{F16_NOTE if dtype == torch.float16 else ''}")
    g = torch.Generator().manual_seed(7)
    K = 576
    rows = min(small_m_rows(dtype), 9)
    if dtype == torch.bfloat16 and amx_rows():
        pytest.skip("bf16 batches run on AMX tiles here (test_amx_rows_do_not_depend_on_the_batch)")
    x = torch.randn(rows, K, generator=g).to(dtype)
    w = torch.randn(N, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if with_bias else None
    batch = small_m_linear(x, w, b)
    for i in range(rows):
        alone = small_m_linear(x[i:i + 1].contiguous(), w, b)
        assert torch.equal(batch[i], alone[0]), i


def test_amx_is_used_where_the_cpu_has_it():
    from pagedllm.hardware import cpu_flags

    assert bool(amx_rows()) == ({"amx_bf16", "amx_tile", "avx512_bf16"} <= cpu_flags())


@pytest.mark.skipif(not amx_rows(), reason="no AMX-BF16 on this CPU (or the OS does not lend the tiles)")
@pytest.mark.parametrize("N", [13, 130, 960])
@pytest.mark.parametrize("K", [576, 1536])
def test_amx_rows_do_not_depend_on_the_batch(N, K):
    """On AMX tiles every element of y is the same sequence of tile products wherever its x row sits
    in a 16-row block, whichever block it is in, and whether its W rows are a whole 16-row block or a
    short one padded with zeros (N = 13: one short block; 130: eight whole blocks and a short one),
    however the call splits x into blocks of rows (K = 1536: blocks of 96 rows, so the 128-row
    call and the 100-row part run as two): a row gives the same bits in every batch of amx_rows()
    rows or more."""
    g = torch.Generator().manual_seed(N)
    x = torch.randn(200, K, generator=g).bfloat16()
    w = (torch.randn(N, K, generator=g) / K**0.5).bfloat16()
    b = torch.randn(N, generator=g).bfloat16()
    whole = small_m_linear(x[:small_m_rows(torch.bfloat16)].contiguous(), w, b)
    for lo, hi in ((0, amx_rows()), (5, 22), (31, 48), (17, 117)):
        part = small_m_linear(x[lo:hi].contiguous(), w, b)
        assert torch.equal(part, whole[lo:hi]), (lo, hi)
    ref = F.linear(x[:small_m_rows(torch.bfloat16)].double(), w.double(), b.double())
    torch.testing.assert_close(whole.double(), ref, rtol=2**-8, atol=1e-3)  # as test_small_m_linear_matches_fp32


@pytest.mark.skipif(not amx_rows(), reason="no AMX-BF16 on this CPU (or the OS does not lend the tiles)")
@pytest.mark.parametrize("M", [2, 5, 9])
def test_rows_below_amx_from_give_their_bits_alone(M):
    """A single bf16 row runs in the AVX-512 BF16 form, a batch on the tiles, which sum in another
    order: some of 64 rows differ from their bits alone. With amx_rows_from(M + 1), as a speculating
    engine sets it for one request's verification rows, an M-row batch runs in the AVX-512 form and
    each row gives its bits alone; amx_rows_from(0) restores the default."""
    g = torch.Generator().manual_seed(M)
    K, N, R = 576, 960, 64
    x = torch.randn(R, K, generator=g).bfloat16()
    w = (torch.randn(N, K, generator=g) / K**0.5).bfloat16()
    b = torch.randn(N, generator=g).bfloat16()
    alone = torch.cat([small_m_linear(x[i:i + 1].contiguous(), w, b) for i in range(R)])

    def batches_differ() -> int:
        return sum(not torch.equal(small_m_linear(x[i:i + M].contiguous(), w, b), alone[i:i + M])
                   for i in range(0, R - M + 1, M))

    assert batches_differ() > 0
    try:
        amx_rows_from(M + 1)
        assert load_linear_kernel().small_m_amx_rows() == M + 1
        assert batches_differ() == 0
    finally:
        amx_rows_from(0)
    assert load_linear_kernel().small_m_amx_rows() == amx_rows() == 2
    assert batches_differ() > 0


@pytest.mark.skipif(not AVX512_FORM or "f16c" not in cpu_flags(), reason="this CPU's own build is the AVX2 form")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_avx2_form_built_on_an_avx512_cpu(dtype):
    """The AVX2 + FMA + F16C form (gemm_tile_avx2: 16-bit values widened to float32 in registers),
    built with every AVX-512 subset off, against a float64 GEMM on the same values, with the
    tolerance of test_small_m_linear_matches_fp32, up to its row limit (passes of 2 rows over a
    float32 panel), and against the AVX-512 form of this CPU: each sums in its own order, so the two
    agree to one rounding of the output."""
    cdll = native.compile_native(native.CSRC / kernels.LINEAR.source, native.AVX2_FORM_FLAGS)
    lib = None if cdll is None else native.bind(cdll, kernels.LINEAR)
    if lib is None:
        pytest.skip("no C compiler")
    assert lib.small_m_available() == 1 | 2 | 4 | 8  # float32, bf16 and float16, widening; not the AVX-512 form
    g = torch.Generator().manual_seed(11)
    rtol = 2**-8 if dtype == torch.bfloat16 else 2**-10
    for M, N, K in ((1, 960, 576), (3, 7, 64), (9, 130, 1536), (F16_ROWS_AVX2, 40, 576)):
        x = torch.randn(M, K, generator=g).to(dtype)
        w = (torch.randn(N, K, generator=g) / K**0.5).to(dtype)
        b = torch.randn(N, generator=g).to(dtype)
        y = torch.empty(M, N, dtype=dtype)
        assert lib.small_m_linear(x.data_ptr(), M, w.data_ptr(), b.data_ptr(), N, K, y.data_ptr(),
                                  _DTYPE_CODES[dtype]) == 0
        ref = F.linear(x.double(), w.double(), b.double())
        torch.testing.assert_close(y.double(), ref, rtol=rtol, atol=1e-3)
        if M <= small_m_rows(dtype):
            torch.testing.assert_close(y.double(), small_m_linear(x, w, b).double(), rtol=2 * rtol, atol=2e-3)
