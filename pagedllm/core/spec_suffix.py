"""Speculative decoding's suffix method: proposals from the request's own tokens and from the
outputs of recent requests, scored by how often each continuation occurred. No torch here.

Where the n-gram method follows one earlier occurrence of the request's tail, this one looks at
every occurrence of it, in the request's own prompt and output and in a bounded cache of finished
requests' outputs (repetitive agent loops, code edits: a request often repeats what an earlier one
wrote). The search, `suffix_propose`, over each source (a token array):

1. Match: the positions holding the request's last token are the candidate ends of a match; the
   match of each grows backwards by one array comparison over the candidates per token, up to
   max_depth - 1 tokens. Candidates with nothing after them (the end of their source) drop out.
   The longest match length L over all sources wins, and every candidate matching L tokens is an
   occurrence of the request's tail (the node of a suffix tree at depth L).
2. Propose: at most min(k, max_depth - L, floor(spec_factor * L)) tokens. Each one is the token
   that follows the most occurrences still alive (ties: the one of the most recent occurrence,
   the request's own tokens being the most recent of all); its probability is the share of the
   alive occurrences it follows, and the proposal's estimated probability the product of these.
   Proposals stop before a token whose product falls below min_prob; the occurrences it does not
   follow drop out.

Each step is array operations over the candidates (numpy), never a Python loop over the tokens of
a source; the Python loops run over match lengths and proposal positions only. Matching scans the
cache's tokens once per proposal (about a millisecond per million cached tokens).

vLLM's options (suffix_decoding_*) set max_depth, the cache's size in requests (first in, first
out; 0 turns it off), spec_factor and min_prob.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from pagedllm.config import SpeculativeConfig
from pagedllm.core.request import Request
from pagedllm.core.spec_adaptive import SpecController
from pagedllm.core.spec_decode import SEP, DraftSlotsProposer, NgramProposer, Proposer, match_lengths



def suffix_propose(sources: list[tuple[np.ndarray, int]], tail: np.ndarray, k: int, max_depth: int,
                   spec_factor: float, min_prob: float) -> np.ndarray:
    """Up to k tokens to follow `tail` (module docstring). `sources`: (tokens, max_end) pairs,
    oldest first; a match may end before max_end only, and its continuation runs to the end of
    the tokens or a separator (-1)."""
    if k < 1 or len(tail) == 0 or max_depth < 2:
        return np.zeros(0, dtype=np.int64)
    tail = tail[-(max_depth - 1):]
    found = [match_lengths(src, max_end, tail, max_depth - 1) for src, max_end in sources]
    best = max((int(length.max()) for _, length in found if len(length)), default=0)
    room = min(k, max_depth - best, int(spec_factor * best))
    if best == 0 or room < 1:
        return np.zeros(0, dtype=np.int64)
    # The occurrences of the tail's last `best` tokens: source index, end, recency rank.
    src_idx, pos, rank = [], [], []
    offset = 0
    for i, ((src, _), (ends, length)) in enumerate(zip(sources, found)):
        keep = ends[length == best]
        src_idx.append(np.full(len(keep), i, dtype=np.int64))
        pos.append(keep)
        rank.append(keep + offset)
        offset += len(src)
    src_idx, pos, rank = np.concatenate(src_idx), np.concatenate(pos), np.concatenate(rank)
    out: list[int] = []
    prob = 1.0
    for j in range(1, room + 1):
        nxt = np.full(len(pos), SEP, dtype=np.int64)
        for i, (src, _) in enumerate(sources):
            mine = src_idx == i
            at = pos[mine] + j
            ok = at < len(src)
            vals = np.full(len(at), SEP, dtype=np.int64)
            vals[ok] = src[at[ok]]
            nxt[mine] = vals
        valid = nxt != SEP
        if not valid.any():
            break
        tokens, inverse, counts = np.unique(nxt[valid], return_inverse=True, return_counts=True)
        latest = np.full(len(tokens), -1, dtype=np.int64)
        np.maximum.at(latest, inverse, rank[valid])
        top = np.flatnonzero(counts == counts.max())
        choice = int(top[np.argmax(latest[top])])
        prob *= counts[choice] / len(pos)
        if prob < min_prob:
            break
        token = int(tokens[choice])
        out.append(token)
        keep = nxt == token
        src_idx, pos, rank = src_idx[keep], pos[keep], rank[keep]
    return np.asarray(out, dtype=np.int64)


class SuffixProposer(Proposer):
    """Method suffix: proposals from the request's own tokens and the outputs of up to
    max_cached_requests finished requests."""

    def __init__(self, config: SpeculativeConfig, control: SpecController | None = None) -> None:
        super().__init__()
        self.k = config.num_speculative_tokens
        self.max_depth = config.suffix_decoding_max_tree_depth
        self.max_cached = config.suffix_decoding_max_cached_requests
        self.spec_factor = float(config.suffix_decoding_max_spec_factor)
        self.min_prob = float(config.suffix_decoding_min_token_prob)
        self.control = control
        self._cached: deque[np.ndarray] = deque()
        self._corpus: np.ndarray | None = np.zeros(0, dtype=np.int64)

    @property
    def corpus(self) -> np.ndarray:
        """The cached outputs, oldest first, each followed by a separator."""
        if self._corpus is None:
            parts = [p for out in self._cached for p in (out, np.array([SEP], dtype=np.int64))]
            self._corpus = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return self._corpus

    def propose(self, req: Request, max_tokens: int) -> list[int]:
        """Up to min(k, max_tokens) tokens to follow the request's last token."""
        k = min(self.k, max_tokens)
        if k < 1:
            return []
        tokens = self.tokens_of(req)
        corpus = self.corpus
        # The request's own tokens last (the most recent); its tail itself is no match.
        sources = ([(corpus, len(corpus))] if len(corpus) else []) + [(tokens, len(tokens) - 1)]
        return suffix_propose(sources, tokens, k, self.max_depth, self.spec_factor, self.min_prob).tolist()

    def release(self, req: Request) -> None:
        """The request's output goes into the cache (the oldest leaves beyond max_cached)."""
        if self.max_cached > 0 and req.num_output_tokens > 0:
            self._cached.append(np.asarray(req.output_token_ids, dtype=np.int64))
            while len(self._cached) > self.max_cached:
                self._cached.popleft()
            self._corpus = None
        super().release(req)


def make_proposer(config: SpeculativeConfig) -> Proposer:
    """The proposer of the configured method."""
    if config.method == "draft_model":
        return DraftSlotsProposer(config)
    return SuffixProposer(config) if config.method == "suffix" else NgramProposer(config)
