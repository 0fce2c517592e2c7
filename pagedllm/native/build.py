"""The C compiler driver: a kernel's source compiled for this CPU once, the shared library cached.

Each library is one C file of `CSRC` (it may include other files of the folder: shared headers,
its ISA forms, or whole kernels, as the fused decode step includes the attention source). The
cached `.so` is named by the source's stem and a hash of every file it includes (followed through
the folder), the compiler flags and the CPU (model and flags), so an edited source, a new flag or
another CPU builds anew and a stale build is never loaded.

Kernels share torch's OpenMP runtime (torch ships `libgomp.so.1`, and the kernels link the same
soname), so `torch.set_num_threads` governs both.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from pagedllm.utils import cache_dir

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
# Added to FLAGS: the AVX2 + FMA form of the kernels on a CPU with AVX-512 (every AVX-512 subset off),
# so that the tests run both forms on such a CPU; the engine never loads it.
AVX2_FORM_FLAGS = ("-mno-avx512f",)
_LOCAL_INCLUDE = re.compile(rb'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def cpu_signature() -> str:
    """The machine, CPU model and CPU flags: part of every build's cache key (-march=native)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return platform.machine() + "|".join(lines)


def local_includes(src: Path) -> list[Path]:
    """`src` and every file it includes with `#include "..."`, transitively (each once, in order)."""
    seen: list[Path] = []
    stack = [src]
    while stack:
        path = stack.pop()
        if path in seen:
            continue
        seen.append(path)
        found = [path.parent / name.decode() for name in _LOCAL_INCLUDE.findall(path.read_bytes())]
        stack.extend(reversed([p for p in found if p.exists()]))
    return seen


def cache_key(src: Path, extra_flags: tuple[str, ...] = ()) -> str:
    """Hash of the sources `src` compiles from, the flags and the CPU."""
    text = b"".join(p.read_bytes() for p in local_includes(src))
    flags = " ".join([*FLAGS, *extra_flags]).encode()
    return hashlib.sha256(text + flags + cpu_signature().encode()).hexdigest()[:16]


def _build(src: Path, out: Path, extra_flags: tuple[str, ...] = ()) -> None:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc/cc) found")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        target = Path(tmp) / out.name
        proc = subprocess.run([cc, *FLAGS, *extra_flags, str(src), "-o", str(target), "-lm"], capture_output=True,
                              text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[:500]}")
        os.replace(target, out)


def _build_once(src: Path, out: Path, extra_flags: tuple[str, ...] = ()) -> None:
    """Builds `out` unless another process has meanwhile: processes that start together on a cold
    cache (an engine's rank workers, a server's processes, parallel test runs) wait on one lock
    file beside it and the first builds, instead of each compiling the same source."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.exists():
            _build(src, out, extra_flags)
            logger.info("compiled %s into %s", src.name, out)


def compile_native(src: Path, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """`src` compiled for this CPU (cached by its sources, flags and CPU) and opened, or None with
    one warning (no compiler, a build error). `extra_flags` follow FLAGS (AVX2_FORM_FLAGS)."""
    lib_path = cache_dir() / "kernels" / f"{src.stem}_{cache_key(src, extra_flags)}.so"
    try:
        if not lib_path.exists():
            _build_once(src, lib_path, extra_flags)
        return ctypes.CDLL(str(lib_path))
    except (OSError, RuntimeError) as e:
        logger.warning("native kernel %s unavailable (%s); using torch", src.name, e)
        return None
