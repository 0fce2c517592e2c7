"""The OpenAI-compatible server, end to end: a real `pagedllm serve` subprocess on the default
model, driven with the official `openai` client and raw httpx.

The main server is the shared default-model one (`default_server`, a large queue bound); a small
one (`--max-queued-requests 5`, two sequences at a time) serves the 429 and shutdown tests. The
greedy outputs equal `LLM.generate` / `LLM.chat` computed in this process with the same engine settings exactly
(tokens, text, finish reason).
A tiny random checkpoint serves the in-process checks (engine failure, custom chat template).
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from pagedllm import LLM, SamplingParams
from server_helpers import API_KEY, Server, assert_error_shape, metrics, serve

MODEL = "smollm2-135m-instruct"
KV = "512MiB"
PROMPTS = [
    "The capital of France is",
    "Write a haiku about autumn.",
    "1, 2, 3, 4,",
    "def fibonacci(n):",
]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
TOP = 5


# ---- servers ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(default_server: Server) -> Server:
    return default_server


@pytest.fixture(scope="module")
def small_server(tmp_path_factory: pytest.TempPathFactory):
    with serve(tmp_path_factory.mktemp("small-server"), "--kv-cache-memory", KV, "--dtype", "float32",
               "--api-key", API_KEY, "--max-queued-requests", "5", "--max-num-seqs", "2") as s:
        yield s


@pytest.fixture(scope="module")
def llm(server: Server) -> LLM:
    # After the server: the same engine settings in this process.
    return LLM(dtype="float32", kv_cache_memory=512 << 20)


def wait_idle(http: httpx.Client, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(http)
        if m["pagedllm:num_requests_running"] == 0 and m["pagedllm:kv_cache_usage_perc"] == 0:
            return m
        if time.monotonic() > deadline:
            pytest.fail(f"the engine still holds requests or blocks: {m}")
        time.sleep(0.1)


def llm_tokens(tok, out) -> list[str]:
    return [tok.decode([t], skip_special_tokens=False) for t in out.outputs[0].token_ids]


# ---- basics -------------------------------------------------------------------------------------
def test_models_version_health(server: Server, client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]
    out = server.output()
    assert (f"Serving {MODEL} at {server.url} (OpenAI-compatible: /v1/completions, /v1/chat/completions; "
            "HTTP parser httptools, event loop uvloop)") in out
    assert re.search(r"KV cache \(.*\): \d+ blocks of 16 tokens.*maximum concurrency", out), out[-2000:]


def test_completions_greedy_match_llm(client: openai.OpenAI, llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=TOP)
    refs = llm.generate(PROMPTS, params, use_tqdm=False)
    tok = llm.get_tokenizer()
    resp = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0, logprobs=TOP)
    assert [c.index for c in resp.choices] == list(range(len(PROMPTS)))
    for choice, ref in zip(resp.choices, refs):
        # pagedllm against itself: exactly the same tokens, text and finish reason.
        assert choice.logprobs.tokens == llm_tokens(tok, ref)
        assert choice.text == ref.outputs[0].text
        assert choice.finish_reason == ref.outputs[0].finish_reason
    assert resp.id.startswith("cmpl-") and resp.created > 0 and resp.object == "text_completion"
    assert resp.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in refs)
    assert resp.usage.completion_tokens == sum(len(r.outputs[0].token_ids) for r in refs)


def test_completion_stream_equals_non_stream(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=10, temperature=0)
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_greedy_match_llm(client: openai.OpenAI, llm: LLM) -> None:
    ref = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=16, logprobs=TOP), use_tqdm=False)[0]
    resp = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=16, temperature=0, logprobs=True, top_logprobs=TOP
    )
    assert resp.id.startswith("chatcmpl-") and resp.object == "chat.completion"
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    content = choice.logprobs.content
    ours = [c.token for c in content]
    assert all(len(c.top_logprobs) == TOP for c in content)
    assert ours == llm_tokens(llm.get_tokenizer(), ref)
    assert choice.message.content == ref.outputs[0].text
    assert choice.finish_reason == ref.outputs[0].finish_reason
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.usage.completion_tokens == len(ref.outputs[0].token_ids)


def test_chat_stream(server: Server, client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens
    # Raw: server-sent events ending with [DONE].
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    first = json.loads(events[0][6:])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_stream_sends_a_chunk_per_token_while_text_waits(client: openai.OpenAI) -> None:
    """Tokens that add no text yet (here a lone UTF-8 lead byte, forced by logit_bias, which decodes
    to text only once its character is complete or given up) still get one chunk per decode step, with
    "" as their text, as vLLM's server does: a client timing first tokens sees the first token."""
    lead = "173"  # the default tokenizer's byte token for 0xE2, a UTF-8 lead byte
    kwargs = dict(model=MODEL, max_tokens=6, temperature=0, logit_bias={lead: 100})
    full = client.chat.completions.create(messages=CHAT, **kwargs)
    assert full.usage.completion_tokens == 6
    chunks = list(client.chat.completions.create(messages=CHAT, stream=True, **kwargs))
    deltas = [c.choices[0].delta for c in chunks[1:] if c.choices]  # chunks[0] names the role
    assert len(deltas) == 6 and deltas[0].content == ""
    assert "".join(d.content or "" for d in deltas) == full.choices[0].message.content
    full = client.completions.create(prompt=PROMPTS[0], **kwargs)
    chunks = [c for c in client.completions.create(prompt=PROMPTS[0], stream=True, **kwargs) if c.choices]
    assert len(chunks) == 6 and chunks[0].choices[0].text == ""
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text


