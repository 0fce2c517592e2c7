"""Speculative decoding's parts on their own: the n-gram search against a plain-Python oracle, the
configuration's validation, and the rejection sampler's output distribution against the target
distribution computed here from first principles (chi-square)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pagedllm.config import SpeculativeConfig
from pagedllm.core.request import Request
from pagedllm.core.spec_adaptive import SpecController
from pagedllm.core.spec_decode import NgramProposer, ngram_lookup, ngram_propose, proposals_for
from pagedllm.engine.arg_utils import EngineArgs, parse_speculative_config
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.sample import Sampler
from pagedllm.worker.spec_decode import SpecRows, verify

# ---- n-gram proposals ---------------------------------------------------------------------------


def ngram_oracle_match(tokens: list[int], k: int, min_n: int, max_n: int) -> tuple[list[int], int]:
    """The longest suffix (max_n down to min_n) that occurs earlier: its latest earlier occurrence's
    continuation and its length, by brute force."""
    n = len(tokens)
    for size in range(min(max_n, n - 1), min_n - 1, -1):
        suffix = tokens[n - size :]
        for start in range(n - size - 1, -1, -1):
            if tokens[start : start + size] == suffix:
                return tokens[start + size : start + size + k], size
    return [], 0


def ngram_oracle(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    return ngram_oracle_match(tokens, k, min_n, max_n)[0]


def test_ngram_examples() -> None:
    t = np.asarray([5, 6, 7, 8, 5, 6, 7])
    assert ngram_propose(t, 2, 1, 3).tolist() == [8, 5]
    assert ngram_propose(t, 9, 1, 3).tolist() == [8, 5, 6, 7]
    assert ngram_propose(t, 2, 4, 5).tolist() == []  # no 4-token suffix occurs earlier
    assert ngram_propose(np.asarray([1, 2, 3]), 2, 1, 3).tolist() == []
    # The longest match wins over a later, shorter one: [1 2 3] at 0 beats [3] at 5.
    assert ngram_propose(np.asarray([1, 2, 3, 9, 9, 3, 4, 1, 2, 3]), 1, 1, 3).tolist() == [9]
    # Among equally long matches, the latest.
    assert ngram_propose(np.asarray([1, 2, 7, 1, 2, 8, 1, 2]), 1, 2, 2).tolist() == [8]


@pytest.mark.parametrize("seed", range(4))
def test_ngram_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(300):
        vocab = rng.choice([2, 3, 5, 50])
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 60))]
        k, min_n = rng.randint(1, 5), rng.randint(1, 3)
        max_n = rng.randint(min_n, 6)
        got = ngram_propose(np.asarray(tokens, dtype=np.int64), k, min_n, max_n).tolist()
        assert got == ngram_oracle(tokens, k, min_n, max_n), (tokens, k, min_n, max_n)
        found, size = ngram_lookup(np.asarray(tokens, dtype=np.int64), k, min_n, max_n)
        want, want_size = ngram_oracle_match(tokens, k, min_n, max_n)
        assert (found.tolist(), size if want else 0) == (want, want_size), (tokens, k, min_n, max_n)


def test_proposer_follows_a_growing_request() -> None:
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=3))
    req = Request("a", [1, 2, 3, 4, 1, 2], SamplingParams(max_tokens=50))
    assert proposer.propose(req, 10) == [3, 4, 1]
    assert proposer.propose(req, 1) == [3]  # capped by what the request may still generate
    for t in [3, 9, 9, 9]:
        req.append_output_token(t)
    assert proposer.propose(req, 10) == [9]  # [9 9] last occurred at 7..8, then 9
    proposer.forget("a")
    assert proposer.propose(req, 10) == [9]


def test_proposals_adapt_per_match_length() -> None:
    """A request's proposals after a one-token match that are always rejected stop (but for the
    controller's probes); those after a three-token match are still proposed in full, then stop
    too once they are rejected."""
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3),
                             SpecController(3, 32))
    req = Request("a", [1, 2, 3, 4, 9, 1], SamplingParams(max_tokens=50))

    def step() -> list[int]:
        req.num_computed_tokens = req.num_tokens - 1  # a decode: its last token to compute
        proposer.begin_step(1)
        return proposals_for(proposer, req, 100, 1000)

    assert step() == [2, 3, 4]  # [1] matched at 0: nothing measured yet, k
    for _ in range(10):
        proposer.record("a", len(step()) or 1, 0)
    assert step() == []
    for t in [2, 3]:
        req.append_output_token(t)
    assert step() == [4, 9, 1]  # [1 2 3] matched at 0: a kind of its own, in full
    proposer.record("a", 3, 3)
    assert step() == [4, 9, 1]
    for _ in range(10):
        proposer.record("a", len(step()) or 1, 0)
    assert step() == []
    proposer.forget("a")
    assert step() == [4, 9, 1]


# ---- configuration -----------------------------------------------------------------------------


def test_speculative_config_parsing() -> None:
    c = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}')
    assert c == SpeculativeConfig("ngram", 5, 1, 3)
    assert parse_speculative_config(None) is None and parse_speculative_config("{}") is None
    assert EngineArgs(speculative_config={"num_speculative_tokens": 2}).speculative_config.num_speculative_tokens == 2


@pytest.mark.parametrize(("value", "named"), [
    ('{"method": "eagle", "num_speculative_tokens": 2}', "method"),
    ('{"num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"num_speculative_tokens": 2.5}', "num_speculative_tokens"),
    ('{"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "prompt_lookup_max"),
    ('{"num_speculative_tokens": 2, "prompt_lookup_min": 0}', "prompt_lookup_min"),
    ('{"method": "ngram"}', "num_speculative_tokens"),
    ('{"num_speculative_tokens": 2, "draft": 1}', "draft"),
    ("[1]", "JSON object"),
    ("{nope", "JSON"),
])
def test_speculative_config_errors_name_the_field(value: str, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        EngineArgs(speculative_config=value)


# ---- rejection sampling ------------------------------------------------------------------------

# chi-square critical values at significance 0.001, by degrees of freedom
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}
V = 8
DRAWS = 6000


def oracle_probs(logits: torch.Tensor, params: SamplingParams, history: list[int]) -> torch.Tensor:
    """The target distribution of one position, written out from the parameters' definitions:
    presence / frequency penalties over the output so far, logit bias, temperature, top-k, top-p,
    min-p."""
    x = logits.double().clone()
    counts = torch.bincount(torch.tensor(history, dtype=torch.int64), minlength=V).double()
    x -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).double()
    for t, b in (params.logit_bias or {}).items():
        x[int(t)] += b
    p = torch.softmax(x / params.temperature, dim=0)
    order = torch.argsort(p, descending=True)
    keep = torch.zeros(V, dtype=torch.bool)
    mass = 0.0
    for rank, t in enumerate(order.tolist()):
        if (params.top_k > 0 and rank >= params.top_k) or mass >= params.top_p:
            break
        keep[t] = True
        mass += float(p[t])
    p = torch.where(keep, p, 0.0)
    p = torch.where(p >= params.min_p * p.max(), p, 0.0)
    return p / p.sum()


def chi_square(counts: np.ndarray, probs: torch.Tensor) -> tuple[float, int]:
    expected = probs.numpy() * counts.sum()
    support = expected > 0
    assert counts[~support].sum() == 0, f"drew tokens of probability 0: {counts}"
    stat = float((((counts - expected) ** 2)[support] / expected[support]).sum())
    return stat, int(support.sum()) - 1


PARAMS = {
    "temperature": SamplingParams(temperature=0.8, seed=None),
    "top_k": SamplingParams(temperature=1.0, top_k=4),
    "top_p": SamplingParams(temperature=1.2, top_p=0.7),
    "min_p": SamplingParams(temperature=1.0, min_p=0.15),
    "penalties": SamplingParams(temperature=1.0, frequency_penalty=0.9, presence_penalty=0.4),
    "logit_bias": SamplingParams(temperature=1.0, logit_bias={5: 2.0, 0: -1.0}),
    "seeded": SamplingParams(temperature=0.9, seed=7),
}


@pytest.mark.parametrize("name", list(PARAMS))
def test_rejection_sampling_keeps_the_target_distribution(name: str) -> None:
    """DRAWS copies of one request propose [x0, x1] after the same logits; the first emitted
    token must follow p0, and the second (where x0 was accepted) p1, whose penalties count x0.
    Proposals are the likeliest token and an unlikely one (mostly rejected), so both the
    acceptance and the correction draws matter. Significance 0.001 per test."""
    params = PARAMS[name]
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, V, generator=gen) * 1.5
    prompt = [1, 2]
    p0 = oracle_probs(logits[0], params, [])
    x0 = int(p0.argmax())
    p1 = oracle_probs(logits[1], params, [x0])
    x1 = int(p1.argsort()[-3])
    ib = InputBatch(64, 16, capacity=DRAWS)
    for i in range(DRAWS):
        p = params if params.seed is None else params.clone()
        if params.seed is not None:
            p.seed = params.seed + i
        g = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
        ib.add(f"r{i}", prompt, len(prompt), [0], 2, p, g)
    slots = np.arange(DRAWS)
    spec = SpecRows(list(range(DRAWS)), slots, [[x0, x1]] * DRAWS, np.zeros(3 * DRAWS, dtype=np.int64))
    torch.manual_seed(1)
    rows = torch.cat([logits, logits[1:]]).float()  # positions 0, 1 and the bonus (any logits)
    kept = verify(Sampler(), rows.repeat(DRAWS, 1), ib, spec, torch.device("cpu"))
    first = np.bincount([k[0] for k in kept], minlength=V)
    stat, df = chi_square(first, p0)
    assert stat < CHI2_999[df], (name, stat, df, first, p0)
    second = np.bincount([k[1] for k in kept if k[0] == x0], minlength=V)
    assert second.sum() > DRAWS * float(p0[x0]) * 0.8
    stat, df = chi_square(second, p1)
    assert stat < CHI2_999[df], (name, stat, df, second, p1)
    assert all(len(k) <= 3 for k in kept)


def test_seeded_verification_repeats_itself() -> None:
    params = SamplingParams(temperature=1.0, seed=3)
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(5))

    def run() -> list[list[int]]:
        ib = InputBatch(64, 16, capacity=4)
        ib.add("a", [1], 1, [0], 1, params, torch.Generator().manual_seed(3))
        spec = SpecRows([0], np.arange(1), [[0, 1]], np.zeros(3, dtype=np.int64))
        return verify(Sampler(), logits, ib, spec, torch.device("cpu"))

    torch.manual_seed(0)
    a = [run() for _ in range(5)]
    torch.manual_seed(1)
    assert [run() for _ in range(5)] == a


def test_greedy_verification_accepts_while_argmax() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    ib = InputBatch(64, 16, capacity=4)
    ib.add("a", [1], 1, [0], 1, SamplingParams(temperature=0.0), None)
    cases = {(1, 0): [1, 0, 2], (1, 2): [1, 0], (2, 0): [1]}
    for props, want in cases.items():
        spec = SpecRows([0], np.arange(1), [list(props)], np.zeros(3, dtype=np.int64))
        assert verify(Sampler(), logits, ib, spec, torch.device("cpu")) == [want]
