"""Tokenizer access: encoding, chat templates (rendered by transformers in a sandboxed Jinja
environment) and the Rust tokenizer used for incremental decoding."""

from __future__ import annotations

import logging
from typing import Any

from tokenizers import Tokenizer as RustTokenizer

logger = logging.getLogger(__name__)


class TokenizerWrapper:
    def __init__(self, hf_tokenizer: Any, chat_template: str | None = None) -> None:
        self.hf = hf_tokenizer
        self.chat_template = chat_template
        backend = getattr(hf_tokenizer, "backend_tokenizer", None) or getattr(hf_tokenizer, "_tokenizer", None)
        if not isinstance(backend, RustTokenizer):
            raise ValueError(f"tokenizer {type(hf_tokenizer).__name__} has no fast (Rust) backend")
        self.rust: RustTokenizer = backend

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.rust.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        template = chat_template or self.chat_template
        if template is None and getattr(self.hf, "chat_template", None) is None:
            raise ValueError("this model's tokenizer has no chat template; pass one with --chat-template")
        try:
            return self.hf.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message,
                chat_template=template,
                **kwargs,
            )
        except ValueError:
            raise
        except Exception as e:  # template errors (jinja2 TemplateError, sandbox violations) are input errors
            raise ValueError(f"cannot render the chat template: {e}") from e
