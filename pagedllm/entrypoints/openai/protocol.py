"""Request and response bodies of the OpenAI-compatible API (pydantic), with vLLM's extra fields.

Requests validate strictly: a string where a number belongs, a float where an integer belongs, NaN
or infinity are rejected (HTTP 400), never coerced. Unknown fields are kept and logged, not
rejected, so clients that send newer OpenAI fields still work.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class RequestModel(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---- errors ---------------------------------------------------------------------------------
class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(ResponseModel):
    error: ErrorInfo


# ---- shared pieces --------------------------------------------------------------------------
class StructuredOutputsRequest(RequestModel):
    """vLLM's `structured_outputs` object: one structure and its options (unknown keys are a 400)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid", populate_by_name=True)

    json_schema: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None


class StreamOptions(RequestModel):
    include_usage: bool | None = False
    """Send one last chunk with the usage of the whole request (its `choices` is empty)."""
    continuous_usage_stats: bool | None = False
    """vLLM extension: every chunk carries the usage so far."""


class SamplingFields(RequestModel):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # vLLM's extra sampling fields.
    best_of: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    priority: int = 0
    cache_salt: str | None = None
    # vLLM's structured-output, prompt and other extra fields (request_fields.py honours them or
    # answers 400 naming the field).
    response_format: dict[str, Any] | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    thinking_token_budget: int | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None
    request_id: str | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    watermarking: bool | None = None
    bad_words: list[str] | None = None
    logprob_token_ids: list[int] | None = None
    logits_processors: list[Any] | None = None
    session_id: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    repetition_detection: dict[str, Any] | None = None
    stream_interval: int | None = None
    routed_experts_prompt_start: int = 0
    return_token_offsets: bool | None = False
    return_mm_kwargs: bool = True

    @field_validator("n", mode="before")
    @classmethod
    def _null_n(cls, value: Any) -> Any:
        return 1 if value is None else value  # OpenAI's spec allows null for the default


# A completion prompt: text, a batch of texts, token ids, or a batch of token-id lists.
Prompt = Union[str, list[int], list[str], list[list[int]]]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: int | None = 16
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True
    """vLLM extension: add the tokenizer's special tokens (e.g. BOS) to text prompts."""
    prompt_embeds: Any = None


class TextPart(RequestModel):
    type: str
    text: str | None = None


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat extras.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's chat extras handled by request_fields.py.
    echo: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    media_io_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    return_prompt_text: bool | None = None


class TokenizeRequest(RequestModel):
    """Either `prompt` (text or token ids) or `messages` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


# ---- responses ------------------------------------------------------------------------------
class PromptTokenUsageInfo(ResponseModel):
    cached_tokens: int = 0


class UsageInfo(ResponseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None


class CompletionLogProbs(ResponseModel):
    """OpenAI's legacy format: per token its text, logprob, top alternatives and offset in `text`."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(ResponseModel):
    """One token's entry in vLLM's `prompt_logprobs` (keyed by token id)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs: None for the first prompt token, then token id -> PromptLogprob.
PromptLogprobsOut = list[dict[int, PromptLogprob] | None]


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobsOut | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None

    @model_serializer(mode="wrap")
    def _drop_unasked(self, handler: Any) -> dict[str, Any]:
        # vLLM's extras appear only when asked for (OpenAI clients see OpenAI's fields).
        d = handler(self)
        for key in ("prompt_logprobs", "token_ids", "prompt_token_ids"):
            if d.get(key) is None:
                d.pop(key, None)
        return d


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatLogProb(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatLogProbs(ResponseModel):
    content: list[ChatLogProbsContent] | None = None


class FunctionCall(ResponseModel):
    name: str
    arguments: str
    """The arguments as JSON text."""


class ToolCall(ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class _DropNone(ResponseModel):
    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_DropNone):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_DropNone):
    """A streamed piece of a tool call: the first names it (index, id, type, function name), the
    next ones carry fragments of its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatMessageOut(ResponseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    reasoning_content: str | None = None
    """A reasoning model's thinking (--reasoning-parser); `reasoning` carries the same text."""
    reasoning: str | None = None


class ChatChoice(ResponseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobsOut | None = None

    @model_serializer(mode="wrap")
    def _drop_unasked(self, handler: Any) -> dict[str, Any]:
        d = handler(self)
        if d.get("prompt_logprobs") is None:
            d.pop("prompt_logprobs", None)
        return d


class DeltaMessage(ResponseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        # A delta names only what it carries: {"role": ..., "content": ""}, {"content": "..."} or {}.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(ResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionChunk(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class TokenizeResponse(ResponseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(ResponseModel):
    prompt: str
