"""compressed-tensors and FP8 checkpoints: which scheme each linear module has, and its stored
tensors decoded to group codes (``w = code * scale + zero``, :class:`GroupCodes`).

compressed-tensors (``quant_method: compressed-tensors``, written by llm-compressor; vLLM's format
for its INT8 W8A8, FP8 and W4A16 models) names its schemes in ``config_groups``: each group's
``targets`` (``Linear``, a module name or ``re:<regex>``) and ``weights`` (``num_bits``, ``type``
int or float, ``strategy`` tensor / channel / group / block, ``group_size``, ``block_structure``,
``symmetric``) and ``input_activations``; ``ignore`` lists the modules left in float. Stored forms:

- ``pack-quantized``: ``weight_packed`` int32 [N, ceil(K b / 32)], value ``q + 2^(b-1)`` of
  input i at bit ``i b`` of the little-endian stream; ``weight_scale``; ``weight_zero_point``
  (asymmetric, packed alike along the output rows); ``weight_shape``; ``weight_g_idx`` (act-order);
- ``int-quantized`` / ``naive-quantized``: ``weight`` int8 with ``weight_scale`` (and a zero point);
- ``float-quantized``: ``weight`` float8_e4m3fn with ``weight_scale``.

``w = (q - zero_point) * scale``. vLLM's own FP8 form (``quant_method: fp8``) stores ``weight``
float8_e4m3fn with a per-tensor ``weight_scale``, or with ``weight_block_size`` [bn, bk] and
``weight_scale_inv`` [ceil(N/bn), ceil(K/bk)]. Activation scales (``input_scale``) and KV-cache
scales (``k_scale``/``v_scale``) are dropped: activations stay in the model dtype (int8 per token for
INT8 W8A8 layers), and ``--kv-cache-dtype`` sets the cache's own.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from pagedllm.quantization.formats import E4M3, GroupCodes, QuantFormatError, group_order, unpack_words

# Stored tensors of one quantized module, besides ``weight``.
PARTS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx",
         "weight_scale_inv")
# Tensors dropped with a log line: static activation scales, output and KV-cache scales.
DROPPED = ("input_scale", "output_scale", "k_scale", "v_scale", "input_zero_point", "output_zero_point",
           "input_global_scale", "weight_global_scale")
_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized", "mixed-precision", "dense")


@dataclass(frozen=True)
class WeightScheme:
    """How one linear module's weight is stored."""

    kind: str
    """``int`` (int codes) or ``fp8`` (e4m3)."""
    bits: int
    strategy: str
    """``tensor``, ``channel``, ``group`` or ``block``."""
    group_size: int = 0
    block: tuple[int, int] = (0, 0)
    symmetric: bool = True
    int8_activations: bool = False
    """Inputs quantized to int8 per token (INT8 W8A8), the w8a8 method's arithmetic."""
    act_order: bool = False
    """Inputs in groups given by ``weight_g_idx`` (GPTQ's act-order, ``actorder: group``)."""

    def group(self, k: int) -> int:
        """Inputs per group of the codes of a layer with ``k`` inputs."""
        return _blocks(self, 1, k)[2]

    @property
    def w8a8(self) -> bool:
        """Runs as pagedllm's w8a8: symmetric int8 weights with one scale per output row."""
        return (self.kind == "int" and self.bits == 8 and self.symmetric and self.int8_activations
                and self.strategy in ("tensor", "channel"))

    @property
    def code_bits(self) -> int:
        """``bits`` of the group codes (e4m3: :data:`E4M3`)."""
        return E4M3 if self.kind == "fp8" else self.bits

    def describe(self) -> str:
        what = "fp8 e4m3" if self.kind == "fp8" else f"int{self.bits}"
        per = {"group": f"groups of {self.group_size}", "block": f"{self.block[0]}x{self.block[1]} blocks"}
        return f"{what}, {per.get(self.strategy, 'per ' + self.strategy)}" + (", int8 activations" if self.w8a8 else "")


