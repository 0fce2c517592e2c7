"""Fixtures shared across test folders (keep this file small)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Qwen2 checkpoint with its tokenizer (see pagedllm.models.testing)."""
    from pagedllm.models.testing import make_tiny_checkpoint

    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny") / "qwen2"), arch="qwen2", seed=0)
