"""w8a8_linear's batch form in vpdpbusd (16 x 16 blocks over packed x rows,
pagedllm/native/csrc/linear_quant_vnni.h) against its row form, the torch path
(kernels.int8_dynamic_linear) and the definition, to the bit (tolerance zero: both forms quantize the
rows with the same function and take exact int32 sums, wrapping alike, then the same two fp32
products). Runs wherever the kernel's AVX-512 form builds; where the CPU also has AMX-INT8 the tiles
are set aside for these tests."""

from __future__ import annotations

import pytest
import torch

from pagedllm.quantization import native

from tests.unit.w8a8_reference import check_batch_form, check_sums_wrap

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
    assert _LIB.w8a8_vnni_rows() == 5
    check_batch_form(n, k, dtype, n * k + 1, (5, 6, 16, 17, 33, 256, 257, 530), _row_form)


def test_w8a8_vnni_int32_sums_wrap_as_the_row_form() -> None:
    """K = 140,002 inputs at ±127 (K % 4 = 2: the padded dword too): sums past 2^31."""
    check_sums_wrap(140_002, _row_form)


def test_w8a8_vnni_threshold_is_this_librarys_setting() -> None:
    """w8a8_vnni_from sets the rows from which the batch form runs and returns them; 0 restores the
    default."""
    assert _LIB.w8a8_vnni_from(9) == 9 and _LIB.w8a8_vnni_rows() == 9
    assert _LIB.w8a8_vnni_from(0) == 5 and _LIB.w8a8_vnni_rows() == 5
