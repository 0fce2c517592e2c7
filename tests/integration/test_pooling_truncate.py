"""vLLM's `truncate_prompt_tokens` and `truncation_side` offline (LLM.embed, encode, score):
all-MiniLM-L6-v2 against sentence-transformers truncating at `max_seq_length`, a side's cut against
sentence-transformers' own forward on the same token ids, a cross-encoder's pairs against
CrossEncoder(max_length=k), and the errors.

Tolerances: float32; cosine >= 0.9999 per text against sentence-transformers (the stated target),
1e-5 per score against CrossEncoder."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm import LLM
from test_pooling import DOCS, QUERIES, SMALL, _cross_encoder, minilm, needs_minilm, st_model  # noqa: F401 (fixtures)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LONG = ["word " * 300 + "the end", "A man is eating food. " * 40, "short text"]


def _st(st_model, texts: list[str], k: int) -> torch.Tensor:
    saved = st_model.max_seq_length
    st_model.max_seq_length = k
    try:
        return st_model.encode(texts, convert_to_tensor=True)
    finally:
        st_model.max_seq_length = saved


def _st_ids(st_model, ids: list[int]) -> torch.Tensor:
    """sentence-transformers' embedding of exactly these token ids (its modules' forward)."""
    t = torch.tensor([ids])
    features = {"input_ids": t, "attention_mask": torch.ones_like(t), "token_type_ids": torch.zeros_like(t)}
    with torch.no_grad():
        return st_model(features)["sentence_embedding"][0]


def _embeddings(outs) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in outs])


@needs_minilm
def test_truncated_text_matches_sentence_transformers(minilm: LLM, st_model) -> None:
    for k in (16, 100):
        ours = _embeddings(minilm.embed(LONG, truncate_prompt_tokens=k, use_tqdm=False))
        assert F.cosine_similarity(ours, _st(st_model, LONG, k), dim=1).min() >= 0.9999
    full = _embeddings(minilm.embed(LONG, truncate_prompt_tokens=-1, use_tqdm=False))  # the context: 256
    assert F.cosine_similarity(full, st_model.encode(LONG, convert_to_tensor=True), dim=1).min() >= 0.9999
    outs = minilm.encode(LONG[:1], truncate_prompt_tokens=16, use_tqdm=False)
    assert len(outs[0].prompt_token_ids) == 16
    with pytest.raises(ValueError, match="maximum context length|max_model_len|256"):
        minilm.embed(LONG[:1], use_tqdm=False)  # over the context without truncation


@needs_minilm
def test_truncation_side_cuts_token_ids(minilm: LLM, st_model) -> None:
    ids = minilm.llm_engine.tokenizer.encode(LONG[0])
    for side, kept in (("left", ids[-20:]), ("right", ids[:20])):
        outs = minilm.embed(LONG[:1], use_tqdm=False,
                            tokenization_kwargs={"truncate_prompt_tokens": 20, "truncation_side": side})
        assert outs[0].prompt_token_ids == kept
        assert F.cosine_similarity(_embeddings(outs)[0], _st_ids(st_model, kept), dim=0) >= 0.9999
    by_ids = minilm.embed([ids], truncate_prompt_tokens=20, use_tqdm=False)  # token ids: the tokenizer's side
    assert by_ids[0].prompt_token_ids == ids[:20]


@needs_minilm
def test_score_truncates_each_text(minilm: LLM, st_model) -> None:
    ref = _st(st_model, LONG, 32)
    got = [o.outputs.score for o in minilm.score(LONG[0], LONG[1:], truncate_prompt_tokens=32, use_tqdm=False)]
    want = F.cosine_similarity(ref[:1], ref[1:], dim=1)
    torch.testing.assert_close(torch.tensor(got), want, atol=1e-5, rtol=0)


@needs_minilm
def test_bad_truncation_values(minilm: LLM) -> None:
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens \(300\) cannot be greater than max_model_len \(256\)"):
        minilm.embed("x", truncate_prompt_tokens=300, use_tqdm=False)
    with pytest.raises(ValueError, match="-1 or at least 1, got 0"):
        minilm.embed("x", truncate_prompt_tokens=0, use_tqdm=False)
    with pytest.raises(ValueError, match="truncation_side must be 'left' or 'right'"):
        minilm.embed("x", tokenization_kwargs={"truncate_prompt_tokens": 4, "truncation_side": "middle"})
    with pytest.raises(ValueError, match="with truncate_prompt_tokens only"):
        minilm.embed("x", tokenization_kwargs={"truncation_side": "left"})
    with pytest.raises(ValueError, match="padding"):
        minilm.embed("x", tokenization_kwargs={"padding": "max_length"})


def test_cross_encoder_pairs_truncated_as_cross_encoder(tmp_path) -> None:
    from sentence_transformers import CrossEncoder

    folder = _cross_encoder(tmp_path, 1)
    llm = LLM(folder, **SMALL)
    for k in (8, 12):
        ce = CrossEncoder(folder, device="cpu", max_length=k)
        for q in QUERIES:
            ours = [o.outputs.score for o in llm.score(q, DOCS, truncate_prompt_tokens=k, use_tqdm=False)]
            ref = ce.predict([(q, d) for d in DOCS], activation_fn=torch.nn.Sigmoid())
            torch.testing.assert_close(torch.tensor(ours), torch.tensor(ref), atol=1e-5, rtol=0)
    outs = llm.score(QUERIES[0], DOCS[:1], tokenization_kwargs={"truncate_prompt_tokens": 5, "truncation_side": "left"},
                     use_tqdm=False)
    assert len(outs[0].prompt_token_ids) == 5
