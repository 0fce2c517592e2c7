"""w8a8_linear on AMX tiles (TDPBSSD, pagedllm/native/csrc/linear_quant_amx.h) against its vpdpbusd
form, the torch path (kernels.int8_dynamic_linear) and the definition, to the bit (tolerance zero:
both forms quantize the rows with the same function and take exact int32 sums, wrapping alike,
then the same two fp32 products). Runs where the CPU has AMX-INT8 and the OS lends the tiles."""

from __future__ import annotations

import pytest
import torch

from pagedllm.quantization import native

from tests.unit.w8a8_reference import check_batch_form, check_sums_wrap

_LIB = native.load_quant_kernel()
pytestmark = pytest.mark.skipif(_LIB is None or _LIB.w8a8_amx_rows() == 0,
                                reason="w8a8_linear does not run on AMX tiles here (no AMX-INT8 or no tile permission)")


def _vnni(fn):
    """fn() with every w8a8_linear call in the vpdpbusd form."""
    _LIB.w8a8_amx_from(1 << 62)
    try:
        return fn()
    finally:
        _LIB.w8a8_amx_from(0)


# Odd sizes: output rows past a tile of 16 and a block of 32, inputs past a tile row of 64 bytes
# (the last code rows then come from a zero-padded copy), K below 64; x rows past a tile of 16, a
# pair of tiles, and a chunk of 128 rows.
@pytest.mark.parametrize("n,k", [(960, 576), (48, 1536), (37, 100), (17, 64), (5, 3), (33, 130)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_w8a8_amx_equals_vpdpbusd_torch_and_definition(n: int, k: int, dtype: torch.dtype) -> None:
    assert _LIB.w8a8_amx_rows() == 5
    check_batch_form(n, k, dtype, n * k, (5, 6, 16, 17, 32, 33, 129, 300), _vnni)


def test_w8a8_amx_int32_sums_wrap_as_the_vpdpbusd_form() -> None:
    """K = 140,000 inputs at ±127: sums past 2^31."""
    check_sums_wrap(140_000, _vnni)


def test_w8a8_amx_threshold_is_this_librarys_setting() -> None:
    """w8a8_amx_from sets the rows from which the tiles run and returns them; 0 restores the default."""
    assert _LIB.w8a8_amx_from(9) == 9 and _LIB.w8a8_amx_rows() == 9
    assert _LIB.w8a8_amx_from(0) == 5 and _LIB.w8a8_amx_rows() == 5
