"""Structured output in the engine core: grammars compiled off the step loop, one matcher per
sequence, and each step's token bitmask filled in one batched call per backend.

`StructuredOutputManager.init_request` gives a request that asks for a structure (or for a
thinking budget) a `StructuredRequest` and queues the compile of its grammar on a worker thread;
compiled grammars are cached by their key, so the same schema compiles once. The scheduler leaves
a request whose grammar is not ready in the waiting queue (`StructuredRequest.ready`) and steps
the others. After `schedule()`, `grammar_bitmask` fills one row for every constrained sequence that
samples this step; the model runner applies the rows to the logits in place before sampling
(worker/sample/grammar.py). `Scheduler.update_from_output` feeds each sampled token to the
sequence's matcher (`StructuredRequest.accept`); the matcher lives with the request, so preemption
by swap or by recompute keeps it where it was.

With a reasoning parser (`--reasoning-parser`), the structure applies to the answer: tokens up to
the end of the thinking are not fed to the matcher and get no mask, unless the config's
`enable_in_reasoning` is set. `thinking_token_budget` ends the thinking after N tokens by allowing
only the end-of-thinking token in the next row.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.structured_output.backends import BACKEND_CLASSES, GrammarBackend, Matcher, choose_backend

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.core.request import Request

logger = logging.getLogger(__name__)

# Compiled grammars kept for reuse (their key: backend and the structure with its options).
GRAMMAR_CACHE_SIZE = 512


# Front-end verdicts by structure key: the backend chosen, or the error (the same schema sent by
# many requests is checked once).
_VERDICTS: OrderedDict[str, tuple[str | None, str | None]] = OrderedDict()
_VERDICTS_LOCK = threading.Lock()


def validate_structured_outputs(params: SamplingParams, backend: str) -> None:
    """Front-end check of a request's structure: chooses its backend (stored in the params) and
    compiles it without the tokenizer; ValueError naming the problem. Verdicts are cached by the
    structure's key."""
    sop = params.structured_outputs
    if sop is None:
        return
    sop._backend = None
    key = backend + ":" + grammar_key(sop)
    with _VERDICTS_LOCK:
        verdict = _VERDICTS.get(key)
        if verdict is not None:
            _VERDICTS.move_to_end(key)
    if verdict is None:
        try:
            verdict = (choose_backend(sop, backend), None)
        except ValueError as e:
            verdict = (None, str(e))
        with _VERDICTS_LOCK:
            _VERDICTS[key] = verdict
            while len(_VERDICTS) > GRAMMAR_CACHE_SIZE:
                _VERDICTS.popitem(last=False)
    if verdict[1] is not None:
        raise ValueError(verdict[1])
    sop._backend = verdict[0]


def grammar_key(sop: StructuredOutputsParams) -> str:
    return json.dumps(sop.to_dict(), sort_keys=True, default=str)


