"""Fixtures shared across test folders (keep this file small)."""

from __future__ import annotations

import os

import pytest

# Triton interpreter tests need TRITON_INTERPRET=1 before triton's import: they run in their own
# process (tests/unit/test_triton_interpreter.py), never in this one.
collect_ignore = [] if os.environ.get("TRITON_INTERPRET") == "1" else ["triton_interp"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` are skipped where torch sees no CUDA device."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in gpu_items:
        item.add_marker(skip)


# A pytest session started by a test (tests/unit/test_triton_interpreter.py) reuses its parent's
# tiny model folder, named by this variable, instead of making one again.
TINY_MODEL_DIR_ENV = "PAGEDLLM_TEST_TINY_MODEL_DIR"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Qwen2 checkpoint with its tokenizer (see pagedllm.models.testing)."""
    if os.environ.get(TINY_MODEL_DIR_ENV):
        return os.environ[TINY_MODEL_DIR_ENV]
    from pagedllm.models.testing import make_tiny_checkpoint

    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny") / "qwen2"), arch="qwen2", seed=0)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Runs a module's engines on one torch thread.

    Small CPU matmuls gain nothing from a second thread, and on shared cores OpenMP threads that
    wait for each other make every step many times slower.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
