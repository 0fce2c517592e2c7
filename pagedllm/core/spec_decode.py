"""Speculative decoding's scheduler side: proposals and acceptance counts. No torch here.

Each step the scheduler asks the proposer for up to k tokens to follow a decoding request's last
token; the request is then scheduled for 1 + k tokens (its own last token and the proposals), and
the worker verifies the proposals in the same forward pass (pagedllm/worker/spec_decode.py). The
worker returns the accepted proposals and one token of the target's own; the scheduler takes the
rejected ones back off `num_computed_tokens` and frees the blocks they alone used.

`NgramProposer` (method ngram, also called prompt lookup): the tokens that followed the latest
earlier occurrence of the request's longest suffix of `prompt_lookup_max` down to
`prompt_lookup_min` tokens, found by array comparisons over the request's tokens (numpy), never a
Python loop over them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from pagedllm.config import SpeculativeConfig
from pagedllm.core.request import Request
from pagedllm.core.spec_adaptive import SpecController, max_spec_rows

if TYPE_CHECKING:
    from pagedllm.core.kv_cache_manager import KVCacheManager

logger = logging.getLogger(__name__)


SEP = -1
"""Separates token streams in one array: matches and continuations never cross it."""


def match_lengths(src: np.ndarray, max_end: int, tail: np.ndarray, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(the candidate ends p < max_end with src[p] == tail[-1] and a token, not SEP, after them;
    how many tokens of `tail` each matches going back, at most max_len). The match of each grows by
    one array comparison over the candidates per token back."""
    n = len(tail)
    ends = np.flatnonzero(src[:max_end] == tail[-1])
    ends = ends[ends + 1 < len(src)]
    if len(ends):
        ends = ends[src[ends + 1] != SEP]
    length = np.ones(len(ends), dtype=np.int64)
    alive = np.ones(len(ends), dtype=bool)
    for j in range(1, min(max_len, n)):
        back = ends - j
        alive &= back >= 0
        alive[alive] = src[back[alive]] == tail[n - 1 - j]
        if not alive.any():
            break
        length += alive
    return ends, length