def test_n_and_prompt_batches(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[:2], n=3, max_tokens=4, temperature=1.0, seed=7,
                                     extra_body={"ignore_eos": True})
    assert [c.index for c in resp.choices] == list(range(6))
    assert resp.usage.completion_tokens == 24
    again = client.completions.create(model=MODEL, prompt=PROMPTS[:2], n=3, max_tokens=4, temperature=1.0, seed=7,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in resp.choices]  # seeded: reproducible
    greedy = client.completions.create(model=MODEL, prompt=PROMPTS[0], n=2, max_tokens=4, temperature=0)
    assert greedy.choices[0].text == greedy.choices[1].text
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, n=2, max_tokens=3,
                                          extra_body={"ignore_eos": True})
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 6
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[:2], n=2, max_tokens=3, stream=True,
                                       extra_body={"ignore_eos": True})
    seen: dict[int, str] = {}
    for chunk in stream:
        for c in chunk.choices:
            seen[c.index] = seen.get(c.index, "") + c.text
    assert sorted(seen) == [0, 1, 2, 3]


def test_logprobs(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=3)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == resp.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for value, top, tok in zip(lp.token_logprobs, lp.top_logprobs, lp.tokens):
        assert value <= 0 and 3 <= len(top) <= 4 and top[tok] == value
        assert max(top.values()) == value  # greedy: the chosen token is the most likely


def test_echo_logprobs(client: openai.OpenAI, http: httpx.Client, llm: LLM) -> None:
    # lm-evaluation-harness loglikelihood: echo, logprobs, max_tokens=0.
    prompt = "One two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen seventeen eighteen nineteen twenty"
    ids = http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    assert len(ids) > 16  # more than one KV block: the second request could hit the prefix cache
    first = None
    for _ in range(2):
        resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
        c = resp.choices[0]
        assert c.text == prompt
        assert len(c.logprobs.token_logprobs) == len(ids)
        assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
        assert all(v is not None and v <= 0 for v in c.logprobs.token_logprobs[1:])
        assert resp.usage.completion_tokens == 0 and resp.usage.prompt_tokens == len(ids)
        if first is not None:  # the same numbers again (a prefix-cache hit must not drop them)
            assert c.logprobs.token_logprobs == pytest.approx(first, abs=1e-4)
        first = c.logprobs.token_logprobs
    # n > 1: every sample computes the prompt, its logprobs are reported once.
    ref = llm.generate(prompt, SamplingParams(n=2, max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    assert len(ref.prompt_logprobs) == len(ids)
    # Echo plus generation, n=2, streamed and not: prompt logprobs once, then the new tokens.
    for stream in (False, True):
        resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, echo=True, logprobs=1, n=2,
                                         temperature=0, stream=stream)
        choices = {}
        for chunk in (resp if stream else [resp]):
            for c in chunk.choices:
                prev = choices.setdefault(c.index, {"text": "", "lps": []})
                prev["text"] += c.text
                prev["lps"] += c.logprobs.token_logprobs
        assert sorted(choices) == [0, 1]
        for ch in choices.values():
            assert ch["text"].startswith(prompt) and len(ch["lps"]) == len(ids) + 2
            assert ch["lps"][0] is None and ch["lps"][1 : len(ids)] == pytest.approx(first[1:], abs=1e-4)


def test_stop_strings(client: openai.OpenAI, llm: LLM) -> None:
    prompt = "1, 2, 3, 4,"
    ref = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, stop=[" 7"]), use_tqdm=False)[0]
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stop=[" 7"])
    c = resp.choices[0]
    assert c.text == ref.outputs[0].text and " 7" not in c.text
    assert c.finish_reason == "stop" == ref.outputs[0].finish_reason
    kept = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stop=" 7",
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == c.text + " 7"
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stop=[" 7"],
                                         stream=True)
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == c.text


