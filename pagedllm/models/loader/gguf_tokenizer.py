"""The pre-tokenizer a GGUF vocabulary names (``tokenizer.ggml.pre``), for the types transformers'
GGUF conversion leaves at GPT-2's.

A byte-level BPE vocabulary only tokenizes like the model's own tokenizer when the text is first cut
into pieces the way its merges were learned. A GGUF records that cut as a name in
``tokenizer.ggml.pre`` (llama.cpp's names: the converter picks the name whose pre-tokenizer
reproduces the original tokenizer's output on a reference text). transformers maps some names to
their split regex and builds every other byte-level vocabulary with GPT-2's regex alone. For the
names below that is wrong: their original tokenizers first cut every digit out on its own (the
``tokenizer.json`` of SmolLM/SmolLM2, StarCoder and the others says ``Digits(individual_digits=true)``
before ``ByteLevel``). Without that cut, ``"\\n   2"`` becomes ``"\\n  "``, ``" "``, ``"2"``
(GPT-2's ``\\s+(?!\\S)`` leaves the space before the digit to ``" ?\\p{N}+"``) where the model's
tokenizer and llama.cpp give ``"\\n   "``, ``"2"``: one token more on every indented number, 153
more on the Python reference corpus (113,108 tokens instead of 112,955).
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

TOKENIZER_FORMAT = 2
"""Version of the converted tokenizer; part of the cache key, so that a folder converted before a
fix here is converted again."""

DIGITS_THEN_GPT2 = frozenset({
    "smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b", "mellum2",
})
"""Pre-tokenizer names whose vocabularies cut each digit out, then apply GPT-2's regex (llama.cpp
gives them all the same two regexes: ``\\p{N}``, then GPT-2's)."""

GPT2_ONLY = frozenset({
    "default", "gpt2", "gpt-2", "phi-2", "mpt", "olmo", "jais", "roberta-bpe", "jina-v1-en", "jina-es",
    "jina-de", "jina-v2-es", "jina-v2-de", "jina-v2-code", "gigachat", "a.x-4.0", "mellum", "modern-bert",
    "exaone4", "trillion", "granite-docling",
})
"""Names whose pre-tokenizer is GPT-2's regex alone: transformers' default is already right."""


def _is_plain_byte_level(pre: Any) -> bool:
    return pre is not None and type(pre).__name__ == "ByteLevel"


def apply_gguf_pre_tokenizer(tok: Any, pre_name: str | None) -> bool:
    """Give ``tok`` (a transformers fast tokenizer built from a GGUF) the pre-tokenizer ``pre_name``
    stands for, where transformers left GPT-2's; True when it was changed.

    A name this table does not know, on a vocabulary transformers left at GPT-2's regex, is logged:
    its text may be cut differently from the model's own tokenizer and llama.cpp.
    """
    from tokenizers import pre_tokenizers

    backend = tok.backend_tokenizer
    if pre_name is None or not _is_plain_byte_level(backend.pre_tokenizer):
        return False  # no name, or transformers already set this name's own split (or a non-byte-level one)
    if pre_name in DIGITS_THEN_GPT2:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ])
        return True
    if pre_name not in GPT2_ONLY:
        logger.warning("GGUF pre-tokenizer %r is not known to pagedllm; the text is cut with GPT-2's regex, "
                       "which may tokenize differently from the model's own tokenizer and llama.cpp", pre_name)
    return False
