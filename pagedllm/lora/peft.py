"""A PEFT LoRA adapter folder read and checked: `adapter_config.json` (rank, alpha, rsLoRA, target
modules) and `adapter_model.safetensors` (or `adapter_model.bin`), as PEFT's save_pretrained
writes them. Anything PEFT can put there that this engine would otherwise ignore is refused with a
ValueError naming it."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

_PREFIX = "base_model.model."
# Config fields whose non-default values change the math; refused rather than ignored.
_REFUSED = {
    "use_dora": (False, None),
    "fan_in_fan_out": (False, None),
    "lora_bias": (False, None),
    "layer_replication": (None,),
    "alpha_pattern": ({}, None),
    "trainable_token_indices": (None,),
    "use_qalora": (False, None),
}


@dataclass
class ModuleLoRA:
    """One adapted module: A [r, in], B [out, r] scaled by alpha / r (or alpha / sqrt(r))."""

    name: str
    """The module's checkpoint name, e.g. model.layers.0.self_attn.q_proj."""
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    a_name: str = ""
    """The file's name of A (and B) for messages; PEFT's `<name>.lora_A.weight` when empty."""
    b_name: str = ""

    def __post_init__(self) -> None:
        self.a_name = self.a_name or f"{self.name}.lora_A.weight"
        self.b_name = self.b_name or f"{self.name}.lora_B.weight"

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]


@dataclass
class PeftAdapter:
    path: str
    rank: int
    base_model: str | None
    modules: list[ModuleLoRA]


def _config(folder: Path) -> dict:
    f = folder / "adapter_config.json"
    if not f.is_file():
        raise ValueError(f"LoRA adapter {str(folder)!r}: no adapter_config.json in it")
    try:
        cfg = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"LoRA adapter {str(folder)!r}: adapter_config.json is not JSON ({e})") from None
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"LoRA adapter {str(folder)!r}: peft_type {cfg.get('peft_type')!r} is not LORA")
    if cfg.get("modules_to_save"):
        raise ValueError(f"LoRA adapter {str(folder)!r}: modules_to_save={cfg['modules_to_save']} (whole modules "
                         "trained beside the adapter) is not supported")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {str(folder)!r}: bias={cfg['bias']!r} (trained biases) is not supported")
    for key, allowed in _REFUSED.items():
        if key in cfg and cfg[key] not in allowed:
            raise ValueError(f"LoRA adapter {str(folder)!r}: {key}={cfg[key]!r} is not supported")
    return cfg


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    st = folder / "adapter_model.safetensors"
    if st.is_file():
        from safetensors.torch import load_file

        try:
            return load_file(str(st))
        except Exception as e:  # a corrupt or truncated file
            raise ValueError(f"LoRA adapter {str(folder)!r}: cannot read adapter_model.safetensors ({e})") from None
    pt = folder / "adapter_model.bin"
    if pt.is_file():
        try:
            return torch.load(str(pt), map_location="cpu", weights_only=True)
        except Exception as e:
            raise ValueError(f"LoRA adapter {str(folder)!r}: cannot read adapter_model.bin ({e})") from None
    raise ValueError(f"LoRA adapter {str(folder)!r}: no adapter_model.safetensors (or adapter_model.bin) in it")


def both_halves(path: str, label: str, ab: dict, keys: tuple[str, str]) -> tuple:
    """ab[keys[0]], ab[keys[1]] (A's and B's entries of one module); a ValueError naming the
    module (`label`) and the missing half."""
    for key in keys:
        if key not in ab:
            raise ValueError(f"LoRA adapter {path!r}: {label} has no {key} tensor")
    return ab[keys[0]], ab[keys[1]]


def read_peft_adapter(path: str, max_rank: int) -> PeftAdapter:
    """The adapter's modules with B pre-scaled; a ValueError naming the file, field or tensor for
    anything this engine cannot serve exactly (rank over `max_rank` among them)."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"LoRA adapter path {path!r} is not a folder")
    cfg = _config(folder)
    alpha = float(cfg.get("lora_alpha", cfg.get("r", 8)))
    rslora = bool(cfg.get("use_rslora", False))
    tensors = _tensors(folder)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        name = key.removeprefix(_PREFIX)
        for part in ("lora_A", "lora_B"):
            for suffix in (f".{part}.weight", f".{part}.default.weight"):
                if name.endswith(suffix):
                    pairs.setdefault(name[: -len(suffix)], {})[part] = t
                    break
            else:
                continue
            break
        else:
            raise ValueError(f"LoRA adapter {path!r}: tensor {key!r} is neither a lora_A nor a lora_B weight "
                             "(embedding adapters and trained modules are not supported)")
    if not pairs:
        raise ValueError(f"LoRA adapter {path!r}: adapter_model holds no LoRA tensors")
    modules = []
    for name, ab in sorted(pairs.items()):
        a, b = both_halves(path, f"module {name!r}", ab, ("lora_A", "lora_B"))
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"LoRA adapter {path!r}: tensor {name}.lora_A {tuple(a.shape)} and lora_B "
                             f"{tuple(b.shape)} do not share a rank")
        r = a.shape[0]
        if r > max_rank:
            raise ValueError(f"LoRA adapter {path!r}: tensor {name}.lora_A has rank {r}, over --max-lora-rank "
                             f"{max_rank}")
        scale = alpha / math.sqrt(r) if rslora else alpha / r
        modules.append(ModuleLoRA(name, a.float(), b.float() * scale))
    return PeftAdapter(path, max(m.rank for m in modules), cfg.get("base_model_name_or_path"), modules)
