"""Turns per-step EngineCoreOutputs into RequestOutputs: text, logprobs, stop strings, n > 1.

It runs in the front end (the API server process when serving). A failure while processing one
request's output (a detokenizer error, say), or a sequence the engine core ended with
finish_reason "error", fails that request alone: it is reported in `ProcessedOutputs.failed` and
its unfinished sequences are handed back for the engine core to abort.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tokenizers import Tokenizer

from pagedllm.core.scheduler_output import EngineCoreOutput, Logprobs
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.stats import FinishedRequestStats, IterationStats
from pagedllm.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
)
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


class EngineRequestError(RuntimeError):
    """The engine core ended one sequence of the request with an error (its sampling raised)."""


class TokenTexts:
    """Memoized text of single tokens, for logprob entries."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, tid: int) -> str:
        text = self._cache.get(tid)
        if text is None:
            text = self._cache[tid] = self.tokenizer.decode([tid], skip_special_tokens=False)
        return text


@dataclass
class SequenceState:
    """One generated sequence (a request with n > 1 has n of them)."""

    seq_id: str
    index: int
    params: SamplingParams
    detok: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_tokens_sent: int = 0
    num_logprobs_sent: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[SequenceState]
    metrics: RequestMetrics
    priority: int = 0
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    updated: set[int] = field(default_factory=set)
    pooling: PoolingParams | None = None
    pooled: PoolingOutput | None = None

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)


def child_id(request_id: str, index: int, n: int) -> str:
    """Scheduler-level id of sample `index` of a request (the request's own id when n == 1)."""
    return request_id if n == 1 else f"{index}_{request_id}"


