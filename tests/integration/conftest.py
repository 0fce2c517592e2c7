"""The integration tests' shared server (see server_helpers.py)."""

from __future__ import annotations

import pytest

from server_helpers import DEFAULT_SERVER_FLAGS, serve


@pytest.fixture(scope="session")
def default_server(tmp_path_factory: pytest.TempPathFactory):
    """One `pagedllm serve` of the default model with `DEFAULT_SERVER_FLAGS`, for every module that
    asks for it; started on first use, stopped at the session's end."""
    with serve(tmp_path_factory.mktemp("default-server"), *DEFAULT_SERVER_FLAGS) as s:
        yield s

