"""LoRA adapters on a real server from the openai SDK: --lora-modules (both forms, and a GGUF LoRA
file beside the PEFT folders) listed in
/v1/models with their parent, the request's `model` picking the adapter (greedy text equal to
transformers + PEFT), an unknown name 404 in OpenAI's shape, and POST /v1/load_lora_adapter /
/v1/unload_lora_adapter behind the API key: a bad adapter 400 naming the tensor, unloading an
adapter while its stream runs finishes the stream, then its name is 404."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import openai
import pytest

from pagedllm.models.testing import make_tiny_checkpoint
from gguf_files import write_gguf_lora
from server_helpers import assert_error_shape, serve
from test_lora import MAX_TOKENS, PROMPTS, make_adapter, peft_reference

KEY = "lora-key"
pytestmark = pytest.mark.slow  # a server start and PEFT references: about a minute


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-server")
    base = make_tiny_checkpoint(str(root / "base"), arch="llama")
    paths = {
        "a": make_adapter(base, root / "a", 1, r=8, lora_alpha=16, target_modules="all-linear"),
        "b": make_adapter(base, root / "b", 2, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        "c": make_adapter(base, root / "c", 3, r=4, lora_alpha=4, target_modules=["down_proj"], use_rslora=True),
        "big": make_adapter(base, root / "big", 4, r=16, lora_alpha=16, target_modules=["o_proj"]),
    }
    from transformers import AutoConfig

    # adapter a again, as llama.cpp's converter writes it
    paths["g"] = write_gguf_lora(paths["a"], str(root / "a.gguf"), "llama", AutoConfig.from_pretrained(base))
    with serve(root, base, "--dtype", "float32", "--kv-cache-memory", "32MiB", "--api-key", KEY,
               "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--lora-modules", f"a={paths['a']}", f"g={paths['g']}",
               json.dumps({"name": "b", "path": paths["b"], "base_model_name": "base"}),
               env={"PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}) as s:
        yield s, base, paths


@pytest.fixture(scope="module")
def client(setup):
    return openai.OpenAI(base_url=setup[0].url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _text(client, model: str, prompt: list[int]) -> str:
    r = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    return r.choices[0].text.rstrip("\ufffd")


def _expected(base: str, adapter: str | None, prompt: list[int]) -> str:
    from transformers import AutoTokenizer

    # The server holds back a last token's incomplete UTF-8 bytes; the tokenizer shows them as U+FFFD.
    return AutoTokenizer.from_pretrained(base).decode(peft_reference(base, adapter, prompt)[0]).rstrip("\ufffd")


def test_models_list_adapters_with_parent(client):
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"base", "a", "b", "g"}
    assert cards["a"].parent == "base" and cards["b"].parent == "base" and cards["g"].parent == "base"
    assert client.models.retrieve("a").parent == "base"


def test_model_names_the_adapter(setup, client):
    _, base, paths = setup
    texts = {}
    for model in ("a", "b", "base"):
        texts[model] = _text(client, model, PROMPTS[0])
        assert texts[model] == _expected(base, paths.get(model), PROMPTS[0]), model
    assert len(set(texts.values())) == 3
    assert _text(client, "g", PROMPTS[0]) == texts["a"]  # the GGUF file of adapter a: the same float32 tensors


def test_unknown_adapter_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert e.value.status_code == 404
    assert_error_shape(e.value.response.json())


def test_load_and_unload_at_run_time(setup, client):
    server, base, paths = setup
    http = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert httpx.post(server.url + "/v1/load_lora_adapter",
                      json={"lora_name": "c", "lora_path": paths["c"]}).status_code == 401
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": paths["c"]})
    assert r.status_code == 200, r.text
    assert "c" in {m.id for m in client.models.list().data}
    assert _text(client, "c", PROMPTS[1]) == _expected(base, paths["c"], PROMPTS[1])
    again = http.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": paths["c"]})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    bad = http.post("/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": paths["big"]})
    assert bad.status_code == 400, bad.text
    assert_error_shape(bad.json())
    assert "o_proj.lora_A" in bad.json()["error"]["message"] and "max-lora-rank" in bad.json()["error"]["message"]
    # Unloading an adapter while its stream runs: the stream finishes, then the name is gone.
    stream = client.completions.create(model="c", prompt=PROMPTS[2], max_tokens=40, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    first = next(iter(stream))
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "c"})
    assert r.status_code == 200, r.text
    rest = list(stream)
    assert first.choices[0].text is not None and rest and rest[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="c", prompt="hi", max_tokens=2)
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "c"}).status_code == 404
    assert "c" not in {m.id for m in client.models.list().data}


def test_load_while_streams_run(setup, client):
    server, base, paths = setup
    http = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    results: list[str] = []

    def run():
        for _ in range(3):
            results.append(_text(client, "a", PROMPTS[3]))

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "c2", "lora_path": paths["c"]})
    for t in threads:
        t.join()
    assert r.status_code == 200
    assert results == [_expected(base, paths["a"], PROMPTS[3])] * 6


def test_adapter_folder_gone_fails_its_requests_only(setup, client, tmp_path):
    # Loaded (checked) at run time, then its folder is deleted before any step reads it: its
    # requests get a 500 in OpenAI's error shape naming the folder; a stream of another adapter
    # running meanwhile completes, and the server serves on.
    import shutil

    server, base, paths = setup
    http = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    folder = tmp_path / "gone"
    shutil.copytree(paths["c"], folder)
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "gone", "lora_path": str(folder)}).status_code == 200
    shutil.rmtree(folder)
    stream = client.completions.create(model="a", prompt=PROMPTS[3], max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True)
    first = next(iter(stream))
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model="gone", prompt=PROMPTS[1], max_tokens=MAX_TOKENS)
    body = e.value.response.json()
    assert_error_shape(body)
    assert "cannot be read from" in body["error"]["message"] and str(folder) in body["error"]["message"]
    text = first.choices[0].text + "".join(c.choices[0].text for c in stream)
    assert text.rstrip("\ufffd") == _expected(base, paths["a"], PROMPTS[3])
    assert _text(client, "b", PROMPTS[0]) == _expected(base, paths["b"], PROMPTS[0])
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "gone"}).status_code == 200


def test_load_and_unload_chaos_while_streams_run(setup, client):
    # Seeded chaos (PAGEDLLM_CHAOS_SEED): 4 clients stream greedy completions of random adapters
    # while another loads and unloads those adapters at random moments. As in vLLM, unloading
    # removes the name only: a stream that started with an adapter ends normally with that
    # adapter's text; a request sent after its adapter's name went is a 404. Nothing else: no
    # 500, no dropped or mixed-up stream, and afterwards nothing runs and no KV block is held.
    import os
    import random
    import time

    from server_helpers import wait_idle

    server, base, paths = setup
    seed = int(os.environ.get("PAGEDLLM_CHAOS_SEED", "20261206"))
    rng = random.Random(seed)
    http = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    folders = {"ch-a": paths["a"], "ch-b": paths["b"], "ch-c": paths["c"]}
    prompt = PROMPTS[2]
    want = {name: _expected(base, folder, prompt) for name, folder in folders.items()}
    loaded = set()
    lock = threading.Lock()
    for name in ("ch-a", "ch-b"):
        assert http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": folders[name]}).status_code == 200
        loaded.add(name)
    outcomes: list[tuple[str, str]] = []
    problems: list[str] = []
    done = threading.Event()
    toggles: list[str] = []

    def streamer(r: random.Random) -> None:
        sent = 0
        while sent < 4 or not done.is_set():  # until the toggling is over, 4 requests at least
            sent += 1
            name = r.choice(sorted(folders))
            try:
                s = client.completions.create(model=name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                              stream=True)
                chunks = list(s)
            except openai.NotFoundError:
                outcomes.append((name, "404"))
                continue
            except Exception as e:  # noqa: BLE001 - every other outcome is a failure of the test
                problems.append(f"{name}: {type(e).__name__}: {e}")
                continue
            text = "".join(c.choices[0].text for c in chunks).rstrip("\ufffd")
            if text != want[name] or chunks[-1].choices[0].finish_reason != "length":
                problems.append(f"{name}: {text!r} (finish {chunks[-1].choices[0].finish_reason}), want {want[name]!r}")
            outcomes.append((name, "ok"))

    def chaos(r: random.Random) -> None:
        for _ in range(12):
            time.sleep(r.uniform(0.0, 0.15))
            name = r.choice(sorted(folders))
            with lock:
                if name in loaded:
                    resp = http.post("/v1/unload_lora_adapter", json={"lora_name": name})
                    loaded.discard(name)
                else:
                    resp = http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": folders[name]})
                    loaded.add(name)
            if resp.status_code != 200:
                problems.append(f"load/unload {name}: {resp.status_code} {resp.text}")
            toggles.append(name)

    clients = [threading.Thread(target=streamer, args=(random.Random(rng.random()),)) for _ in range(4)]
    toggler = threading.Thread(target=chaos, args=(random.Random(rng.random()),))
    for t in clients:
        t.start()
    toggler.start()
    toggler.join()
    done.set()
    for t in clients:
        t.join()
    assert not problems, problems
    assert len(toggles) == 12 and len(outcomes) >= 16 and any(o == "ok" for _, o in outcomes)
    wait_idle(http)
    for name in loaded:
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": name}).status_code == 200
    assert _text(client, "a", PROMPTS[0]) == _expected(base, paths["a"], PROMPTS[0])
