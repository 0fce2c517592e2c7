"""The package's layers (docs/architecture.md): no package imports one above it, no two modules
import each other (directly or round a longer loop), and no Python file in the package is over
600 lines. Imports inside functions count too: a lazy import is still a dependency."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "pagedllm"

# Bottom to top. A unit may import units of its own layer or below. Units are the top-level
# modules and subpackages of pagedllm.
LAYERS: list[set[str]] = [
    {"envs", "utils", "config", "sampling_params", "pooling_params", "outputs", "hardware"},
    {"core", "tokenizer", "reasoning"},  # the scheduler and block pool import no torch
    {"native"},                       # C kernels: compiler driver, loader, declarations
    {"distributed"},
    {"attention"},
    {"quantization"},
    {"layers"},
    {"models", "lora"},
    {"worker"},
    {"executor", "structured_output"},
    {"engine"},
    {"llm", "llm_pooling", "metrics"},
    {"benchmarks", "eval"},
    {"simulator"},
    {"benchmarks_cli"},
    {"entrypoints"},
]
RANK = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    mods = {}
    for f in PKG.rglob("*.py"):
        name = ".".join(f.relative_to(PKG.parent).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = f
    return mods


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return [n for n in out if n == "pagedllm" or n.startswith("pagedllm.")]


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    edges: dict[str, set[str]] = defaultdict(set)
    for mod, path in mods.items():
        for name in _imports(path):
            dst = _resolve(name, mods)
            # A module's own parent packages are imported by Python anyway.
            if dst and dst != mod and not mod.startswith(dst + "."):
                edges[mod].add(dst)
    return edges


def _unit(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_unit_has_a_layer():
    units = {_unit(m) for m in _modules()} - {""}
    assert units <= set(RANK), f"place these in LAYERS (and docs/architecture.md): {sorted(units - set(RANK))}"


def test_no_upward_import():
    upward = sorted(
        f"{src} -> {dst}"
        for src, dsts in _graph().items() for dst in dsts
        if _unit(src) and _unit(dst) and RANK[_unit(dst)] > RANK[_unit(src)]
    )
    assert not upward, "imports of a higher layer:\n" + "\n".join(upward)


def test_no_import_cycle():
    edges = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in list(edges):
        if v not in index:
            visit(v)
    assert not cycles, "modules that import each other: " + "; ".join(", ".join(c) for c in cycles)


def test_no_python_file_over_the_line_limit():
    long = {str(p.relative_to(PKG.parent)): n for p in PKG.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"