@dataclass
class ProcessedOutputs:
    outputs: list[RequestOutput]
    """RequestOutputs to hand out."""
    stopped: list[str]
    """Sequence ids stopped by a stop string (the engine core must finish them)."""
    failed: dict[str, Exception] = field(default_factory=dict)
    """Requests that failed while their outputs were processed, with the error."""
    failed_seq_ids: list[str] = field(default_factory=list)
    """Unfinished sequences of the failed requests (the engine core must abort them)."""


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.token_text = TokenTexts(tokenizer)
        self.requests: dict[str, RequestState] = {}
        self.seq_owner: dict[str, tuple[RequestState, SequenceState]] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams,
        arrival_time: float,
        priority: int = 0,
    ) -> list[str]:
        """Registers a request; returns the scheduler-level ids of its n sequences."""
        if isinstance(params, PoolingParams):
            return self._add_pooling_request(request_id, prompt, prompt_token_ids, params, arrival_time, priority)
        seqs = []
        for i in range(params.n):
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params) if params.detokenize else None
            seqs.append(
                SequenceState(
                    seq_id=child_id(request_id, i, params.n),
                    index=i,
                    params=params,
                    detok=detok,
                    logprobs=[] if params.logprobs is not None else None,
                    cumulative_logprob=0.0 if params.logprobs is not None else None,
                )
            )
        state = RequestState(
            request_id, prompt, list(prompt_token_ids), params, seqs, RequestMetrics(arrival_time=arrival_time), priority
        )
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
        self.requests[request_id] = state
        for s in seqs:
            self.seq_owner[s.seq_id] = (state, s)
        return [s.seq_id for s in seqs]

    def _add_pooling_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                             params: PoolingParams, arrival_time: float, priority: int) -> list[str]:
        """A pooling request: one sequence that ends with its pooled output and generates nothing."""
        sampling = SamplingParams(max_tokens=1, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
        seq = SequenceState(seq_id=request_id, index=0, params=sampling, detok=None)
        state = RequestState(request_id, prompt, list(prompt_token_ids), sampling, [seq],
                             RequestMetrics(arrival_time=arrival_time), priority, pooling=params)
        self.requests[request_id] = state
        self.seq_owner[request_id] = (state, seq)
        return [request_id]

    def __contains__(self, request_id: object) -> bool:
        """Whether `request_id` names a request or a sample of one in flight."""
        return request_id in self.requests or request_id in self.seq_owner

    def remove_request(self, request_id: str) -> list[str]:
        """Forgets a request; returns its unfinished sequence ids (for the scheduler to abort)."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return []
        for s in state.seqs:
            self.seq_owner.pop(s.seq_id, None)
        return [s.seq_id for s in state.seqs if not s.finished]

    def _to_logprob_dicts(self, lp: Logprobs) -> list[dict[int, Logprob]]:
        out = []
        for ids, values, rank in zip(lp.token_ids, lp.logprobs, lp.ranks):
            d: dict[int, Logprob] = {}
            # First entry is the chosen token with its true rank; the rest are the top-k by rank.
            for j, (tid, v) in enumerate(zip(ids, values)):
                if tid in d:
                    continue
                d[tid] = Logprob(v, rank if j == 0 else j, self.token_text(tid))
            out.append(d)
        return out

    def process_outputs(
        self, core_outputs: list[EngineCoreOutput], stats: IterationStats | None = None
    ) -> ProcessedOutputs:
        """RequestOutputs for one step's core outputs; see ProcessedOutputs."""
        now = time.time()
        stats = stats if stats is not None else IterationStats()
        touched: dict[str, RequestState] = {}
        result = ProcessedOutputs([], [])
        for co in core_outputs:
            owner = self.seq_owner.get(co.req_id)
            if owner is None:
                continue
            state, seq = owner
            try:
                self._process_one(state, seq, co, now, stats, result.stopped)
            except Exception as e:  # this request's failure, not the engine's
                result.failed[state.request_id] = e
                result.failed_seq_ids += self.remove_request(state.request_id)
                touched.pop(state.request_id, None)
                continue
            touched[state.request_id] = state
        for state in touched.values():
            try:
                out = self._make_output(state)
            except Exception as e:
                result.failed[state.request_id] = e
                result.failed_seq_ids += self.remove_request(state.request_id)
                continue
            if state.finished:
                state.metrics.finished_time = now
                stats.finished.append(self._finished_stats(state, now))
                self.remove_request(state.request_id)
            if out is not None:
                result.outputs.append(out)
        return result

    def _process_one(
        self, state: RequestState, seq: SequenceState, co: EngineCoreOutput, now: float, stats: IterationStats,
        stopped_by_string: list[str],
    ) -> None:
        if seq.finished:
            # A sequence the front end ended (a stop string) may still get the output of a step the
            # engine core ran before it heard of the stop: it is not part of the sequence.
            return
        if co.finish_reason == "error":
            seq.finish_reason = "error"  # ended by the engine core: nothing of it is left to abort
            raise EngineRequestError(co.error or "the engine core ended this request with an error")
        if co.pooled is not None:
            state.pooled = PoolingOutput.from_bytes(co.pooled.shape, co.pooled.data)
            state.num_cached_tokens = co.num_cached_tokens
            state.metrics.first_scheduled_time = co.first_scheduled_time
            stats.num_prompt_tokens += len(state.prompt_token_ids)
            seq.finish_reason = co.finish_reason
        # With n > 1 every sample computes the prompt: keep the first sample's logprobs only.
        if co.prompt_logprobs is not None and state.prompt_logprobs is not None and seq.index == 0:
            state.prompt_logprobs.extend(self._to_logprob_dicts(co.prompt_logprobs))
        if co.new_token_ids:
            m = state.metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = co.first_scheduled_time
            if m.first_token_time is None:
                m.first_token_time = now
                state.num_cached_tokens = co.num_cached_tokens
                stats.num_prompt_tokens += len(state.prompt_token_ids)
                stats.time_to_first_tokens.append(now - m.arrival_time)
            elif m.last_token_time is not None:
                stats.inter_token_latencies.append(now - m.last_token_time)
            m.last_token_time = now
            stats.num_generation_tokens += len(co.new_token_ids)
            self._update_sequence(seq, co)
            if seq.finish_reason == "stop" and isinstance(seq.stop_reason, str) and not co.finished:
                stopped_by_string.append(seq.seq_id)
        state.updated.add(seq.index)

    @staticmethod
    def _finished_stats(state: RequestState, now: float) -> FinishedRequestStats:
        """One record per request (an n > 1 request counts once; its tokens are summed)."""
        m = state.metrics
        scheduled = m.first_scheduled_time or now
        first_token = m.first_token_time or now
        return FinishedRequestStats(
            finish_reason=state.seqs[0].finish_reason or "abort",
            e2e_latency=now - m.arrival_time,
            queue_time=max(scheduled - m.arrival_time, 0.0),
            prefill_time=max(first_token - scheduled, 0.0),
            decode_time=max(now - first_token, 0.0),
            num_prompt_tokens=len(state.prompt_token_ids),
            num_generation_tokens=sum(len(s.token_ids) for s in state.seqs),
        )

    def _update_sequence(self, seq: SequenceState, co: EngineCoreOutput) -> None:
        seq.token_ids.extend(co.new_token_ids)
        if co.logprobs is not None and seq.logprobs is not None:
            seq.logprobs.extend(self._to_logprob_dicts(co.logprobs))
            seq.cumulative_logprob = (seq.cumulative_logprob or 0.0) + sum(v[0] for v in co.logprobs.logprobs)
        if co.finished:
            seq.finish_reason, seq.stop_reason = co.finish_reason, co.stop_reason
        if seq.detok is not None:
            # An EOS / stop token that ended the sequence is not part of its text.
            skip_last = co.finish_reason == "stop" and not seq.params.include_stop_str_in_output
            matched = seq.detok.update(co.new_token_ids, skip_last=skip_last)
            if matched is not None:
                seq.finish_reason, seq.stop_reason = "stop", matched
                # Tokens after the one that completed the stop string (a step of speculative
                # decoding yields several) are not part of the sequence.
                extra = len(co.new_token_ids) - 1 - seq.detok.stop_index
                if extra > 0:
                    del seq.token_ids[-extra:]
                    if co.logprobs is not None and seq.logprobs is not None:
                        dropped = co.logprobs.logprobs[-extra:]
                        del seq.logprobs[-extra:]
                        seq.cumulative_logprob = (seq.cumulative_logprob or 0.0) - sum(v[0] for v in dropped)

    def _make_output(self, state: RequestState) -> RequestOutput | PoolingRequestOutput | None:
        kind = state.params.output_kind
        finished = state.finished
        if state.pooling is not None:
            if not finished:
                return None
            if state.pooled is None:  # ended without a result (aborted)
                raise EngineRequestError(f"the pooling request ended ({state.seqs[0].finish_reason}) without output")
            return PoolingRequestOutput(state.request_id, state.pooled, state.prompt_token_ids, True, state.prompt,
                                        state.num_cached_tokens, state.metrics)
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind == RequestOutputKind.DELTA
        seqs = [s for s in state.seqs if s.index in state.updated] if delta else state.seqs
        state.updated = set()
        completions = [self._completion(s, delta) for s in seqs]
        prompt_lp = state.prompt_logprobs
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=prompt_lp,
            outputs=completions,
            finished=finished,
            num_cached_tokens=state.num_cached_tokens,
            metrics=state.metrics,
            priority=state.priority,
        )

    def _completion(self, seq: SequenceState, delta: bool) -> CompletionOutput:
        if delta:
            text = seq.detok.get_delta(seq.finished) if seq.detok else ""
            tokens = seq.token_ids[seq.num_tokens_sent :]
            logprobs = seq.logprobs[seq.num_logprobs_sent :] if seq.logprobs is not None else None
            seq.num_tokens_sent = len(seq.token_ids)
            seq.num_logprobs_sent = len(seq.logprobs or [])
        else:
            text = seq.detok.text if seq.detok else ""
            tokens = list(seq.token_ids)
            logprobs = list(seq.logprobs) if seq.logprobs is not None else None
        return CompletionOutput(
            index=seq.index,
            text=text,
            token_ids=tokens,
            cumulative_logprob=seq.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )
