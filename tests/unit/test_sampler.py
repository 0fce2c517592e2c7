"""Sampler tests on random logits over a small vocabulary: greedy, top-k/top-p/min-p, seeds, penalties, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from fault_hooks import SamplingFaultInjected, parse_sampler_fault, sampler_fault
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.sample import (
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    SamplingRow,
    apply_top_k_top_p,
    compute_topk_logprobs,
    draw_uniforms,
    kernel,
    metadata,
    ops,
    pick_from_probs,
    sample_isolating_faults,
    top_candidates,
)
from pagedllm.worker.sample.ops import _top_k_top_p_sorted

V = 50
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _fixed_default_seed() -> None:
    torch.manual_seed(1234)


def make_row(
    params: SamplingParams | None = None,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    eos: set[int] | None = None,
) -> SamplingRow:
    """A row as the runner builds it: seeded params get a generator seeded with params.seed."""
    params = params or SamplingParams()
    generator = None
    if params.seed is not None:
        generator = torch.Generator().manual_seed(params.seed)
    return SamplingRow(params, generator, list(prompt or [1, 2]), list(output or []), set(eos or set()))


def sample(rows: list[SamplingRow], logits: torch.Tensor, vocab_size: int = V) -> SamplerOutput:
    md = SamplingMetadata.from_rows(rows, vocab_size, CPU)
    return Sampler()(logits, md)


def reference_probs(
    logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> list[float]:
    """The distribution a random row should sample from, computed token by token without the sampler's tricks."""
    probs = torch.softmax(logits.double() / temperature, dim=-1).tolist()
    order = sorted(range(len(probs)), key=lambda t: -probs[t])
    keep = set(order[:top_k] if top_k > 0 else order)
    probs = _renormalize(probs, keep)
    nucleus: set[int] = set()
    mass = 0.0
    for token in order:  # smallest prefix whose mass reaches top_p
        if token in keep and mass < top_p:
            nucleus.add(token)
            mass += probs[token]
    probs = _renormalize(probs, nucleus)
    best = max(probs)
    return _renormalize(probs, {t for t, p in enumerate(probs) if p >= min_p * best})


def _renormalize(probs: list[float], keep: set[int]) -> list[float]:
    total = sum(probs[t] for t in keep)
    return [p / total if t in keep else 0.0 for t, p in enumerate(probs)]


def empirical(tokens: torch.Tensor, vocab_size: int = V) -> list[float]:
    counts = torch.bincount(tokens, minlength=vocab_size).double()
    return (counts / counts.sum()).tolist()


def total_variation(p: list[float], q: list[float]) -> float:
    return 0.5 * sum(abs(a - b) for a, b in zip(p, q))


# ----------------------------------------------------------------------------------------------- greedy


def test_greedy_is_argmax_and_skips_optional_parts() -> None:
    logits = torch.randn(8, V)
    rows = [make_row(SamplingParams(temperature=0.0)) for _ in range(8)]
    md = SamplingMetadata.from_rows(rows, V, CPU)
    assert md.all_greedy and not md.needs_processing
    assert md.temperature is None and md.top_k is None and md.top_p is None and md.min_p is None
    out = Sampler()(logits, md)
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.logprobs is None and out.logprob_token_ids is None and out.sampled_token_ranks is None


def test_greedy_rows_unaffected_by_random_rows() -> None:
    logits = torch.randn(6, V)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.5, top_k=5),
        SamplingParams(temperature=0.0, seed=3),
        SamplingParams(temperature=1.0, top_p=0.5, seed=9),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=2.0, min_p=0.2),
    ]
    rows = [make_row(p) for p in params]
    greedy = [0, 2, 4]
    for _ in range(20):
        out = sample(rows, logits)
        assert torch.equal(out.sampled_token_ids[greedy], logits[greedy].argmax(dim=-1))


def test_input_logits_left_unmodified() -> None:
    logits = torch.randn(3, V)
    before = logits.clone()
    rows = [
        make_row(SamplingParams(repetition_penalty=1.5, logit_bias={3: 2.0}, temperature=0.7, top_k=3), output=[3]),
        make_row(SamplingParams(allowed_token_ids=[1, 2], min_tokens=2, top_p=0.5), eos={1}),
        make_row(SamplingParams(temperature=0.0, presence_penalty=1.0, logprobs=2), output=[4, 4]),
    ]
    sample(rows, logits)
    assert torch.equal(logits, before)


