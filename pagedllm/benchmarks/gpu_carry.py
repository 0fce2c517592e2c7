"""Prepares, on a machine with network and the project's environment, what the GPU machine lacks
for the default-model part of `make gpu-check`: the pure-Python `gguf` wheel and the default
model's GGUF file, split into parts of 40 MB for transfers that limit a file's size. Everything
goes to .gpu-carry/ (git-ignored) in the source tree; docs/gpu.md gives the commands that
reassemble it there.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys

from pagedllm.benchmarks.script import ROOT, parser

PART = 40 << 20


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = parser(__doc__, prog)
    ap.add_argument("--out", default=str(ROOT / ".gpu-carry"), help="folder to fill (emptied first)")
    args = ap.parse_args(argv)
    from pathlib import Path

    from pagedllm.models.loader import resolve_model

    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    (out / "wheels").mkdir(parents=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d",
                    str(out / "wheels"), "gguf==0.19.0"], check=True)
    model = Path(resolve_model(None).path)
    digest = hashlib.sha256()
    with model.open("rb") as f:
        for i, chunk in enumerate(iter(lambda: f.read(PART), b"")):
            (out / f"model.part{i:02d}").write_bytes(chunk)  # the names `split -b 40M -d` gives
            digest.update(chunk)
    (out / "model.sha256").write_text(digest.hexdigest() + "\n")
    for p in sorted(out.rglob("*")):
        if p.is_file():
            print(f"{p.stat().st_size:12d}  {p.relative_to(out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
