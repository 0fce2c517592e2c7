"""The integration tests' shared server (see server_helpers.py)."""

from __future__ import annotations

import pytest

from server_helpers import DEFAULT_SERVER_FLAGS, MINILM_SERVER_ARGS, TINY_SERVER_FLAGS, Server, serve


@pytest.fixture(scope="session")
def default_server(tmp_path_factory: pytest.TempPathFactory):
    """One `pagedllm serve` of the default model with `DEFAULT_SERVER_FLAGS`, for every module that
    asks for it; started on first use, stopped at the session's end."""
    with serve(tmp_path_factory.mktemp("default-server"), *DEFAULT_SERVER_FLAGS) as s:
        yield s


@pytest.fixture(scope="session")
def thinker_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Llama whose tokenizer has `<think>` and `</think>` as single tokens (the
    reasoning modules' model; its embeddings grown to match)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedllm.models.testing import make_tiny_checkpoint

    path = make_tiny_checkpoint(str(tmp_path_factory.mktemp("thinker") / "m"), arch="llama", seed=3)
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_tokens(["<think>", "</think>"])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.resize_token_embeddings(len(tok))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str):
    """One `pagedllm serve` of the tiny random model with `TINY_SERVER_FLAGS`, for the modules that
    ask for it; at the session's end it must exit 0 without a traceback in its log."""
    s = Server(tmp_path_factory.mktemp("tiny-server") / "server.log", tiny_model_dir, *TINY_SERVER_FLAGS)
    try:
        s.wait_ready()
        yield s
    finally:
        assert s.stop() == 0
        assert "Traceback" not in s.output(), s.output()[-3000:]


@pytest.fixture(scope="session")
def minilm_server(tmp_path_factory: pytest.TempPathFactory):
    """One `pagedllm serve all-minilm-l6-v2` (`MINILM_SERVER_ARGS`) for the pooling modules that ask
    for it; started on first use, stopped at the session's end."""
    with serve(tmp_path_factory.mktemp("minilm-server"), *MINILM_SERVER_ARGS) as s:
        yield s


# Clients on the module's `server` fixture (a module defines `server`; these follow it). A module
# that needs other clients defines its own fixture of the same name.
@pytest.fixture(scope="module")
def http(server):
    """httpx on the module's server, with its API key."""
    with server.http(timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def client(server):
    """The openai client on the module's server."""
    return server.openai()


@pytest.fixture(scope="module")
def model(http) -> str:
    """The id the module's server serves."""
    return http.get("/v1/models").json()["data"][0]["id"]
