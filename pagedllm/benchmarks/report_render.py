"""Shared pieces of the benchmark report: reading result files, the run block every section opens
with (command, machine and ISA line, versions, commit, load), tables, and lazy plotting."""

from __future__ import annotations

import fnmatch
import json
import re
from pathlib import Path
from typing import Any


GIB = 1 << 30
SOURCE = "_source"  # key added to every run's meta: the result file it was read from


def load(path: Path) -> dict[str, Any] | None:
    """A result file, with each `meta`/`env` dict inside it marked with the file's name."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    _mark(data, path.name)
    return data


def _mark(node: Any, name: str) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("meta", "env") and isinstance(value, dict):
                value[SOURCE] = name
            _mark(value, name)
    elif isinstance(node, list):
        for value in node:
            _mark(value, name)


class Hosts:
    """benchmarks/results/hosts.json: which host (and so which ISA line) a result file ran on."""

    def __init__(self, results: Path):
        path = results / "hosts.json"
        self.hosts: list[dict[str, Any]] = json.loads(path.read_text())["hosts"] if path.exists() else []

    def of(self, meta: dict[str, Any] | None, source: str | None = None) -> dict[str, Any]:
        meta = meta or {}
        source = source or meta.get(SOURCE, "")
        model = meta.get("cpu_model")
        if flags := meta.get("cpu_flags"):
            isa = ("AMX" if "amx_bf16" in flags else "AVX-512 BF16" if "avx512_bf16" in flags
                   else "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "other")
            return {"label": model or "?", "isa": isa, "cpu_model": model}
        for host in self.hosts:
            if model and host.get("cpu_model") != model:
                continue
            if any(fnmatch.fnmatch(source, pattern) for pattern in host.get("files", ["*"])):
                return host
        for host in self.hosts:  # a file named for no host: the first host with that CPU model
            if model and host.get("cpu_model") == model:
                return host
        return {"label": model or "?", "isa": "?", "cpu_model": model}


HOSTS = Hosts(Path("."))  # replaced by report.build() with the results folder's hosts


def short_commit(commit: str | None) -> str:
    if not commit:
        return "?"
    sha, dirty, _ = commit.partition("+")
    return sha[:7] + ("+dirty" if dirty else "")


def citable(commit: str | None) -> bool:
    return bool(commit) and commit not in ("unknown", "?") and "+dirty" not in commit


def cpu(meta: dict[str, Any] | None, source: str | None = None) -> tuple[str, str]:
    """(`AMD EPYC (Zen 4 class)`, `AVX-512 BF16`) for a run's meta."""
    host = HOSTS.of(meta, source)
    model = (meta or {}).get("cpu_model") or host.get("cpu_model") or "?"
    return (f"{model} ({host['label']})" if host.get("label") and host["label"] != model else model,
            host.get("isa", "?"))


def machine(meta: dict[str, Any] | None) -> str:
    name, isa = cpu(meta)
    return f"{name}, {isa}"


def checkout_relative(text: str) -> str:
    """`text` with the absolute directories of a checkout's virtual environments left out.

    A run records the paths it was given (`/home/u/pagedllm/.venv-peers/bin/python`); the page shows
    them as they lie in any checkout (`.venv-peers/bin/python`), so it renders the same wherever the
    repository was cloned."""
    return re.sub(r"(?<![\w.-])/\S*?/(\.venv[\w.-]*)(?=/|\s|$)", r"\1", text)


def command(meta: dict[str, Any] | None) -> str:
    """The run's command as a user of any checkout would type it."""
    cmd = checkout_relative(str((meta or {}).get("command", "?")))
    # The CLI run as a script from a checkout (`python pagedllm/entrypoints/cli.py bench ...`) is `pagedllm`.
    return re.sub(r"^\S*pagedllm/entrypoints/cli\.py(?= )", "pagedllm", cmd)


def commit_text(commit: str | None) -> str:
    if citable(commit):
        return f"Commit {commit}"
    return (f"Commit {commit}: **not citable** (the tree had uncommitted changes; kept for the record, "
            "the clean runs elsewhere on this page are the figures to quote)")


def run_block(meta: dict[str, Any] | None) -> str:
    if not meta:
        return ""
    v = meta.get("versions", {})
    versions = ", ".join(f"{k} {val}" for k, val in v.items() if val)
    load_avg = meta.get("load_avg_at_start")
    omp = meta.get("omp_num_threads")
    return (
        f"```\n{command(meta)}\n```\n"
        f"Machine: {machine(meta)}, {meta.get('cpu_cores', '?')} cores, {meta.get('memory_gib', '?')} GiB; "
        f"load average (1, 5, 15 min) at start {load_avg}"
        + (f", at end {meta['load_avg_at_end']}" if meta.get("load_avg_at_end") else "")
        + (f"; OMP_NUM_THREADS={omp}" if omp else "") + ". "
        f"Versions: {versions}. {commit_text(meta.get('commit'))}, run {meta.get('time', '?')}.\n"
    )


def fmt(v: Any, spec: str = ".1f", none: str = "-") -> str:
    return none if v is None else format(v, spec)


def table(headers: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out) + "\n"


def pyplot():
    """matplotlib's pyplot on the Agg backend (imported only when plots are drawn)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def use_hosts(results: Path) -> None:
    """Classify runs with `results`/hosts.json from now on."""
    global HOSTS
    HOSTS = Hosts(results)


def provenance(results: Path) -> dict[str, Any]:
    """benchmarks/results/provenance.json: run records for result files that carry none."""
    path = results / "provenance.json"
    return json.loads(path.read_text())["files"] if path.exists() else {}


def with_record(data: dict[str, Any], name: str, results: Path) -> dict[str, Any]:
    """`data` with a `meta` from provenance.json where the file has none of its own."""
    records = provenance(results)
    if "meta" not in data and name in records:
        data = dict(data, meta=dict(records[name], _source=name, provenance=True))
    return data
