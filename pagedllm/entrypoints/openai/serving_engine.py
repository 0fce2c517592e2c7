"""What /v1/completions and /v1/chat/completions share: model names, prompt checks, chat
rendering, logprob entries and the one run loop (`OpenAIServing.run`). Errors live in errors.py,
the engine call with disconnect handling in engine_call.py, the sampling mapping in sampling.py."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response

from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.output_processor import TokenTexts
from pagedllm.entrypoints.openai.engine_call import (
    ClientDisconnected,
    EngineCall,
    EnginePrompt,
    await_unless_disconnected,
)
from pagedllm.entrypoints.openai.errors import OpenAIError, ServerState, bad_request, to_openai_error
from pagedllm.entrypoints.openai.protocol import ChatMessage, PromptTokenUsageInfo, SamplingFields, UsageInfo
from pagedllm.entrypoints.openai.sampling import sampling_params_from_request
from pagedllm.entrypoints.openai.streaming import EngineStreamingResponse, sse
from pagedllm.outputs import Logprob, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")

# JSON has no infinity: logprobs of impossible tokens are reported as this.
MIN_LOGPROB = -9999.0
# Prompts longer than this (characters) are tokenized on a worker thread, not the event loop.
_THREAD_TOKENIZE_CHARS = 20_000


# Arguments of the tokenizer's apply_chat_template that a request's chat_template_kwargs may not
# override (they would change what is rendered or returned, not only the template's variables).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


def clamp_logprob(x: float) -> float:
    return x if x > MIN_LOGPROB else MIN_LOGPROB  # also maps -inf (and NaN) to the floor


class OpenAIServing:
    """Shared state and helpers of the serving classes."""

    def __init__(
        self,
        async_engine: AsyncLLMEngine,
        served_model_names: list[str],
        max_logprobs: int = 20,
        chat_template: str | None = None,
        state: ServerState | None = None,
    ) -> None:
        self.async_engine = async_engine
        self.state = state or ServerState()
        self.processor = async_engine.processor
        self.tokenizer = async_engine.tokenizer
        self.served_model_names = list(served_model_names)
        self.max_logprobs = max_logprobs
        self.chat_template = chat_template
        self.max_model_len = async_engine.model_config.max_model_len
        self.token_text = TokenTexts(self.tokenizer.rust)

    # ---- checks ---------------------------------------------------------------------------
    def model_name(self, requested: str | None) -> str:
        """The served name a request asks for: the base model's or a LoRA adapter's (404 otherwise)."""
        if requested is None or requested == "":
            return self.served_model_names[0]
        loras = self.state.loras
        if requested not in self.served_model_names and (loras is None or loras.get(requested) is None):
            available = self.served_model_names + (list(loras.by_name) if loras is not None else [])
            available += self.state.models.names() if self.state.models is not None else []
            raise OpenAIError(
                404,
                f"The model `{requested}` does not exist. Available: {', '.join(available)}",
                type="not_found_error",
                param="model",
                code="model_not_found",
            )
        return requested

    @staticmethod
    def log_ignored_fields(body: Any) -> None:
        extra = getattr(body, "model_extra", None)
        if extra:
            logger.warning("ignoring unknown request fields: %s", sorted(extra))

    def check_logprobs(self, value: int | None, name: str) -> None:
        if value is None:
            return
        if value < 0:
            raise bad_request(f"{name} must be non-negative, got {value}", name)
        if value > self.max_logprobs:
            raise bad_request(f"{name}={value} is more than the server's limit of {self.max_logprobs}", name)

    def check_length(self, prompts: list[EnginePrompt], max_tokens: int | None, what: str = "prompt") -> None:
        """Rejects prompts that, with max_tokens, do not fit in max_model_len (naming both numbers)."""
        m = self.max_model_len
        for p in prompts:
            n = len(p.token_ids)
            if max_tokens is None:
                if n >= m:
                    raise bad_request(
                        f"This model's maximum context length is {m} tokens, but the {what} has {n} tokens "
                        f"and leaves no room to generate. Please reduce the length of the {what}.",
                        "messages" if what == "messages" else "prompt",
                    )
            elif n + max_tokens > m:
                raise bad_request(
                    f"This model's maximum context length is {m} tokens. However, you requested "
                    f"{n + max_tokens} tokens ({n} in the {what}, {max_tokens} in the completion). "
                    f"Please reduce the length of the {what} or max_tokens.",
                    "max_tokens",
                )

    # ---- prompts --------------------------------------------------------------------------
    def prompt_from_text(self, text: str, add_special_tokens: bool = True) -> EnginePrompt:
        if text == "":
            raise bad_request("prompt must not be empty", "prompt")
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        _, ids = self.processor.tokenize_prompt({"prompt": text, "prompt_token_ids": ids})
        return EnginePrompt(ids, text)

    def prompt_from_ids(self, ids: list[int]) -> EnginePrompt:
        if not ids:
            raise bad_request("prompt must not be empty", "prompt")
        _, ids = self.processor.tokenize_prompt(list(ids))
        return EnginePrompt(ids, None)

    def prompt_text(self, p: EnginePrompt) -> str:
        if p.text is None:
            p.text = self.tokenizer.decode(p.token_ids, skip_special_tokens=False)
        return p.text

    def render_chat(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
        documents: list[dict[str, Any]] | None = None,
        add_special_tokens: bool = False,
        tools: list[dict[str, Any]] | None = None,
        tool_format: Any = None,
    ) -> EnginePrompt:
        """The conversation through the chat template (vLLM's `documents` are the template's RAG
        documents; `add_special_tokens` adds the tokenizer's BOS on top of the template's)."""
        if add_generation_prompt and continue_final_message:
            raise bad_request("add_generation_prompt and continue_final_message cannot both be true")
        reserved = RESERVED_TEMPLATE_KWARGS.intersection(template_kwargs or {})
        if reserved:
            raise bad_request(f"chat_template_kwargs may not set {sorted(reserved)}", "chat_template_kwargs")
        conversation = [message_to_dict(m) for m in messages]
        tool_kwargs: dict[str, Any] = {}
        if tool_format is not None:  # tools and tool history (tool_parsers/prompt.py)
            from pagedllm.entrypoints.openai.tool_parsers.prompt import tool_conversation

            template = self.chat_template or getattr(self.tokenizer.hf, "chat_template", None)
            conversation, tool_kwargs = tool_conversation(conversation, tools, tool_format, template)
        if continue_final_message and conversation[-1]["role"] != "assistant":
            raise bad_request("continue_final_message needs an assistant message last", "messages")
        text = self.tokenizer.apply_chat_template(
            conversation,
            add_generation_prompt=add_generation_prompt,
            chat_template=self.chat_template,
            continue_final_message=continue_final_message,
            **({"documents": documents} if documents is not None else {}),
            **tool_kwargs,
            **(template_kwargs or {}),
        )
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        if not ids:
            raise bad_request("the rendered conversation is empty", "messages")
        _, ids = self.processor.tokenize_prompt({"prompt": text, "prompt_token_ids": ids})
        return EnginePrompt(ids, text)

    async def run_blocking(self, fn: Callable[[], T], size: int) -> T:
        """Runs tokenization inline, or on a worker thread when the input is large."""
        if size < _THREAD_TOKENIZE_CHARS:
            return fn()
        return await asyncio.to_thread(fn)

    # ---- running ----------------------------------------------------------------------
    def sampling_params(
        self,
        body: SamplingFields,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None,
        output_kind: RequestOutputKind,
    ) -> SamplingParams:
        return sampling_params_from_request(
            body, self.async_engine.model_config.vocab_size, max_tokens, logprobs, prompt_logprobs, output_kind,
            self.async_engine.config.structured_outputs_config,
        )

    async def run(
        self,
        raw_request: Request | None,
        request_id: str,
        prompts: list[EnginePrompt],
        params: SamplingParams,
        body: Any,
        stream: Callable[[EngineCall, list[RequestOutput]], AsyncIterator[str]],
        respond: Callable[[list[RequestOutput]], Response],
    ) -> Response:
        """The one run loop of chat and completions: submit every prompt and wait for their first
        outputs (so bad input, a full queue or a dead engine is an HTTP status, not an event);
        a client gone meanwhile gets 499 and its requests are aborted. Then either stream server-sent
        events from `stream` (an error mid-stream becomes an error event; [DONE] ends every stream)
        or wait for the final outputs and answer with `respond`."""
        model = getattr(body, "model", None)
        lora = self.state.loras.get(model) if self.state.loras is not None else None
        if model and lora is None:
            self.model_name(model)  # 404 for a name unloaded since the request's check
        call = EngineCall(self.async_engine, request_id, self.state)
        try:
            firsts = await await_unless_disconnected(
                raw_request,
                self.async_engine,
                call.start(prompts, params, body.priority, body.user, body.cache_salt, lora),
                self.state,
            )
        except ClientDisconnected:
            await call.close()
            return Response(status_code=499)
        except BaseException:
            await call.close()
            raise
        if body.stream:
            return EngineStreamingResponse(self._events(call, stream(call, firsts)))
        await call.close()
        return respond(firsts)

    @staticmethod
    async def _events(call: EngineCall, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        try:
            async for s in chunks:
                yield s
        except Exception as e:
            yield sse(to_openai_error(e).body().model_dump_json())
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]
            await call.close()
        yield sse("[DONE]")

    # ---- logprobs -------------------------------------------------------------------------
    def token_entry(self, tid: int, d: dict[int, Logprob] | None) -> tuple[str, float | None]:
        """(text, logprob) of token `tid` at a position with logprobs `d` (None for the first prompt token)."""
        if d is None or tid not in d:
            return self.token_text(tid), None
        lp = d[tid]
        text = lp.decoded_token if lp.decoded_token is not None else self.token_text(tid)
        return text, clamp_logprob(lp.logprob)

    def top_entries(self, d: dict[int, Logprob], k: int) -> list[tuple[str, float]]:
        """The k most likely tokens at a position, most likely first."""
        ranked = sorted(d.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else math.inf)[:k]
        return [
            (lp.decoded_token if lp.decoded_token is not None else self.token_text(tid), clamp_logprob(lp.logprob))
            for tid, lp in ranked
        ]


def message_to_dict(m: ChatMessage) -> dict[str, Any]:
    """A chat message as the template sees it; text parts are joined, other parts are refused."""
    if isinstance(m.content, list):
        texts = []
        for part in m.content:
            if part.type != "text" or part.text is None:
                raise bad_request(f"only text content parts are supported, got type {part.type!r}", "messages")
            texts.append(part.text)
        content: str | None = "\n".join(texts)
    else:
        content = m.content
    d: dict[str, Any] = {"role": m.role, "content": content if content is not None else ""}
    for key in ("name", "tool_call_id", "tool_calls"):
        value = getattr(m, key)
        if value is not None:
            d[key] = value
    return d


def usage_info(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=cached_tokens),
    )
