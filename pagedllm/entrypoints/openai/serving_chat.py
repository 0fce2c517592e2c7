"""POST /v1/chat/completions: the model's chat template, chat logprobs, streaming chunks."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

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
from pagedllm.entrypoints.openai.engine_call import EngineCall
from pagedllm.entrypoints.openai.errors import bad_request
from pagedllm.entrypoints.openai.serving_engine import OpenAIServing, usage_info
from pagedllm.entrypoints.openai.streaming import sse
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import RequestOutputKind

logger = logging.getLogger(__name__)


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(self, body: ChatCompletionRequest, raw_request: Request | None) -> Response:
        model = self.model_name(body.model)
        self.log_ignored_fields(body)
        if body.tools:
            raise bad_request("tool calling is not supported by this server", "tools")
        if body.tool_choice not in (None, "none"):
            raise bad_request(f"tool_choice {body.tool_choice!r} is not supported by this server", "tool_choice")
        if body.response_format is not None and body.response_format.get("type", "text") != "text":
            raise bad_request(
                f"response_format type {body.response_format.get('type')!r} is not supported (only 'text')",
                "response_format",
            )
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
                body.messages, body.add_generation_prompt, body.continue_final_message, body.chat_template_kwargs
            ),
            size,
        )
        self.check_length([prompt], max_tokens, "messages")
        params = self.sampling_params(
            body,
            max_tokens,
            logprobs=top,
            prompt_logprobs=None,
            output_kind=RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY,
        )
        request_id = random_id("chatcmpl")
        n_prompt = len(prompt.token_ids)

        def respond(outputs: list[RequestOutput]) -> Response:
            out = outputs[0]
            choices = [
                ChatChoice(
                    index=c.index,
                    message=ChatMessageOut(role="assistant", content=c.text),
                    logprobs=self._logprobs(c, top) if top is not None else None,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
                for c in sorted(out.outputs, key=lambda c: c.index)
            ]
            usage = usage_info(n_prompt, sum(len(c.token_ids) for c in out.outputs), out.num_cached_tokens)
            resp = ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage)
            return Response(content=resp.model_dump_json(), media_type="application/json")

        return await self.run(
            raw_request, request_id, [prompt], params, body,
            lambda call, firsts: self._stream(body, model, request_id, call, n_prompt, firsts[0]),
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
    ) -> AsyncIterator[str]:
        created = int(time.time())
        top = (body.top_logprobs or 0) if body.logprobs else None
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)
        num_tokens = [0] * body.n
        cached = first.num_cached_tokens

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
                if not c.text and logprobs is None and c.finish_reason is None:
                    continue
                delta = DeltaMessage(content=c.text) if c.text else DeltaMessage()
                choice = ChatChunkChoice(
                    index=c.index, delta=delta, logprobs=logprobs, finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
                result.append(chunk([choice]))
            return result

        # The first chunk of every choice names the role.
        for j in range(body.n):
            yield chunk([ChatChunkChoice(index=j, delta=DeltaMessage(role="assistant", content=""))])
        for s in chunks_for(first):
            yield s
        while (item := await call.next()) is not None:
            for s in chunks_for(item[1]):
                yield s
        if include_usage:
            yield chunk([], usage_info(prompt_tokens, sum(num_tokens), cached))