# ------------------------------------------------------------------------------------ top-k, top-p, min-p


CONFIGS = [
    dict(top_k=5),
    dict(top_p=0.6),
    dict(min_p=0.1),
    dict(temperature=0.8, top_k=12, top_p=0.9, min_p=0.05),
    dict(temperature=0.5),
    dict(temperature=1.7, top_p=0.95),
]


def test_truncation_stays_in_set_and_matches_distribution() -> None:
    """Each config gets its own logits row, repeated `draws` times, all in one mixed batch."""
    draws = 4000
    base = torch.randn(len(CONFIGS), V) * 2.0
    rows = [make_row(SamplingParams(**cfg)) for cfg in CONFIGS for _ in range(draws)]
    logits = base.repeat_interleave(draws, dim=0)
    tokens = sample(rows, logits).sampled_token_ids.view(len(CONFIGS), draws)
    for i, cfg in enumerate(CONFIGS):
        expected = reference_probs(base[i], **cfg)
        allowed = {t for t, p in enumerate(expected) if p > 0}
        assert set(tokens[i].tolist()) <= allowed, (cfg, sorted(allowed))
        assert total_variation(empirical(tokens[i]), expected) < 0.05, cfg


def test_top_k_keeps_exactly_k_and_top_p_keeps_at_least_one() -> None:
    logits = torch.randn(1, V) * 3.0
    top3 = set(logits[0].topk(3).indices.tolist())
    rows = [make_row(SamplingParams(top_k=3)) for _ in range(2000)]
    tokens = sample(rows, logits.expand(2000, V)).sampled_token_ids
    assert set(tokens.tolist()) == top3  # all three show up, nothing else
    tiny_p = [make_row(SamplingParams(top_p=1e-6)) for _ in range(200)]
    tokens = sample(tiny_p, logits.expand(200, V)).sampled_token_ids
    assert set(tokens.tolist()) == {int(logits.argmax())}


def test_top_k_larger_than_vocab_is_harmless() -> None:
    logits = torch.randn(1, V)
    rows = [make_row(SamplingParams(top_k=10 * V)) for _ in range(4000)]
    tokens = sample(rows, logits.expand(4000, V)).sampled_token_ids
    assert total_variation(empirical(tokens), reference_probs(logits[0])) < 0.06


def test_low_temperature_is_greedy() -> None:
    logits = torch.randn(4, V)
    logits[torch.arange(4), torch.tensor([3, 17, 42, 0])] += 10.0  # a clear winner per row
    rows = [make_row(SamplingParams(temperature=0.01)) for _ in range(4)]
    for _ in range(50):
        assert sample(rows, logits).sampled_token_ids.tolist() == [3, 17, 42, 0]


def test_temperature_scaling_chi_square() -> None:
    draws, temperature = 20000, 0.6
    logits = torch.randn(1, V)
    rows = [make_row(SamplingParams(temperature=temperature)) for _ in range(draws)]
    tokens = sample(rows, logits.expand(draws, V)).sampled_token_ids
    expected = reference_probs(logits[0], temperature=temperature)
    counts = torch.bincount(tokens, minlength=V).double().tolist()
    # Pool tokens with small expected counts so every cell has at least 5 expected draws.
    chi2, pooled_obs, pooled_exp, cells = 0.0, 0.0, 0.0, 0
    for obs, p in zip(counts, expected):
        if p * draws >= 5:
            chi2 += (obs - p * draws) ** 2 / (p * draws)
            cells += 1
        else:
            pooled_obs, pooled_exp = pooled_obs + obs, pooled_exp + p * draws
    if pooled_exp > 0:
        chi2 += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        cells += 1
    dof = cells - 1
    assert chi2 < dof + 6 * math.sqrt(2 * dof), (chi2, dof)  # mean dof, sd sqrt(2 dof): a 6-sigma bound
    # The same logits at temperature 1 are clearly a different distribution.
    assert total_variation(expected, reference_probs(logits[0])) > 0.05


