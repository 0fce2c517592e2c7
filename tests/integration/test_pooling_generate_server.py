"""A generation server answers the pooling routes on its decoder: `pagedllm serve` of a tiny random
Qwen2 (`--runner generate`, the session's `tiny_server`) embeds with LAST pooling in the same engine
as its generation, against transformers' last_hidden_state (float32: cosine >= 0.9999 per text),
while a completion runs beside it."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F

from server_helpers import Server

TEXTS = ["A man is eating food.", "The girl is carrying a baby.", "pagedllm serves embeddings beside chat"]


@pytest.fixture(scope="module")
def server(tiny_server: Server) -> Server:
    return tiny_server  # the session's tiny-model server, float32


def test_generation_server_embeds_beside_generation(server: Server, tiny_model_dir: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tiny_model_dir
    with server.http(timeout=300) as http:
        cmpl = {"prompt": "Count to twenty:", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        with ThreadPoolExecutor(2) as pool:
            talking = pool.submit(http.post, "/v1/completions", json=cmpl)
            emb = http.post("/v1/embeddings", json={"input": TEXTS})
            assert talking.result().status_code == 200
        assert emb.status_code == 200, emb.text
        body = emb.json()
        score = http.post("/v1/score", json={"text_1": TEXTS[0], "text_2": TEXTS[1:]})
        assert score.status_code == 200
    tok = AutoTokenizer.from_pretrained(root)
    hf = AutoModelForCausalLM.from_pretrained(root, torch_dtype=torch.float32).eval()
    ref = []
    for t in TEXTS:
        ids = tok(t)["input_ids"]
        with torch.no_grad():
            ref.append(F.normalize(hf.model(torch.tensor([ids])).last_hidden_state[0, -1], dim=0))
    ours = torch.tensor([d["embedding"] for d in body["data"]])
    assert F.cosine_similarity(ours, torch.stack(ref), dim=1).min() >= 0.9999
    assert body["usage"]["prompt_tokens"] == sum(len(tok(t)["input_ids"]) for t in TEXTS)
    want = [float(F.cosine_similarity(ref[0], r, dim=0)) for r in ref[1:]]
    torch.testing.assert_close(torch.tensor([d["score"] for d in score.json()["data"]]), torch.tensor(want),
                               atol=1e-4, rtol=0)
