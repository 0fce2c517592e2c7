"""The suffix proposer (core/spec_suffix.py) against a plain-Python oracle written from its
definition (every occurrence of the longest matching tail, the most frequent continuation, the
estimated probability's cut-off, the length limits), on random token streams and on hand-made
cases; the cache of finished requests' outputs; the configuration's checks."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pagedllm.config import SpeculativeConfig
from pagedllm.core.request import Request
from pagedllm.core.spec_suffix import SuffixProposer, make_proposer, suffix_propose
from pagedllm.engine.arg_utils import parse_speculative_config
from pagedllm.sampling_params import SamplingParams


def oracle(sources: list[tuple[list[int], int]], tokens: list[int], k: int, max_depth: int, spec_factor: float,
           min_prob: float) -> list[int]:
    """Plain loops: sources as (tokens with -1 separators, max_end), oldest first."""
    tail = tokens[-(max_depth - 1):]
    occ = []  # (match length, source, end, recency)
    offset = 0
    for si, (src, max_end) in enumerate(sources):
        for p in range(max_end):
            if src[p] != tail[-1] or p + 1 >= len(src) or src[p + 1] == -1:
                continue
            m = 1
            while m < len(tail) and p - m >= 0 and src[p - m] == tail[-1 - m]:
                m += 1
            occ.append((m, si, p, offset + p))
        offset += len(src)
    if not occ:
        return []
    best = max(o[0] for o in occ)
    room = min(k, max_depth - best, int(spec_factor * best))
    alive = [o for o in occ if o[0] == best]
    out: list[int] = []
    prob = 1.0
    for j in range(1, room + 1):
        follow: dict[int, list[int]] = {}
        for _, si, p, rank in alive:
            src = sources[si][0]
            if p + j < len(src) and src[p + j] != -1:
                follow.setdefault(src[p + j], []).append(rank)
        if not follow:
            break
        token = max(follow, key=lambda t: (len(follow[t]), max(follow[t])))
        prob *= len(follow[token]) / len(alive)
        if prob < min_prob:
            break
        out.append(token)
        alive = [o for o in alive if o[2] + j < len(sources[o[1]][0]) and sources[o[1]][0][o[2] + j] == token]
    return out


def run(sources: list[tuple[list[int], int]], tokens: list[int], *args: float) -> list[int]:
    arrays = [(np.asarray(s, dtype=np.int64), e) for s, e in sources]
    return suffix_propose(arrays, np.asarray(tokens, dtype=np.int64), *args).tolist()  # type: ignore[arg-type]


def test_hand_made_frequency_and_probability() -> None:
    # "1 2" is followed by 3 twice and by 4 once: 3 (prob 2/3), then 3's continuation
    own = [1, 2, 3, 5, 1, 2, 4, 6, 1, 2, 3, 5, 7, 1, 2]
    assert run([(own, len(own) - 1)], own, 4, 24, 1.0, 0.1) == [3, 5]  # spec factor 1: at most 2 (the match)
    assert run([(own, len(own) - 1)], own, 4, 24, 4.0, 0.1) == [3, 5, 7, 1]
    assert run([(own, len(own) - 1)], own, 4, 24, 4.0, 0.7) == []  # 2/3 < 0.7
    assert run([(own, len(own) - 1)], own, 4, 3, 4.0, 0.1) == [3]  # depth 3: match 2 + 1 proposal
    # a cached output holds the longer match: it wins over the own tokens
    cache = [9, 8, 1, 2, 4, 4, -1]
    assert run([(cache, len(cache)), (own, len(own) - 1)], own + [9, 8, 1, 2], 3, 24, 1.0, 0.1) == [4, 4]


@pytest.mark.parametrize("seed", range(40))
def test_random_streams_match_the_oracle(seed: int) -> None:
    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 8])
    own = [rng.randrange(vocab) for _ in range(rng.randrange(2, 80))]
    sources: list[tuple[list[int], int]] = []
    if rng.random() < 0.7:
        cache: list[int] = []
        for _ in range(rng.randrange(1, 5)):
            cache += [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))] + [-1]
        sources.append((cache, len(cache)))
    sources.append((own, len(own) - 1))
    args = (rng.choice([1, 3, 8]), rng.choice([2, 4, 24]), rng.choice([0.5, 1.0, 3.0]), rng.choice([0.0, 0.1, 0.4]))
    assert run(sources, own, *args) == oracle(sources, own, *args), (sources, own, args)


def request(rid: str, prompt: list[int], output: list[int]) -> Request:
    req = Request(rid, prompt, SamplingParams(max_tokens=100))
    for t in output:
        req.append_output_token(t)
    return req


def test_cache_of_finished_outputs_is_bounded_first_in_first_out() -> None:
    cfg = SpeculativeConfig(method="suffix", num_speculative_tokens=4, suffix_decoding_max_cached_requests=2,
                            suffix_decoding_max_spec_factor=4.0)
    p = make_proposer(cfg)
    assert isinstance(p, SuffixProposer)
    for i, out in enumerate([[50, 51, 52, 53, 54], [60, 61, 62, 63], [70, 71, 72, 73]]):
        p.release(request(f"r{i}", [1, 2], out))
    assert p.corpus.tolist() == [60, 61, 62, 63, -1, 70, 71, 72, 73, -1]
    assert p.propose(request("a", [9, 60, 61], []), 10) == [62, 63]
    assert p.propose(request("b", [9, 50, 51], []), 10) == []  # evicted
    off = make_proposer(SpeculativeConfig(method="suffix", num_speculative_tokens=4,
                                          suffix_decoding_max_cached_requests=0))
    off.release(request("r", [1], [5, 6, 7]))
    assert len(off.corpus) == 0


def test_config_names_and_checks() -> None:
    cfg = parse_speculative_config('{"method": "suffix"}')
    assert cfg.num_speculative_tokens == 24 and cfg.suffix_decoding_min_token_prob == 0.1
    assert cfg.suffix_decoding_max_cached_requests == 10000 and cfg.suffix_decoding_max_spec_factor == 1.0
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        parse_speculative_config('{"method": "suffix", "prompt_lookup_max": 3}')
    with pytest.raises(ValueError, match="suffix_decoding_max_tree_depth"):
        parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 2, "suffix_decoding_max_tree_depth": 3}')
    with pytest.raises(ValueError, match="suffix_decoding_min_token_prob"):
        SpeculativeConfig(method="suffix", suffix_decoding_min_token_prob=1.5)
    with pytest.raises(ValueError, match="suffix_decoding_max_cached_requests"):
        SpeculativeConfig(method="suffix", suffix_decoding_max_cached_requests=-1)