def _args(group: str, args: dict[str, Any], activations: dict[str, Any] | None) -> WeightScheme:
    kind = str(args.get("type", "int")).lower()
    bits = int(args.get("num_bits", 8))
    strategy = str(args.get("strategy", "tensor")).lower()
    where = f"compressed-tensors config group {group!r}"
    if kind not in ("int", "float"):
        raise ValueError(f"{where}: weight type {kind!r} is not supported (int or float)")
    if kind == "float" and bits != 8:
        raise ValueError(f"{where}: {bits}-bit float weights (NVFP4/MXFP4) are not supported (fp8 only)")
    if kind == "int" and not 2 <= bits <= 8:
        raise ValueError(f"{where}: {bits}-bit int weights are not supported (2 to 8 bits)")
    if strategy not in ("tensor", "channel", "group", "block"):
        raise ValueError(f"{where}: weight strategy {strategy!r} is not supported (tensor, channel, group, block)")
    group_size = int(args.get("group_size") or 0)
    if strategy == "group" and group_size < 1:
        raise ValueError(f"{where}: strategy 'group' needs a positive group_size, got {args.get('group_size')!r}")
    block = tuple(int(b) for b in (args.get("block_structure") or (0, 0)))
    if strategy == "block" and (len(block) != 2 or min(block) < 1):
        raise ValueError(f"{where}: strategy 'block' needs a block_structure [rows, cols], "
                         f"got {args.get('block_structure')!r}")
    act = activations or {}
    int8_act = bool(act) and str(act.get("type", "int")).lower() == "int" and int(act.get("num_bits", 0)) == 8
    act_order = str(args.get("actorder")).lower() in ("group", "true")
    return WeightScheme("fp8" if kind == "float" else "int", bits, strategy, group_size,
                        block, bool(args.get("symmetric", True)), int8_act, act_order)  # type: ignore[arg-type]


class CompressedConfig:
    """The schemes of a checkpoint's ``quantization_config`` and the modules they apply to."""

    def __init__(self, qc: dict[str, Any]) -> None:
        method = str(qc.get("quant_method", "")).lower()
        self.groups: list[tuple[list[str], WeightScheme]] = []
        self.ignore: list[str] = [str(i) for i in qc.get("ignore") or []]
        self.not_converted: list[str] = []
        """FP8 checkpoints' ``modules_to_not_convert``: names contained in a module's name."""
        if method == "fp8":
            block = qc.get("weight_block_size")
            scheme = WeightScheme("fp8", 8, "block", block=(int(block[0]), int(block[1]))) if block \
                else WeightScheme("fp8", 8, "tensor")
            self.groups.append((["Linear"], scheme))
            self.not_converted = [str(m) for m in qc.get("modules_to_not_convert") or []]
            return
        fmt = str(qc.get("format", "")).lower()
        if fmt and fmt not in _FORMATS:
            raise ValueError(f"compressed-tensors format {fmt!r} is not supported ({', '.join(_FORMATS)})")
        if qc.get("sparsity_config"):
            raise ValueError("compressed-tensors checkpoint with a sparsity_config: sparse weights are not supported")
        if qc.get("transform_config"):
            raise ValueError("compressed-tensors checkpoint with a transform_config (rotations) is not supported")
        for name, group in (qc.get("config_groups") or {}).items():
            gfmt = str(group.get("format") or fmt).lower()
            if gfmt and gfmt not in _FORMATS:
                raise ValueError(f"compressed-tensors config group {name!r}: format {gfmt!r} is not supported")
            if group.get("weights") and gfmt != "dense":  # dense: float weights as stored
                self.groups.append(([str(t) for t in group.get("targets") or []],
                                    _args(name, group["weights"], group.get("input_activations"))))

    def describe(self) -> str:
        groups = "; ".join(f"{s.describe()} for {', '.join(t)}" for t, s in self.groups) or "no quantized weights"
        kept = self.ignore + self.not_converted
        return groups + (f" (kept in float: {', '.join(kept)})" if kept else "")

    def scheme(self, module: str) -> WeightScheme | None:
        """The scheme of checkpoint module ``module`` (a linear layer), None where it stays float."""
        if any(_matches(module, t) for t in self.ignore) or any(m in module for m in self.not_converted):
            return None
        for targets, scheme in self.groups:
            if any(t == "Linear" or _matches(module, t) for t in targets):
                return scheme
        return None