@pytest.mark.parametrize("native", [True, False], ids=["native-cut", "torch-cut"])
def test_candidate_cuts_equal_whole_row_sorts(monkeypatch: pytest.MonkeyPatch, native: bool) -> None:
    """Top-k / top-p cuts keep exactly what sorting each whole row keeps: among the candidates for
    the rows whose cut they hold (`top_candidates`), and over the whole row for the others, by the
    native kernel (or, without it, a sort: `apply_top_k_top_p`)."""
    if native:
        assert kernel._sampling_kernel() is not None  # the kernel builds here
    else:
        monkeypatch.setattr(ops, "top_p_cuts", lambda logits, top_p: None)
    monkeypatch.setattr(ops, "TOP_CANDIDATES", 32)
    vocab, rows = 4000, 96
    g = torch.Generator().manual_seed(7)
    scales = torch.tensor([0.05, 1.0, 4.0, 9.0]).repeat(rows // 4).unsqueeze(1)  # flat .. peaked rows
    logits = torch.randn(rows, vocab, generator=g) * scales
    top_k = torch.tensor([vocab, 1, 5, 20, 32, vocab, 3, 17]).repeat(rows // 8)
    top_p = torch.tensor([1.0, 0.5, 0.9, 0.95, 1e-6, 0.99]).repeat(rows // 6)
    nucleus = torch.isfinite(_top_k_top_p_sorted(logits, None, top_p)).sum(dim=1)
    for lo, hi in ((1, 32), (33, 512), (513, vocab)):  # nuclei within the candidates and beyond
        assert bool(((nucleus >= lo) & (nucleus <= hi)).any()), (lo, hi)
    for k, p in ((top_k, None), (None, top_p), (top_k, top_p)):
        fast, ref = apply_top_k_top_p(logits, k, p), _top_k_top_p_sorted(logits, k, p)
        kept = torch.isfinite(ref)
        assert torch.equal(torch.isfinite(fast), kept), (k is None, p is None)
        assert torch.equal(fast[kept], logits[kept])  # kept logits unchanged
        assert bool((kept.sum(dim=1) >= 1).all())
        vals, ids, inside = top_candidates(logits, k, p)
        held = torch.zeros_like(kept).scatter_(1, ids, torch.isfinite(vals))
        assert bool(inside.any()) and torch.equal(held[inside], kept[inside])


def _walk_cut(row: torch.Tensor, top_p: float) -> float:
    """The top-p cut by definition, in float64: values in descending order, equal ones together,
    the first at which the running probability reaches top_p."""
    probs = torch.softmax(row.double(), dim=0)
    values, mass = sorted(set(row.tolist()), reverse=True), 0.0
    for v in values:
        mass += float(probs[row == v].sum())
        if mass >= top_p:
            return v
    return values[-1]


def test_native_top_p_cuts_match_the_definition() -> None:
    g = torch.Generator().manual_seed(11)
    rows = torch.randn(12, 3000, generator=g) * torch.tensor([0.02, 0.5, 1, 2, 4, 8] * 2).unsqueeze(1)
    rows[1, ::3] = float("-inf")  # masked by top-k or allowed tokens
    rows[2, :40] = rows[2, :40].max()  # a tie at the top, spanning the cut for a small top_p
    rows[3] = torch.round(rows[3] * 4) / 4  # many ties everywhere
    top_p = torch.tensor([0.9, 0.5, 0.01, 0.95, 0.99, 0.3, 0.999, 0.7, 0.8, 0.6, 0.9, 1.0])
    cut = kernel.top_p_cuts(rows, top_p)
    assert cut is not None
    for i in range(12):
        expected = float("-inf") if top_p[i] >= 1.0 else _walk_cut(rows[i], float(top_p[i]))
        assert float(cut[i]) == expected, (i, float(cut[i]), expected)
    nan_row = rows[:1].clone()
    nan_row[0, 5] = float("nan")
    assert float(kernel.top_p_cuts(nan_row, top_p[:1])[0]) == float("-inf")  # keeps the row as it is


def test_ties_with_the_last_kept_token_stay() -> None:
    logits = torch.full((1, 300), -5.0)
    logits[0, :3] = torch.tensor([4.0, 2.0, 2.0])
    # p(4.0) = 0.76, each 2.0 0.10: top_p 0.8 stops at the first 2.0, and its tie stays with it.
    for fn in (apply_top_k_top_p, _top_k_top_p_sorted):
        assert torch.isfinite(fn(logits, None, torch.tensor([0.8]))).nonzero()[:, 1].tolist() == [0, 1, 2]
        assert torch.isfinite(fn(logits, torch.tensor([2]), None)).nonzero()[:, 1].tolist() == [0, 1, 2]
        assert torch.isfinite(fn(logits, None, torch.tensor([0.5]))).nonzero()[:, 1].tolist() == [0]


def test_sampled_rows_keep_ties_beyond_their_candidates() -> None:
    logits = torch.full((1, 300), -5.0)
    logits[0, :4] = torch.tensor([4.0, 2.0, 2.0, 2.0])
    for params in (SamplingParams(top_k=2), SamplingParams(top_p=0.8), SamplingParams(top_k=1, seed=3)):
        tokens = sample([make_row(params) for _ in range(3000)], logits.expand(3000, 300), 300).sampled_token_ids
        expected = {0} if params.top_k == 1 else {0, 1, 2, 3}  # the 2.0s stay together (ties with the cut)
        assert set(tokens.tolist()) == expected, params


def test_candidate_and_sorted_rows_sample_their_distributions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ops, "TOP_CANDIDATES", 16)
    vocab, draws = 400, 8000
    g = torch.Generator().manual_seed(3)
    base = torch.randn(3, vocab, generator=g) * torch.tensor([[6.0], [1.0], [6.0]])
    configs = [dict(top_p=0.9), dict(top_p=0.3, min_p=0.2), dict(top_k=40, top_p=0.95, temperature=0.7)]
    rows = [make_row(SamplingParams(**cfg)) for cfg in configs for _ in range(draws)]
    tokens = sample(rows, base.repeat_interleave(draws, dim=0), vocab).sampled_token_ids.view(3, draws)
    for i, cfg in enumerate(configs):
        expected = reference_probs(base[i], **cfg)
        assert set(tokens[i].tolist()) <= {t for t, p in enumerate(expected) if p > 0}, cfg
        assert total_variation(empirical(tokens[i], vocab), expected) < 0.05, cfg


def test_native_draws_of_odd_rows() -> None:
    """The native draw (top-p rows without top-k): the first NaN of a row that has one, the last
    token of a row with nothing to draw, the only token left of a row masked down to one."""
    logits = torch.randn(4, 300)
    logits[0, [7, 9]] = float("nan")
    logits[1] = float("-inf")
    logits[2, :] = float("-inf")
    logits[2, 123] = 0.0
    u = torch.rand(4, 1, dtype=torch.float64)
    for temperature in (0.5, 1.0):
        tokens = kernel.sample_rows_native(logits, torch.full((4,), temperature), torch.full((4,), 0.9),
                                                   None, u)
        assert tokens is not None and tokens[:3].tolist() == [7, 299, 123]
        assert 0 <= int(tokens[3]) < 300


def test_inverse_cdf_draws_never_pick_zero_probability_tokens() -> None:
    probs = torch.tensor([[0.0, 2.0, 0.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0, 3e-38], [0.0] * 5])
    tokens = pick_from_probs(probs.repeat(4000, 1), draw_uniforms(12000, {}, CPU)).view(4000, 3)
    assert set(tokens[:, 0].tolist()) == {1, 3}  # unnormalized rows, both halves drawn
    assert abs(float((tokens[:, 0] == 1).double().mean()) - 0.5) < 0.05
    assert set(tokens[:, 1].tolist()) == {4}  # a tiny last token is still the only one
    assert set(tokens[:, 2].tolist()) <= set(range(5))  # nothing to draw: an index, not an error


# ------------------------------------------------------------------------------------------------ seeds


def _seeded_run(seed: int | None, position: int, others: list[SamplingParams], steps: int = 8,
                vocab: int = V, **target_params: object) -> list[int]:
    """Samples `steps` tokens for one row whose logits per step are fixed, placed among `others`."""
    logits_gen = torch.Generator().manual_seed(77)
    target_logits = [torch.randn(vocab, generator=logits_gen) * 3 for _ in range(steps)]
    target = make_row(SamplingParams(seed=seed, **(target_params or dict(temperature=0.9, top_p=0.95))))
    other_rows = [make_row(p) for p in others]
    tokens = []
    for step in range(steps):
        rows = other_rows[:position] + [target] + other_rows[position:]
        logits = torch.randn(len(rows), vocab)
        logits[position] = target_logits[step]
        tokens.append(int(sample(rows, logits, vocab).sampled_token_ids[position]))
    return tokens


@pytest.mark.parametrize("target", [dict(top_p=0.9), dict(top_k=20, top_p=0.9), dict(top_k=300), dict(min_p=0.02)],
                         ids=["top-p", "top-k-top-p", "wide-top-k", "min-p"])
def test_seeded_rows_take_the_same_way_in_any_batch(target: dict) -> None:
    """Over a vocabulary larger than the candidates: whichever rows share the batch (other top-k
    sizes, other ways through the sampler, more rows than one chunk), a seeded row draws the same."""
    vocab = 3000
    alone = _seeded_run(5, 0, [], vocab=vocab, **target)
    mixes = [
        (1, [SamplingParams(top_k=1000), SamplingParams(temperature=0.0)]),
        (0, [SamplingParams(top_p=0.5), SamplingParams(top_k=2, top_p=0.3, seed=1)]),
        (40, [SamplingParams(temperature=1.3)] * 70),
    ]
    for position, others in mixes:
        assert _seeded_run(5, position, others, vocab=vocab, **target) == alone, (position, len(others))


def test_seed_is_independent_of_batch_and_position() -> None:
    alone = _seeded_run(5, 0, [])
    mixes = [
        (0, [SamplingParams(), SamplingParams(temperature=0.0)]),
        (2, [SamplingParams(top_k=3), SamplingParams(seed=11, min_p=0.1), SamplingParams(repetition_penalty=1.3)]),
        (1, [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(top_p=0.3, seed=5)]),
        (3, [SamplingParams(temperature=2.0)] * 5),
    ]
    for position, others in mixes:
        assert _seeded_run(5, position, others) == alone, (position, others)


def test_different_seeds_differ_and_unseeded_rows_vary() -> None:
    assert _seeded_run(5, 0, []) != _seeded_run(6, 0, [])
    assert _seeded_run(None, 0, []) != _seeded_run(None, 0, [])


# -------------------------------------------------------------------------------------------- penalties


def test_penalties_exact_values() -> None:
    vocab = 6
    raw = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 1.0])
    rows = [
        make_row(
            SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
            prompt=[0],
            output=[1, 3, 3],
        ),
        make_row(SamplingParams(), prompt=[0, 1], output=[3]),  # default penalties: untouched
        make_row(SamplingParams(frequency_penalty=-1.0), prompt=[2], output=[5, 5, 5]),
    ]
    md = SamplingMetadata.from_rows(rows, vocab, CPU)
    processed = Sampler().process_logits(raw.expand(3, vocab), md)
    # Row 0: repetition on {0 (prompt), 1, 3 (output)}: 2.0 -> 1.0, -1.0 -> -2.0, 3.0 -> 1.5;
    # then frequency 0.25 per occurrence (1: once, 3: twice) and presence 0.5 for 1 and 3.
    expected0 = [1.0, -2.0 - 0.25 - 0.5, 0.5, 1.5 - 0.5 - 0.5, -2.0, 1.0]
    assert processed[0].tolist() == pytest.approx(expected0)
    assert processed[1].tolist() == pytest.approx(raw.tolist())
    # Row 2: a negative frequency penalty rewards the token 3 times; the prompt is ignored without repetition.
    assert processed[2].tolist() == pytest.approx([2.0, -1.0, 0.5, 3.0, -2.0, 4.0])
    # Greedy follows the penalized logits: the raw argmax 3 (3.0) drops to 0.75, so token 0 (2.0) wins.
    greedy = [make_row(SamplingParams(temperature=0.0, repetition_penalty=4.0), prompt=[3])]
    assert sample(greedy, raw.view(1, vocab), vocab_size=vocab).sampled_token_ids.item() == 0


