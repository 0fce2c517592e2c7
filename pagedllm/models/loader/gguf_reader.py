"""GGUF headers: metadata and the tensor table, parsed with a small reader and validated.

The reader takes about 0.1 s for the default model, where ``gguf.GGUFReader`` builds a numpy
view for every vocabulary string and needs about 2 s. The tensor table is checked against the
file before any weight is read: every tensor inside the data section, aligned, not overlapping
another, with a byte size that matches its type and dimensions.
"""

from __future__ import annotations

import functools
import logging
import mmap
import os
import struct
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedllm.models.loader.source import ModelLoadError

logger = logging.getLogger(__name__)

_GGUF_MAGIC = b"GGUF"
_GGUF_DEFAULT_ALIGNMENT = 32
_GGML_MAX_DIMS = 4



@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor entry of a GGUF header."""

    name: str
    shape: tuple[int, ...]
    """GGUF order: ``shape[0]`` (ne0) is the contiguous dimension."""
    qtype: int
    """A ``gguf.GGMLQuantizationType`` value."""
    offset: int
    """Absolute byte offset of the tensor data in the file."""
    n_bytes: int

    @property
    def torch_shape(self) -> tuple[int, ...]:
        """Row-major shape: GGUF ``[in, out]`` becomes ``[out, in]``."""
        return tuple(reversed(self.shape))


@dataclass(frozen=True)
class GGUFHeader:
    """Metadata key/values and tensor table of one GGUF file."""

    path: str
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]

    @property
    def arch(self) -> str:
        """``general.architecture`` (e.g. ``llama``, ``qwen2``)."""
        return str(self.metadata.get("general.architecture", ""))

    def require(self, key: str) -> Any:
        """Metadata value for ``key``; ModelLoadError when absent."""
        if key not in self.metadata:
            raise ModelLoadError(f"GGUF file {self.path} lacks metadata key {key!r}")
        return self.metadata[key]


class _Cursor:
    """Little-endian reader over a memory-mapped GGUF header."""

    def __init__(self, buf: mmap.mmap, path: str) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path
        self.size = len(buf)

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise ModelLoadError(
                f"GGUF file {self.path} is truncated or corrupt: {what} at byte {self.pos} "
                f"needs {n} bytes but the file has {self.size}"
            )

    def unpack(self, fmt: str, what: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n, what)
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += n
        return value

    def string(self, what: str) -> str:
        n = self.unpack("<Q", what)
        self.need(n, what)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw.decode("utf-8", errors="replace")


# GGUF value types (gguf.GGUFValueType) -> struct format / numpy dtype.
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f",
                   7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_ARRAY_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4",
                 7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8"}
_TYPE_STRING, _TYPE_ARRAY = 8, 9


def _read_value(cur: _Cursor, vtype: int, key: str) -> Any:
    """One metadata value; numeric arrays become numpy arrays, strings lists."""
    if vtype in _SCALAR_FORMATS:
        return cur.unpack(_SCALAR_FORMATS[vtype], f"value of {key!r}")
    if vtype == _TYPE_STRING:
        return cur.string(f"value of {key!r}")
    if vtype != _TYPE_ARRAY:
        raise ModelLoadError(f"GGUF file {cur.path} is corrupt: key {key!r} has unknown type {vtype}")
    etype = cur.unpack("<I", f"array type of {key!r}")
    count = cur.unpack("<Q", f"array length of {key!r}")
    if etype in _ARRAY_DTYPES:
        dtype = np.dtype(_ARRAY_DTYPES[etype])
        cur.need(count * dtype.itemsize, f"array {key!r}")
        arr = np.frombuffer(cur.buf, dtype=dtype, count=count, offset=cur.pos).copy()
        cur.pos += count * dtype.itemsize
        return arr.astype(bool) if etype == 7 else arr
    if etype == _TYPE_STRING:
        cur.need(count * 8, f"array {key!r}")
        return [cur.string(f"element of {key!r}") for _ in range(count)]
    raise ModelLoadError(f"GGUF file {cur.path} is corrupt: array {key!r} has element type {etype}")


def _read_tensor_info(cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    """Name, GGUF shape, type and relative data offset of one tensor entry."""
    name = cur.string("tensor name")
    n_dims = cur.unpack("<I", f"dimension count of tensor {name!r}")
    if not 1 <= n_dims <= _GGML_MAX_DIMS:
        raise ModelLoadError(
            f"GGUF file {cur.path} is corrupt: tensor {name!r} has {n_dims} dimensions"
        )
    shape = tuple(cur.unpack("<Q", f"shape of tensor {name!r}") for _ in range(n_dims))
    qtype = cur.unpack("<I", f"type of tensor {name!r}")
    offset = cur.unpack("<Q", f"offset of tensor {name!r}")
    return name, shape, qtype, offset


def _tensor_nbytes(path: str, name: str, shape: tuple[int, ...], qtype: int) -> int:
    """Byte size of a tensor from its GGML block size and type size."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    except (ValueError, KeyError):
        raise ModelLoadError(
            f"GGUF file {path} is corrupt or too new: tensor {name!r} has unknown type {qtype}"
        ) from None
    if shape[0] % block_size:
        raise ModelLoadError(
            f"GGUF file {path} is corrupt: tensor {name!r} row length {shape[0]} is not a "
            f"multiple of the block size {block_size}"
        )
    return int(np.prod(shape, dtype=np.uint64)) // block_size * type_size


