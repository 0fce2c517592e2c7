"""POST /v1/chat/completions: the model's chat template, chat logprobs, streaming chunks."""

from __future__ import annotations

import logging
import time
from typing import Any
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from pagedllm.entrypoints.openai import request_fields
from pagedllm.entrypoints.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogProb,
    ChatLogProbs,
    ChatLogProbsContent,
    ChatMessageOut,
    DeltaMessage,
    UsageInfo,
    random_id,
)
from pagedllm.entrypoints.openai.engine_call import EngineCall, EnginePrompt
from pagedllm.entrypoints.openai.errors import bad_request
from pagedllm.entrypoints.openai.serving_engine import OpenAIServing, message_to_dict, usage_info
from pagedllm.entrypoints.openai.streaming import sse
from pagedllm.entrypoints.openai.tool_parsers import ToolParser, get_tool_parser
from pagedllm.entrypoints.openai.tool_parsers.chat import (
    ChatReplyParser,
    ChatReplyStream,
    resolve_tool_choice,
    tool_choice_schema,
    validate_tools,
)
from pagedllm.entrypoints.openai.tool_parsers.json_formats import HermesToolParser
from pagedllm.reasoning import ReasoningParser, get_reasoning_parser
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)


class OpenAIServingChat(OpenAIServing):
    def __init__(self, *args: Any, enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.tool_parser_cls: type[ToolParser] | None = get_tool_parser(tool_call_parser) if tool_call_parser else None
        so_config = getattr(self.async_engine.config, "structured_outputs_config", None)
        name = getattr(so_config, "reasoning_parser", None)
        self.reasoner: ReasoningParser | None = get_reasoning_parser(name)(self.tokenizer) if name else None

    async def create_chat_completion(self, body: ChatCompletionRequest, raw_request: Request | None) -> Response:
        model = self.model_name(body.model)
        self.log_ignored_fields(body)
        tools = validate_tools(body.tools)
        mode, tool_name = resolve_tool_choice(
            body.tool_choice, tools, self.enable_auto_tool_choice, self.tool_parser_cls and self.tool_parser_cls.name
        )
        request_fields.check_chat(body)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        if max_tokens is not None and max_tokens < 1:
            raise bad_request(f"{param} must be at least 1, got {max_tokens}", param)
        top = None
        if body.logprobs:
            top = body.top_logprobs or 0
            self.check_logprobs(top, "top_logprobs")
        elif body.top_logprobs:
            raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
        size = sum(len(m.content) if isinstance(m.content, str) else 0 for m in body.messages)
        prompt = await self.run_blocking(
            lambda: self.render_chat(
                body.messages, body.add_generation_prompt, body.continue_final_message, body.chat_template_kwargs,
                body.documents, body.add_special_tokens,
                tools=tools, tool_format=self._tool_format(tools, body.messages),
            ),
            size,
        )
        prompt_lp = request_fields.prompt_logprobs(body, self.max_logprobs)
        prompt = request_fields.truncate(prompt, body, self.max_model_len, max_tokens)
        echo = request_fields.chat_echo(body, message_to_dict(body.messages[-1]))
        self.check_length([prompt], max_tokens, "messages")
        params = self.sampling_params(
            body,
            max_tokens,
            logprobs=top,
            prompt_logprobs=prompt_lp,
            output_kind=RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY,
        )
        replies = self._reply_parser(body, params, prompt, mode, tools, tool_name)
        request_id = request_fields.response_id("chatcmpl", body, random_id("chatcmpl"))
        n_prompt = len(prompt.token_ids)

        def respond(outputs: list[RequestOutput]) -> Response:
            out = outputs[0]
            choices = [
                ChatChoice(
                    index=c.index,
                    message=(message := self._message(echo, c.text, replies)),
                    logprobs=self._logprobs(c, top) if top is not None else None,
                    finish_reason=tool_finish_reason(c.finish_reason, bool(message.tool_calls)),
                    stop_reason=c.stop_reason,
                )
                for c in sorted(out.outputs, key=lambda c: c.index)
            ]
            usage = usage_info(n_prompt, sum(len(c.token_ids) for c in out.outputs), out.num_cached_tokens)
            resp = ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage)
            if prompt_lp is not None:
                resp.prompt_logprobs = request_fields.prompt_logprobs_out(
                    prompt.token_ids, out.prompt_logprobs, prompt_lp, self.token_text
                )
            return Response(content=resp.model_dump_json(), media_type="application/json")

        return await self.run(
            raw_request, request_id, [prompt], params, body,
            lambda call, firsts: self._stream(body, model, request_id, call, n_prompt, firsts[0], echo, replies),
            respond,
        )

    def _logprobs(self, c: CompletionOutput, top: int) -> ChatLogProbs:
        content = []
        lps = list(c.logprobs or [])
        for tid, d in zip(c.token_ids, lps):
            text, lp = self.token_entry(tid, d)
            content.append(
                ChatLogProbsContent(
                    token=text,
                    logprob=lp if lp is not None else 0.0,
                    bytes=list(text.encode("utf-8")),
                    top_logprobs=[
                        ChatLogProb(token=t, logprob=v, bytes=list(t.encode("utf-8")))
                        for t, v in (self.top_entries(d, top) if d else [])
                    ],
                )
            )
        return ChatLogProbs(content=content)

    async def _stream(
        self,
        body: ChatCompletionRequest,
        model: str,
        request_id: str,
        call: EngineCall,
        prompt_tokens: int,
        first: RequestOutput,
        echo: str = "",
        replies: ChatReplyParser | None = None,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        top = (body.top_logprobs or 0) if body.logprobs else None
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)
        num_tokens = [0] * body.n
        cached = first.num_cached_tokens
        streams = [replies.stream() if replies is not None else None for _ in range(body.n)]

        def chunk(choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> str:
            if usage is None and continuous:
                usage = usage_info(prompt_tokens, sum(num_tokens), cached)
            c = ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices, usage=usage)
            return sse(c.model_dump_json())

        def chunks_for(out: RequestOutput) -> list[str]:
            nonlocal cached
            cached = out.num_cached_tokens
            result = []
            for c in out.outputs:
                num_tokens[c.index] += len(c.token_ids)
                logprobs = self._logprobs(c, top) if top is not None and c.token_ids else None
                if not c.text and not c.token_ids and logprobs is None and c.finish_reason is None:
                    continue
                delta, finish_reason = self._delta(streams[c.index], c)
                if delta == DeltaMessage() and logprobs is None and finish_reason is None:
                    continue  # text held back until it is known to be content, reasoning or a call
                choice = ChatChunkChoice(
                    index=c.index, delta=delta, logprobs=logprobs, finish_reason=finish_reason,
                    stop_reason=c.stop_reason,
                )
                result.append(chunk([choice]))
            return result

        # The first chunk of every choice names the role.
        for j in range(body.n):
            yield chunk([ChatChunkChoice(index=j, delta=DeltaMessage(role="assistant", content=""))])
            if echo:  # chat echo: the echoed message comes right after the role
                yield chunk([ChatChunkChoice(index=j, delta=DeltaMessage(content=echo))])
        for s in chunks_for(first):
            yield s
        while (item := await call.next()) is not None:
            for s in chunks_for(item[1]):
                yield s
        if include_usage:
            yield chunk([], usage_info(prompt_tokens, sum(num_tokens), cached))

    # ---- tools and reasoning (tool_parsers/chat.py) ---------------------------------------------
    def _tool_format(self, tools: list[dict[str, Any]], messages: list[Any]) -> ToolParser | None:
        """The format tools and tool history are written in for a template without tool support
        (the --tool-call-parser's, else hermes); None when the request has neither."""
        if not tools and not any(m.tool_calls or m.role == "tool" for m in messages):
            return None
        return (self.tool_parser_cls or HermesToolParser)(tools)

    def _reply_parser(
        self, body: ChatCompletionRequest, params: SamplingParams, prompt: EnginePrompt, mode: str,
        tools: list[dict[str, Any]], tool_name: str | None,
    ) -> ChatReplyParser | None:
        """How the replies split (None: all content). tool_choice "required" or a named tool puts
        its JSON schema on the request's structured output."""
        parallel = body.parallel_tool_calls is not False
        schema = tool_choice_schema(mode, tools, tool_name, parallel)
        if schema is not None:
            if params.structured_outputs is not None:
                raise bad_request(
                    f"tool_choice {body.tool_choice!r} enforces its own structure and cannot be combined with "
                    "response_format, structured_outputs or guided_* fields", "tool_choice")
            params.structured_outputs = StructuredOutputsParams(json=schema)
            try:
                self.processor.check_structured_outputs(params)
            except ValueError as e:
                raise bad_request(str(e), "tools") from None
        auto = self.tool_parser_cls if mode == "auto" else None
        if auto is not None and auto.needs_special_tokens:
            params.skip_special_tokens = False  # the format's markers are special tokens
        reasoner = self.reasoner
        kwargs = body.chat_template_kwargs
        if reasoner is not None and reasoner.reasoning_disabled(kwargs):
            reasoner = None
        in_reasoning = reasoner is not None and reasoner.prompt_in_reasoning(prompt.text, kwargs)
        replies = ChatReplyParser(mode, tools, tool_name, auto, reasoner, in_reasoning, parallel)
        return replies if replies.active else None

    @staticmethod
    def _message(echo: str, text: str, replies: ChatReplyParser | None) -> ChatMessageOut:
        if replies is None:
            return ChatMessageOut(role="assistant", content=echo + text)
        reasoning, content, calls = replies.whole(text)
        if echo:
            content = echo + (content or "")
        return ChatMessageOut(role="assistant", content=content, tool_calls=calls, reasoning_content=reasoning,
                              reasoning=reasoning)

    @staticmethod
    def _delta(stream: ChatReplyStream | None, c: CompletionOutput) -> tuple[DeltaMessage, str | None]:
        if stream is None:  # plain content: a chunk per step that made tokens, "" while they add no text
            return (DeltaMessage(content=c.text) if c.text or c.token_ids else DeltaMessage()), c.finish_reason
        reasoning, content, calls = stream.step(c.text, c.finish_reason is not None)
        delta = DeltaMessage(content=content, reasoning_content=reasoning, reasoning=reasoning, tool_calls=calls or None)
        return delta, tool_finish_reason(c.finish_reason, stream.called)


def tool_finish_reason(reason: str | None, called: bool) -> str | None:
    """"tool_calls" for a reply that ended by itself with tool calls."""
    return "tool_calls" if called and reason == "stop" else reason
