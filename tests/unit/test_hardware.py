"""`--dtype auto`: the choice follows the CPU's bf16, AVX-512 and AVX2 + FMA flags."""

from __future__ import annotations

import pytest

from pagedllm.hardware import choose_auto_dtype, resolve_dtype

BASE = {"fpu", "sse4_2", "avx2", "fma", "avx512f", "avx512bw", "avx512_vnni"}


@pytest.mark.parametrize(
    ("flags", "has_gpu", "expected"),
    [
        (BASE | {"avx512_bf16"}, False, "bfloat16"),  # AMD Zen 4 / Cooper Lake
        (BASE | {"amx_bf16", "amx_tile", "avx512_bf16"}, False, "bfloat16"),  # Sapphire Rapids
        (BASE | {"amx_bf16"}, False, "bfloat16"),
        (BASE, False, "float32"),  # AVX-512 without bf16: emulated bf16 is slower
        ({"fpu", "avx2", "fma"}, False, "bfloat16"),  # AVX2 + FMA: widened bf16 reads half the bytes
        ({"fpu", "avx2"}, False, "float32"),
        ({"fpu", "sse4_2"}, False, "float32"),
        (set(), False, "float32"),  # flags unreadable
        (set(), True, "bfloat16"),
    ],
)
def test_auto_dtype_follows_flags(flags, has_gpu, expected):
    dtype, why = choose_auto_dtype(frozenset(flags), has_gpu=has_gpu)
    assert dtype == expected
    assert why  # the log line says why


def test_explicit_dtype_is_kept():
    for d in ("float32", "bfloat16", "float16"):
        assert resolve_dtype(d) == d
