"""Writes a GGUF model as an unquantized GGUF (F32, F16 or BF16) with the same metadata, so that a
peer (llama.cpp) runs exactly the weights pagedllm dequantizes, in the dtype being compared; and
re-quantizes it with llama.cpp's own quantizer (Q4_0, Q8_0, ...), the reference producer."""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import numpy as np

from pagedllm.utils import cache_dir

logger = logging.getLogger(__name__)

_OUT_TYPES = ("F32", "F16", "BF16")


def _target(src: str, name: str, dst: str | None) -> tuple[Path, bool]:
    """Where an export of `src` goes (`dst`, else the cache's `gguf/<stem of src>.<name>.gguf`), its
    folder made, and whether it is there already, no older than `src`."""
    target = Path(dst) if dst else cache_dir() / "gguf" / f"{Path(src).stem}.{name}.gguf"
    if target.exists() and target.stat().st_mtime >= Path(src).stat().st_mtime:
        return target, True
    target.parent.mkdir(parents=True, exist_ok=True)
    return target, False


def export_unquantized_gguf(src: str, out_type: str, dst: str | None = None) -> str:
    """Path of `src` rewritten with every tensor in `out_type` (cached next to other artefacts)."""
    import gguf

    if out_type not in _OUT_TYPES:
        raise ValueError(f"out_type must be one of {_OUT_TYPES}, got {out_type!r}")
    target, fresh = _target(src, out_type, dst)
    if fresh:
        return str(target)
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


LLAMACPP_QUANT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K_M", "Q5_K_M", "Q6_K")


def llamacpp_quantized_gguf(src: str, qtype: str, peers_venv: str | None = None, threads: int = 2,
                            dst: str | None = None) -> str:
    """Path of `src` quantized to `qtype` by llama.cpp's ``llama_model_quantize`` (llama-cpp-python in
    the peers' environment), from `src` itself where it is unquantized (F32, F16, BF16), else from
    its F32 export; written to `dst`, else cached like the unquantized exports.

    llama.cpp's defaults apply (as ``llama-quantize`` makes them): the tied token embedding of a
    model whose width is not a multiple of 256 becomes Q8_0, norms stay F32.
    """
    from pagedllm.benchmarks.throughput import BackendUnavailable, peers_python, run_child

    if qtype not in LLAMACPP_QUANT_TYPES:
        raise ValueError(f"qtype must be one of {LLAMACPP_QUANT_TYPES}, got {qtype!r}")
    target, fresh = _target(src, f"{qtype}.llamacpp", dst)
    if fresh:
        return str(target)
    # An unquantized source is read as it is (its values are exact in float32); else its F32 export.
    f32 = src if _is_unquantized(src) else export_unquantized_gguf(src, "F32")
    python = peers_python(peers_venv)
    tmp = target.with_suffix(".tmp")
    spec = {"backend": "llama.cpp", "tag": f"llama.cpp-quantize-{qtype}", "model_path": f32, "output": str(tmp),
            "quantize": qtype, "threads": threads}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with tempfile.TemporaryDirectory(prefix="pagedllm-quantize-") as workdir:
        run = run_child([str(python), str(Path(__file__).with_name("llamacpp_worker.py"))], env, spec, workdir, None)
    if run.returncode != 0 or not tmp.exists():
        raise BackendUnavailable(f"llama.cpp quantize to {qtype} failed: "
                                 f"{run.result.get('error') or f'exit code {run.returncode}'}")
    tmp.replace(target)
    logger.info("wrote %s (%s, llama.cpp %s)", target, qtype, run.result.get("llama_cpp_version"))
    return str(target)


def _is_unquantized(path: str) -> bool:
    """Whether every tensor of the GGUF `path` is F32, F16 or BF16."""
    import gguf

    return all(t.tensor_type.name in _OUT_TYPES for t in gguf.GGUFReader(path).tensors)
