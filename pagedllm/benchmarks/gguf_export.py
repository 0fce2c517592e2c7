"""Writes a GGUF model as an unquantized GGUF (F32, F16 or BF16) with the same metadata, so that a
peer (llama.cpp) runs exactly the weights pagedllm dequantizes, in the dtype being compared."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from pagedllm.utils import cache_dir

logger = logging.getLogger(__name__)

_OUT_TYPES = ("F32", "F16", "BF16")


def export_unquantized_gguf(src: str, out_type: str, dst: str | None = None) -> str:
    """Path of `src` rewritten with every tensor in `out_type` (cached next to other artefacts)."""
    import gguf

    if out_type not in _OUT_TYPES:
        raise ValueError(f"out_type must be one of {_OUT_TYPES}, got {out_type!r}")
    target = Path(dst) if dst else cache_dir() / "gguf" / f"{Path(src).stem}.{out_type}.gguf"
    if target.exists() and target.stat().st_mtime >= Path(src).stat().st_mtime:
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    qtype = getattr(gguf.GGMLQuantizationType, out_type)
    reader = gguf.GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    tmp = target.with_suffix(".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
    writer.add_file_type({"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
                          "BF16": gguf.LlamaFileType.MOSTLY_BF16}[out_type])
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        # 1-D tensors (norms) stay F32, as llama.cpp's converter keeps them.
        tt = qtype if data.ndim > 1 else gguf.GGMLQuantizationType.F32
        arr = data if tt == gguf.GGMLQuantizationType.F32 else gguf.quants.quantize(data, tt)
        writer.add_tensor(t.name, arr, raw_dtype=tt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(target)
    logger.info("wrote %s (%s)", target, out_type)
    return str(target)
