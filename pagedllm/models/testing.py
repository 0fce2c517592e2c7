"""Tiny random checkpoints (model + tokenizer) for tests that need a real folder.

:func:`make_tiny_checkpoint` writes a Hugging Face folder that loads with
``AutoModelForCausalLM`` / ``AutoTokenizer`` and with :mod:`pagedllm.models.loader`,
so engine tests can run end to end in well under a second per forward pass.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal

import torch

logger = logging.getLogger(__name__)

# The pad token doubles as the unknown token that transformers' Qwen2 tokenizer
# class adds when missing; keeping it in the vocabulary keeps len(tokenizer)
# equal for both architectures.
PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<|endoftext|>", "<s>", "</s>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, IM_START, IM_END]
"""Ids 0..4 in this order: pad=0, bos=1, eos=2."""

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '</s>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! This is a tiny tokenizer for engine tests.",
    "Paged attention stores the key value cache in fixed size blocks.",
    "Continuous batching schedules tokens, not phases, at every step.",
    "Once upon a time there was a small language model that counted 1 2 3 4 5.",
    "user assistant system: what is the capital of France? Paris.",
]


def build_tiny_tokenizer(vocab_size: int = 320):
    """A byte-level BPE tokenizer trained on a few sentences, with a chat template.

    Byte-level pre-tokenization means any text encodes and decodes losslessly.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size={vocab_size} is too small for a byte-level tokenizer "
            f"(needs at least {256 + len(SPECIAL_TOKENS)})"
        )
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_CORPUS, trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_tiny_checkpoint(
    out_dir: str,
    arch: Literal["qwen2", "llama", "qwen3"] = "qwen2",
    seed: int = 0,
    vocab_size: int = 320,
    tie: bool = False,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
) -> str:
    """Save a tiny random ``arch`` model and a matching tokenizer into ``out_dir``.

    The model has 2 layers, hidden size 64, 4 query heads and 2 KV heads (or the given counts;
    qwen3: heads of 32, its q/k norms' weights random around 1 so that they count); ``vocab_size`` is raised to the tokenizer's size if that is larger.
    Returns ``out_dir``.
    """
    from transformers import AutoModelForCausalLM

    tok = build_tiny_tokenizer(vocab_size)
    config = _tiny_config(arch, max(vocab_size, len(tok)), tie, num_attention_heads, num_key_value_heads)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if arch == "qwen3":  # from_config leaves the norms' weights at one
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    p.copy_(1.0 + 0.5 * torch.randn_like(p))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    logger.debug("saved tiny %s checkpoint to %s", arch, out)
    return str(out)


def _tiny_config(arch: str, vocab_size: int, tie: bool, num_heads: int = 4, num_kv_heads: int = 2):
    """Config of the tiny model (ids follow :data:`SPECIAL_TOKENS`)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    classes = {"qwen2": (Qwen2Config, "Qwen2ForCausalLM"), "llama": (LlamaConfig, "LlamaForCausalLM"),
               "qwen3": (Qwen3Config, "Qwen3ForCausalLM")}
    if arch not in classes:
        raise ValueError(f"arch={arch!r} is not supported; use one of {sorted(classes)}")
    config_cls, architecture = classes[arch]
    return config_cls(
        architectures=[architecture],
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        vocab_size=vocab_size,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=tie,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        dtype="float32",
        **({"head_dim": 32} if arch == "qwen3" else {}),
    )
