"""The GGUF reader refuses a file it cannot trust: seeded mutants of a GGUF either read back the
same tensors as the intact file or fail with one ModelLoadError naming the problem."""

from __future__ import annotations

import random
import shutil
import struct
import time
from pathlib import Path

import gguf
import numpy as np
import pytest

from pagedllm.models.loader import ModelLoadError, read_gguf_header, resolve_model


def _tiny_gguf(path: Path) -> bytes:
    """A small GGUF with string/array metadata and Q4_1, Q8_0, Q4_0 and F32 tensors."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_token_list([f"tok{i}" for i in range(40)])
    w.add_array("test.ints", list(range(12)))
    w.add_string("test.text", "hello")
    T = gguf.GGMLQuantizationType
    for name, qt, shape in (("blk.0.attn_q.weight", T.Q4_1, (64, 64)), ("blk.0.ffn_up.weight", T.Q8_0, (96, 64)),
                            ("blk.0.ffn_down.weight", T.Q4_0, (64, 96)), ("blk.0.attn_norm.weight", T.F32, (64,))):
        x = rng.standard_normal(shape).astype(np.float32)
        data = x if qt == T.F32 else gguf.quants.quantize(x, qt)
        w.add_tensor(name, data, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def _table(path: Path) -> dict[str, tuple]:
    header = read_gguf_header(str(path))
    data = path.read_bytes()
    return {t.name: (t.shape, t.qtype, data[t.offset : t.offset + t.n_bytes]) for t in header.tensors.values()}


def _header_end(blob: bytes, path: Path) -> int:
    header = read_gguf_header(str(path))
    return min(t.offset for t in header.tensors.values())


def _mutants(blob: bytes, header_end: int, info_start: int, n: int, seed: int):
    rng = random.Random(seed)
    kinds = ("truncate", "flip", "u64", "u32")
    for i in range(n):
        kind = kinds[i % len(kinds)]
        b = bytearray(blob)
        if kind == "truncate":
            yield kind, bytes(b[: rng.randrange(0, len(b))])
            continue
        if kind == "flip":
            pos = rng.randrange(0, header_end)
            b[pos] ^= 1 << rng.randrange(8)
        else:
            # a length, count, dim, type or offset field: rewrite a little-endian integer in the
            # tensor-info table or the metadata with a nearby or extreme value
            fmt, size = ("<Q", 8) if kind == "u64" else ("<I", 4)
            pos = rng.randrange(info_start if rng.random() < 0.7 else 8, header_end - size)
            old = struct.unpack_from(fmt, b, pos)[0]
            new = rng.choice([0, 1, old + 1, old - 1 if old else 2, old + 16, old * 2, 2 ** (8 * size) - 1,
                              old ^ (1 << rng.randrange(8 * size))])
            struct.pack_into(fmt, b, pos, new % 2 ** (8 * size))
        yield kind, bytes(b)


def test_fuzzed_headers_load_identically_or_fail_clearly(tmp_path: Path) -> None:
    intact = tmp_path / "intact.gguf"
    blob = _tiny_gguf(intact)
    reference = _table(intact)
    header_end = _header_end(blob, intact)
    info_start = blob.index(b"blk.0.attn_q.weight") - 8
    outcomes = {"same": 0, "error": 0}
    start = time.perf_counter()
    for i, (kind, data) in enumerate(_mutants(blob, header_end, info_start, n=300, seed=1234)):
        path = tmp_path / f"m{i}.gguf"
        path.write_bytes(data)
        try:
            table = _table(path)
        except ModelLoadError as e:
            assert str(path) in str(e), (kind, str(e))
            outcomes["error"] += 1
        else:
            # A renamed tensor is caught by the model's missing-tensor check, a changed shape (a dim
            # shrunk within the alignment padding) by its shape check; the same shape must read the same data.
            for k, v in table.items():
                if k in reference and v[0] == reference[k][0]:
                    assert v == reference[k], f"mutant {i} ({kind}) reads different data for {k}"
            outcomes["same"] += 1
        path.unlink()
    assert outcomes["error"] > 100
    assert time.perf_counter() - start < 30


def _rewrite_tensor_field(src: Path, dst: Path, name: str, field: str, value: int) -> None:
    """Copy the default model with one field of one tensor-info entry replaced."""
    shutil.copyfile(src, dst)
    header = read_gguf_header(str(src))
    t = header.tensors[name]
    with open(dst, "r+b") as f:
        head = f.read(min(t.offset, 8 << 20))
        pos = head.index(name.encode()) + len(name)
        n_dims = struct.unpack_from("<I", head, pos)[0]
        type_pos = pos + 4 + 8 * n_dims
        where, fmt = {"type": (type_pos, "<I"), "offset": (type_pos + 4, "<Q")}[field]
        if field == "offset" and value < 0:
            value = struct.unpack_from("<Q", head, where)[0] - value
        f.seek(where)
        f.write(struct.pack(fmt, value))


@pytest.mark.parametrize("field,value,match", [
    ("offset", -16, "not a multiple of the alignment"),  # moved 16 bytes: off the 32-byte alignment
    ("offset", 0, "overlaps the previous tensor"),
    ("type", 1, "overlaps|belong to no tensor"),  # Q4_1 relabelled F16
])
def test_default_model_mutants_named_clearly(tmp_path: Path, field: str, value: int, match: str) -> None:
    src = Path(resolve_model(None).path)
    name = "blk.3.ffn_up.weight"
    dst = tmp_path / "mutant.gguf"
    _rewrite_tensor_field(src, dst, name, field, value)
    with pytest.raises(ModelLoadError, match=match) as info:
        read_gguf_header(str(dst))
    assert "tensor '" in str(info.value)
