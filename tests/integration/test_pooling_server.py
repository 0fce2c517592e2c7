"""The pooling routes of a real `pagedllm serve all-minilm-l6-v2` (the session's `minilm_server`):
the openai SDK's embeddings.create against sentence-transformers, base64 against floats, token
ids against text, dimensions, usage, /pooling, /score and /rerank, and the 400s (an input over the
context naming its index, unknown fields, generation routes on a pooling server, pooling routes on
an engine without a pooler)."""

from __future__ import annotations

import asyncio
import base64
import importlib.util
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedllm.models.loader.pooling import MINILM_PIP
from server_helpers import Server

pytestmark = pytest.mark.skipif(importlib.util.find_spec("all_minilm_l6_v2") is None,
                                reason=f"needs all-MiniLM-L6-v2: {MINILM_PIP}")

TEXTS = ["A man is eating food.", "A man is riding a horse.", "The girl is carrying a baby.", "pagedllm"]


@pytest.fixture(scope="module")
def server(minilm_server: Server) -> Server:
    return minilm_server


@pytest.fixture(scope="module")
def reference(server: Server):
    from sentence_transformers import SentenceTransformer

    from pagedllm.models.loader.pooling import minilm_path

    return SentenceTransformer(str(minilm_path()), device="cpu")


def test_openai_sdk_embeddings(server: Server, reference) -> None:
    client = server.openai()
    res = client.embeddings.create(model="all-minilm-l6-v2", input=TEXTS)  # the SDK asks for base64
    ours = torch.tensor([d.embedding for d in res.data])
    ref = reference.encode(TEXTS, convert_to_tensor=True)
    assert F.cosine_similarity(ours, ref, dim=1).min() >= 0.9999
    assert [d.index for d in res.data] == list(range(len(TEXTS)))
    n = sum(len(reference.tokenizer(t)["input_ids"]) for t in TEXTS)
    assert (res.usage.prompt_tokens, res.usage.total_tokens) == (n, n)
    floats = client.embeddings.create(model="all-minilm-l6-v2", input=TEXTS[0], encoding_format="float")
    # another request, alone in its step: another batch shape, equal within 1e-6 (see below)
    np.testing.assert_allclose(floats.data[0].embedding, res.data[0].embedding, atol=1e-6, rtol=0)
    short = client.embeddings.create(model="all-minilm-l6-v2", input=TEXTS[0], dimensions=32, user="u1")
    want = F.normalize(ref[0, :32], dim=0)
    torch.testing.assert_close(torch.tensor(short.data[0].embedding), want, atol=1e-5, rtol=0)
    models = client.models.list()
    assert [m.id for m in models.data] == ["all-minilm-l6-v2"]


def test_base64_and_token_ids(server: Server, reference) -> None:
    ids = [reference.tokenizer(t)["input_ids"] for t in TEXTS[:2]]
    with server.http() as http:
        by_ids = http.post("/v1/embeddings", json={"input": ids, "encoding_format": "base64"}).json()
        by_text = http.post("/v1/embeddings", json={"input": TEXTS[:2]}).json()
        one = http.post("/v1/embeddings", json={"input": ids[0]}).json()
    # Separate HTTP requests may share a step with different neighbours (another padded batch
    # shape, so other rounding): equal within 1e-6, not bit for bit.
    for b, f in zip(by_ids["data"], by_text["data"]):
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        np.testing.assert_allclose(decoded, f["embedding"], atol=1e-6, rtol=0)
        assert decoded.dtype == np.float32 and len(decoded) == 384
    np.testing.assert_allclose(one["data"][0]["embedding"], by_text["data"][0]["embedding"], atol=1e-6, rtol=0)
    assert by_ids["object"] == "list" and by_ids["model"] == "all-minilm-l6-v2"


