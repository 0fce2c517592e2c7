"""What every result records about its run (machine, versions, commit, load), the machine's
measured fp32 matmul and copy peaks, and peak-RSS polling of a process tree."""

from __future__ import annotations

import os
import platform
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import psutil

from pagedllm import envs
from pagedllm.benchmarks.script import ROOT as REPO_ROOT


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or "unknown"


def git_commit(root: Path = REPO_ROOT) -> str:
    """`<sha>` of the checkout, with `+dirty` when tracked files differ from it. Result files
    (benchmarks/results/) do not count: a run that writes one there leaves the code of the next run
    in the same checkout as it was."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":(exclude)benchmarks/results"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (sha or "unknown") + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def command_line() -> str:
    """This process's command: `pagedllm ARGS` under the CLI, else the script and its arguments."""
    prog = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    script = sys.argv[0].replace("\\", "/") if sys.argv else ""
    if prog in ("pagedllm", "__main__.py", "") or script.endswith("pagedllm/entrypoints/cli.py"):
        return "pagedllm " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    return " ".join(shlex.quote(a) for a in sys.argv)


def run_metadata(extra_versions: dict[str, str | None] | None = None) -> dict[str, Any]:
    """Machine, versions, commit, load and command line of this run."""
    versions = {name: _version(name) for name in ("pagedllm", "torch", "transformers", "numpy")}
    versions["python"] = platform.python_version()
    versions.update(extra_versions or {})
    return {
        "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": command_line(),
        "cpu_model": _cpu_model(),
        "cpu_cores": psutil.cpu_count(logical=False) or os.cpu_count(),
        "logical_cpus": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / (1 << 30), 1),
        "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"),
        "versions": versions,
        "commit": git_commit(),
    }


# ---- machine peaks --------------------------------------------------------------------------

def call_times(fn: Callable[[], object], reps: int) -> list[float]:
    """Seconds of each of `reps` calls of fn, after one untimed warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def measure_matmul_peak(n: int = 1024, seconds: float | None = None, dtype: str = "float32") -> float:
    """FLOP/s of a large square matmul in `dtype` (2 n^3 FLOPs each), with torch's current threads:
    the faster of torch.mm and oneDNN's linear (torch.ops.mkldnn._linear_pointwise), each timed for
    half of `seconds` (default PAGEDLLM_BENCH_PEAK_SECONDS, 2 s). On AMD CPUs torch.mm's float32 path (MKL) runs AVX2 code at about half of
    what oneDNN's AVX-512 GEMM reaches on the same machine, so torch.mm alone understates the peak.
    bfloat16 or float16 on CPUs without dot products in that dtype: pagedllm's GEMM there
    (layers/linear.py, operands widened to float32 for oneDNN's float32 GEMM), since torch's own
    GEMMs in it are emulated at a hundredth of that rate (0.7 GFLOP/s on a 2-core AVX2 host) and
    pagedllm never runs them."""
    import torch

    from pagedllm.layers.linear import WIDENED_DTYPES, torch_linear

    if seconds is None:
        seconds = envs.PAGEDLLM_BENCH_PEAK_SECONDS
    dt = getattr(torch, dtype)
    a = torch.randn(n, n).to(dt)
    b = torch.randn(n, n).to(dt)
    c = torch.empty(n, n, dtype=dt)
    if dt in WIDENED_DTYPES:
        calls = [lambda: torch_linear(a, b)]
    else:
        calls = [lambda: torch.mm(a, b, out=c)]
        if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
            calls.append(lambda: torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], ""))
    best = 0.0
    for call in calls:
        try:
            call()  # warm-up
        except RuntimeError:  # oneDNN without this dtype on this CPU
            continue
        deadline = time.perf_counter() + seconds / len(calls)
        while True:
            t0 = time.perf_counter()
            call()
            elapsed = time.perf_counter() - t0
            best = max(best, 2 * n**3 / elapsed)
            if time.perf_counter() > deadline:
                break
    return best


def measure_copy_bandwidth(nbytes: int = 256 << 20, seconds: float | None = None) -> float:
    """Bytes/s of a large tensor copy, counting each byte read and each byte written, timed for
    `seconds` (default half of PAGEDLLM_BENCH_PEAK_SECONDS, 1 s)."""
    import torch

    if seconds is None:
        seconds = envs.PAGEDLLM_BENCH_PEAK_SECONDS / 2

    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up (commits the pages)
    best = 0.0
    deadline = time.perf_counter() + seconds
    while True:
        t0 = time.perf_counter()
        dst.copy_(src)
        dt = time.perf_counter() - t0
        best = max(best, 2 * nbytes / dt)
        if time.perf_counter() > deadline:
            return best


def measure_read_bandwidth(nbytes: int = 256 << 20, seconds: float | None = None) -> float:
    """Bytes/s of a read-only pass over a large tensor (a float32 sum on torch's threads), the
    median of the passes timed for `seconds` (default half of PAGEDLLM_BENCH_PEAK_SECONDS, 1 s):
    the rate a decode step's weight reads can reach, as the host runs now. A decode step only
    reads its weights; a copy also writes (measure_copy_bandwidth), and where reads run faster
    than a copy a decode beats the copy roofline. The median, not the best pass, because a
    shared host's best pass comes from a quiet moment that the decode it is set against may not
    have had."""
    import torch

    if seconds is None:
        seconds = envs.PAGEDLLM_BENCH_PEAK_SECONDS / 2
    src = torch.ones(nbytes // 4)
    src.sum()  # warm-up (commits the pages)
    rates: list[float] = []
    deadline = time.perf_counter() + seconds
    while True:
        t0 = time.perf_counter()
        src.sum()
        rates.append(nbytes / (time.perf_counter() - t0))
        if time.perf_counter() > deadline and len(rates) >= 3:
            return statistics.median(rates)


def temporaries_faults(steps: int, tensors: int = 6, mib: int = 24) -> list[int]:
    """Minor page faults of each of `steps` rounds of a step's temporaries (`tensors` float32
    tensors of `mib` MiB, written, then freed), after one untimed round: how many of their pages
    the C heap hands back between steps."""
    import resource

    import torch

    def one() -> int:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        ts = [torch.empty(mib << 18, dtype=torch.float32) for _ in range(tensors)]
        for t in ts:
            t.fill_(1.0)
        del ts
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    one()
    return [one() for _ in range(steps)]


# ---- peak RSS -------------------------------------------------------------------------------

def tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants (0 once it is gone)."""
    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


class PeakRSSMonitor:
    """Polls a process tree's resident memory in a thread and keeps the maximum."""

    def __init__(self, pid: int | None = None, interval: float = 0.1) -> None:
        self.pid = os.getpid() if pid is None else pid
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_rss(self.pid))
            self._stop.wait(self.interval)

    def __enter__(self) -> PeakRSSMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, tree_rss(self.pid))