def test_presence_and_frequency_only_skip_prompt_counts() -> None:
    rows = [make_row(SamplingParams(presence_penalty=1.0), prompt=[0], output=[2])]
    md = SamplingMetadata.from_rows(rows, 4, CPU)
    assert md.penalties is not None and md.penalties.prompt_token_ids is None
    processed = Sampler().process_logits(torch.zeros(1, 4), md)
    assert processed.tolist() == [[0.0, 0.0, -1.0, 0.0]]


def test_min_tokens_blocks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(1, V)
    logits[0, 5] = 10.0  # eos
    logits[0, 7] = 9.0  # stop token
    logits[0, 9] = 8.0
    for ignore_eos in (False, True):
        params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7], ignore_eos=ignore_eos)
        early = make_row(params, output=[1, 2], eos={5})
        assert sample([early], logits).sampled_token_ids.item() == 9
        reached = make_row(params, output=[1, 2, 3], eos={5})
        assert sample([reached], logits).sampled_token_ids.item() == 5
    random_rows = [make_row(SamplingParams(min_tokens=2, stop_token_ids=[7]), eos={5}) for _ in range(500)]
    tokens = sample(random_rows, logits.expand(500, V)).sampled_token_ids
    assert not ({5, 7} & set(tokens.tolist()))


