"""The structured-output bitmask on the logits: the native kernel and the vectorized torch pass
against a row-by-row Python reference, its effect on sampling, and the bitmask rows the manager fills (xgrammar and llguidance)."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output.manager import _bit
from pagedllm.worker.sample import Sampler, SamplingMetadata, SamplingRow, apply_grammar_bitmask

CPU = torch.device("cpu")


def reference_mask(logits: torch.Tensor, bitmask: torch.Tensor, logit_rows: list[int], mask_rows: list[int]) -> torch.Tensor:
    """One row, one token at a time: a token keeps its logit when its bit is set."""
    out = logits.clone()
    vocab = logits.shape[1]
    for lr, mr in zip(logit_rows, mask_rows):
        for t in range(vocab):
            word = int(bitmask[mr, t // 32]) & 0xFFFFFFFF
            if not (word >> (t % 32)) & 1:
                out[lr, t] = float("-inf")
    return out


def random_bitmask(rows: int, vocab: int, rng: random.Random, density: float) -> torch.Tensor:
    words = (vocab + 31) // 32
    m = torch.zeros(rows, words, dtype=torch.int32)
    for r in range(rows):
        allowed = [t for t in range(vocab) if rng.random() < density] or [rng.randrange(vocab)]
        for t in allowed:
            m[r, t // 32] |= _bit(t % 32)
    return m


@pytest.fixture(params=["native", "torch"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways the mask is applied: the native kernel and the vectorized torch pass."""
    from pagedllm.worker.sample import grammar

    if request.param == "torch":
        monkeypatch.setattr(grammar, "_sampling_kernel", lambda: None)
    else:
        assert grammar._sampling_kernel() is not None, "the native sampling kernel does not build here"
    return request.param


@pytest.mark.parametrize("vocab", [50, 64, 97])
@pytest.mark.parametrize("seed", range(4))
def test_mask_equals_row_by_row_reference(vocab: int, seed: int, path: str) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed))
    constrained = sorted(rng.sample(range(n), rng.randint(0, n)))  # a mix of constrained and free rows
    bitmask = random_bitmask(len(constrained) + 2, vocab, rng, rng.choice([0.02, 0.3, 0.9]))
    mask_rows = rng.sample(range(bitmask.shape[0]), len(constrained))
    expected = reference_mask(logits, bitmask, constrained, mask_rows)
    got = logits.clone()
    apply_grammar_bitmask(got, bitmask, constrained, mask_rows)
    assert torch.equal(got, expected)


def test_whole_batch_in_order_is_masked_in_place(path: str) -> None:
    logits = torch.randn(3, 70)
    bitmask = random_bitmask(3, 70, random.Random(1), 0.5)
    expected = reference_mask(logits, bitmask, [0, 1, 2], [0, 1, 2])
    apply_grammar_bitmask(logits, bitmask, [0, 1, 2], [0, 1, 2])
    assert torch.equal(logits, expected)


def test_bit_helper_covers_the_sign_bit() -> None:
    assert _bit(0) == 1 and _bit(30) == 1 << 30 and _bit(31) == -(1 << 31)
    assert torch.tensor([_bit(31)], dtype=torch.int32).item() & 0xFFFFFFFF == 1 << 31


def _rows(params: list[SamplingParams]) -> list[SamplingRow]:
    return [SamplingRow(p, torch.Generator().manual_seed(p.seed) if p.seed is not None else None, [1], [], set())
            for p in params]


def test_greedy_with_a_mask_that_allows_the_argmax_is_the_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 80)
    top = logits.argmax(dim=1)
    rng = random.Random(3)
    bitmask = random_bitmask(6, 80, rng, 0.3)
    for r in range(6):  # allow each row's argmax, block a random other half
        bitmask[r, int(top[r]) // 32] |= _bit(int(top[r]) % 32)
    masked = logits.clone()
    apply_grammar_bitmask(masked, bitmask, list(range(6)), list(range(6)))
    md = SamplingMetadata.from_rows(_rows([SamplingParams(temperature=0)] * 6), 80, CPU)
    assert torch.equal(Sampler()(masked, md).sampled_token_ids, top)


def test_seeded_draw_unchanged_by_a_mask_of_tokens_it_could_not_draw() -> None:
    """Inverse-CDF sampling draws from the distribution after top-k; a mask that blocks only
    tokens outside the top k leaves that distribution, and so each seeded draw, the same. A mask
    that blocks some of the top k gives draws only among the allowed tokens."""
    torch.manual_seed(1)
    vocab, k = 90, 7
    logits = torch.randn(8, vocab)
    params = [SamplingParams(temperature=0.9, top_k=k, seed=100 + i) for i in range(8)]
    base = Sampler()(logits.clone(), SamplingMetadata.from_rows(_rows(params), vocab, CPU)).sampled_token_ids
    topk = logits.topk(k, dim=1).indices
    bitmask = torch.zeros(8, (vocab + 31) // 32, dtype=torch.int32)
    for r in range(8):
        for t in topk[r].tolist():
            bitmask[r, t // 32] |= _bit(t % 32)
    masked = logits.clone()
    apply_grammar_bitmask(masked, bitmask, list(range(8)), list(range(8)))
    same = Sampler()(masked, SamplingMetadata.from_rows(_rows(params), vocab, CPU)).sampled_token_ids
    assert torch.equal(same, base)
    # Now allow only two of each row's top k: every draw is one of them.
    narrow = torch.zeros_like(bitmask)
    for r in range(8):
        for t in topk[r, 2:4].tolist():
            narrow[r, t // 32] |= _bit(t % 32)
    masked = logits.clone()
    apply_grammar_bitmask(masked, narrow, list(range(8)), list(range(8)))
    drawn = Sampler()(masked, SamplingMetadata.from_rows(_rows(params), vocab, CPU)).sampled_token_ids
    for r in range(8):
        assert int(drawn[r]) in topk[r, 2:4].tolist()


@pytest.fixture(scope="module")
def tokenizer():  # noqa: ANN201
    from pagedllm.models.loader import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(None))


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_backends_fill_rows_that_allow_exactly_the_grammar(tokenizer, backend: str) -> None:  # noqa: ANN001
    """A choice grammar's first row allows the first token of each choice (and nothing that starts
    no choice); after the whole of one choice only the stop token is allowed."""
    from pagedllm.sampling_params import StructuredOutputsParams
    from pagedllm.structured_output.backends import BACKEND_CLASSES

    vocab = len(tokenizer)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    b = BACKEND_CLASSES[backend](tokenizer, vocab, [eos])
    sop = StructuredOutputsParams(choice=["yes", "no"])
    m = b.matcher(b.compile(sop))
    bitmask = torch.full((2, (vocab + 31) // 32), -1, dtype=torch.int32)
    b.fill([(m, 1)], bitmask)
    allowed = [t for t in range(vocab) if (int(bitmask[1, t // 32]) >> (t % 32)) & 1]
    texts = {tokenizer.decode([t]) for t in allowed}
    assert texts and all("yes".startswith(x) or "no".startswith(x) for x in texts), sorted(texts)[:20]
    assert torch.all(bitmask[0] == -1)  # other rows untouched
    for t in tokenizer.encode("yes", add_special_tokens=False):
        assert m.accept(t)
    b.fill([(m, 0)], bitmask)
    allowed = [t for t in range(vocab) if (int(bitmask[0, t // 32]) >> (t % 32)) & 1]
    assert allowed == [eos]
    assert m.accept(eos) and m.is_terminated()
