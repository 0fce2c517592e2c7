"""Decoders from checkpoint layouts to group-wise codes: ``w[n, k] = codes * scale + zero``.

Every decoder returns ``codes`` [N, K] (uint8), ``scales`` and ``zeros`` [N, K/g] (float32) in
the row-major [out, in] orientation of a linear weight, which
:func:`pagedllm.quantization.methods.finish_group_codes` packs for the kernel.

GGUF block layouts follow ggml's ``block_q*`` structs (ggml-common.h); AWQ and GPTQ follow the
``qweight``/``qzeros``/``scales``(/``g_idx``) tensors written by AutoAWQ and AutoGPTQ/GPTQModel.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# gguf.GGMLQuantizationType values -> (bits, group size, bytes per 256-or-32 block, elements per block)
GGUF_TYPES: dict[int, tuple[str, int, int]] = {
    2: ("Q4_0", 4, 32), 3: ("Q4_1", 4, 32), 6: ("Q5_0", 5, 32), 7: ("Q5_1", 5, 32),
    8: ("Q8_0", 8, 32), 12: ("Q4_K", 4, 32), 13: ("Q5_K", 5, 32), 14: ("Q6_K", 6, 16),
}


E4M3 = 3
"""``bits`` of e4m3 (fp8) group codes, the bytes of float8_e4m3fn values (the native kernel's name)."""


class QuantFormatError(ValueError):
    """A quantized tensor's layout does not match what its format requires."""


@dataclass
class GroupCodes:
    codes: torch.Tensor
    """uint8 [N, K]"""
    scales: torch.Tensor
    """float32 [N, K/g]"""
    zeros: torch.Tensor
    """float32 [N, K/g]"""
    perm: torch.Tensor | None = None
    """int64 [K]: input order that makes groups contiguous (GPTQ act-order), else None."""

    def dequantize(self, bits: int = 0) -> torch.Tensor:
        """The float32 weight [N, K] (``bits`` :data:`E4M3`: the codes are e4m3 bytes)."""
        n, k = self.codes.shape
        g = self.scales.shape[1]
        codes = self.codes.view(torch.float8_e4m3fn) if bits == E4M3 else self.codes
        w = codes.reshape(n, g, k // g).float() * self.scales[..., None] + self.zeros[..., None]
        w = w.reshape(n, k)
        if self.perm is not None:
            out = torch.empty_like(w)
            out[:, self.perm] = w
            return out
        return w


# ---- GGUF ------------------------------------------------------------------------------------ #


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """fp16 field at byte ``start`` of each block -> float32 [n]."""
    return blocks[:, start : start + 2].copy().view(np.float16).astype(np.float32)[:, 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes -> [n, 32]: low nibbles are elements 0..15, high nibbles 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """[n, 4] bytes of a little-endian uint32 -> [n, 32] bits (bit j for element j)."""
    bits = qh.copy().view("<u4")
    return ((bits >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _k_scale_min(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins per 256-block."""
    sc = sc.astype(np.uint8)
    scale = np.empty((sc.shape[0], 8), np.uint8)
    mins = np.empty((sc.shape[0], 8), np.uint8)
    scale[:, :4] = sc[:, 0:4] & 63
    mins[:, :4] = sc[:, 4:8] & 63
    scale[:, 4:] = (sc[:, 8:12] & 0x0F) | ((sc[:, 0:4] >> 6) << 4)
    mins[:, 4:] = (sc[:, 8:12] >> 4) | ((sc[:, 4:8] >> 6) << 4)
    return scale.astype(np.float32), mins.astype(np.float32)


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K: 128 bytes -> 256 values; chunk j's 32 bytes hold elements 64j..64j+31 in the
    low nibbles and 64j+32..64j+63 in the high ones."""
    q = qs.reshape(-1, 4, 32)
    return np.stack([q & 0x0F, q >> 4], axis=2).reshape(-1, 256)


def _decode_blocks(blocks: np.ndarray, qtype: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per block: codes [n, E], scales and zeros [n, E/g] (E = 32 or 256 elements)."""
    if qtype in (2, 3, 6, 7):
        has_min = qtype in (3, 7)
        d = _f16(blocks, 0)
        off = 4 if has_min else 2
        if qtype in (6, 7):
            codes = _nibbles(blocks[:, off + 4 :]) | (_high_bits(blocks[:, off : off + 4]) << 4)
        else:
            codes = _nibbles(blocks[:, off:])
        zero = _f16(blocks, 2) if has_min else -d * (16.0 if qtype == 6 else 8.0)
        return codes, d[:, None], zero[:, None]
    if qtype == 8:
        d = _f16(blocks, 0)
        codes = (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return codes, d[:, None], (-128.0 * d)[:, None]
    if qtype in (12, 13):
        d, dmin = _f16(blocks, 0), _f16(blocks, 2)
        sc, mn = _k_scale_min(blocks[:, 4:16])
        if qtype == 12:
            codes = _k_low_nibbles(blocks[:, 16:144])
        else:
            qh = blocks[:, 16:48]
            high = ((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1)  # [n, 8, 32]
            codes = _k_low_nibbles(blocks[:, 48:176]) | (high.reshape(-1, 256) << 4)
        return codes, d[:, None] * sc, -dmin[:, None] * mn
    if qtype == 14:
        ql, qh = blocks[:, 0:128].reshape(-1, 2, 64), blocks[:, 128:192].reshape(-1, 2, 32)
        sc = blocks[:, 192:208].view(np.int8).astype(np.float32)
        d = _f16(blocks, 208)
        parts = [(ql[:, :, :32] & 0x0F) | (((qh >> 0) & 3) << 4),
                 (ql[:, :, 32:] & 0x0F) | (((qh >> 2) & 3) << 4),
                 (ql[:, :, :32] >> 4) | (((qh >> 4) & 3) << 4),
                 (ql[:, :, 32:] >> 4) | (((qh >> 6) & 3) << 4)]
        codes = np.stack(parts, axis=2).reshape(-1, 256)  # [n, half, part, 32] in element order
        scale = d[:, None] * sc
        return codes, scale, -32.0 * scale
    raise QuantFormatError(f"GGUF type {qtype} is not decoded to group codes")


def gguf_group_codes(raw: np.ndarray, qtype: int, shape: tuple[int, ...]) -> GroupCodes:
    """Codes of one GGUF tensor (raw bytes, row-major ``shape`` [N, K])."""
    name, _bits, _group = GGUF_TYPES[qtype]
    n, k = shape
    block_bytes = {2: 18, 3: 20, 6: 22, 7: 24, 8: 34, 12: 144, 13: 176, 14: 210}[qtype]
    blocks = np.asarray(raw).reshape(-1, block_bytes)
    codes, scales, zeros = _decode_blocks(blocks, qtype)
    return GroupCodes(
        codes=torch.from_numpy(np.ascontiguousarray(codes.reshape(n, k), dtype=np.uint8)),
        scales=torch.from_numpy(np.ascontiguousarray(scales.reshape(n, -1), dtype=np.float32)),
        zeros=torch.from_numpy(np.ascontiguousarray(zeros.reshape(n, -1), dtype=np.float32)),
    )


# ---- AWQ and GPTQ (4-bit codes in int32 words) ----------------------------------------------- #

# AutoAWQ writes output column 8c + AWQ_ORDER[i] into nibble i of word c.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack_words(words: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 words -> codes, each word expanded along ``dim`` into 32/bits values.

    ``order[i]`` is the position (within its word's run) of the value stored in field i:
    e.g. AWQ's (0, 2, 4, 6, 1, 3, 5, 7) puts field 1 at column 2.
    """
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits
    w = words.to(torch.int32).unsqueeze(-1)
    fields = (w >> shifts) & ((1 << bits) - 1)  # [..., per], field i last
    if order is not None:
        inv = [0] * per
        for field, pos in enumerate(order):
            inv[pos] = field
        fields = fields[..., inv]
    if dim == 0:
        fields = fields.movedim(-1, 1)  # [rows, per, cols]
        return fields.reshape(-1, words.shape[1])
    return fields.reshape(words.shape[0], -1)


def _check(cond: bool, name: str, what: str) -> None:
    if not cond:
        raise QuantFormatError(f"quantized tensor {name!r}: {what}")


def awq_group_codes(prefix: str, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                    group_size: int, bits: int = 4) -> GroupCodes:
    """AutoAWQ GEMM layout: qweight [K, N/8], qzeros [K/g, N/8], scales [K/g, N] (fp16);
    ``w[k, n] = (q - z) * s``."""
    _check(bits == 4, prefix, f"AWQ with {bits} bits is not supported (4 only)")
    k = qweight.shape[0]
    n = qweight.shape[1] * 8
    g = k if group_size in (-1, 0) else group_size
    _check(k % g == 0, f"{prefix}.qweight", f"group size {g} does not divide the input size {k}")
    _check(tuple(scales.shape) == (k // g, n), f"{prefix}.scales",
           f"shape {tuple(scales.shape)}, expected {(k // g, n)} for qweight {tuple(qweight.shape)} and group size {g}")
    _check(tuple(qzeros.shape) == (k // g, n // 8), f"{prefix}.qzeros",
           f"shape {tuple(qzeros.shape)}, expected {(k // g, n // 8)}")
    q = unpack_words(qweight, 4, dim=1, order=AWQ_ORDER)  # [K, N]
    z = unpack_words(qzeros, 4, dim=1, order=AWQ_ORDER).float()  # [G, N]
    s = scales.float()
    return GroupCodes(codes=q.t().contiguous().to(torch.uint8), scales=s.t().contiguous(),
                      zeros=(-z * s).t().contiguous())


def gptq_group_codes(prefix: str, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                     g_idx: torch.Tensor | None, group_size: int, bits: int = 4, zero_offset: int = 1
                     ) -> GroupCodes:
    """GPTQ layout: qweight [K/8, N] (packed along inputs), qzeros [G, N/8], scales [G, N],
    g_idx [K] (group of each input). ``w[k, n] = (q - (z + zero_offset)) * s[g_idx[k]]``;
    ``zero_offset`` is 1 for the original (v1) format, which stores zeros minus one, 0 for v2.
    With act-order the inputs are reordered so that each group is contiguous (``perm``)."""
    _check(bits == 4, prefix, f"GPTQ with {bits} bits is not supported (4 only)")
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    g = k if group_size in (-1, 0) else group_size
    _check(k % g == 0, f"{prefix}.qweight", f"group size {g} does not divide the input size {k}")
    groups = k // g
    _check(tuple(scales.shape) == (groups, n), f"{prefix}.scales",
           f"shape {tuple(scales.shape)}, expected {(groups, n)} for qweight {tuple(qweight.shape)} and group size {g}")
    _check(tuple(qzeros.shape) == (groups, n // 8), f"{prefix}.qzeros",
           f"shape {tuple(qzeros.shape)}, expected {(groups, n // 8)}")
    q = unpack_words(qweight, 4, dim=0)  # [K, N]
    z = (unpack_words(qzeros, 4, dim=1).float() + zero_offset)  # [G, N]
    s = scales.float()
    perm = None if g_idx is None else group_order(f"{prefix}.g_idx", g_idx, k, g, groups)
    if perm is not None:
        q = q[perm]
    return GroupCodes(codes=q.t().contiguous().to(torch.uint8), scales=s.t().contiguous(),
                      zeros=(-z * s).t().contiguous(), perm=perm)


def group_order(name: str, g_idx: torch.Tensor, k: int, g: int, groups: int) -> torch.Tensor | None:
    """act-order: the input order that makes each group's ``g`` inputs contiguous, from ``g_idx``
    [K] (the group of each input); None where the inputs are in group order already."""
    _check(tuple(g_idx.shape) == (k,), name, f"shape {tuple(g_idx.shape)}, expected {(k,)}")
    g_idx = g_idx.long()
    _check(bool(((g_idx >= 0) & (g_idx < groups)).all()), name, f"values outside [0, {groups})")
    if torch.equal(g_idx, torch.arange(k) // g):
        return None
    perm = torch.argsort(g_idx, stable=True)
    _check(torch.equal(g_idx[perm], torch.arange(k) // g), name, f"groups are not all of size {g}")
    return perm