def test_logit_bias_and_allowed_token_ids() -> None:
    logits = torch.randn(1, V)
    biased = make_row(SamplingParams(temperature=0.0, logit_bias={4: 100.0}))
    assert sample([biased], logits).sampled_token_ids.item() == 4
    allowed = [3, 7, 11]
    rows = [make_row(SamplingParams(allowed_token_ids=allowed, logit_bias={20: 100.0})) for _ in range(2000)]
    rows.append(make_row(SamplingParams(logit_bias={int(logits.argmax()): -1000.0})))
    tokens = sample(rows, logits.expand(len(rows), V)).sampled_token_ids
    assert set(tokens[:-1].tolist()) == set(allowed)  # the bias cannot re-admit token 20
    assert tokens[-1].item() != int(logits.argmax())


# --------------------------------------------------------------------------------------------- logprobs


def test_logprobs_come_from_raw_logits() -> None:
    logits = torch.randn(4, V)
    rows = [
        make_row(SamplingParams(logprobs=3, temperature=0.5, repetition_penalty=2.0), output=[1, 2]),
        make_row(SamplingParams(temperature=0.0)),  # no logprobs asked: still computed, sliced by the runner
        make_row(SamplingParams(logprobs=0, top_k=2)),
        make_row(SamplingParams(logprobs=1, temperature=0.0, logit_bias={6: 50.0})),
    ]
    out = sample(rows, logits)
    assert out.logprob_token_ids is not None and out.logprobs is not None and out.sampled_token_ranks is not None
    assert out.logprob_token_ids.shape == (4, 4) and out.logprobs.shape == (4, 4)
    assert out.logprob_token_ids.dtype == torch.int64 and out.logprobs.dtype == torch.float32
    raw = logits.log_softmax(dim=-1)
    sampled = out.sampled_token_ids
    assert sampled[3].item() == 6
    assert torch.equal(out.logprob_token_ids[:, 0], sampled)
    assert torch.allclose(out.logprobs[:, 0], raw.gather(1, sampled[:, None]).squeeze(1))
    top = raw.topk(3, dim=-1)
    assert torch.equal(out.logprob_token_ids[:, 1:], top.indices)
    assert torch.allclose(out.logprobs[:, 1:], top.values)
    assert bool((out.logprobs[:, 1:].diff(dim=-1) <= 0).all())
    ranks = [1 + int((raw[i] > raw[i, sampled[i]]).sum()) for i in range(4)]
    assert out.sampled_token_ranks.tolist() == ranks


