"""Maps a checkpoint's `architectures` entry to the model class that runs it."""

from __future__ import annotations

from torch import nn

from pagedllm.models.bert import BertForSequenceClassification, BertModel
from pagedllm.models.embedding import decoder_embedding_model
from pagedllm.models.gemma3 import Gemma3ForCausalLM
from pagedllm.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from pagedllm.models.moe import MixtralForCausalLM, OlmoeForCausalLM, Qwen3MoeForCausalLM
from pagedllm.models.phi3 import Phi3ForCausalLM
from pagedllm.models.qwen3 import Qwen3ForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    # pooling models: encoders, a cross-encoder, decoders without their LM head
    "BertModel": BertModel,
    "BertForSequenceClassification": BertForSequenceClassification,
    "LlamaModel": decoder_embedding_model(LlamaForCausalLM, "LlamaModel"),
    "MistralModel": decoder_embedding_model(MistralForCausalLM, "MistralModel"),
    "Qwen2Model": decoder_embedding_model(Qwen2ForCausalLM, "Qwen2Model"),
    "Qwen3Model": decoder_embedding_model(Qwen3ForCausalLM, "Qwen3Model"),
}
# config.json's model_type -> architecture, for configs without `architectures`
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "bert": "BertModel",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(config) -> type[nn.Module]:
    archs = list(getattr(config, "architectures", None) or [])
    if not archs and getattr(config, "model_type", None) in _MODEL_TYPES:
        archs = [_MODEL_TYPES[config.model_type]]
    if not archs and getattr(config, "model_type", None) == "gemma3_text":
        archs = ["Gemma3ForCausalLM"]
    for arch in archs:
        if arch in _MODELS:
            return _MODELS[arch]
    raise ValueError(f"model architecture {archs or getattr(config, 'model_type', None)} is not supported; "
                     f"supported: {', '.join(supported_architectures())}")