def _matches(module: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == module


# ---- stored tensors -> group codes ------------------------------------------------------------ #


def unpack_int32(words: torch.Tensor, bits: int, count: int, name: str) -> torch.Tensor:
    """compressed-tensors' dense packing: rows of int32 words, value j of a row at bits
    ``[j b, (j + 1) b)`` of its little-endian bit stream -> uint8 [rows, count] (stored values)."""
    if words.dtype != torch.int32 or words.dim() != 2:
        raise QuantFormatError(f"quantized tensor {name!r}: expected 2-D int32 words, got {words.dtype} "
                               f"{tuple(words.shape)}")
    need = math.ceil(count * bits / 32)
    if words.shape[1] != need:
        raise QuantFormatError(f"quantized tensor {name!r}: {words.shape[1]} words per row, expected {need} for "
                               f"{count} values of {bits} bits")
    if 32 % bits == 0:  # whole values per word, field i at bits [i b, (i + 1) b): GPTQ's word layout
        return unpack_words(words, bits, dim=1)[:, :count].to(torch.uint8).contiguous()
    raw = np.ascontiguousarray(words.numpy()).view("<u4").view(np.uint8)  # little-endian bytes per row
    stream = np.unpackbits(raw, axis=1, bitorder="little")[:, : count * bits].reshape(raw.shape[0], count, bits)
    values = (stream.astype(np.uint16) << np.arange(bits, dtype=np.uint16)).sum(axis=2)
    return torch.from_numpy(values.astype(np.uint8))


def _per_group(t: torch.Tensor, n: int, k: int, rows: int, cols: int, g: int, name: str) -> torch.Tensor:
    """A scale (or zero point) stored per ``rows x cols`` block of the [n, k] weight -> [n, k / g]
    float32, g dividing cols and k (blocks at the edges may be partial)."""
    t = t.float()
    if t.numel() == 1:
        return t.reshape(1, 1).expand(n, k // g).contiguous()
    shape = (math.ceil(n / rows), math.ceil(k / cols))
    if t.dim() == 1 and shape[1] == 1:
        t = t[:, None]
    if tuple(t.shape) != shape:
        raise QuantFormatError(f"quantized tensor {name!r}: shape {tuple(t.shape)}, expected {shape} "
                               f"for a [{n}, {k}] weight in {rows}x{cols} blocks")
    row_of = torch.arange(n) // rows
    col_of = (torch.arange(k // g) * g) // cols
    return t[row_of][:, col_of].contiguous()


def _blocks(scheme: WeightScheme, n: int, k: int) -> tuple[int, int, int]:
    """(rows, cols) of the weight each stored scale covers, and the group size of the codes."""
    rows, cols = {"tensor": (n, k), "channel": (1, k), "group": (1, scheme.group_size),
                  "block": scheme.block}[scheme.strategy]
    if scheme.act_order:  # g_idx may gather any inputs into a group: groups as stored, whole
        return rows, cols, cols
    g = math.gcd(cols, k)
    return rows, cols, g


def group_codes(module: str, scheme: WeightScheme, parts: dict[str, torch.Tensor]) -> GroupCodes:
    """The group codes of one module's stored tensors (``weight`` or ``weight_packed``, and
    :data:`PARTS`), in the [out, in] orientation; e4m3 codes as their bytes."""
    scale = parts.get("weight_scale", parts.get("weight_scale_inv"))
    if scale is None:
        raise QuantFormatError(f"quantized module {module!r} lacks {module}.weight_scale")
    offset = 1 << (scheme.bits - 1)
    if "weight_packed" in parts:
        if scheme.kind != "int":
            raise QuantFormatError(f"quantized tensor {module + '.weight_packed'!r}: packed codes of a float scheme")
        shape = parts.get("weight_shape")
        if shape is None or shape.numel() != 2:
            raise QuantFormatError(f"quantized module {module!r} lacks a 2-element {module}.weight_shape")
        n, k = (int(v) for v in shape.tolist())
        packed = parts["weight_packed"]
        if packed.shape[0] != n:
            raise QuantFormatError(f"quantized tensor {module + '.weight_packed'!r}: {packed.shape[0]} rows, "
                                   f"weight_shape says {n}")
        codes = unpack_int32(packed, scheme.bits, k, f"{module}.weight_packed")
    else:
        w = parts.get("weight")
        if w is None:
            raise QuantFormatError(f"quantized module {module!r} lacks {module}.weight")
        want = torch.float8_e4m3fn if scheme.kind == "fp8" else torch.int8
        if w.dtype != want or w.dim() != 2:
            raise QuantFormatError(f"quantized tensor {module + '.weight'!r}: {w.dtype} {tuple(w.shape)}, expected a "
                                   f"2-D {want} weight for {scheme.describe()}")
        n, k = w.shape
        codes = w.view(torch.uint8).clone() if scheme.kind == "fp8" else (w.to(torch.int16) + offset).to(torch.uint8)
    if scheme.strategy == "tensor" and scale.numel() == n > 1:  # FP8 checkpoints with one scale per row
        scheme = replace(scheme, strategy="channel")
    rows, cols, g = _blocks(scheme, n, k)
    scales = _per_group(scale, n, k, rows, cols, g, f"{module}.weight_scale")
    if scheme.kind == "fp8":
        return GroupCodes(codes=codes, scales=scales, zeros=torch.zeros_like(scales))
    zp = parts.get("weight_zero_point")
    if zp is None or scheme.symmetric:
        zero = torch.zeros_like(scales)
    elif "weight_packed" in parts:  # packed along the output rows: [ceil(N b / 32), groups]
        stored = unpack_int32(zp.t().contiguous(), scheme.bits, n, f"{module}.weight_zero_point")
        zero = _per_group(stored.t().float() - offset, n, k, rows, cols, g, f"{module}.weight_zero_point")
    else:
        zero = _per_group(zp.float(), n, k, rows, cols, g, f"{module}.weight_zero_point")
    perm = None
    if "weight_g_idx" in parts:
        perm = group_order(f"{module}.weight_g_idx", parts["weight_g_idx"], k, g, k // g)
        if perm is not None:
            codes = codes[:, perm].contiguous()
    # w = (q - z) * s with q = code - offset: code * s - (offset + z) * s
    return GroupCodes(codes=codes, scales=scales, zeros=-(zero + offset) * scales, perm=perm)


def w8a8_codes(module: str, parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """INT8 W8A8: int8 codes [N, K] and float32 scales [N] (one per output row)."""
    w, scale = parts.get("weight"), parts.get("weight_scale")
    if w is None or scale is None:
        missing = "weight" if w is None else "weight_scale"
        raise QuantFormatError(f"quantized module {module!r} lacks {module}.{missing}")
    if w.dtype != torch.int8 or w.dim() != 2:
        raise QuantFormatError(f"quantized tensor {module + '.weight'!r}: {w.dtype} {tuple(w.shape)}, "
                               "expected a 2-D int8 weight")
    n = w.shape[0]
    if scale.numel() not in (1, n):
        raise QuantFormatError(f"quantized tensor {module + '.weight_scale'!r}: {scale.numel()} values, "
                               f"expected 1 or {n}")
    return w.contiguous(), scale.float().reshape(-1).expand(n).contiguous()

