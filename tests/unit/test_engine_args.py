"""EngineArgs is the one source of the engine flags: argparse, Python and the README agree."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from pagedllm.engine.arg_utils import EngineArgs

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_flag_table_matches_engine_args() -> None:
    text = README.read_text()
    start = text.index("<!-- engine-flags:start")
    start = text.index("\n", start) + 1
    end = text.index("<!-- engine-flags:end -->")
    expected = EngineArgs.flag_table_markdown()
    assert text[start:end].strip() == expected, "README's flag table is stale; replace it with:\n" + expected


def test_every_field_has_a_flag_with_its_default() -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    ns = parser.parse_args([])
    from_cli = EngineArgs.from_cli_args(ns)
    assert from_cli == EngineArgs()
    for f in dataclasses.fields(EngineArgs):
        assert f.metadata["help"], f"{f.name} has no help text"


def test_python_values_go_through_the_cli_parsers() -> None:
    args = EngineArgs(kv_cache_memory="256MiB", user_weights="alice=2,bob=1")
    assert args.kv_cache_memory == 256 << 20
    assert args.user_weights == {"alice": 2.0, "bob": 1.0}
    with pytest.raises(ValueError, match="kv_cache_memory='lots'"):
        EngineArgs(kv_cache_memory="lots")


def test_aliases_and_boolean_flags() -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    ns = parser.parse_args(["--num-gpu-blocks-override", "7", "--no-enable-prefix-caching", "--kv-cache-memory", "1GiB"])
    args = EngineArgs.from_cli_args(ns)
    assert (args.num_kv_blocks, args.enable_prefix_caching, args.kv_cache_memory) == (7, False, 1 << 30)


@pytest.mark.parametrize(("argv", "reason"), [
    (["--speculative-config", "{bad"], "cannot read '{bad' as JSON"),
    (["--speculative-config", '{"method": "ngram"}'], "num_speculative_tokens is required"),
    (["--kv-cache-memory", "12XB"], "as a size in bytes"),
])
def test_a_bad_flag_value_gets_its_reason_on_one_line(argv: list[str], reason: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser(prog="pagedllm"))
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"pagedllm: error: argument {argv[0]}:") and reason in err, err
