"""What every `pagedllm bench <name>` module that parses its own flags shares: its parser, with the
module's docstring (what it measures) as the description, and `main(argv, prog)` as the CLI calls
it (`pagedllm/benchmarks_cli.py` forwards the rest of the command line)."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the source tree (tests/, benchmarks/results/, docs/)
RESULTS = ROOT / "benchmarks" / "results"


def parser(doc: str | None, prog: str | None) -> argparse.ArgumentParser:
    """A benchmark's parser: `doc` (its module's docstring) printed as written under the usage."""
    return argparse.ArgumentParser(prog=prog, description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def hf_prompts() -> list[str]:
    """The 64 prompts of the HF correctness test (tests/integration/test_correctness_hf.py), read
    from the source tree so that the benchmarks and the test use the same list."""
    path = ROOT / "tests" / "integration" / "test_correctness_hf.py"
    spec = importlib.util.spec_from_file_location("_hf_prompts", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return list(module.PROMPTS)
