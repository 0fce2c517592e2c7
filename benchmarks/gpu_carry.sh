#!/usr/bin/env bash
# Prepares, on a machine with network and the project's venv, what the GPU machine lacks for the
# default-model part of `make gpu-check`: the pure-Python `gguf` wheel and the default model's GGUF
# file, split into parts of 40 MB for transfers that limit a file's size. Everything goes to
# .gpu-carry/ (git-ignored). See docs/gpu.md for the commands that reassemble it there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
out=.gpu-carry
rm -rf "$out" && mkdir -p "$out/wheels"
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$out/wheels" gguf==0.19.0
model=$("$PY" -c "from pagedllm.models.loader import resolve_model; print(resolve_model(None).path)")
split -b 40M -d "$model" "$out/model.part"
sha256sum "$model" | cut -d' ' -f1 > "$out/model.sha256"
ls -la "$out" "$out/wheels"
