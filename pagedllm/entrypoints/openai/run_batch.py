"""`pagedllm run-batch -i input.jsonl -o output.jsonl`: an OpenAI batch file through the serving layer.

Each input line is `{"custom_id", "method": "POST", "url", "body"}`, url one of SUPPORTED_URLS (the
generation routes, and the pooling routes vLLM's run-batch takes); its body goes through the same
serving class, request parsing and response building as the server's route for `url`, so each
output line's `response.body` is what the server answers for that body (an error object with the
same status and message where the server refuses it). Lines that are no request at all (malformed
JSON, an unknown url, a method other than POST, a repeated custom_id) get a 400 line of their own;
no line stops the run. Output lines come in input order (as vLLM's), each written and flushed as
soon as every line before it is written.

All lines go to one AsyncLLMEngine whose engine core runs on a thread of this process (as under
`LLM`: a batch has no HTTP clients to keep answering, and on a few shared cores a second process
only adds its own threads' contention), with up to `window` requests in flight at once (4x
--max-num-seqs, at least 64): enough that continuous batching keeps the batch full, few enough
that waiting requests cost the front end nothing.
SIGINT or SIGTERM stops the run after the line being written; the rest run on a rerun with the same
output file (batch_files.py says how).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError
from tqdm.auto import tqdm

from pagedllm.engine.async_engine import AsyncLLMEngine, EngineDeadError
from pagedllm.entrypoints.openai.batch_files import OutputWriter, check_output, read_input, resume_output
from pagedllm.entrypoints.openai.errors import OpenAIError, ServerState, bad_request, to_openai_error, validation_error
from pagedllm.entrypoints.openai.json_body import surrogate_error

logger = logging.getLogger(__name__)

# A handler takes a validated body and answers as the server's route does.
Handler = Callable[[Any, None], Awaitable[Any]]


@dataclass
class Endpoint:
    request: type[BaseModel]
    handler: Handler


@dataclass
class BatchLine:
    number: int  # 1-based, in the input file
    custom_id: str | None
    url: str | None = None
    body: Any = None
    error: OpenAIError | None = None


def parse_lines(raw_lines: list[str], urls: list[str]) -> list[BatchLine]:
    """Every non-blank input line with its custom_id, or the 400 it gets without reaching the engine."""
    lines: list[BatchLine] = []
    first: dict[str, int] = {}
    for number, raw in enumerate(raw_lines, 1):
        if not raw.strip():
            continue
        line = _parse(number, raw, urls)
        if line.custom_id is not None and line.error is None:
            if line.custom_id in first:
                line.error = bad_request(
                    f"line {number}: custom_id {line.custom_id!r} is already used by line {first[line.custom_id]}; "
                    "custom_ids must be unique in a batch file", "custom_id")
            else:
                first[line.custom_id] = number
        lines.append(line)
    return lines


def _parse(number: int, raw: str, urls: list[str]) -> BatchLine:
    try:
        doc = json.loads(raw)
    except ValueError as e:
        return BatchLine(number, None, error=bad_request(f"line {number}: malformed JSON: {e}"))
    if not isinstance(doc, dict):
        return BatchLine(number, None, error=bad_request(
            f"line {number}: a batch line must be a JSON object, got {type(doc).__name__}"))
    custom_id = doc.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return BatchLine(number, None, error=bad_request(
            f"line {number}: custom_id must be a non-empty string, got {json.dumps(custom_id)}", "custom_id"))
    line = BatchLine(number, custom_id, doc.get("url"), doc.get("body"))
    extra = sorted(set(doc) - {"custom_id", "method", "url", "body"})
    if doc.get("method") != "POST":
        line.error = bad_request(f"line {number}: method must be \"POST\", got {json.dumps(doc.get('method'))}",
                                 "method")
    elif line.url not in urls:
        line.error = bad_request(f"line {number}: url {json.dumps(line.url)} is not supported; supported: "
                                 f"{', '.join(urls)}", "url")
    elif not isinstance(line.body, dict):
        line.error = bad_request(f"line {number}: body must be a JSON object", "body")
    elif extra:
        line.error = bad_request(f"line {number}: unknown fields {extra} (a batch line has custom_id, method, url "
                                 "and body)", extra[0])
    elif "\\u" in raw:  # only an escape can put a lone surrogate in a JSON string
        line.error = surrogate_error(json.dumps(line.body).encode())
    return line


def still_to_run(lines: list[BatchLine], done: dict[str | None, int]) -> list[BatchLine]:
    """The lines an output file that already holds `done` lines per custom_id still lacks."""
    left = dict(done)
    pending = []
    for line in lines:
        if left.get(line.custom_id, 0) > 0:
            left[line.custom_id] -= 1
        else:
            pending.append(line)
    return pending


def output_line(custom_id: str | None, status: int, body: Any) -> str:
    """One line of OpenAI's batch output: the response (status and body as the server answers)
    and, for a failed request, `error` with the error object's code and message."""
    error = None
    if status != 200:
        info = body.get("error", {}) if isinstance(body, dict) else {}
        error = {"code": info.get("code") or info.get("type"), "message": info.get("message")}
    request_id = body.get("id") if status == 200 and isinstance(body, dict) else None
    return json.dumps({
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": request_id or f"req_{uuid.uuid4().hex}", "body": body},
        "error": error,
    }, ensure_ascii=False)


