"""/rerank and /score of a real server over a cross-encoder (a tiny random
BertForSequenceClassification): the order and the scores of sentence-transformers' CrossEncoder."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from server_helpers import Server, serve
from test_pooling import DOCS, QUERIES, _cross_encoder


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return _cross_encoder(tmp_path_factory.mktemp("ce-server"), 1)


@pytest.fixture(scope="module")
def server(folder: str, tmp_path_factory):
    with serve(tmp_path_factory.mktemp("ce-log"), folder, "--dtype", "float32", "--kv-cache-memory", "64MiB") as s:
        yield s


def test_rerank_and_score_match_cross_encoder(server: Server, folder: str) -> None:
    from sentence_transformers import CrossEncoder

    ce = CrossEncoder(folder, device="cpu")
    with server.http() as http:
        for q in QUERIES:
            ref = ce.predict([(q, d) for d in DOCS], activation_fn=torch.nn.Sigmoid())
            got = http.post("/rerank", json={"query": q, "documents": DOCS, "top_n": 3}).json()
            assert [r["index"] for r in got["results"]] == list(np.argsort(-ref)[:3])
            np.testing.assert_allclose([r["relevance_score"] for r in got["results"]], np.sort(ref)[::-1][:3],
                                       atol=1e-5)
            score = http.post("/score", json={"text_1": q, "text_2": DOCS}).json()
            np.testing.assert_allclose([d["score"] for d in score["data"]], ref, atol=1e-5)
        probs = http.post("/pooling", json={"input": "hi there"}).json()
        assert len(probs["data"][0]["data"]) == 1  # one label: its sigmoid
        emb = http.post("/v1/embeddings", json={"input": "hi there"})  # the CLS state, before the head
        assert emb.status_code == 200 and len(emb.json()["data"][0]["embedding"]) == 32


def test_truncated_pairs_match_cross_encoder(server: Server, folder: str) -> None:
    """truncate_prompt_tokens cuts each (query, document) pair as one input, longest first, as
    CrossEncoder(max_length=k) does; over the context without it, a 400 naming the pair."""
    from sentence_transformers import CrossEncoder

    ce = CrossEncoder(folder, device="cpu", max_length=10)
    ref = ce.predict([(QUERIES[0], d) for d in DOCS], activation_fn=torch.nn.Sigmoid())
    with server.http() as http:
        got = http.post("/v1/rerank", json={"query": QUERIES[0], "documents": DOCS, "truncate_prompt_tokens": 10})
        by_index = {r["index"]: r["relevance_score"] for r in got.json()["results"]}
        np.testing.assert_allclose([by_index[i] for i in range(len(DOCS))], ref, atol=1e-5)
        score = http.post("/score", json={"queries": QUERIES[0], "items": DOCS, "truncate_prompt_tokens": 10}).json()
        np.testing.assert_allclose([d["score"] for d in score["data"]], ref, atol=1e-5)
        long = http.post("/rerank", json={"query": QUERIES[0], "documents": ["short", "word " * 80]})
        assert long.status_code == 400 and "pair 1" in long.json()["error"]["message"]
