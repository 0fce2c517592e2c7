"""What /v1/completions and /v1/chat/completions share: errors, model names, prompt checks,
SamplingParams from a request body, and running engine requests with abort on disconnect."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request

from pagedllm.engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineOverloadedError
from pagedllm.engine.output_processor import TokenTexts
from pagedllm.entrypoints.openai.protocol import (
    ChatMessage,
    ErrorInfo,
    ErrorResponse,
    PromptTokenUsageInfo,
    SamplingFields,
    UsageInfo,
)
from pagedllm.outputs import Logprob, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")

# JSON has no infinity: logprobs of impossible tokens are reported as this.
MIN_LOGPROB = -9999.0
# How often a waiting request checks that the engine is still alive.
_POLL_S = 1.0
# Prompts longer than this (characters) are tokenized on a worker thread, not the event loop.
_THREAD_TOKENIZE_CHARS = 20_000


# Arguments of the tokenizer's apply_chat_template that a request's chat_template_kwargs may not
# override (they would change what is rendered or returned, not only the template's variables).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


class OpenAIError(Exception):
    """An error answered with the OpenAI error object and an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param)


def to_openai_error(e: BaseException) -> OpenAIError:
    """Maps engine exceptions to HTTP: bad input 400, full queue 429, dead engine or anything else 500."""
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, EngineOverloadedError):
        return OpenAIError(429, str(e), type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
    if isinstance(e, EngineDeadError):
        return OpenAIError(500, str(e), type="server_error", code="engine_dead")
    if isinstance(e, ValueError):
        return bad_request(str(e))
    logger.error("unexpected error while serving a request", exc_info=e)
    return OpenAIError(500, f"internal server error: {type(e).__name__}", type="server_error")


class ClientDisconnected(Exception):
    """The client went away; whatever it asked for has been aborted."""


@dataclass
class ServerState:
    """Shared by the routes of one app; `shutting_down` ends requests in flight (503) so that a
    graceful shutdown does not wait for long generations."""

    shutting_down: bool = False


def shutting_down_error() -> OpenAIError:
    return OpenAIError(503, "the server is shutting down", type="server_error", code="shutting_down",
                       headers={"Retry-After": "5"})


def clamp_logprob(x: float) -> float:
    return x if x > MIN_LOGPROB else MIN_LOGPROB  # also maps -inf (and NaN) to the floor


@dataclass
class EnginePrompt:
    """One prompt ready for the engine: its token ids and text (for echo)."""

    token_ids: list[int]
    text: str | None

    def as_engine_input(self) -> dict[str, Any]:
        return {"prompt": self.text, "prompt_token_ids": self.token_ids}


class EngineCall:
    """The engine requests behind one API call (one per prompt), merged into one stream.

    `start()` submits every prompt and waits for each one's first output, so that bad input,
    a full queue or a dead engine is known before any response header is sent. `next()` then
    yields (prompt index, output) pairs; `close()` aborts whatever has not finished and must
    run on every path (it is safe to call twice).
    """

    def __init__(self, engine: AsyncLLMEngine, base_id: str, state: ServerState | None = None) -> None:
        self.engine = engine
        self.base_id = base_id
        self.state = state or ServerState()
        self.request_ids: list[str] = []
        self._gens: list[Any] = []
        self._finished: set[int] = set()
        self._tasks: list[asyncio.Task] = []
        self._queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()
        self._live = 0
        self._closed = False

    async def start(
        self,
        prompts: list[EnginePrompt],
        params: SamplingParams,
        priority: int = 0,
        user: str | None = None,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        for i, p in enumerate(prompts):
            rid = f"{self.base_id}-{i}"
            self.request_ids.append(rid)
            self._gens.append(
                self.engine.generate(p.as_engine_input(), params.clone(), rid, priority, user, cache_salt)
            )
        results = await asyncio.gather(*(g.__anext__() for g in self._gens), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.close()
            # Report the most telling error: a dead engine, then bad input, then a full queue.
            for kind in (EngineDeadError, ValueError, EngineOverloadedError):
                for e in errors:
                    if isinstance(e, kind):
                        raise e
            raise errors[0]
        for i, out in enumerate(results):
            assert isinstance(out, RequestOutput)
            if out.finished:
                self._finished.add(i)
        return results  # type: ignore[return-value]

    def _start_pumps(self) -> None:
        async def pump(i: int, gen: Any) -> None:
            try:
                async for out in gen:
                    self._queue.put_nowait((i, out))
                self._queue.put_nowait((i, None))
            except Exception as e:
                self._queue.put_nowait((i, e))

        self._live = len(self._gens)
        self._tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(self._gens)]

    async def next(self) -> tuple[int, RequestOutput] | None:
        """The next output of any prompt, or None when all have finished."""
        if not self._tasks:
            self._start_pumps()
        while self._live:
            if self.state.shutting_down:
                raise shutting_down_error()
            try:
                if self._queue.empty():
                    i, item = await asyncio.wait_for(self._queue.get(), timeout=_POLL_S)
                else:
                    i, item = self._queue.get_nowait()
            except asyncio.TimeoutError:
                if self.engine.errored:
                    raise EngineDeadError(f"the engine has failed: {self.engine.dead_error!r}") from None
                continue
            if item is None:
                self._live -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                self._finished.add(i)
            return i, item
        return None

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Synchronous part first: even under cancellation the aborts reach the engine.
        for t in self._tasks:
            t.cancel()
        for i, rid in enumerate(self.request_ids):
            if i not in self._finished:
                await self.engine.abort(rid)
        for g in self._gens:
            try:
                await g.aclose()
            except RuntimeError:
                pass  # still running in a cancelled pump task; its own finally aborts it


async def await_unless_disconnected(
    raw_request: Request | None, engine: AsyncLLMEngine, aw: Awaitable[T], state: ServerState | None = None
) -> T:
    """Awaits `aw`, cancelling it (which aborts its engine requests) when the client disconnects,
    the engine dies or the server shuts down."""
    task = asyncio.ensure_future(aw)
    watcher: asyncio.Task | None = None
    if raw_request is not None:

        async def wait_disconnect() -> None:
            while True:
                message = await raw_request.receive()
                if message["type"] == "http.disconnect":
                    return

        watcher = asyncio.ensure_future(wait_disconnect())
    try:
        while True:
            waiting = {task} if watcher is None else {task, watcher}
            done, _ = await asyncio.wait(waiting, timeout=_POLL_S, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                return task.result()
            if watcher is not None and watcher in done:
                raise ClientDisconnected()
            if engine.errored:
                raise EngineDeadError(f"the engine has failed: {engine.dead_error!r}")
            if state is not None and state.shutting_down:
                raise shutting_down_error()
    finally:
        for t in (task, watcher):
            if t is not None and not t.done():
                t.cancel()
        if not task.done():
            # Let the cancellation reach the engine streams' `finally` (which aborts them).
            await asyncio.gather(task, return_exceptions=True)


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
        if requested is None or requested == "":
            return self.served_model_names[0]
        if requested not in self.served_model_names:
            raise OpenAIError(
                404,
                f"The model `{requested}` does not exist. Available: {', '.join(self.served_model_names)}",
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
    ) -> EnginePrompt:
        if add_generation_prompt and continue_final_message:
            raise bad_request("add_generation_prompt and continue_final_message cannot both be true")
        reserved = RESERVED_TEMPLATE_KWARGS.intersection(template_kwargs or {})
        if reserved:
            raise bad_request(f"chat_template_kwargs may not set {sorted(reserved)}", "chat_template_kwargs")
        conversation = [message_to_dict(m) for m in messages]
        if continue_final_message and conversation[-1]["role"] != "assistant":
            raise bad_request("continue_final_message needs an assistant message last", "messages")
        text = self.tokenizer.apply_chat_template(
            conversation,
            add_generation_prompt=add_generation_prompt,
            chat_template=self.chat_template,
            continue_final_message=continue_final_message,
            **(template_kwargs or {}),
        )
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise bad_request("the rendered conversation is empty", "messages")
        _, ids = self.processor.tokenize_prompt({"prompt": text, "prompt_token_ids": ids})
        return EnginePrompt(ids, text)

    async def run_blocking(self, fn: Callable[[], T], size: int) -> T:
        """Runs tokenization inline, or on a worker thread when the input is large."""
        if size < _THREAD_TOKENIZE_CHARS:
            return fn()
        return await asyncio.to_thread(fn)

    # ---- sampling -------------------------------------------------------------------------
    def sampling_params(
        self,
        body: SamplingFields,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None,
        output_kind: RequestOutputKind,
    ) -> SamplingParams:
        if body.best_of is not None and body.best_of != body.n:
            raise bad_request(f"best_of={body.best_of} is not supported (only best_of == n={body.n})", "best_of")
        if body.stream_options is not None and not body.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        if body.seed is not None and not -(2**63) <= body.seed < 2**63:
            raise bad_request(f"seed must fit in 64 bits, got {body.seed}", "seed")
        logit_bias = None
        if body.logit_bias:
            logit_bias = {}
            for key, value in body.logit_bias.items():
                try:
                    tid = int(key)
                except ValueError:
                    raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
                if not -100.0 <= value <= 100.0:
                    raise bad_request(f"logit_bias values must be in [-100, 100], got {value}", "logit_bias")
                logit_bias[tid] = value
        kwargs: dict[str, Any] = dict(
            n=body.n,
            presence_penalty=_default(body.presence_penalty, 0.0),
            frequency_penalty=_default(body.frequency_penalty, 0.0),
            repetition_penalty=_default(body.repetition_penalty, 1.0),
            temperature=_default(body.temperature, 1.0),
            top_p=_default(body.top_p, 1.0),
            top_k=_default(body.top_k, 0),
            min_p=_default(body.min_p, 0.0),
            seed=body.seed,
            stop=body.stop,
            stop_token_ids=body.stop_token_ids,
            ignore_eos=body.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=body.skip_special_tokens,
            spaces_between_special_tokens=body.spaces_between_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
            logit_bias=logit_bias,
            allowed_token_ids=body.allowed_token_ids,
            output_kind=output_kind,
        )
        try:
            params = SamplingParams(**kwargs)
            params.verify_vocab(self.async_engine.model_config.vocab_size)
        except (ValueError, TypeError) as e:
            # SamplingParams names the field first ("top_p must be in (0, 1], got 0.0.").
            first = str(e).split(" ", 1)[0]
            raise bad_request(str(e), first if first in type(body).model_fields else None) from None
        return params

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


def _default(value: T | None, default: T) -> T:
    return default if value is None else value


def usage_info(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=cached_tokens),
    )