class BatchRunner:
    """Runs a batch file's lines on one engine through the serving classes' handlers."""

    def __init__(self, engine: AsyncLLMEngine, endpoints: dict[str, Endpoint], window: int) -> None:
        self.engine = engine
        self.endpoints = endpoints
        self.window = window
        self.stop_signal: int | None = None
        self.prompt_tokens = self.completion_tokens = 0
        self.errors = 0  # lines answered with a status other than 200
        self.elapsed = 0.0  # from the first request submitted to the last line written

    async def answer(self, line: BatchLine) -> tuple[int, Any]:
        """(status, body) as the server answers the line's body; raises EngineDeadError."""
        if line.error is not None:
            return line.error.status, line.error.body().model_dump()
        endpoint = self.endpoints[line.url]  # type: ignore[index]
        try:
            try:
                body = endpoint.request.model_validate(line.body)
            except ValidationError as e:
                raise validation_error(e) from None  # type: ignore[arg-type]
            if getattr(body, "stream", False):
                raise bad_request("stream is not supported in a batch file", "stream")
            resp = await endpoint.handler(body, None)
        except EngineDeadError:
            raise
        except Exception as e:
            if self.engine.errored:
                raise EngineDeadError(f"the engine has failed: {self.engine.dead_error}") from e
            err = to_openai_error(e)
            return err.status, err.body().model_dump()
        result = json.loads(resp.body)
        usage = result.get("usage") if isinstance(result, dict) else None
        if usage:
            self.prompt_tokens += usage.get("prompt_tokens") or 0
            self.completion_tokens += usage.get("completion_tokens") or 0
        return resp.status_code, result

    async def run(self, lines: list[BatchLine], writer: OutputWriter, bar: tqdm) -> int:
        """Runs `lines`, writing each answer in input order; returns how many were not written."""
        loop = asyncio.get_running_loop()
        stopped = asyncio.Event()

        def on_signal(sig: int) -> None:
            self.stop_signal = sig
            stopped.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal, sig)
        answers: dict[int, str] = {}
        next_out = 0
        slots = asyncio.Semaphore(self.window)
        failure: list[BaseException] = []
        t0 = time.perf_counter()

        async def one(i: int, line: BatchLine) -> None:
            nonlocal next_out
            try:
                status, body = await self.answer(line)
            except BaseException as e:
                if not isinstance(e, asyncio.CancelledError):
                    failure.append(e)
                    stopped.set()
                raise
            finally:
                slots.release()
            answers[i] = output_line(line.custom_id, status, body)
            self.errors += status != 200
            elapsed = max(time.perf_counter() - t0, 1e-9)
            bar.set_postfix_str(f"input: {self.prompt_tokens / elapsed:.1f} toks/s, "
                                f"output: {self.completion_tokens / elapsed:.1f} toks/s", refresh=False)
            bar.update(1)
            while next_out in answers:  # no await in between: every line is written whole
                writer.write(answers.pop(next_out))
                next_out += 1
            self.elapsed = time.perf_counter() - t0

        tasks: set[asyncio.Task] = set()
        try:
            for i, line in enumerate(lines):
                acquire = asyncio.ensure_future(slots.acquire())
                stop_wait = asyncio.ensure_future(stopped.wait())
                await asyncio.wait({acquire, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
                stop_wait.cancel()
                if stopped.is_set():
                    acquire.cancel()
                    break
                task = asyncio.create_task(one(i, line))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            while tasks and not stopped.is_set():
                stop_wait = asyncio.ensure_future(stopped.wait())
                await asyncio.wait({stop_wait, *tasks}, return_when=asyncio.FIRST_COMPLETED)
                stop_wait.cancel()
        finally:
            for task in list(tasks):
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # aborts their engine requests
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        if failure:
            raise failure[0]
        return len(lines) - next_out


def build_endpoints(engine: AsyncLLMEngine, args: argparse.Namespace) -> dict[str, Endpoint]:
    """The serving classes of `pagedllm serve`, configured by the same flags, keyed by url."""
    from pagedllm.entrypoints.openai.api_server import load_chat_template
    from pagedllm.entrypoints.openai.lora import LoRAAdapters
    from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
    from pagedllm.entrypoints.openai.protocol_pooling import EmbeddingRequest, PoolingRequest, RerankRequest, ScoreRequest
    from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
    from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
    from pagedllm.entrypoints.openai.serving_pooling import OpenAIServingPooling, generation_refused

    names = [engine.model_config.served_model_name]
    chat_template = load_chat_template(args.chat_template)
    state = ServerState()
    state.loras = LoRAAdapters.create(engine, names, args.lora_modules)  # None without --enable-lora
    completions = OpenAIServingCompletion(engine, names, args.max_logprobs, chat_template, state)
    chat = OpenAIServingChat(engine, names, args.max_logprobs, chat_template, state,
                             enable_auto_tool_choice=args.enable_auto_tool_choice,
                             tool_call_parser=args.tool_call_parser)
    pooling = OpenAIServingPooling(engine, names, args.max_logprobs, None, state)
    endpoints = {
        "/v1/completions": Endpoint(CompletionRequest, completions.create_completion),
        "/v1/chat/completions": Endpoint(ChatCompletionRequest, chat.create_chat_completion),
        "/v1/embeddings": Endpoint(EmbeddingRequest, pooling.embeddings),
        "/pooling": Endpoint(PoolingRequest, pooling.pooling_route),
    }
    endpoints.update({url: Endpoint(ScoreRequest, pooling.score) for url in ("/score", "/v1/score")})
    endpoints.update({url: Endpoint(RerankRequest, pooling.rerank) for url in ("/rerank", "/v1/rerank", "/v2/rerank")})
    if pooling.pooling:  # a pooling model's server answers the generation routes with a 400
        for url in ("/v1/completions", "/v1/chat/completions"):
            endpoints[url] = Endpoint(endpoints[url].request, _refuse(generation_refused(names[0], url)))
    return endpoints


def _refuse(err: OpenAIError) -> Handler:
    async def handler(body: Any, raw_request: None) -> Any:
        raise err

    return handler


SUPPORTED_URLS = ["/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/pooling", "/score", "/v1/score",
                  "/rerank", "/v1/rerank", "/v2/rerank"]


def add_run_batch_parser(subparsers: Any) -> argparse.ArgumentParser:
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.entrypoints.openai.cli_args import add_serving_args

    p = subparsers.add_parser(
        "run-batch",
        help="run an OpenAI batch file (JSONL) through the engine",
        description="Run an OpenAI batch file: one request a line, {\"custom_id\", \"method\": \"POST\", \"url\", "
                    f"\"body\"}} with url one of {', '.join(SUPPORTED_URLS)}. Each output line holds the response "
                    "the server gives for that body (docs/run-batch.md). Rerun with the same -o to resume.",
    )
    g = p.add_argument_group("batch")
    g.add_argument("-i", "--input-file", required=True,
                   help="the batch file: a local path, - for stdin, or an http(s) URL (read with GET)")
    g.add_argument("-o", "--output-file", required=True,
                   help="where the results go: a local path (lines already there are skipped, so a rerun "
                        "resumes) or - for stdout (no resuming); URLs are not supported")
    add_serving_args(g)
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run_batch_command)
    return p


def run_batch_command(args: argparse.Namespace) -> int:
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.entrypoints.openai.cli_args import check_serving_args

    check_serving_args(args)
    check_output(args.output_file)
    lines = parse_lines(read_input(args.input_file), SUPPORTED_URLS)
    pending = still_to_run(lines, resume_output(args.output_file))
    done = len(lines) - len(pending)
    if done:
        logger.info("%s already holds %d of the %d lines; running the other %d", args.output_file, done,
                    len(lines), len(pending))
    if not pending:
        print(f"pagedllm run-batch: all {len(lines)} lines are in {args.output_file} already", file=sys.stderr)
        return 0
    engine_args = EngineArgs.from_cli_args(args)
    engine = AsyncLLMEngine.from_engine_args(engine_args, multiprocess=False)
    try:
        endpoints = build_endpoints(engine, args)
        window = max(4 * engine.config.scheduler_config.max_num_seqs, 64)
        runner = BatchRunner(engine, endpoints, window)
        writer = OutputWriter(args.output_file)
        bar = tqdm(total=len(lines), initial=done, desc="Running batch", unit="req", dynamic_ncols=True,
                   file=sys.stderr)
        try:
            remaining = asyncio.run(runner.run(pending, writer, bar))
        except EngineDeadError as e:
            remaining = len(pending) - writer.written
            print(f"pagedllm run-batch: error: {e}; {remaining} of {len(lines)} lines remain (rerun to resume)",
                  file=sys.stderr)
            return 1
        finally:
            bar.close()
            writer.close()
    finally:
        engine.shutdown()
    if runner.stop_signal is not None:
        name = signal.Signals(runner.stop_signal).name
        print(f"pagedllm run-batch: stopped by {name}: {remaining} of {len(lines)} lines remain; rerun the same "
              "command to resume", file=sys.stderr)
        return 128 + runner.stop_signal
    s = max(runner.elapsed, 1e-9)
    print(f"pagedllm run-batch: {len(pending)} lines in {s:.2f} s: {runner.prompt_tokens} prompt tokens, "
          f"{runner.completion_tokens} output tokens ({runner.completion_tokens / s:.1f} output tokens/s); "
          f"{runner.errors} answered with an error; results in {args.output_file}", file=sys.stderr)
    return 0