def test_token_id_prompts(client: openai.OpenAI, http: httpx.Client) -> None:
    ids = [http.post("/tokenize", json={"prompt": p}).json()["tokens"] for p in PROMPTS[:2]]
    by_text = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids[0], max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids[0])
    batch = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0, echo=True)
    assert [c.text[: len(p)] for c, p in zip(batch.choices, PROMPTS)] == PROMPTS[:2]
    assert http.post("/detokenize", json={"tokens": ids[1]}).json() == {"prompt": PROMPTS[1]}


def test_usage_matches_tokenize(client: openai.OpenAI, http: httpx.Client) -> None:
    tok = http.post("/tokenize", json={"prompt": PROMPTS[1]}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 8192
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=5, extra_body={"ignore_eos": True})
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens, resp.usage.total_tokens) == (
        tok["count"], 5, tok["count"] + 5)
    chat_tok = http.post("/tokenize", json={"messages": CHAT}).json()
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, extra_body={"ignore_eos": True})
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (chat_tok["count"], 4)
    # The same conversation again: its prefix comes from the cache.
    again = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


# ---- bad input ----------------------------------------------------------------------------------
COMP, CHATP = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
BAD_REQUESTS = [
    ("temperature-negative", COMP, {"prompt": "hi", "temperature": -1}, 400),
    ("temperature-string", COMP, {"prompt": "hi", "temperature": "hot"}, 400),
    ("temperature-nan", COMP, b'{"prompt": "hi", "temperature": NaN}', 400),
    ("top-p-zero", COMP, {"prompt": "hi", "top_p": 0}, 400),
    ("top-p-above-one", COMP, {"prompt": "hi", "top_p": 1.5}, 400),
    ("top-k-negative", COMP, {"prompt": "hi", "top_k": -5}, 400),
    ("min-p-above-one", COMP, {"prompt": "hi", "min_p": 2}, 400),
    ("presence-penalty", COMP, {"prompt": "hi", "presence_penalty": 5}, 400),
    ("frequency-penalty", COMP, {"prompt": "hi", "frequency_penalty": -3}, 400),
    ("repetition-penalty-zero", COMP, {"prompt": "hi", "repetition_penalty": 0}, 400),
    ("n-too-large", COMP, {"prompt": "hi", "n": 1000}, 400),
    ("n-float", COMP, {"prompt": "hi", "n": 2.5}, 400),
    ("n-zero", COMP, {"prompt": "hi", "n": 0}, 400),
    ("prompt-empty", COMP, {"prompt": ""}, 400),
    ("prompt-empty-list", COMP, {"prompt": []}, 400),
    ("prompt-empty-ids", COMP, {"prompt": [[]]}, 400),
    ("prompt-missing", COMP, {"max_tokens": 3}, 400),
    ("prompt-wrong-type", COMP, {"prompt": {"text": "hi"}}, 400),
    ("prompt-oov-token", COMP, {"prompt": [1, 99999999]}, 400),
    ("prompt-negative-token", COMP, {"prompt": [-4]}, 400),
    ("too-long", COMP, {"prompt": "hi", "max_tokens": 9000}, 400),
    ("max-tokens-zero", COMP, {"prompt": "hi", "max_tokens": 0}, 400),
    ("max-tokens-negative", COMP, {"prompt": "hi", "max_tokens": -1}, 400),
    ("logprobs-over-limit", COMP, {"prompt": "hi", "logprobs": 21}, 400),
    ("logprobs-negative", COMP, {"prompt": "hi", "logprobs": -1}, 400),
    ("too-many-stops", COMP, {"prompt": "hi", "stop": ["a"] * 100}, 400),
    ("empty-stop", COMP, {"prompt": "hi", "stop": [""]}, 400),
    ("stream-options-without-stream", COMP, {"prompt": "hi", "stream_options": {"include_usage": True}}, 400),
    ("stream-not-bool", COMP, {"prompt": "hi", "stream": "yes"}, 400),
    ("suffix", COMP, {"prompt": "hi", "suffix": "x"}, 400),
    ("min-tokens-over-max", COMP, {"prompt": "hi", "min_tokens": 50, "max_tokens": 5}, 400),
    ("stop-token-oov", COMP, {"prompt": "hi", "stop_token_ids": [10**9]}, 400),
    ("logit-bias-key", COMP, {"prompt": "hi", "logit_bias": {"abc": 1}}, 400),
    ("seed-overflow", COMP, {"prompt": "hi", "seed": 2**70}, 400),
    ("malformed-json", COMP, b'{"prompt": "hi",', 400),
    ("json-array", COMP, b"[1, 2]", 400),
    ("unknown-model", COMP, {"prompt": "hi", "model": "gpt-4"}, 404),
    ("messages-empty", CHATP, {"messages": []}, 400),
    ("messages-missing", CHATP, {"max_tokens": 2}, 400),
    ("bad-role", CHATP, {"messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("image-part", CHATP, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400),
    ("top-logprobs-without-logprobs", CHATP, {"messages": MSG, "top_logprobs": 5}, 400),
    ("top-logprobs-over-limit", CHATP, {"messages": MSG, "logprobs": True, "top_logprobs": 50}, 400),
    ("max-completion-tokens-zero", CHATP, {"messages": MSG, "max_completion_tokens": 0}, 400),
    ("chat-too-long", CHATP, {"messages": MSG, "max_tokens": 9000}, 400),
    ("tools", CHATP, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400),
    ("response-format", CHATP, {"messages": MSG, "response_format": {"type": "xml"}}, 400),
    ("chat-unknown-model", CHATP, {"messages": MSG, "model": "nope"}, 404),
    ("template-kwargs-reserved", CHATP, {"messages": MSG, "chat_template_kwargs": {"tokenize": True}}, 400),
    ("tokenize-both", "/tokenize", {"prompt": "hi", "messages": MSG}, 400),
    ("detokenize-oov", "/detokenize", {"tokens": [-1]}, 400),
    ("body-too-large", COMP, b'{"prompt": "' + b"x" * (9 << 20) + b'"}', 413),
    ("unknown-route", "/v1/nope", {}, 404),
]


@pytest.mark.parametrize("name,path,body,status", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request(http: httpx.Client, client: openai.OpenAI, name: str, path: str, body, status: int) -> None:
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == status, r.text
    assert_error_shape(r.json())
    if name == "too-long":
        assert "8192" in r.text and "9001" in r.text  # the limit and the request's total
    # The server keeps serving.
    ok = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == 2


def test_chunked_body_too_large(http: httpx.Client) -> None:
    def chunks():
        for _ in range(10):
            yield b"x" * (1 << 20)

    r = http.post(COMP, content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    assert_error_shape(r.json())


def test_openai_client_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", temperature=-2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MSG)


# ---- API keys -----------------------------------------------------------------------------------
GUARDED = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1}),
    ("POST", "/v1/chat/completions", {"messages": MSG, "max_tokens": 1}),
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("POST", "/detokenize", {"tokens": [1, 2]}),
]


@pytest.mark.parametrize("method,path,body", GUARDED, ids=[g[1] for g in GUARDED])
def test_api_key(server: Server, method: str, path: str, body) -> None:
    url = server.url + path
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.request(method, url, json=body, headers=headers, timeout=60)
        assert r.status_code == 401, (headers, r.text)
        assert_error_shape(r.json())
    r = httpx.request(method, url, json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert r.status_code == 200, r.text


def test_open_routes_and_wrong_key_client(server: Server) -> None:
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(server.url + path).status_code == 200
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


# ---- metrics and disconnects --------------------------------------------------------------------
def test_metrics(http: httpx.Client, client: openai.OpenAI) -> None:
    long_prompt = "Metrics " + " ".join(str(i) for i in range(40))
    for _ in range(2):  # the second one hits the prefix cache
        client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=3, extra_body={"ignore_eos": True})
    text = http.get("/metrics").text
    for name in (
        "num_requests_running", "num_requests_waiting", "num_requests_swapped", "kv_cache_usage_perc",
        "prompt_tokens_total", "generation_tokens_total", "request_success_total", "num_preemptions_total",
        "prefix_cache_queries_total", "prefix_cache_hits_total", "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_bucket",
        "request_queue_time_seconds_bucket", "request_prompt_tokens_bucket", "request_generation_tokens_bucket",
        "cache_config_info",
    ):
        assert re.search(rf"^pagedllm:{name}\{{[^}}]*model_name=\"{MODEL}\"", text, re.M), name
    assert re.search(r'^pagedllm:request_success_total\{.*finished_reason="length".*\} [1-9]', text, re.M)
    assert re.search(r'^pagedllm:cache_config_info\{.*block_size="16".*\} 1\.0', text, re.M)
    m = metrics(http)
    assert m["pagedllm:generation_tokens_total"] > 0 and m["pagedllm:prompt_tokens_total"] > 0
    assert m["pagedllm:prefix_cache_queries_total"] >= m["pagedllm:prefix_cache_hits_total"] > 0


def test_stream_disconnect_frees_blocks(server: Server, http: httpx.Client) -> None:
    wait_idle(http)
    body = {"prompt": "Count to a thousand:", "max_tokens": 1000, "stream": True, "ignore_eos": True}
    with httpx.Client(headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        with c.stream("POST", server.url + COMP, json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for _ in range(2):
                assert next(line for line in lines if line.startswith("data:"))
            during = metrics(http)
            assert during["pagedllm:num_requests_running"] == 1 and during["pagedllm:kv_cache_usage_perc"] > 0
        # Leaving the block closes the connection mid-stream.
    wait_idle(http, timeout=10)
    # A non-streaming request whose client gives up (timeout) is aborted as well.
    with pytest.raises(httpx.TimeoutException):
        http.post(COMP, json={"prompt": "Count to a thousand:", "max_tokens": 1000, "ignore_eos": True}, timeout=2)
    wait_idle(http, timeout=10)


# ---- concurrency and overload -------------------------------------------------------------------
@pytest.mark.slow
def test_200_concurrent_streams(server: Server, http: httpx.Client) -> None:
    async def run() -> list[tuple[str, int]]:
        ac = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=600)

        async def one(i: int) -> tuple[str, int]:
            stream = await ac.completions.create(
                model=MODEL, prompt=f"Story {i}: once upon a time", max_tokens=8, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            )
            text, tokens = "", -1
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].text
                if chunk.usage:
                    tokens = chunk.usage.completion_tokens
            return text, tokens

        try:
            return await asyncio.gather(*(one(i) for i in range(200)))
        finally:
            await ac.close()

    results = asyncio.run(run())
    assert len(results) == 200
    assert [t for _, t in results] == [8] * 200
    assert all(text for text, _ in results)
    wait_idle(http)


@pytest.mark.slow
def test_queue_full_429(small_server: Server) -> None:
    async def run() -> list[httpx.Response | tuple[int, str]]:
        async with httpx.AsyncClient(base_url=small_server.url, timeout=300,
                                     headers={"Authorization": f"Bearer {API_KEY}"}) as c:

            async def one(i: int):
                body = {"prompt": f"Burst {i}", "max_tokens": 8, "stream": True, "ignore_eos": True,
                        "stream_options": {"include_usage": True}}
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        await r.aread()
                        return r
                    events = [line async for line in r.aiter_lines() if line.startswith("data: ")]
                    return 200, events

            return await asyncio.gather(*(one(i) for i in range(40)))

    results = asyncio.run(run())
    rejected = [r for r in results if isinstance(r, httpx.Response)]
    done = [r for r in results if not isinstance(r, httpx.Response)]
    assert rejected and len(done) >= 5, (len(rejected), len(done))
    for r in rejected:
        assert r.status_code == 429 and r.headers["Retry-After"].isdigit()
        assert_error_shape(r.json())
    for _, events in done:
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["usage"]["completion_tokens"] == 8
    # Still serving once the burst is over.
    ok = httpx.post(small_server.url + COMP, json={"prompt": "hi", "max_tokens": 2}, timeout=120,
                    headers={"Authorization": f"Bearer {API_KEY}"})
    assert ok.status_code == 200


@pytest.mark.slow
def test_sigterm_shuts_down_cleanly(small_server: Server) -> None:
    # A long generation in flight ends with a 503 error event instead of holding the shutdown up.
    body = {"prompt": "Count to a thousand:", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", small_server.url + COMP, json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        t0 = time.monotonic()
        small_server.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line.startswith("data:")]
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][6:])["error"]["code"] == "shutting_down"
    assert small_server.stop() == 0
    assert time.monotonic() - t0 < 15
    out = small_server.output()
    assert "Server stopped" in out and "Traceback" not in out


