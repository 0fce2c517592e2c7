"""`pagedllm run-batch` with embedding, score and rerank lines: all-MiniLM-L6-v2 against
sentence-transformers and against what `pagedllm serve` answers for the same bodies (the session's
`minilm_server`), a cross-encoder's scores against sentence-transformers' CrossEncoder, generation lines
refused on a pooling model as the server refuses them, and a cut output file resumed."""

from __future__ import annotations

import base64
import copy
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedllm.models.loader.pooling import MINILM_PIP
from server_helpers import MINILM_SERVER_ARGS, Server
from test_cli import run_cli
from test_pooling import DOCS, QUERIES, _cross_encoder

needs_minilm = pytest.mark.skipif(importlib.util.find_spec("all_minilm_l6_v2") is None,
                                  reason=f"needs all-MiniLM-L6-v2: {MINILM_PIP}")

TEXTS = ["A man is eating food.", "A man is riding a horse.", "The girl is carrying a baby.", "pagedllm"]
ENGINE = list(MINILM_SERVER_ARGS[1:])  # the shared server's engine flags


def line(custom_id: str, url: str, body: dict) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


MINILM_LINES = [
    line("emb-list", "/v1/embeddings", {"input": TEXTS}),
    line("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
    line("emb-one", "/v1/embeddings", {"input": TEXTS[0], "dimensions": 32, "user": "u1"}),
    line("emb-b64", "/v1/embeddings", {"input": TEXTS[1:3], "encoding_format": "base64"}),
    line("emb-long", "/v1/embeddings", {"input": ["fine", "word " * 300]}),
    line("emb-unknown", "/v1/embeddings", {"input": "x", "no_such_field": 5}),
    line("pool", "/pooling", {"input": TEXTS[3]}),
    line("score-v1", "/v1/score", {"text_1": TEXTS[0], "text_2": TEXTS[1:]}),
    line("score", "/score", {"text_1": TEXTS[:2], "text_2": TEXTS[2:]}),
    line("score-mismatch", "/score", {"text_1": ["a", "b"], "text_2": ["c"] * 3}),
    line("cmpl", "/v1/completions", {"prompt": "hello", "max_tokens": 2}),
    line("rerank", "/rerank", {"query": TEXTS[0], "documents": TEXTS[1:], "top_n": 2}),
    line("rerank-v1", "/v1/rerank", {"query": TEXTS[0], "documents": TEXTS[1:], "return_documents": False}),
    line("rerank-empty", "/v1/rerank", {"query": "q", "documents": []}),
]


def run_batch(folder: Path, model: str, lines: list[dict], own_process: bool = True) -> list[dict]:
    """`pagedllm run-batch` on `lines`: as its own process, or through the CLI's `main()` in this one."""
    src, out = folder / "in.jsonl", folder / "out.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    args = ["run-batch", "-i", str(src), "-o", str(out), "--model", model, *ENGINE]
    if own_process:
        res = run_cli(*args)
        assert res.returncode == 0, res.stderr
    else:
        from pagedllm.entrypoints.cli import main

        assert main(args) == 0
    return [json.loads(x) for x in out.read_text().splitlines()]


@pytest.fixture(scope="module")
def minilm_batch(tmp_path_factory) -> dict:
    """The MiniLM file run to the end, then cut (its last three lines gone and the one before cut in
    half, as a kill in the middle of a write leaves it) and run again."""
    d = tmp_path_factory.mktemp("batch-minilm")
    first = run_batch(d, "all-minilm-l6-v2", MINILM_LINES)
    out = d / "out.jsonl"
    kept = out.read_text().splitlines(keepends=True)[:-4]
    cut = out.read_text().splitlines(keepends=True)[-4]
    out.write_text("".join(kept) + cut[: len(cut) // 2])
    second = run_batch(d, "all-minilm-l6-v2", MINILM_LINES, own_process=False)  # the first was a process
    return {"first": first, "resumed": second}


@pytest.fixture(scope="module")
def server(minilm_server: Server) -> Server:
    return minilm_server


@pytest.fixture(scope="module")
def reference():
    from sentence_transformers import SentenceTransformer

    from pagedllm.models.loader.pooling import minilm_path

    return SentenceTransformer(str(minilm_path()), device="cpu")


def _body(out: list[dict], custom_id: str) -> dict:
    (x,) = [x for x in out if x["custom_id"] == custom_id]
    assert x["response"]["status_code"] == 200 and x["error"] is None, x
    assert x["response"]["request_id"] == x["response"]["body"]["id"]
    return x["response"]["body"]


@needs_minilm
def test_embeddings_scores_and_rerank_match_sentence_transformers(minilm_batch: dict, reference) -> None:
    out = minilm_batch["first"]
    assert [x["custom_id"] for x in out] == [x["custom_id"] for x in MINILM_LINES]  # input order
    ref = reference.encode(TEXTS, convert_to_tensor=True)
    emb = _body(out, "emb-list")
    assert F.cosine_similarity(torch.tensor([d["embedding"] for d in emb["data"]]), ref, dim=1).min() >= 0.9999
    n = sum(len(reference.tokenizer(t)["input_ids"]) for t in TEXTS)
    assert emb["usage"] == {"prompt_tokens": n, "total_tokens": n}
    short = _body(out, "emb-one")["data"][0]["embedding"]
    torch.testing.assert_close(torch.tensor(short), F.normalize(ref[0, :32], dim=0), atol=1e-5, rtol=0)
    for d, want in zip(_body(out, "emb-b64")["data"], ref[1:3]):
        got = torch.from_numpy(np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4").copy())
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.tensor(_body(out, "pool")["data"][0]["data"]), ref[3], atol=1e-5, rtol=0)
    cos = F.cosine_similarity(ref[:1], ref[1:], dim=1).tolist()
    np.testing.assert_allclose([d["score"] for d in _body(out, "score-v1")["data"]], cos, atol=1e-5)
    pairwise = F.cosine_similarity(ref[:2], ref[2:], dim=1).tolist()
    np.testing.assert_allclose([d["score"] for d in _body(out, "score")["data"]], pairwise, atol=1e-5)
    order = sorted(range(len(cos)), key=lambda i: -cos[i])
    rerank = _body(out, "rerank")
    assert [r["index"] for r in rerank["results"]] == order[:2]
    assert rerank["results"][0]["document"]["text"] == TEXTS[1 + order[0]]
    bare = _body(out, "rerank-v1")
    assert [r["index"] for r in bare["results"]] == order and "document" not in bare["results"][0]


@needs_minilm
def test_lines_are_answered_as_the_server_answers(minilm_batch: dict, server: Server) -> None:
    """Same statuses and error objects; the same bodies, values within 1e-6 (the server's requests
    share their steps with other neighbours: another batch shape, so other rounding)."""
    out = {x["custom_id"]: x for x in copy.deepcopy(minilm_batch["first"])}
    with server.http() as http:
        for sent in MINILM_LINES:
            r = http.post(sent["url"], json=sent["body"])
            got = out[sent["custom_id"]]
            assert got["response"]["status_code"] == r.status_code, (sent["custom_id"], got, r.text)
            want = r.json()
            if r.status_code != 200:
                assert got["response"]["body"] == want
                assert got["error"] == {"code": want["error"]["code"] or want["error"]["type"],
                                        "message": want["error"]["message"]}
                continue
            body = got["response"]["body"]
            for b in (body, want):
                b.pop("id"), b.pop("created", None)
            _assert_close_json(body, want, sent["custom_id"])
    refused = out["chat"]["response"]["body"]["error"]
    assert "--runner pooling" in refused["message"] and refused["param"] == "model"
    assert "input[1]" in out["emb-long"]["error"]["message"]


def _assert_close_json(got, want, where: str) -> None:
    if isinstance(want, float) or (isinstance(got, float) and isinstance(want, int)):
        assert abs(got - want) <= 1e-6, where
    elif isinstance(want, str) and where == "emb-b64" and len(want) > 64:  # base64 float32 vectors
        np.testing.assert_allclose(np.frombuffer(base64.b64decode(got), "<f4"),
                                   np.frombuffer(base64.b64decode(want), "<f4"), atol=1e-6, rtol=0)
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for k in want:
            _assert_close_json(got[k], want[k], where)
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for a, b in zip(got, want):
            _assert_close_json(a, b, where)
    else:
        assert got == want, where


@needs_minilm
def test_cut_output_resumes_with_every_line_once(minilm_batch: dict) -> None:
    first, resumed = minilm_batch["first"], minilm_batch["resumed"]
    assert [x["custom_id"] for x in resumed] == [x["custom_id"] for x in MINILM_LINES]
    assert resumed[:-4] == first[:-4]  # the lines already written were kept as they were
    for a, b in zip(resumed[-4:], first[-4:]):  # the cut line and the lost ones ran again
        assert a["response"]["status_code"] == b["response"]["status_code"]


def test_cross_encoder_lines_match_cross_encoder(tmp_path: Path) -> None:
    from sentence_transformers import CrossEncoder

    folder = _cross_encoder(tmp_path / "ce", 1)
    lines = [line("r0", "/rerank", {"query": QUERIES[0], "documents": DOCS, "top_n": 3}),
             line("s0", "/v1/score", {"text_1": QUERIES[1], "text_2": DOCS}),
             line("r1", "/v2/rerank", {"query": QUERIES[1], "documents": DOCS}),
             line("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})]
    out = run_batch(tmp_path, folder, lines, own_process=False)
    ce = CrossEncoder(folder, device="cpu")
    ref = [ce.predict([(q, d) for d in DOCS], activation_fn=torch.nn.Sigmoid()) for q in QUERIES]
    r0 = _body(out, "r0")["results"]
    assert [r["index"] for r in r0] == list(np.argsort(-ref[0])[:3])
    np.testing.assert_allclose([r["relevance_score"] for r in r0], np.sort(ref[0])[::-1][:3], atol=1e-5)
    np.testing.assert_allclose([d["score"] for d in _body(out, "s0")["data"]], ref[1], atol=1e-5)
    assert [r["index"] for r in _body(out, "r1")["results"]] == list(np.argsort(-ref[1]))
    assert out[3]["response"]["status_code"] == 400 and "--runner pooling" in out[3]["error"]["message"]