def test_compute_topk_logprobs_worked_example() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0], [3.0, 3.0, 0.0]])
    ids, logprobs, ranks = compute_topk_logprobs(logits, torch.tensor([0, 1]), 2)
    assert ids[0].tolist() == [0, 2, 1]
    assert ranks.tolist() == [3, 1]  # a tie with the best token still ranks 1
    assert torch.allclose(logprobs, logits.log_softmax(-1).gather(1, ids))
    ids, logprobs, ranks = compute_topk_logprobs(logits, torch.tensor([2, 2]), 0)
    assert ids.shape == (2, 1) and ranks.tolist() == [1, 3]


def test_a_row_whose_sampling_raises_fails_alone() -> None:
    """A row with an unvalidated logit_bias id outside the vocabulary makes the batch's index_put_
    raise; it alone is reported, and the greedy, seeded (with logprobs) and unseeded rows get
    the tokens they get in a batch without it, seeded generators included."""
    logits = torch.randn(4, V)
    good = [SamplingParams(temperature=0), SamplingParams(temperature=0.9, seed=7, logprobs=2),
            SamplingParams(temperature=0.9)]
    bad = SamplingParams(temperature=0, logit_bias={V + 3: 1.0})  # the front end would refuse it
    kept_logits = torch.cat([logits[:2], logits[3:]])
    rows = [make_row(good[0]), make_row(good[1]), make_row(bad), make_row(good[2])]
    with pytest.raises(IndexError):
        sample(rows, logits)  # the batch as a whole raises
    rows = [make_row(good[0]), make_row(good[1]), make_row(bad), make_row(good[2])]
    got = sample_isolating_faults(Sampler(), logits, rows, CPU)
    assert got.kept == [0, 1, 3] and list(got.failed) == [2] and "IndexError" in got.failed[2]
    want = sample([make_row(p) for p in good], kept_logits)
    assert got.output is not None
    assert got.output.sampled_token_ids[:2].tolist() == want.sampled_token_ids[:2].tolist()
    assert torch.equal(got.output.logprobs[1], want.logprobs[1])  # type: ignore[index]
    assert 0 <= int(got.output.sampled_token_ids[2]) < V
    # The seeded row's generator went on from where the clean batch left it: the next draws agree.
    nxt = sample_isolating_faults(Sampler(), logits[1:2], [rows[1]], CPU).output
    assert nxt is not None
    ref_row = make_row(good[1])
    sample([ref_row], logits[1:2])
    assert nxt.sampled_token_ids.tolist() == sample([ref_row], logits[1:2]).sampled_token_ids.tolist()


