"""Hugging Face folders: safetensors shards, checked before reading, yielded as float32 tensors."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import torch

from pagedllm.models.loader.source import ModelLoadError, read_json

_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def safetensors_files(folder: Path) -> list[Path]:
    """All shard files of a folder (those named by an index file must exist)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        data = read_json(index, f"model.safetensors.index.json in {folder}")
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


def check_safetensors(path: Path) -> None:
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


def iterate_safetensors(files: list[Path], raw: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the files, as float32 (``raw``: in its stored dtype)."""
    from safetensors import safe_open

    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    if key.endswith(_SKIPPED_SUFFIXES):
                        continue
                    tensor = f.get_tensor(key)
                    yield key, tensor if raw else tensor.to(torch.float32)
        except ModelLoadError:
            raise
        except Exception as exc:  # SafetensorError, OSError, RuntimeError
            raise ModelLoadError(f"cannot read safetensors file {path}: {exc}") from exc

