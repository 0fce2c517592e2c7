"""Maps a checkpoint's `architectures` entry to the model class that runs it."""

from __future__ import annotations

from torch import nn

from pagedllm.models.gemma3 import Gemma3ForCausalLM
from pagedllm.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(config) -> type[nn.Module]:
    archs = list(getattr(config, "architectures", None) or [])
    if not archs and getattr(config, "model_type", None) in ("llama", "mistral", "qwen2"):
        archs = [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}[config.model_type]]
    if not archs and getattr(config, "model_type", None) == "gemma3_text":
        archs = ["Gemma3ForCausalLM"]
    for arch in archs:
        if arch in _MODELS:
            return _MODELS[arch]
    raise ValueError(f"model architecture {archs or getattr(config, 'model_type', None)} is not supported; "
                     f"supported: {', '.join(supported_architectures())}")
