"""Several base models behind one `pagedllm serve` (--extra-models), from the openai SDK: requests
to both models at once, each answered by its own model (greedy text equal to pagedllm.LLM on that
model alone); an idle model unloaded and loaded again on its next request with the same answer; a
model whose safetensors file is corrupt, or whose folder is missing, fails its own requests only
(500 naming it and the reason), and loads once its folder is fixed; an extra model's engine
killed is loaded again by its next request while the server serves on; an unknown name is 404; a bad --extra-models value is one line, exit 2."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from pagedllm.models.testing import make_tiny_checkpoint
from server_helpers import assert_error_shape, serve
from test_cli import run_main

PROMPTS = ["the quick brown fox", "hello world, how are", "one two three four", "a tiny model says"]
MAX_TOKENS = 12
IDLE_S = 3.0
ENGINE_FLAGS = ("--dtype", "float32", "--max-model-len", "256")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("multi-model")
    main = make_tiny_checkpoint(str(root / "main"), arch="llama", seed=0)
    qwen = make_tiny_checkpoint(str(root / "qwen"), arch="qwen2", seed=1)
    broken = root / "broken"
    shutil.copytree(qwen, broken)
    (broken / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{corrupt")
    with serve(root, main, *ENGINE_FLAGS, "--kv-cache-memory", "48MiB",
               "--extra-models", f"qwen={qwen}", f"broken={broken}", f"missing={root / 'nowhere'}",
               "--model-idle-unload-s", str(IDLE_S), "--max-loaded-models", "3") as s:
        yield s, {"main": main, "qwen": qwen, "broken": str(broken)}


@pytest.fixture(scope="module")
def server(setup):
    return setup[0]


@pytest.fixture(scope="module")
def references(setup):
    """Greedy completions and one chat reply of each model served alone, offline (pagedllm.LLM)."""
    from pagedllm import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    out = {}
    for name in ("main", "qwen"):
        llm = LLM(setup[1][name], dtype="float32", max_model_len=256, kv_cache_memory="16MiB")
        texts = [o.outputs[0].text for o in llm.generate(PROMPTS, params)]
        chat = llm.chat([{"role": "user", "content": PROMPTS[0]}], params)[0].outputs[0].text
        embedding = llm.embed([PROMPTS[1]])[0].outputs.embedding
        out[name] = (texts, chat, embedding)
        del llm
    return out


def _loaded(http, name: str) -> float:
    m = re.search(r'^pagedllm:model_loaded\{model_name="%s"\} (\S+)$' % re.escape(name), http.get("/metrics").text,
                  re.M)
    assert m, http.get("/metrics").text[-2000:]
    return float(m.group(1))


def _complete(client, model: str, prompt: str) -> str:
    r = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert r.model == model
    return r.choices[0].text


def test_every_model_is_listed_and_only_the_main_one_loaded_at_start(server, client, http):
    ids = [m.id for m in client.models.list().data]
    assert ids == ["main", "qwen", "broken", "missing"]
    assert client.models.retrieve("qwen").id == "qwen"
    assert _loaded(http, "main") == 1 and _loaded(http, "qwen") == 0 and _loaded(http, "broken") == 0
    log = server.output()
    assert "Models: main (loaded), qwen (registered" in log and "broken (registered" in log


def test_interleaved_requests_are_answered_by_their_own_model(server, client, http, references):
    jobs = [(model, i) for i in range(len(PROMPTS)) for model in ("main", "qwen")]
    with ThreadPoolExecutor(len(jobs)) as pool:
        texts = list(pool.map(lambda job: _complete(client, job[0], PROMPTS[job[1]]), jobs))
    for (model, i), text in zip(jobs, texts):
        assert text == references[model][0][i], (model, i)
    assert references["main"][0] != references["qwen"][0]  # the two models differ
    for model in ("main", "qwen"):
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPTS[0]}],
                                           max_tokens=MAX_TOKENS, temperature=0)
        assert r.model == model and r.choices[0].message.content == references[model][1], model
        stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPTS[0]}],
                                                max_tokens=MAX_TOKENS, temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == references[model][1]
    metrics = http.get("/metrics").text
    for model in ("main", "qwen"):  # each model's own counters, one HELP/TYPE per name
        assert re.search(r'^pagedllm:prompt_tokens_total\{model_name="%s"\} [1-9]' % model, metrics, re.M), model
    assert metrics.count("# TYPE pagedllm:prompt_tokens_total counter") == 1


def test_every_route_that_takes_a_model_routes_by_it(server, client, references):
    """Responses, Anthropic's Messages and embeddings reach the named model (the chat reply and the
    embedding of that model served alone)."""
    for model in ("main", "qwen"):
        r = client.responses.create(model=model, input=[{"role": "user", "content": PROMPTS[0]}],
                                    max_output_tokens=MAX_TOKENS, temperature=0)
        assert r.model == model and r.output_text == references[model][1], model
        with server.http() as http:
            m = http.post("/v1/messages", json={"model": model, "max_tokens": MAX_TOKENS, "temperature": 0,
                                                "messages": [{"role": "user", "content": PROMPTS[0]}]})
        assert m.status_code == 200, m.text
        assert m.json()["model"] == model and m.json()["content"][0]["text"] == references[model][1], model
        e = client.embeddings.create(model=model, input=[PROMPTS[1]])
        assert e.model == model and e.data[0].embedding == pytest.approx(references[model][2], rel=1e-5, abs=1e-6)


def test_an_idle_model_is_unloaded_and_loaded_again_on_demand(server, client, http, references):
    _complete(client, "qwen", PROMPTS[1])
    assert _loaded(http, "qwen") == 1
    deadline = time.monotonic() + IDLE_S + 30
    while _loaded(http, "qwen") == 1 and time.monotonic() < deadline:
        time.sleep(0.25)
    assert _loaded(http, "qwen") == 0
    assert "Unloaded model qwen after" in server.output()
    assert _complete(client, "qwen", PROMPTS[2]) == references["qwen"][0][2]
    assert _loaded(http, "qwen") == 1
    assert client.models.retrieve("qwen").model_extra["max_model_len"] == 256


def test_a_corrupt_model_fails_its_own_requests_only(setup, client, references):
    server, paths = setup
    with pytest.raises(openai.InternalServerError) as e:
        _complete(client, "broken", PROMPTS[0])
    body = e.value.response.json()
    assert_error_shape(body)
    assert "`broken` could not be loaded" in body["error"]["message"] and "safetensors" in body["error"]["message"]
    assert body["error"]["code"] == "model_load_failed"
    with server.http() as http:  # the next request tries again; Anthropic's Messages API answers in its own shape
        r = http.post("/v1/messages", json={"model": "broken", "max_tokens": 4,
                                            "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 500 and r.json()["type"] == "error" and "broken" in r.json()["error"]["message"]
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model="missing", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert "`missing` could not be loaded" in e.value.response.json()["error"]["message"]
    assert "nowhere" in e.value.response.json()["error"]["message"]
    assert _complete(client, "main", PROMPTS[3]) == references["main"][0][3]
    assert _complete(client, "qwen", PROMPTS[3]) == references["qwen"][0][3]
    shutil.copy(Path(paths["qwen"]) / "model.safetensors", Path(paths["broken"]) / "model.safetensors")
    assert _complete(client, "broken", PROMPTS[3]) == references["qwen"][0][3]  # the same weights as qwen now


def test_a_dead_extra_engine_is_loaded_again_and_the_server_serves_on(server, client, http, references):
    _complete(client, "qwen", PROMPTS[0])
    log = server.output()
    tail = log[log.rindex("Loading model qwen"):]
    pid = int(re.search(r"Engine core process (\d+) ready", tail).group(1))
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while _loaded(http, "qwen") == 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _loaded(http, "qwen") == 0 and http.get("/health").status_code == 200
    assert _complete(client, "main", PROMPTS[1]) == references["main"][0][1]
    assert _complete(client, "qwen", PROMPTS[1]) == references["qwen"][0][1]
    assert server.proc.poll() is None


def test_an_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        _complete(client, "nope", PROMPTS[0])
    body = e.value.response.json()
    assert_error_shape(body)
    assert "main, qwen, broken, missing" in body["error"]["message"]


# (argv, what the one line says, whether it runs as its own process): one process (argparse's path),
# the other cases call the CLI's main() in this process.
BAD_FLAGS = {
    "no-equals": (["--extra-models", "qwen"], "as NAME=PATH_OR_BUILTIN", True),
    "unknown-key": (["--extra-models", '{"name": "x", "model": "m", "max_model_lenn": 5}'],
                    "unknown engine flags ['max_model_lenn']", False),
    "bad-size": (["--extra-models", '{"name": "x", "model": "m", "kv_cache_memory": "12XB"}'], "as a size in bytes",
                 False),
    "name-twice": (["--extra-models", "a=x", "a=y"], "the name 'a' is served twice", False),
    "one-loaded": (["--extra-models", "a=x", "--max-loaded-models", "1"], "--max-loaded-models must be at least 2",
                   False),
    "no-models": (["--model-idle-unload-s", "5"], "need --extra-models", False),
}


@pytest.mark.parametrize("case", list(BAD_FLAGS))
def test_a_bad_extra_models_value_is_one_line(case: str, capsys: pytest.CaptureFixture[str]):
    argv, reason, own_process = BAD_FLAGS[case]
    args = ["serve", "--port", "0", *argv]
    if own_process:
        p = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", *args], capture_output=True, text=True,
                           timeout=120)
        rc, err = p.returncode, p.stderr
    else:
        rc, _, err = run_main(args, capsys)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and reason in lines[0], err