def test_pooling_score_rerank(server: Server, reference) -> None:
    ref = reference.encode(TEXTS, convert_to_tensor=True)
    cos = F.cosine_similarity(ref[:1], ref[1:], dim=1).tolist()
    with server.http() as http:
        pooled = http.post("/pooling", json={"input": TEXTS[0]}).json()
        score = http.post("/v1/score", json={"text_1": TEXTS[0], "text_2": TEXTS[1:]}).json()
        rerank = http.post("/v1/rerank", json={"query": TEXTS[0], "documents": TEXTS[1:], "top_n": 2}).json()
        bare = http.post("/rerank", json={"query": TEXTS[0], "documents": TEXTS[1:], "return_documents": False}).json()
    torch.testing.assert_close(torch.tensor(pooled["data"][0]["data"]), ref[0], atol=1e-5, rtol=0)
    assert pooled["data"][0]["object"] == "pooling"
    np.testing.assert_allclose([d["score"] for d in score["data"]], cos, atol=1e-5)
    order = sorted(range(len(cos)), key=lambda i: -cos[i])
    assert [r["index"] for r in rerank["results"]] == order[:2]
    assert rerank["results"][0]["document"]["text"] == TEXTS[1 + order[0]]
    assert [r["index"] for r in bare["results"]] == order and "document" not in bare["results"][0]
    assert rerank["usage"]["total_tokens"] > 0


def test_score_shapes_and_truncation(server: Server, reference) -> None:
    """vLLM's /score field pairs, 1:N and N:N with 400s naming the fields, and truncate_prompt_tokens
    on every pooling route against sentence-transformers truncating at max_seq_length."""
    ref = reference.encode(TEXTS, convert_to_tensor=True)
    one_to_n = F.cosine_similarity(ref[:1], ref[1:], dim=1).tolist()
    pairwise = F.cosine_similarity(ref[:2], ref[2:], dim=1).tolist()
    long = ["word " * 300 + "the end", "A man is eating food. " * 40]
    reference.max_seq_length = 20
    try:
        cut = reference.encode(long, convert_to_tensor=True)
    finally:
        reference.max_seq_length = 256
    with server.http() as http:
        for a, b in (("text_1", "text_2"), ("data_1", "data_2"), ("queries", "documents"), ("queries", "items")):
            r = http.post("/score", json={a: TEXTS[0], b: TEXTS[1:]}).json()
            np.testing.assert_allclose([d["score"] for d in r["data"]], one_to_n, atol=1e-5)
            r = http.post("/v1/score", json={a: TEXTS[:2], b: TEXTS[2:]}).json()
            np.testing.assert_allclose([d["score"] for d in r["data"]], pairwise, atol=1e-5)
        mixed = http.post("/score", json={"text_1": "a", "documents": ["b"]})
        assert mixed.status_code == 400 and "text_1/text_2, data_1/data_2" in mixed.json()["error"]["message"]
        uneven = http.post("/score", json={"queries": ["a", "b"], "documents": ["c"] * 3})
        err = uneven.json()["error"]
        assert uneven.status_code == 400 and err["param"] == "documents"
        assert "queries and documents" in err["message"] and "got 2 and 3 texts" in err["message"]
        emb = http.post("/v1/embeddings", json={"input": long, "truncate_prompt_tokens": 20}).json()
        ours = torch.tensor([d["embedding"] for d in emb["data"]])
        assert F.cosine_similarity(ours, cut, dim=1).min() >= 0.9999
        assert emb["usage"]["prompt_tokens"] == 40
        pooled = http.post("/pooling", json={"input": long[0], "truncate_prompt_tokens": 20}).json()
        torch.testing.assert_close(torch.tensor(pooled["data"][0]["data"]), cut[0], atol=1e-5, rtol=0)
        whole = http.post("/v1/embeddings", json={"input": long, "truncate_prompt_tokens": -1})  # the context
        n = 256 + len(reference.tokenizer(long[1])["input_ids"])
        assert whole.status_code == 200 and whole.json()["usage"]["prompt_tokens"] == n
        left = http.post("/v1/embeddings", json={"input": long[0], "truncate_prompt_tokens": 20,
                                                 "truncation_side": "left"}).json()
        assert left["usage"]["prompt_tokens"] == 20
        score = http.post("/score", json={"text_1": long[0], "text_2": [long[1]], "truncate_prompt_tokens": 20}).json()
        want = F.cosine_similarity(cut[:1], cut[1:], dim=1).tolist()
        np.testing.assert_allclose([d["score"] for d in score["data"]], want, atol=1e-5)
        rerank = http.post("/rerank", json={"query": long[0], "documents": long[1], "truncate_prompt_tokens": 20})
        assert rerank.status_code == 200 and rerank.json()["results"][0]["relevance_score"] == pytest.approx(
            want[0], abs=1e-5)
        over = http.post("/v1/embeddings", json={"input": "x", "truncate_prompt_tokens": 257})
        assert over.status_code == 400 and over.json()["error"]["param"] == "truncate_prompt_tokens"
        assert "cannot be greater than max_model_len (256)" in over.json()["error"]["message"]
        side = http.post("/v1/embeddings", json={"input": "x", "truncation_side": "left"})
        assert side.status_code == 400 and side.json()["error"]["param"] == "truncation_side"
        too_long = http.post("/v1/rerank", json={"query": "q", "documents": ["fine", long[0]]})
        assert too_long.status_code == 400 and "text 2" in too_long.json()["error"]["message"]
        assert "truncate_prompt_tokens" in too_long.json()["error"]["message"]


