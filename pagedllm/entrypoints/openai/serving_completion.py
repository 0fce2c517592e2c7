"""POST /v1/completions: text or token-id prompts (one or a batch), echo, legacy logprobs, streaming.

Choices are numbered `prompt_index * n + sample_index` (a batch of 2 prompts with n=3 gives
choices 0-2 for the first prompt and 3-5 for the second).

`echo` with `max_tokens=0` (what lm-evaluation-harness sends to score a text) returns the prompt
only: the engine needs at least one new token, so it generates one and the server drops it
(its text, token and logprob); usage reports 0 completion tokens and finish_reason "length".
Such a prompt must therefore leave room for one token within max_model_len.

vLLM's extras (request_fields.py): `prompt_logprobs` on each choice (not with stream),
`truncate_prompt_tokens`, `request_id` (the response's id is `cmpl-<request_id>`),
`return_token_ids` (each choice's `token_ids` and `prompt_token_ids`; streamed, the prompt's ids
come with a choice's first chunk), and the structured-output fields (sampling.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import Response

from pagedllm.entrypoints.openai import request_fields
from pagedllm.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    random_id,
)
from pagedllm.entrypoints.openai.engine_call import EngineCall, EnginePrompt
from pagedllm.entrypoints.openai.errors import bad_request
from pagedllm.entrypoints.openai.serving_engine import OpenAIServing, usage_info
from pagedllm.entrypoints.openai.streaming import sse
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import RequestOutputKind

logger = logging.getLogger(__name__)

# (token text, its logprob or None, the top alternatives or None) for one position.
LogprobEntry = tuple[str, float | None, dict[str, float] | None]


@dataclass
class _ChoiceStream:
    """One streamed choice: holds its text back until the echoed prompt's logprobs are complete."""

    index: int
    prompt: EnginePrompt
    echo_pending: bool
    text: str = ""
    entries: list[LogprobEntry] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    offset: int = 0
    num_tokens: int = 0
    done: bool = False
    token_ids: list[int] = field(default_factory=list)
    prompt_ids_sent: bool = False


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, body: CompletionRequest, raw_request: Request | None) -> Response:
        model = self.model_name(body.model)
        self.log_ignored_fields(body)
        if body.suffix is not None:
            raise bad_request("suffix is not supported by this server", "suffix")
        max_tokens = body.max_tokens
        if max_tokens is not None and max_tokens < 0:
            raise bad_request(f"max_tokens must be non-negative, got {max_tokens}", "max_tokens")
        echo_only = max_tokens == 0
        if echo_only and not body.echo:
            raise bad_request("max_tokens must be at least 1 (0 is allowed only with echo)", "max_tokens")
        self.check_logprobs(body.logprobs, "logprobs")
        prompt_lp = request_fields.prompt_logprobs(body, self.max_logprobs)
        engine_max_tokens = 1 if echo_only else max_tokens
        raw_prompts = _prompt_list(body.prompt)
        size = sum(len(p) if isinstance(p, str) else 0 for p in raw_prompts)
        prompts = await self.run_blocking(
            lambda: [
                self.prompt_from_text(p, body.add_special_tokens) if isinstance(p, str) else self.prompt_from_ids(p)
                for p in raw_prompts
            ],
            size,
        )
        prompts = [request_fields.truncate(p, body, self.max_model_len, engine_max_tokens) for p in prompts]
        self.check_length(prompts, engine_max_tokens)
        want_logprobs = body.logprobs is not None
        wanted = [k for k in (body.logprobs if body.echo else None, prompt_lp) if k is not None]
        params = self.sampling_params(
            body,
            engine_max_tokens,
            logprobs=body.logprobs,
            prompt_logprobs=max(wanted) if wanted else None,
            output_kind=RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY,
        )
        request_id = request_fields.response_id("cmpl", body, random_id("cmpl"))
        return await self.run(
            raw_request, request_id, prompts, params, body,
            lambda call, firsts: self._stream(body, model, request_id, call, prompts, firsts, echo_only),
            lambda outputs: self._response(body, model, request_id, prompts, outputs, echo_only),
        )

    # ---- non-streaming --------------------------------------------------------------------
    def _response(
        self,
        body: CompletionRequest,
        model: str,
        request_id: str,
        prompts: list[EnginePrompt],
        outputs: list[RequestOutput],
        echo_only: bool,
    ) -> Response:
        choices = []
        completion_tokens = 0
        for i, (p, out) in enumerate(zip(prompts, outputs)):
            for c in out.outputs:
                text, entries = "", []
                if body.echo:
                    text = self.prompt_text(p)
                    if body.logprobs is not None:
                        entries += self._prompt_entries(p, out, body.logprobs)
                if not echo_only:
                    text += c.text
                    completion_tokens += len(c.token_ids)
                    if body.logprobs is not None:
                        entries += self._output_entries(c)
                choices.append(
                    CompletionChoice(
                        index=i * body.n + c.index,
                        text=text,
                        logprobs=_legacy_logprobs(entries, 0) if body.logprobs is not None else None,
                        finish_reason="length" if echo_only else c.finish_reason,
                        stop_reason=None if echo_only else c.stop_reason,
                        prompt_logprobs=(
                            request_fields.prompt_logprobs_out(
                                p.token_ids, out.prompt_logprobs, body.prompt_logprobs, self.token_text
                            )
                            if body.prompt_logprobs is not None
                            else None
                        ),
                        token_ids=([] if echo_only else list(c.token_ids)) if body.return_token_ids else None,
                        prompt_token_ids=list(p.token_ids) if body.return_token_ids else None,
                    )
                )
        choices.sort(key=lambda ch: ch.index)
        resp = CompletionResponse(
            id=request_id,
            model=model,
            choices=choices,
            usage=self._usage(prompts, outputs, completion_tokens),
        )
        return Response(content=resp.model_dump_json(), media_type="application/json")

    @staticmethod
    def _usage(prompts: list[EnginePrompt], outputs: list[RequestOutput], completion_tokens: int) -> UsageInfo:
        prompt_tokens = sum(len(p.token_ids) for p in prompts)
        return usage_info(prompt_tokens, completion_tokens, sum(o.num_cached_tokens for o in outputs))

    # ---- logprobs -------------------------------------------------------------------------
    def _entry(self, tid: int, d: dict[int, Logprob] | None, k: int | None = None) -> LogprobEntry:
        if d is not None and k is not None:
            d = request_fields.top_of(d, k, tid)  # the engine may hold more (for prompt_logprobs)
        text, lp = self.token_entry(tid, d)
        top = None if d is None else dict(self.top_entries(d, len(d)))
        return text, lp, top

    def _prompt_entries(self, p: EnginePrompt, out: RequestOutput, k: int) -> list[LogprobEntry]:
        # The first prompt token has no logprob (nothing precedes it): None, as OpenAI reports it.
        plp = list(out.prompt_logprobs or [])
        plp += [None] * (len(p.token_ids) - len(plp))
        return [self._entry(tid, d, k) for tid, d in zip(p.token_ids, plp)]

    def _output_entries(self, c: CompletionOutput) -> list[LogprobEntry]:
        lps = list(c.logprobs or [])
        lps += [None] * (len(c.token_ids) - len(lps))
        return [self._entry(tid, d) for tid, d in zip(c.token_ids, lps)]

    # ---- streaming ------------------------------------------------------------------------
    async def _stream(
        self,
        body: CompletionRequest,
        model: str,
        request_id: str,
        call: EngineCall,
        prompts: list[EnginePrompt],
        firsts: list[RequestOutput],
        echo_only: bool,
    ) -> AsyncIterator[str]:
        n = body.n
        created = int(time.time())
        want_lp = body.logprobs is not None
        states = {
            i * n + j: _ChoiceStream(i * n + j, prompts[i], echo_pending=bool(body.echo))
            for i in range(len(prompts))
            for j in range(n)
        }
        last: dict[int, RequestOutput] = {}
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)
        def usage_now() -> UsageInfo:
            completion = sum(s.num_tokens for s in states.values())
            return self._usage(prompts, list(last.values()), completion)

        def chunks_for(i: int, out: RequestOutput | None, final: bool = False) -> list[str]:
            if out is None:
                return []
            if not final:
                last[i] = out
                for c in out.outputs:
                    self._feed(states[i * n + c.index], c, body, echo_only, want_lp)
            result = []
            # Every choice of the prompt: one held back for the echoed prompt's logprobs may be ready now.
            for j in range(n):
                ch = self._flush(states[i * n + j], out, body, final)
                if ch is not None:
                    chunk = CompletionChunk(id=request_id, created=created, model=model, choices=[ch])
                    if continuous:
                        chunk.usage = usage_now()
                    result.append(sse(chunk.model_dump_json()))
            return result

        for i, out in enumerate(firsts):
            for s in chunks_for(i, out):
                yield s
        while (item := await call.next()) is not None:
            for s in chunks_for(*item):
                yield s
        for i in range(len(prompts)):
            for s in chunks_for(i, last.get(i), final=True):
                yield s
        if include_usage:
            final = CompletionChunk(id=request_id, created=created, model=model, choices=[], usage=usage_now())
            yield sse(final.model_dump_json())

    def _feed(
        self,
        st: _ChoiceStream,
        c: CompletionOutput,
        body: CompletionRequest,
        echo_only: bool,
        want_lp: bool,
    ) -> None:
        if not echo_only:
            st.text += c.text
            st.num_tokens += len(c.token_ids)
            st.token_ids += c.token_ids
            if want_lp:
                st.entries += self._output_entries(c)
        if c.finish_reason is not None:
            st.finish_reason = "length" if echo_only else c.finish_reason
            st.stop_reason = None if echo_only else c.stop_reason

    def _flush(
        self, st: _ChoiceStream, out: RequestOutput, body: CompletionRequest, final: bool
    ) -> CompletionChoice | None:
        want_lp = body.logprobs is not None
        if st.done:
            return None
        prefix_text, prefix_entries = "", []
        if st.echo_pending:
            complete = not want_lp or len(out.prompt_logprobs or []) >= len(st.prompt.token_ids)
            if not complete and not final:
                return None  # hold everything back until the prompt's logprobs are in
            prefix_text = self.prompt_text(st.prompt)
            if want_lp:
                prefix_entries = self._prompt_entries(st.prompt, out, body.logprobs)
            st.echo_pending = False
        text, entries = prefix_text + st.text, prefix_entries + st.entries
        token_ids = st.token_ids
        st.text, st.entries, st.token_ids = "", [], []
        if not text and not entries and not token_ids and st.finish_reason is None:
            return None  # tokens that add no text yet still get their chunk (text ""), one per step
        logprobs = _legacy_logprobs(entries, st.offset) if want_lp else None
        st.offset += sum(len(e[0]) for e in entries)
        if st.finish_reason is not None:
            st.done = True
        choice = CompletionChoice(
            index=st.index, text=text, logprobs=logprobs, finish_reason=st.finish_reason, stop_reason=st.stop_reason
        )
        if body.return_token_ids:
            choice.token_ids = token_ids
            if not st.prompt_ids_sent:
                choice.prompt_token_ids = list(st.prompt.token_ids)
                st.prompt_ids_sent = True
        return choice


def _prompt_list(prompt: str | list) -> list[str | list[int]]:
    """A request's prompt field as a list of prompts (text or token ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def _legacy_logprobs(entries: list[LogprobEntry], offset: int) -> CompletionLogProbs:
    """Entries in OpenAI's legacy layout; text_offset counts characters of the choice's text
    (continuing from `offset` across streamed chunks)."""
    lp = CompletionLogProbs()
    for text, value, top in entries:
        lp.tokens.append(text)
        lp.token_logprobs.append(value)
        lp.top_logprobs.append(top)
        lp.text_offset.append(offset)
        offset += len(text)
    return lp
