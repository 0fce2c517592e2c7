"""The token embedding and the LM head kept as codes (``--quantize-embeddings``).

A vocabulary matrix [rows, hidden] is quantized once after loading into a layout of the native
quantized kernel (:mod:`pagedllm.quantization.native`), the same layouts a quantized linear layer
keeps, and its float copy dropped:

- int8 / w8a8: symmetric int8 codes per group of 32 inputs with bfloat16 scales, tiled by 16 rows
  (each group quantized as an int8 output channel is; GGUF's Q8_0 codes where the weight came
  from Q8_0);
- int4: the int4 LinearMethod's asymmetric 4-bit group codes (``--quantization-group-size``, or
  the largest group size below it that divides the hidden size);
- fp8: e4m3 codes with one scale per row, as the fp8 LinearMethod;
- gguf: the file's own blocks where they fit the kernel (4-bit types as 4-bit codes, 5 to 8 bits
  as int8 codes, groups of 32), else int8 codes per 32 inputs of the expanded weight.

The LM head multiplies through the kernel (:func:`native.group_linear`); the embedding expands only
the rows it looks up (:func:`native.gather_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.config import EMBEDDING_QUANTIZATION_METHODS
from pagedllm.quantization import kernels as K
from pagedllm.quantization import native

INT8_GROUP = 32


@dataclass(frozen=True)
class RowCodes:
    """A [rows, K] matrix in a native kernel layout (``bits``: 4, 8, or 3 for e4m3)."""

    bits: int
    group: int
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.codes, self.scales, self.zeros


def quantize_rows(w: torch.Tensor, method: str, group_size: int = 128, clip_search: bool = False) -> RowCodes:
    """``w`` [rows, K] (float) in the layout of ``method`` (int8, w8a8, int4, fp8; gguf takes int8)."""
    rows, k = w.shape
    if method in ("int8", "w8a8", "gguf"):
        if k % INT8_GROUP:
            raise ValueError(f"quantized embeddings: hidden size {k} is not a multiple of {INT8_GROUP}")
        codes, scales = K.quantize_int8_per_channel(w.reshape(-1, INT8_GROUP))
        packed, s, z = native.pack_int8_native(codes.reshape(rows, k), scales.reshape(rows, -1),
                                               torch.zeros(rows, k // INT8_GROUP))
        return RowCodes(8, INT8_GROUP, packed, s, z)
    if method == "int4":
        fitting = [g for g in K.INT4_GROUP_SIZES if g <= group_size and k % g == 0 and g % 32 == 0]
        if not fitting:
            raise ValueError(f"quantized embeddings: no int4 group size up to {group_size} divides hidden size {k}")
        codes, scales, zeros = K.quantize_groupwise(w, fitting[-1], 4, clip_search)
        return RowCodes(4, fitting[-1], *native.pack_int4_native(codes, scales, zeros))
    if method == "fp8":
        codes, scales = K.quantize_fp8_per_channel(w)
        return RowCodes(3, k, codes.view(torch.uint8), scales.to(torch.bfloat16).unsqueeze(1).contiguous(),
                        torch.zeros(rows, 1, dtype=torch.bfloat16))
    raise ValueError(f"--quantize-embeddings does not apply to quantization={method!r} "
                     f"(only {', '.join(EMBEDDING_QUANTIZATION_METHODS)})")


def rows_from_group_codes(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int) -> RowCodes:
    """Stored group codes (``w = code * scale + zero``, codes [rows, K] of ``bits`` bits, scales and
    zeros [rows, K/g]; a GGUF tensor's blocks) in the kernel's layout, as a linear layer keeps them."""
    group = codes.shape[1] // scales.shape[1]
    if bits <= 4:
        return RowCodes(4, group, *native.pack_int4_native(codes, scales, zeros))
    shift = 1 << (bits - 1)  # centred codes, as finish_group_codes keeps 5- to 8-bit ones
    centred = (codes.to(torch.int16) - shift).to(torch.int8)
    return RowCodes(8, group, *native.pack_int8_native(centred, scales, zeros + shift * scales))
