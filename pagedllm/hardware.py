"""What the machine offers the engine: CPU feature flags and the dtype `--dtype auto` picks.

No torch here: the decision is a pure function of the flags, so it is testable with fake flag sets.
"""

from __future__ import annotations

import logging
from functools import lru_cache
from pathlib import Path

logger = logging.getLogger(__name__)

# CPU flags (as /proc/cpuinfo spells them) that give native bfloat16 / float16 dot products.
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
FP16_FLAGS = ("avx512_fp16", "amx_fp16")


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where it cannot be read)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def choose_auto_dtype(flags: frozenset[str] | set[str], has_gpu: bool = False) -> tuple[str, str]:
    """(dtype, reason) that `--dtype auto` resolves to, from measured per-ISA facts
    (docs/benchmarks.md, "The default dtype on each CPU"):

    - a GPU, or a CPU with AVX-512 BF16 or AMX-BF16: bfloat16 (hardware bf16 dot products: GEMMs run
      faster than in float32 and the weights take half the bytes);
    - a CPU with AVX2 and FMA but no AVX-512: bfloat16. pagedllm's kernels widen bf16 to float32
      in registers and multiply in float32 (as llama.cpp's BF16 path does there), so a decode step
      reads half the bytes: on a 2-core Zen 3 EPYC the default model's single stream ran 1.80x
      float32's speed and 128 requests offline 1.05x its throughput, in half the memory;
    - AVX-512 without its BF16 extension (Skylake-SP to Cascade Lake): float32. The AVX-512 form of
      the kernels has no widening bf16 path, so bf16 there would run torch's emulated GEMMs;
    - anything else (no AVX2 + FMA, or flags unreadable): float32.

    `--dtype float32` keeps every result within float rounding of a float32 reference.
    """
    if has_gpu:
        return "bfloat16", "a GPU is available"
    found = [f for f in BF16_FLAGS if f in flags]
    if found:
        return "bfloat16", f"the CPU has {' and '.join(found)}"
    if "avx512f" in flags:
        return "float32", f"the CPU has AVX-512 but none of {', '.join(BF16_FLAGS)}"
    if {"avx2", "fma"} <= set(flags):
        return "bfloat16", ("the CPU has AVX2 and FMA: bf16 weights widened to float32 in registers "
                            "read half the bytes of float32 ones")
    return "float32", f"the CPU has neither {' nor '.join(BF16_FLAGS)} nor AVX2 + FMA"


# Default KV budget on the CPU: this share of the memory available after loading, at most this many bytes.
DEFAULT_KV_FRACTION = 0.3
DEFAULT_KV_MAX_BYTES = 4 << 30


def default_cpu_kv_bytes(available_bytes: int | None = None) -> int:
    """The KV cache bytes an engine takes on the CPU without --kv-cache-memory: DEFAULT_KV_FRACTION
    of `available_bytes` (default: the memory available now), at most DEFAULT_KV_MAX_BYTES."""
    if available_bytes is None:
        import psutil

        available_bytes = psutil.virtual_memory().available
    return min(int(available_bytes * DEFAULT_KV_FRACTION), DEFAULT_KV_MAX_BYTES)


def resolve_dtype(requested: str, device: str = "cpu") -> str:
    """The dtype to run in; `auto` is decided here and the choice logged with its reason."""
    if requested != "auto":
        return requested
    if device == "cuda":
        dtype, why = "bfloat16", "a CUDA GPU"
    else:
        dtype, why = choose_auto_dtype(cpu_flags())
    logger.info("dtype auto -> %s (%s)", dtype, why)
    return dtype
