"""pagedllm/envs.py declares every environment variable pagedllm reads, the README's table is the
one it generates, and values are parsed (and checked) at each access."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pagedllm import envs

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pagedllm"
START = "<!-- envs:start (generated from pagedllm/envs.py; tests/unit/test_envs.py keeps it equal) -->"
END = "<!-- envs:end -->"


def test_every_variable_named_in_the_package_is_declared() -> None:
    """Every PAGEDLLM_* name in pagedllm's code is one envs.py declares; a name that ends in "_"
    (the start of a name built from parts) must begin a declared one."""
    undeclared: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "envs.py":
            continue
        for name in set(re.findall(r"PAGEDLLM_[A-Z0-9_]+", path.read_text(encoding="utf-8"))):
            declared = (any(v.startswith(name) for v in envs.VARIABLES) if name.endswith("_")
                        else name in envs.VARIABLES)
            if not declared:
                undeclared.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert not undeclared, f"declare these in pagedllm/envs.py: {undeclared}"


def test_readme_table_is_the_generated_one() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert START in readme and END in readme, f"README.md has no {START} ... {END} section"
    section = readme.split(START, 1)[1].split(END, 1)[0]
    assert section.strip() == envs.markdown_table(), (
        "README.md's table of environment variables differs from pagedllm/envs.py; put "
        "`python -c 'from pagedllm import envs; print(envs.markdown_table())'` between the markers")


def test_values_are_parsed_at_each_access(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDLLM_SHM_ALLREDUCE_MAX_BYTES", raising=False)
    assert envs.PAGEDLLM_SHM_ALLREDUCE_MAX_BYTES == 16 << 20
    monkeypatch.setenv("PAGEDLLM_SHM_ALLREDUCE_MAX_BYTES", "4096")
    assert envs.PAGEDLLM_SHM_ALLREDUCE_MAX_BYTES == 4096
    monkeypatch.setenv("PAGEDLLM_SHM_ALLREDUCE_MAX_BYTES", "")  # empty: the default
    assert envs.PAGEDLLM_SHM_ALLREDUCE_MAX_BYTES == 16 << 20
    for raw, value in (("0", False), ("1", True), ("off", False), ("True", True)):
        monkeypatch.setenv("PAGEDLLM_CHECK_INTEGRITY", raw)
        assert envs.PAGEDLLM_CHECK_INTEGRITY is value, raw
    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", "Torch")
    assert envs.PAGEDLLM_ATTENTION_BACKEND == "torch"
    monkeypatch.delenv("PAGEDLLM_CACHE_DIR", raising=False)
    assert envs.PAGEDLLM_CACHE_DIR is None


@pytest.mark.parametrize("name, raw", [
    ("PAGEDLLM_SHM_ALLREDUCE_MAX_BYTES", "16MB"),
    ("PAGEDLLM_WORKER_STARTUP_TIMEOUT", "soon"),
    ("PAGEDLLM_QUANT_LM_HEAD", "maybe"),
    ("PAGEDLLM_ATTENTION_BACKEND", "cuda"),
    ("PAGEDLLM_QUANT_ACTIVATIONS", "fp4"),
])
def test_a_bad_value_raises_naming_the_variable(monkeypatch: pytest.MonkeyPatch, name: str, raw: str) -> None:
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError, match=rf"^{name}={raw!r}"):
        getattr(envs, name)


def test_an_undeclared_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError):
        envs.PAGEDLLM_NOT_A_VARIABLE  # noqa: B018


def test_the_table_has_a_row_per_variable() -> None:
    rows = envs.markdown_table().splitlines()[2:]
    assert [r.split("`")[1] for r in rows] == list(envs.VARIABLES)