def test_a_batch_error_no_row_explains_is_raised() -> None:
    """An error only the whole batch hits (as running out of memory would) is not any request's
    fault: it is raised, for the engine to fail."""

    class BatchOnlyFailure(Sampler):
        def forward(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
            if logits.shape[0] > 1:
                raise RuntimeError("out of memory")
            return super().forward(logits, md)

    rows = [make_row(SamplingParams(temperature=0)), make_row(SamplingParams(temperature=0.5, seed=1))]
    with pytest.raises(RuntimeError, match="out of memory"):
        sample_isolating_faults(BatchOnlyFailure(), torch.randn(2, V), rows, CPU)


def test_every_row_failing_samples_nothing() -> None:
    rows = [make_row(SamplingParams(temperature=0, logit_bias={V: 1.0})) for _ in range(2)]
    got = sample_isolating_faults(Sampler(), torch.randn(2, V), rows, CPU)
    assert got.output is None and got.kept == [] and sorted(got.failed) == [0, 1]


def test_sampler_fault_hook_parses_and_fires(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_sampler_fault(None) is None and parse_sampler_fault("7") == (7, 0)
    assert parse_sampler_fault("7:3") == (7, 3)
    with pytest.raises(ValueError, match="SEED:AFTER"):
        parse_sampler_fault("x")
    monkeypatch.setattr(metadata, "fault_hook", sampler_fault(7, 2))
    row = make_row(SamplingParams(temperature=0.5, seed=7), output=[1])
    sample([row], torch.randn(1, V))  # one output token: not yet
    row.output_token_ids.append(2)
    with pytest.raises(SamplingFaultInjected):
        sample([row], torch.randn(1, V))