def _parse_gguf(buf: mmap.mmap, path: str) -> GGUFHeader:
    """Parse magic, version, metadata and tensor table; validate the table against the file."""
    cur = _Cursor(buf, path)
    magic = buf[:4]
    if magic != _GGUF_MAGIC:
        raise ModelLoadError(f"{path} is not a GGUF file (bad magic {magic!r})")
    cur.pos = 4
    version = cur.unpack("<I", "version")
    if version not in (2, 3):
        raise ModelLoadError(f"GGUF file {path} has unsupported version {version} (expected 2 or 3)")
    n_tensors = cur.unpack("<Q", "tensor count")
    n_kv = cur.unpack("<Q", "metadata count")
    if n_tensors > cur.size // 24 or n_kv > cur.size // 12:
        raise ModelLoadError(
            f"GGUF file {path} is truncated or corrupt: header claims {n_tensors} tensors and {n_kv} "
            f"metadata keys in a file of {cur.size} bytes"
        )
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string("metadata key")
        metadata[key] = _read_value(cur, cur.unpack("<I", f"type of {key!r}"), key)
    infos = [_read_tensor_info(cur) for _ in range(n_tensors)]
    alignment = int(metadata.get("general.alignment", _GGUF_DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise ModelLoadError(f"GGUF file {path} is corrupt: alignment {alignment}")
    data_start = -(-cur.pos // alignment) * alignment
    tensors: dict[str, GGUFTensorInfo] = {}
    for name, shape, qtype, rel in infos:
        if name in tensors:
            raise ModelLoadError(f"GGUF file {path} is corrupt: tensor {name!r} appears twice")
        if any(d < 1 for d in shape):
            raise ModelLoadError(f"GGUF file {path} is corrupt: tensor {name!r} has shape {shape}")
        if rel % alignment:
            raise ModelLoadError(
                f"GGUF file {path} is corrupt: tensor {name!r} has offset {rel}, not a multiple of "
                f"the alignment {alignment}"
            )
        n_bytes = _tensor_nbytes(path, name, shape, qtype)
        tensors[name] = GGUFTensorInfo(name, shape, qtype, data_start + rel, n_bytes)
    check_tensor_table(path, cur.size, data_start, alignment, list(tensors.values()))
    return GGUFHeader(path=path, metadata=metadata, tensors=tensors)


def check_tensor_table(path: str, size: int, data_start: int, alignment: int,
                       tensors: list[GGUFTensorInfo]) -> None:
    """Every tensor inside the file, none overlapping another, and no unexplained gap.

    GGUF writers place each tensor at the next multiple of the alignment after the previous one,
    so a gap of ``alignment`` bytes or more between two tensors means a type or shape that does
    not match the offsets (e.g. a Q4_1 tensor relabelled Q4_0 is 10% shorter than its slot).
    """
    expected = data_start
    for t in sorted(tensors, key=lambda t: t.offset):
        end = t.offset + t.n_bytes
        if end > size:
            raise ModelLoadError(
                f"GGUF file {path} is truncated: tensor {t.name!r} needs bytes up to {end} "
                f"but the file has {size}"
            )
        if t.offset < expected:
            raise ModelLoadError(
                f"GGUF file {path} is corrupt: tensor {t.name!r} at byte {t.offset} overlaps the "
                f"previous tensor, which ends at byte {expected}"
            )
        if t.offset - expected >= alignment:
            raise ModelLoadError(
                f"GGUF file {path} is corrupt: {t.offset - expected} bytes before tensor {t.name!r} "
                "belong to no tensor (a type or shape inconsistent with the offsets)"
            )
        expected = end
    if tensors and size - expected >= alignment:
        last = max(tensors, key=lambda t: t.offset)
        raise ModelLoadError(
            f"GGUF file {path} is corrupt: {size - expected} bytes after the last tensor {last.name!r} "
            "belong to no tensor (a type or shape inconsistent with the file size)"
        )


def read_gguf_header(path: str) -> GGUFHeader:
    """Parsed and validated header of a GGUF file (memoized per path, size, mtime)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc.strerror}") from None
    return _read_gguf_header_cached(os.path.abspath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _read_gguf_header_cached(path: str, size: int, mtime_ns: int) -> GGUFHeader:
    """Uncached worker of :func:`read_gguf_header`; the extra args form the cache key."""
    del mtime_ns  # only part of the memo key
    if size < 24:
        raise ModelLoadError(f"{path} is not a GGUF file (only {size} bytes)")
    start = time.perf_counter()
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            header = _parse_gguf(buf, path)
    except ModelLoadError:
        raise
    except (OSError, struct.error, ValueError, OverflowError, MemoryError) as exc:
        raise ModelLoadError(f"GGUF file {path} cannot be parsed: {exc}") from exc
    logger.debug("parsed GGUF header of %s in %.3f s", path, time.perf_counter() - start)
    return header

