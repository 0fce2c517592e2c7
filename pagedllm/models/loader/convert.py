"""Writing a GGUF out as a plain float32 Hugging Face folder (the reference for correctness tests)."""

from __future__ import annotations

from pathlib import Path

from pagedllm.models.loader.config import load_hf_config
from pagedllm.models.loader.gguf_tokenizer import TOKENIZER_FORMAT
from pagedllm.models.loader.resolve import gguf_source, resolve_model
from pagedllm.models.loader.source import file_cache_key, publish_dir
from pagedllm.models.loader.tokenizer import load_tokenizer
from pagedllm.models.loader.weights import iterate_weights
from pagedllm.utils import cache_dir


def convert_gguf_to_hf(gguf_path: str, out_dir: str) -> str:
    """Write a plain fp32 Hugging Face folder (config, weights, tokenizer) for a GGUF.

    The folder loads with ``AutoModelForCausalLM.from_pretrained(out_dir)`` as
    an ordinary float32 model; tied models get no ``lm_head.weight``.
    """
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    source = gguf_source(Path(gguf_path).expanduser(), Path(gguf_path).stem)
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
    """The default GGUF converted once into a Hugging Face folder in the cache (the key names the
    tokenizer conversion's version, so that a folder saved with an older tokenizer is not reused)."""
    source = resolve_model(None)
    final = cache_dir() / "hf" / f"{source.name}-{file_cache_key(source.path)}-t{TOKENIZER_FORMAT}"
    if not final.is_dir():
        publish_dir(final, lambda tmp: convert_gguf_to_hf(source.path, str(tmp)))
    return str(final)