def test_errors(server: Server) -> None:
    with server.http() as http:
        long = http.post("/v1/embeddings", json={"input": ["fine", "word " * 300]})
        assert long.status_code == 400
        err = long.json()["error"]
        assert "input[1]" in err["message"] and "256" in err["message"] and err["param"] == "input"
        bad = http.post("/v1/embeddings", json={"input": "x", "encoding_format": "float16"})
        assert bad.status_code == 400
        unknown = http.post("/v1/embeddings", json={"input": "x", "truncate": 5})  # vLLM's name is truncate_prompt_tokens
        assert unknown.status_code == 400 and "truncate" in unknown.text
        dims = http.post("/v1/embeddings", json={"input": "x", "dimensions": 1000})
        assert dims.status_code == 400 and dims.json()["error"]["param"] == "dimensions"
        empty = http.post("/v1/embeddings", json={"input": []})
        assert empty.status_code == 400
        comp = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
        assert comp.status_code == 400 and "--runner pooling" in comp.json()["error"]["message"]
        chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 400
        assert http.post("/v1/rerank", json={"query": "q", "documents": []}).status_code == 400
        assert http.post("/v1/score", json={"text_1": ["a", "b"], "text_2": ["c"] * 3}).status_code == 400
        assert http.get("/health").status_code == 200  # the server is still fine


def test_server_without_pooler_refuses_embeddings() -> None:
    """An engine with no pooler answers /v1/embeddings with a 400 that says how to start a pooling server."""
    from pagedllm.entrypoints.openai.errors import OpenAIError
    from pagedllm.entrypoints.openai.protocol_pooling import EmbeddingRequest
    from pagedllm.entrypoints.openai.serving_pooling import OpenAIServingPooling

    engine = SimpleNamespace(processor=None, tokenizer=SimpleNamespace(rust=None),
                             model_config=SimpleNamespace(max_model_len=64, runner="generate",
                                                          pooler_config=None))
    serving = OpenAIServingPooling(engine, ["m"])  # type: ignore[arg-type]
    with pytest.raises(OpenAIError) as e:
        asyncio.run(serving.embeddings(EmbeddingRequest(input="hi"), None))  # type: ignore[arg-type]
    assert e.value.status == 400 and "--runner pooling" in str(e.value)