# ---- in process: engine failure, chat template, CLI errors --------------------------------------
def test_engine_failure_gives_500_and_health_503(tiny_model_dir: str) -> None:
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.async_engine import AsyncLLMEngine
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.entrypoints.openai.api_server import build_app

    engine = LLMEngine.from_engine_args(EngineArgs(model=tiny_model_dir, num_kv_blocks=64))
    async_engine = AsyncLLMEngine.from_llm_engine(engine)
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    app = build_app(async_engine, served_model_names=["tiny"], chat_template=template)
    build_app(AsyncLLMEngine.from_llm_engine(engine), served_model_names=["other"])  # a second app: its own registry

    async def run() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as c:
            r = await c.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200
            text = (await c.post("/detokenize", json={"tokens": r.json()["tokens"]})).json()["prompt"]
            assert text == "[hi]"
            r = await c.post(COMP, json={"prompt": "hello", "max_tokens": 3, "ignore_eos": True})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
            assert (await c.get("/health")).status_code == 200

            def broken_step():
                raise RuntimeError("injected fault")

            engine.core.step = broken_step  # type: ignore[method-assign]
            r = await asyncio.wait_for(c.post(COMP, json={"prompt": "hello", "max_tokens": 3}), timeout=30)
            assert r.status_code == 500
            assert_error_shape(r.json())
            health = await c.get("/health")
            assert health.status_code == 503
            assert_error_shape(health.json())
            r = await asyncio.wait_for(c.post(CHATP, json={"messages": MSG, "stream": True}), timeout=30)
            assert r.status_code == 500

    try:
        asyncio.run(run())
    finally:
        async_engine.shutdown()


def test_serve_cli_errors(capsys: pytest.CaptureFixture[str]) -> None:
    """The first case runs `pagedllm serve` as its own process; the others call the CLI's `main()`
    in this one (each fails before a model loads)."""
    from pagedllm.entrypoints.cli import main

    for i, (args, needle) in enumerate((
        (["--port", "70000"], "--port"),
        (["--chat-template", "no-such-template"], "chat-template"),
        (["--max-queued-requests", "0"], "max-queued-requests"),
        (["--no-such-flag"], "unrecognized"),
    )):
        if i == 0:
            r = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", *args],
                               capture_output=True, text=True, timeout=120)
            rc, err = r.returncode, r.stderr
        else:
            try:
                rc = main(["serve", *args])
            except SystemExit as e:  # argparse's errors
                rc = e.code
            err = capsys.readouterr().err
        assert rc == 2, (args, err)
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and needle in lines[0], (args, err)
