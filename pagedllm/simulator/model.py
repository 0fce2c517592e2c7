"""The shape of the simulated model: any Llama-shaped decoder, from a config alone."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedllm.benchmarks.flops import ModelShape


class ModelConfigError(ValueError):
    """A model config for the simulator that cannot be read; the message names the value."""


# Published shapes, usable by name with --model-config.
BUILTIN_SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "intermediate": 14336,
                  "vocab": 128256, "dtype_bytes": 2},
    "llama3-70b": {"layers": 80, "hidden": 8192, "heads": 64, "kv_heads": 8, "intermediate": 28672,
                   "vocab": 128256, "dtype_bytes": 2},
    "smollm2-135m": {"layers": 30, "hidden": 576, "heads": 9, "kv_heads": 3, "intermediate": 1536,
                     "vocab": 49152, "dtype_bytes": 4, "tied": True},
}
_REQUIRED = ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "dtype_bytes")


@dataclass(frozen=True)
class SimModel:
    """A model shape plus the bytes per weight and per KV element."""

    name: str
    shape: ModelShape
    dtype_bytes: int
    """Bytes per weight and per KV cache element (4 float32, 2 bf16/fp16, 1 fp8)."""

    @property
    def kv_bytes_per_token(self) -> int:
        return self.shape.kv_bytes_per_token(self.dtype_bytes)

    @property
    def weight_bytes(self) -> int:
        return self.shape.total_params * self.dtype_bytes

    @property
    def flops_per_token(self) -> float:
        """Linear layers of one token through the decoder: 2 FLOPs per weight."""
        return 2.0 * self.shape.decoder_params

    @property
    def lm_head_flops(self) -> float:
        """Logits of one sampled row."""
        return 2.0 * self.shape.hidden * self.shape.vocab

    @property
    def attention_flops_per_pair(self) -> float:
        """QK^T and PV of one (query, key) pair over all layers."""
        s = self.shape
        return 4.0 * s.layers * s.heads * s.head_dim

    @classmethod
    def from_dict(cls, data: dict[str, Any], name: str = "model") -> SimModel:
        missing = [k for k in _REQUIRED if k not in data]
        if missing:
            raise ModelConfigError(f"model config {name!r} lacks {missing} (needs {list(_REQUIRED)})")
        try:
            vals = {k: int(data[k]) for k in _REQUIRED}
        except (TypeError, ValueError):
            raise ModelConfigError(f"model config {name!r}: {list(_REQUIRED)} must be integers") from None
        bad = {k: v for k, v in vals.items() if v < 1}
        if bad:
            raise ModelConfigError(f"model config {name!r}: values must be positive, got {bad}")
        if vals["heads"] % vals["kv_heads"]:
            raise ModelConfigError(f"model config {name!r}: heads={vals['heads']} is not a multiple of "
                                   f"kv_heads={vals['kv_heads']}")
        head_dim = int(data.get("head_dim") or vals["hidden"] // vals["heads"])
        shape = ModelShape(hidden=vals["hidden"], intermediate=vals["intermediate"], layers=vals["layers"],
                           heads=vals["heads"], kv_heads=vals["kv_heads"], head_dim=head_dim,
                           vocab=vals["vocab"], tied=bool(data.get("tied", False)))
        return cls(str(data.get("name", name)), shape, vals["dtype_bytes"])

    def to_dict(self) -> dict[str, Any]:
        s = self.shape
        return {"name": self.name, "layers": s.layers, "hidden": s.hidden, "heads": s.heads,
                "kv_heads": s.kv_heads, "head_dim": s.head_dim, "intermediate": s.intermediate,
                "vocab": s.vocab, "tied": s.tied, "dtype_bytes": self.dtype_bytes}


def load_model_config(spec: str) -> SimModel:
    """A built-in shape name (llama3-8b, llama3-70b, smollm2-135m) or a JSON file."""
    if spec in BUILTIN_SHAPES:
        return SimModel.from_dict(BUILTIN_SHAPES[spec], spec)
    data = read_json_object(spec, "--model-config", sorted(BUILTIN_SHAPES), ModelConfigError)
    return SimModel.from_dict(data, Path(spec).stem)


def read_json_object(spec: str, flag: str, builtins: list[str], error: type[ValueError]) -> dict[str, Any]:
    """The JSON object in file `spec`; `error` names the flag and the problem."""
    path = Path(spec)
    if not path.is_file():
        raise error(f"{flag} {spec!r} is neither a file nor one of {builtins}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise error(f"{flag} {spec!r} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise error(f"{flag} {spec!r} must hold a JSON object")
    return data


def model_from_checkpoint(model: str | None, dtype: str = "auto") -> SimModel:
    """The shape of a model folder or GGUF file (or the embedded default), as the engine reads it."""
    from pagedllm.models.loader import load_hf_config, resolve_model

    source = resolve_model(model)
    shape = ModelShape.from_hf_config(load_hf_config(source))
    itemsize = 4 if dtype in ("auto", "float32") else 2
    return SimModel(source.name, shape, itemsize)