def ngram_lookup(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> tuple[np.ndarray, int]:
    """(up to k tokens that followed the latest earlier occurrence of the longest suffix of
    `tokens` of min_n .. max_n tokens, that suffix's length); (empty, 0) when none occurs.

    tokens [5 6 7 8 | 5 6 7], max_n 3 -> the suffix [5 6 7] occurs at 0..2, followed by [8 5 6 7];
    k 2 -> ([8 5], 3). The search: positions p < len - 1 whose token equals the last one are the
    candidate ends of a match; their match length grows by one comparison per step back (at most
    max_n array comparisons over the candidates, whatever the length of `tokens`).
    """
    n = len(tokens)
    if n < min_n + 1 or k < 1:
        return tokens[:0], 0
    ends, length = match_lengths(tokens, n - 1, tokens, min(max_n, n - 1))
    if len(ends) == 0:
        return tokens[:0], 0
    best = int(length.max())
    if best < min_n:
        return tokens[:0], 0
    # The latest occurrence among the longest (ends are ascending).
    end = int(ends[np.flatnonzero(length == best)[-1]])
    return tokens[end + 1 : end + 1 + k], best


def ngram_propose(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> np.ndarray:
    """ngram_lookup's tokens alone."""
    return ngram_lookup(tokens, k, min_n, max_n)[0]


@dataclass
class _History:
    tokens: np.ndarray
    length: int = 0
    num_prompt: int = 0


class Proposer:
    """What the scheduler asks of a proposal method: propose(req, max_tokens) -> up to max_tokens
    tokens; release(req) when a request leaves. With an adaptive `control`, the scheduler
    starts each step with begin_step and reports each verification with record. Keeps a numpy
    copy of each request's tokens (`tokens_of`), extended by the new ones only, so a proposal
    costs no conversion of the whole list."""

    control: SpecController | None = None
    """Adapts how many tokens each request proposes (core/spec_adaptive.py); None: always k."""
    adapts_by_kind = False
    """Whether propose() asks `control` for its allowance itself, naming the kind of the proposal
    it found (proposals_for then leaves that to it)."""

    def __init__(self) -> None:
        self._history: dict[str, _History] = {}

    def propose(self, req: Request, max_tokens: int) -> list[int]:
        raise NotImplementedError

    def tokens_of(self, req: Request) -> np.ndarray:
        """The request's prompt and output tokens so far (a view of its numpy copy)."""
        tokens = req.all_token_ids
        h = self._history.get(req.request_id)
        n = len(tokens)
        if h is None or h.length > n:
            h = self._history[req.request_id] = _History(np.empty(max(2 * n, 64), dtype=np.int64),
                                                         num_prompt=req.num_prompt_tokens)
        if n > len(h.tokens):
            grown = np.empty(2 * n, dtype=np.int64)
            grown[: h.length] = h.tokens[: h.length]
            h.tokens = grown
        if n > h.length:
            h.tokens[h.length : n] = tokens[h.length : n]
            h.length = n
        return h.tokens[:n]

    def forget(self, request_id: str) -> None:
        self._history.pop(request_id, None)
        if self.control is not None:
            self.control.forget(request_id)

    def release(self, req: Request) -> None:
        """The request has finished or was aborted."""
        self.forget(req.request_id)

    def begin_step(self, num_running: int) -> None:
        """A step with this many running requests starts (its rows left for proposals)."""
        if self.control is not None:
            self.control.begin_step(num_running)

    def record(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        if self.control is not None:
            self.control.record(request_id, num_proposed, num_accepted)


class NgramProposer(Proposer):
    """Proposals from each request's own prompt and output (ngram_lookup). With an adaptive
    `control`, a proposal's kind is the length of the match it follows: each length has its own
    acceptance per request (core/spec_adaptive.py), so the tokens after a match of one token are
    proposed as rarely as they land, without cutting those after a longer match short."""

    adapts_by_kind = True

    def __init__(self, config: SpeculativeConfig, control: SpecController | None = None) -> None:
        super().__init__()
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.control = control
        self._kind: dict[str, int] = {}
        """The match length of each request's pending proposals."""

    def propose(self, req: Request, max_tokens: int) -> list[int]:
        """Up to min(k, max_tokens) tokens to follow the request's last token (fewer where
        `control` allows fewer after a match of that length)."""
        k = min(self.k, max_tokens)
        if k < 1:
            return []
        tokens, length = ngram_lookup(self.tokens_of(req), k, self.min_n, self.max_n)
        if self.control is not None and len(tokens):
            tokens = tokens[: self.control.allowance(req.request_id, len(tokens), length)]
            if len(tokens):
                self._kind[req.request_id] = length
        return tokens.tolist()

    def record(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        if self.control is not None:
            self.control.record(request_id, num_proposed, num_accepted, self._kind.pop(request_id, None))

    def forget(self, request_id: str) -> None:
        self._kind.pop(request_id, None)
        super().forget(request_id)


DRAFT_SLOT = 0
"""What method draft_model's scheduler side proposes: a placeholder the worker's draft model
replaces with its own tokens before the target verifies them (worker/draft_runner.py)."""


class DraftSlotsProposer(Proposer):
    """Method draft_model: the scheduler decides how many tokens a request proposes (its budget,
    the adaptive controller) and reserves their KV slots; the worker's draft model decodes them
    ahead of the target in the same step, so the placeholders never reach the model."""

    def __init__(self, config: SpeculativeConfig, control: SpecController | None = None) -> None:
        super().__init__()
        self.k = config.num_speculative_tokens
        self.control = control

    def propose(self, req: Request, max_tokens: int) -> list[int]:
        return [DRAFT_SLOT] * max(0, min(self.k, max_tokens))


def spec_control(config: SpeculativeConfig, device: str) -> SpecController:
    """The adaptive controller of a speculating engine on this device ('cpu', 'cuda'), logged."""
    max_rows = max_spec_rows(device)
    if config.method == "suffix":
        how = (f"suffix matches of up to {config.suffix_decoding_max_tree_depth} tokens over its own tokens and "
               f"the outputs of up to {config.suffix_decoding_max_cached_requests} finished requests, "
               f"token probability at least {config.suffix_decoding_min_token_prob}, "
               f"spec factor {config.suffix_decoding_max_spec_factor}")
    elif config.method == "draft_model":
        how = (f"greedy decodes of the draft model {config.model or '(the target itself)'}"
               + (f", {config.quantization}" if config.quantization else ""))
    else:
        how = f"n-gram lookup of {config.prompt_lookup_min}..{config.prompt_lookup_max} tokens"
    logger.info(
        "Speculative decoding: method %s, up to %d tokens proposed per step (%s), fewer where a request's "
        "proposals are rarely accepted; proposals only while a step holds at most %d rows (%s rule: beyond them a "
        "decode step is bound by computing its rows), so none from %d running requests; requests with structured "
        "output decode without it",
        config.method, config.num_speculative_tokens, how, max_rows, "GPU" if device == "cuda" else "CPU", max_rows)
    return SpecController(config.num_speculative_tokens, max_rows)


def proposals_for(proposer: Proposer, req: Request, budget: int, max_model_len: int) -> list[int]:
    """Proposed tokens to verify after a decoding request's last token: within the step's token
    budget left, and never more than it may still generate after the token the step yields of
    its own; with adaptation, no more than the request's acceptance and the step's rows allow.
    None for a request with a structure (its grammar matcher cannot roll back)."""
    if req.structured is not None or req.num_tokens - req.num_computed_tokens != 1:
        return []
    room = min(budget - 1, req.max_tokens - req.num_output_tokens - 1, max_model_len - req.num_tokens - 1)
    control = proposer.control
    if control is not None and room > 0:
        room = min(room, control.rows_left) if proposer.adapts_by_kind else control.allowance(req.request_id, room)
    proposals = proposer.propose(req, room) if room > 0 else []
    if control is not None:
        control.took(len(proposals))
    return proposals


def roll_back(kv: KVCacheManager, req: Request, num_proposed: int, num_accepted: int) -> None:
    """Takes a verified request's rejected proposals back off its progress (their K/V slots are
    written again before anything reads them) and frees the blocks that only they used. Called
    before its kept tokens (the accepted ones and the target's own) are appended."""
    assert 0 <= num_accepted <= num_proposed, (num_accepted, num_proposed)
    req.num_computed_tokens -= num_proposed - num_accepted
    kv.trim(req, req.num_tokens + num_accepted + 1)


@dataclass
class SpecDecodeStats:
    """Speculative decoding's counts so far (vLLM's spec_decode metrics)."""

    num_drafts: int = 0
    """Steps in which a request verified proposals."""
    num_draft_tokens: int = 0
    """Tokens proposed and verified."""
    num_accepted_tokens: int = 0
    """Of those, tokens accepted."""
    accepted_per_position: list[int] = field(default_factory=list)
    """Accepted tokens by their position among the step's proposals (0: the first)."""

    def record(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft:
            self.accepted_per_position.extend([0] * (num_draft - len(self.accepted_per_position)))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def copy(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               list(self.accepted_per_position))

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a speculating step yields on average: the accepted ones plus the target's own."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