class StructuredRequest:
    """One sequence's structured-output state: its grammar (compiling or compiled), its matcher,
    and where it is relative to a reasoning model's thinking."""

    __slots__ = ("future", "backend", "new_matcher", "matcher", "in_reasoning", "thinking_tokens", "budget", "end_token_id",
                 "reasoner", "error", "complete", "stop_token_ids", "ignore_eos")

    def __init__(self, future: Future | None, backend: str | None, new_matcher: Callable[[Any], Matcher] | None,
                 in_reasoning: bool, budget: int | None, end_token_id: int | None, reasoner: Any,
                 stop_token_ids: list[int], ignore_eos: bool = False) -> None:
        self.future = future
        self.backend = backend  # the backend's name
        self.new_matcher = new_matcher  # compiled grammar -> Matcher (the backend is built on first use)
        self.matcher: Matcher | None = None
        self.in_reasoning = in_reasoning
        self.thinking_tokens = 0
        self.budget = budget
        self.end_token_id = end_token_id
        self.reasoner = reasoner
        self.error: str | None = None
        # The structure is whole but its last token was not a stop token (llguidance stops as soon
        # as nothing else may follow): the next token is forced to a stop token, so the sequence
        # ends the way every other does (by EOS, left out of its text).
        self.complete = False
        self.stop_token_ids = stop_token_ids
        self.ignore_eos = ignore_eos

    @property
    def ready(self) -> bool:
        """Whether the request may be scheduled: its grammar is compiled. (One that failed to
        compile is never ready: the engine core ends it, see `compile_error`.)"""
        return self.future is None or (self.future.done() and self.future.exception() is None)

    @property
    def compiling(self) -> bool:
        return self.future is not None and not self.future.done()

    def compile_error(self) -> str | None:
        """Why the grammar did not compile, once it is done compiling; None when it compiled."""
        if self.future is None or not self.future.done():
            return None
        e = self.future.exception()
        return None if e is None else f"cannot compile the structured output: {e}"

    def _get_matcher(self) -> Matcher | None:
        if self.matcher is None and self.future is not None and self.new_matcher is not None:
            self.matcher = self.new_matcher(self.future.result())
        return self.matcher

    def forces_end_of_thinking(self) -> bool:
        return (self.in_reasoning and self.budget is not None and self.end_token_id is not None
                and self.thinking_tokens >= self.budget)

    def constrained(self) -> bool:
        """Whether this sequence's next token is masked."""
        return self.complete or self.forces_end_of_thinking() or (not self.in_reasoning and self.future is not None)

    def accept(self, token_id: int, all_token_ids: list[int]) -> bool:
        """Feeds one sampled token; True when the structure has ended (the sequence stops). Sets
        `error` when the grammar does not allow the token."""
        if self.in_reasoning:
            self.thinking_tokens += 1
            if self.end_token_id is not None:
                ended = token_id == self.end_token_id
            else:
                ended = bool(self.reasoner.is_reasoning_end(all_token_ids))
            if ended:
                self.in_reasoning = False
            return False
        matcher = self._get_matcher()
        if matcher is None:
            return False
        if not matcher.accept(token_id):
            self.error = f"token {token_id} is outside the structured output's grammar"
            return True
        if matcher.is_terminated() and token_id not in self.stop_token_ids:
            self.complete = True
            return self.ignore_eos or not self.stop_token_ids  # no stop token could end it: end it now
        return matcher.is_terminated()


class StructuredOutputManager:
    """The engine core's grammars: compiles them on one worker thread, caches them, and fills the
    step's bitmask."""

    def __init__(self, config: EngineConfig) -> None:
        mc = config.model_config
        self.config = config
        self.so_config = config.structured_outputs_config
        self.vocab_size = mc.vocab_size
        self.words = (self.vocab_size + 31) // 32
        self._executor: ThreadPoolExecutor | None = None
        self._tokenizer: Any = None
        self._backends: dict[str, GrammarBackend] = {}
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._reasoner: Any = None
        self._reasoner_loaded = False

    # ---- set-up, lazily (a server that never sees a structured request never loads any of it) ----
    def tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                from pagedllm.models.loader import load_tokenizer, resolve_model

                mc = self.config.model_config
                self._tokenizer = load_tokenizer(resolve_model(mc.tokenizer or mc.path))
            return self._tokenizer

    def backend(self, name: str) -> GrammarBackend:
        tok = self.tokenizer()
        with self._lock:
            b = self._backends.get(name)
            if b is None:
                stop = sorted(self.config.model_config.eos_token_ids) or (
                    [tok.eos_token_id] if tok.eos_token_id is not None else [])
                b = self._backends[name] = BACKEND_CLASSES[name](tok, self.vocab_size, stop)
                logger.info("Structured output: %s backend ready (vocabulary of %d tokens)", name, self.vocab_size)
            return b

    def reasoner(self) -> Any:
        if not self._reasoner_loaded:
            name = self.so_config.reasoning_parser
            if name is not None:
                from pagedllm.reasoning import get_reasoning_parser

                self._reasoner = get_reasoning_parser(name)(self.tokenizer())
            self._reasoner_loaded = True
        return self._reasoner

    def _compile(self, sop: StructuredOutputsParams, backend: str) -> Future:
        key = backend + ":" + grammar_key(sop)
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None and not (fut.done() and fut.exception() is not None):
                self._cache.move_to_end(key)
                return fut
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedllm-grammar")
            fut = self._executor.submit(lambda: self.backend(backend).compile(sop))
            self._cache[key] = fut
            while len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
            return fut

    # ---- requests ------------------------------------------------------------------------------
    def init_request(self, req: Request) -> None:
        """Gives `req` its StructuredRequest when it asks for a structure or a thinking budget."""
        params = req.sampling_params
        sop = params.structured_outputs
        budget = params.thinking_token_budget
        reasoner = self.reasoner() if (sop is not None or budget is not None) else None
        if sop is None and (budget is None or reasoner is None):
            return
        future = name = new_matcher = None
        if sop is not None:
            name = sop._backend or choose_backend(sop, self.so_config.backend)
            future = self._compile(sop, name)
            new_matcher = partial(self._new_matcher, name)
        in_reasoning = reasoner is not None and not (sop is not None and self.so_config.enable_in_reasoning) and not (
            _prompt_closes_thinking(reasoner, req.prompt_token_ids))
        if budget is not None and not in_reasoning:
            budget = None
        end_id = getattr(reasoner, "end_token_id", None) if reasoner is not None else None
        stop = sorted(req.eos_token_ids) or sorted(self.config.model_config.eos_token_ids)
        req.structured = StructuredRequest(future, name, new_matcher, in_reasoning, budget, end_id, reasoner, stop,
                                           params.ignore_eos)

    def _new_matcher(self, backend: str, compiled: Any) -> Matcher:
        return self.backend(backend).matcher(compiled)

    def grammar_bitmask(self, sampling: list[Request]) -> tuple[torch.Tensor, dict[str, int]] | None:
        """The bitmask rows of this step's constrained sequences among `sampling` (the requests that
        sample a token this step), or None when none is constrained."""
        rows: dict[str, int] = {}
        forced: list[tuple[int, list[int]]] = []
        by_backend: dict[str, list[tuple[Matcher, int]]] = {}
        for req in sampling:
            s = req.structured
            if s is None or not s.constrained():
                continue
            row = rows[req.request_id] = len(rows)
            if s.complete:
                forced.append((row, s.stop_token_ids))
            elif s.in_reasoning:  # constrained while thinking only to end it (thinking_token_budget)
                forced.append((row, [s.end_token_id]))  # type: ignore[list-item]
            else:
                matcher = s._get_matcher()
                assert matcher is not None and s.backend is not None
                by_backend.setdefault(s.backend, []).append((matcher, row))
        if not rows:
            return None
        bitmask = torch.full((len(rows), self.words), -1, dtype=torch.int32)
        for name, items in by_backend.items():
            self.backend(name).fill(items, bitmask)
        for row, tokens in forced:
            bitmask[row].zero_()
            for token in tokens:
                bitmask[row, token // 32] |= _bit(token % 32)
        return bitmask, rows

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)


def _prompt_closes_thinking(reasoner: Any, prompt_token_ids: list[int]) -> bool:
    """Whether the prompt's last think marker is the end of a thinking (a template that turned
    thinking off writes `<think></think>`); else the reply starts inside the thinking, and the
    structure waits for its end, as in vLLM."""
    start, end = reasoner.start_token_id, reasoner.end_token_id
    if start is None or end is None:
        return bool(reasoner.is_reasoning_end(prompt_token_ids))
    for t in reversed(prompt_token_ids):
        if t == end:
            return True
        if t == start:
            return False
    return False


def _bit(i: int) -> int:
    """Bit i of an int32 word, as the signed value torch stores."""
    v = 1 << i
    return v - (1 << 32) if v >= 1 << 31 else v

